"""Exporter: real HTTP S3 endpoint (moto server), idempotence, aliases, bad input, kill mid-upload."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shared.adapters import AdapterStore
from shared.storage.files import staged_dir
from shared.storage.manifest import verify_manifest

REPO = Path(__file__).resolve().parent.parent


def _run(args, shared, endpoint, bucket_uri, wait=True, extra_env=None):
    env = {**os.environ, "SHARED_DIR": str(shared), "AWS_ENDPOINT_URL": endpoint, "S3_URI": bucket_uri,
           **(extra_env or {})}
    cmd = [sys.executable, "-m", "services.exporter", *args]
    if wait:
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


@pytest.fixture()
def bucket(s3_endpoint, request):
    from shared.storage.s3 import s3_client

    name = "b-" + request.node.name.lower().replace("_", "-")[:40]
    s3_client(s3_endpoint).create_bucket(Bucket=name)
    return f"s3://{name}/prefix"


def test_export_alias_list_and_idempotence(exported_run, s3_endpoint, bucket):
    volume, run_id = exported_run
    first = _run(["--run", run_id, "--alias", "maze-grpo", "--pick", "best"], volume.root, s3_endpoint, bucket)
    assert first.returncode == 0, first.stderr
    assert "exp-run-step2: uploaded" in first.stdout and "exp-run-step4: uploaded" in first.stdout
    assert "maze-grpo -> exp-run-step2 (best)" in first.stdout
    store = AdapterStore(bucket, s3_endpoint, cache_dir=volume.root / "cache-test")
    assert store.list() == ["exp-run-step2", "exp-run-step4", "maze-grpo"]
    manifest = store.manifest("exp-run-step4")
    assert manifest["run_id"] == run_id and manifest["step"] == 4 and manifest["eval"]["solve_rate"] == 0.125
    assert manifest["base_model"] == "tiny-qwen3vl-sft"
    local = store.fetch("maze-grpo")
    verify_manifest(local)
    original = volume.export(run_id, 2) / "adapter_model.safetensors"
    assert (local / "adapter_model.safetensors").read_bytes() == original.read_bytes()

    again = _run(["--run", run_id, "--alias", "maze-grpo"], volume.root, s3_endpoint, bucket)
    assert again.returncode == 0 and "uploaded" not in again.stdout and again.stdout.count("unchanged") == 3

    latest = _run(["--run", run_id, "--alias", "maze-grpo", "--pick", "latest"], volume.root, s3_endpoint, bucket)
    assert "maze-grpo -> exp-run-step4 (latest)" in latest.stdout
    assert store.manifest("maze-grpo")["alias_of"] == "exp-run-step4"

    listing = _run(["list"], volume.root, s3_endpoint, bucket)
    lines = listing.stdout.splitlines()
    assert lines[0].split()[:3] == ["adapter_id", "run", "step"]
    assert any(line.startswith("exp-run-step2") and "25.0%" in line for line in lines)


def test_incomplete_and_corrupt_exports(exported_run, s3_endpoint, bucket, tmp_path):
    volume, run_id = exported_run
    shared = tmp_path / "shared"
    shutil.copytree(volume.root / "runs" / run_id, shared / "runs" / "bad-run")
    exports = shared / "runs" / "bad-run" / "exports"
    (exports / "global_step_2" / "policy" / "manifest.json").unlink()  # half-written: no manifest, weights missing
    (exports / "global_step_2" / "policy" / "adapter_model.safetensors").unlink()
    weights = exports / "global_step_4" / "policy" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated, then re-manifested so only validation catches it
    with staged_dir(exports / "global_step_6" / "policy") as tmp:
        for f in (exports / "global_step_4" / "policy").iterdir():
            if f.name != "manifest.json":
                shutil.copy(f, tmp / f.name)
    from shared.storage.manifest import write_manifest

    write_manifest(exports / "global_step_4" / "policy")
    proc = _run(["--run", "bad-run"], shared, s3_endpoint, bucket)
    assert proc.returncode != 0
    assert "skipping incomplete export" in proc.stdout and "global_step_2" in proc.stdout
    assert "rejected" in proc.stdout and "global_step_4" in proc.stdout and "safetensors" in proc.stdout
    assert AdapterStore(bucket, s3_endpoint).list() == []


def test_wrong_base_and_bad_alias(exported_run, s3_endpoint, bucket):
    volume, run_id = exported_run
    proc = _run(["--run", run_id, "model.base_model_id=another-model"], volume.root, s3_endpoint, bucket)
    assert proc.returncode != 0 and "another-model" in proc.stdout
    proc = _run(["--run", run_id, "--alias", "../escape"], volume.root, s3_endpoint, bucket)
    assert proc.returncode != 0 and "'../escape'" in proc.stderr


def test_unreachable_s3_fails_clearly(exported_run):
    volume, run_id = exported_run
    proc = _run(["--run", run_id], volume.root, "http://127.0.0.1:9", "s3://nowhere/x",
                extra_env={"AWS_MAX_ATTEMPTS": "2"})
    assert proc.returncode != 0 and "127.0.0.1:9" in proc.stderr and "failed after retries" in proc.stderr


def test_killed_mid_upload_then_rerun_completes(exported_run, s3_endpoint, bucket, tmp_path):
    volume, run_id = exported_run
    # A 48 MB adapter so the multipart upload is in flight when the exporter is killed.
    shared = tmp_path / "shared"
    shutil.copytree(volume.root / "runs" / run_id, shared / "runs" / "big-run")
    import torch
    from safetensors.torch import load_file, save_file

    policy = shared / "runs" / "big-run" / "exports" / "global_step_2" / "policy"
    tensors = load_file(str(policy / "adapter_model.safetensors"))
    tensors["base_model.model.extra.lora_A.weight"] = torch.randn(3000, 4000)
    save_file(tensors, str(policy / "adapter_model.safetensors"))
    from shared.storage.manifest import write_manifest

    write_manifest(policy)
    store = AdapterStore(bucket, s3_endpoint)
    proc = _run(["--run", "big-run"], shared, s3_endpoint, bucket, wait=False)
    time.sleep(2.5)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    # Whatever got there, nothing without a valid manifest is visible to readers.
    for adapter_id in store.list():
        verify_manifest(store.fetch(adapter_id))
    done = _run(["--run", "big-run"], shared, s3_endpoint, bucket)
    assert done.returncode == 0, done.stderr
    assert store.list() == ["big-run-step2", "big-run-step4"]
    for adapter_id in store.list():
        assert (store.fetch(adapter_id) / "adapter_model.safetensors").stat().st_size == \
            json.loads((store.fetch(adapter_id) / "manifest.json").read_text())["files"]["adapter_model.safetensors"]["size"]


def test_skyrl_exports_without_a_manifest_are_adopted_only_by_the_adopt_command(exported_run, s3_endpoint, bucket, tmp_path):
    """SkyRL writes exports/global_step_N/policy/{adapter_model.safetensors, adapter_config.json} and no manifest
    (the skyrl backend seals its own; a SkyRL run made otherwise does not). Exporting skips such an export and
    writes nothing; `adopt` seals a settled one and leaves one still changing."""
    volume, run_id = exported_run
    shared = tmp_path / "shared"
    exports = shared / "runs" / "skyrl-run" / "exports"
    for step in (20, 40):
        policy = exports / f"global_step_{step}" / "policy"
        policy.mkdir(parents=True)
        for name in ("adapter_model.safetensors", "adapter_config.json"):
            shutil.copy(volume.export(run_id, 2) / name, policy / name)
    settled = time.time() - 3600
    for f in (exports / "global_step_20" / "policy").iterdir():
        os.utime(f, (settled, settled))

    skipped = _run(["--run", "skyrl-run"], shared, s3_endpoint, bucket)
    assert skipped.returncode != 0 and "no complete, valid export" in skipped.stderr
    assert "python -m services.exporter adopt --run skyrl-run" in skipped.stdout + skipped.stderr
    assert not list(exports.rglob("manifest.json")), "exporting read the volume and wrote nothing"

    adopted = _run(["adopt", "--run", "skyrl-run"], shared, s3_endpoint, bucket)
    assert adopted.returncode == 0, adopted.stderr
    assert f"sealed {exports / 'global_step_20' / 'policy'}" in adopted.stdout
    assert f"not yet: {exports / 'global_step_40' / 'policy'}" in adopted.stdout
    verify_manifest(exports / "global_step_20" / "policy")
    assert not (exports / "global_step_40" / "policy" / "manifest.json").exists()

    proc = _run(["--run", "skyrl-run"], shared, s3_endpoint, bucket)
    assert proc.returncode == 0, proc.stderr
    assert "skyrl-run-step20: uploaded" in proc.stdout
    assert AdapterStore(bucket, s3_endpoint).list() == ["skyrl-run-step20"]
    again = _run(["adopt", "--run", "skyrl-run", "--settle", "0"], shared, s3_endpoint, bucket)
    assert again.returncode == 0 and again.stdout.strip() == f"sealed {exports / 'global_step_40' / 'policy'}"


def test_local_s3_endpoint_of_another_host_is_neither_used_nor_stopped(tmp_path):
    """endpoint.json lives on the shared volume; its process id means something only on the host that wrote it."""
    from shared.storage import local_s3

    path = local_s3.state_file(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"endpoint_url": "http://127.0.0.1:9", "s3_uri": "s3://maze-grpo/local",
                                "host": "another-host", "pid": os.getpid()}))
    assert local_s3.running_endpoint(tmp_path) is None
    proc = subprocess.run([sys.executable, "-m", "services.exporter", "s3-down"], cwd=REPO, capture_output=True,
                          text=True, env={**os.environ, "SHARED_DIR": str(tmp_path)}, timeout=120)
    assert proc.returncode != 0 and "started on host 'another-host': stop it there" in proc.stderr
    assert "Traceback" not in proc.stderr and path.exists()  # this process was not signalled, the record kept
