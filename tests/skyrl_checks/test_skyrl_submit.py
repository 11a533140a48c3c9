"""`make submit` of the 8B profile to a real Ray head, where the job runs SkyRL's own `initialize_ray`.

The head runs in .venv-skyrl (a cluster node's Python, with SkyRL); the submission comes from the main venv,
as `make submit` does. The job is the skyrl backend's `--preflight`: SkyRL's config and validation, then SkyRL's
`initialize_ray`, whose `ray.init(runtime_env=...)` merges with the job's runtime env (Ray refuses a variable
set in both), then our env made inside a Ray worker. With HF_HUB_OFFLINE in the submitting shell and without.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from shared.local_ray import stop_ray_started_in
from shared.net import free_port

REPO = Path(__file__).resolve().parents[2]
MAIN_PY = REPO / ".venv" / "bin" / "python"


@pytest.fixture(scope="module")
def ray_cluster():
    """HyperPod's shape on one machine: a head with no CPUs for tasks, and a worker node that has the CPUs and
    declares 2 GPUs (logical ones: SkyRL's set-up reserves 2 GPUs to probe peer access, which then finds no CUDA)."""
    temp_dir = Path(tempfile.mkdtemp(prefix="ray-skyrl-", dir="/tmp"))
    dashboard, gcs = free_port(), free_port()
    # Like a cluster node: `python` is the one with SkyRL and the project installed.
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("HF_HUB_OFFLINE", None)
    ray_cli = str(Path(sys.executable).parent / "ray")
    try:
        subprocess.run([ray_cli, "start", "--head", f"--port={gcs}", "--node-ip-address=127.0.0.1", "--num-cpus=0",
                        "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}", f"--temp-dir={temp_dir}",
                        f"--dashboard-agent-listen-port={free_port()}", "--disable-usage-stats"], check=True, env=env, capture_output=True, timeout=300)
        subprocess.run([ray_cli, "start", f"--address=127.0.0.1:{gcs}", "--node-ip-address=127.0.0.1", "--num-cpus=2",
                        "--num-gpus=2", f"--dashboard-agent-listen-port={free_port()}", "--disable-usage-stats"], check=True, env=env, capture_output=True, timeout=300)
        yield f"http://127.0.0.1:{dashboard}"
    finally:
        stop_ray_started_in(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.parametrize("hf_hub_offline", ["1", None])
def test_submit_reaches_skyrls_initialize_ray_with_and_without_hf_hub_offline(ray_cluster, tmp_path, hf_hub_offline):
    assert MAIN_PY.exists(), "make submit runs in the main venv (make setup)"
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update({"RAY_ADDRESS": ray_cluster, "SHARED_DIR": str(tmp_path)})
    if hf_hub_offline:
        env["HF_HUB_OFFLINE"] = hf_hub_offline
    proc = subprocess.run([str(MAIN_PY), "-m", "services.trainer", "submit", "--config", "configs/qwen3vl-8b-hyperpod.yaml",
                           "--preflight", "--timeout", "600", "--forward-env", "SHARED_DIR", "--record-dir",
                           str(tmp_path / "records")], cwd=REPO, env=env, capture_output=True, text=True, timeout=700)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    report = json.loads(next(line for line in out.splitlines() if line.startswith("preflight ok: "))[len("preflight ok: "):])
    assert report["skyrl"] == "0.4.0" and report["solve_rate_metric"] == "eval/all/environment/solved"
    # The shell's value, or the project's own default (shared/__init__.py: nothing downloads at run time), forwarded
    # by SkyRL from the driver to the worker.
    assert report["HF_HUB_OFFLINE"] == "1"
    assert report["task_node_gpus"] == 2, "a 1-CPU task (like SkyRL's trainer loop) runs on the worker, not the head"
    job = json.loads((tmp_path / "records" / "qwen3vl-8b-maze-grpo.json").read_text())
    assert job["status"] == "SUCCEEDED"
    assert job["entrypoint"].startswith("env HF_HUB_OFFLINE=1 python -m services.trainer"), "on the command line"
