"""Exporter: real HTTP S3 endpoint (moto server), idempotence, aliases, bad input, kill mid-upload."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from shared.storage.adapters import AdapterStore
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
    assert "maze-grpo -> exp-run-step2 (best: held-out 25.0%, evals/global_step_2)" in first.stdout
    store = AdapterStore(bucket, s3_endpoint, cache_dir=volume.root / "cache-test")
    assert store.list() == ["exp-run-step2", "exp-run-step4", "maze-grpo"]
    manifest = store.manifest("exp-run-step4")
    assert manifest["run_id"] == run_id and manifest["step"] == 4 and manifest["eval"]["solve_rate"] == 0.125
    # Every S3 copy carries a model card, in the manifest. These exports hold PEFT's template (as a SkyRL run's
    # do), so the exporter writes the card from what it knows; the trainer's own card travels as it is.
    assert set(manifest["files"]) == {"adapter_config.json", "adapter_model.safetensors", "README.md"}
    card = (store.fetch("exp-run-step4") / "README.md").read_text()
    assert card.startswith("---\nbase_model: tiny-qwen3vl-sft\nlibrary_name: peft\n") and "# exp-run, step 4" in card
    assert "| 8/64 | 12.5% [" in card and "More Information Needed" not in card
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
    # Ages are counted in UTC: a local zone in daylight saving time does not add an hour.
    from datetime import datetime
    from zoneinfo import ZoneInfo

    summer = next(z for z in ("Australia/Sydney", "Europe/Berlin") if datetime.now(ZoneInfo(z)).dst())
    listing = _run(["list"], volume.root, s3_endpoint, bucket, extra_env={"TZ": summer})
    ages = [line.split()[-1] for line in listing.stdout.splitlines()[1:] if line.split()]
    assert ages and all("h" not in age for age in ages), (summer, ages)


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
    assert "warning: skipping incomplete export" in proc.stderr and "global_step_2" in proc.stderr, proc.stderr
    assert "rejected" in proc.stdout and "global_step_4" in proc.stdout and "safetensors" in proc.stdout
    assert AdapterStore(bucket, s3_endpoint).list() == []


def test_wrong_base_and_bad_alias(exported_run, s3_endpoint, bucket):
    volume, run_id = exported_run
    proc = _run(["--run", run_id, "model.path=another-model", "model.base_model_id=another-model"], volume.root,
                s3_endpoint, bucket)
    assert proc.returncode != 0
    line = next(x for x in proc.stdout.splitlines() if "rejected" in x)
    assert "'tiny-qwen3vl-sft'" in line and "'another-model'" in line, line
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

    # --pick best on a SkyRL run: its evals are SkyRL's own dumps (no evals/global_step_N); with none, one line.
    unscored = _run(["--run", "skyrl-run", "--alias", "skyrl-best"], shared, s3_endpoint, bucket)
    assert unscored.returncode != 0 and unscored.stderr.count("\n") == 1, unscored.stderr
    assert "none of run skyrl-run's exports (steps 20, 40) has a held-out eval" in unscored.stderr
    assert "python -m services.evaluator --watch skyrl-run --once" in unscored.stderr
    assert AdapterStore(bucket, s3_endpoint).list() == ["skyrl-run-step20"], "refused before any upload"
    for step, rate in ((20, 0.375), (40, 0.25)):
        dump = exports / "dumped_evals" / f"global_step_{step}_evals"
        dump.mkdir(parents=True)
        (dump / "aggregated_results.jsonl").write_text(json.dumps({"eval/all/environment/solved": rate,
                                                                   "eval/all/pass_at_1": rate + 0.1}) + "\n")
    best = _run(["--run", "skyrl-run", "--alias", "skyrl-best"], shared, s3_endpoint, bucket)
    assert best.returncode == 0, best.stderr
    assert "skyrl-best -> skyrl-run-step20 (best: held-out 37.5%, SkyRL's eval" in best.stdout
    assert AdapterStore(bucket, s3_endpoint).manifest("skyrl-best")["eval"]["solve_rate"] == 0.375
    # The evaluator's own eval of a step (its --watch) comes before SkyRL's.
    watched = shared / "runs" / "skyrl-run" / "evals" / "watch_step_40"
    watched.mkdir(parents=True)
    (watched / "summary.json").write_text(json.dumps({"solve_rate": 0.5, "solved": 32, "total": 64}))
    best = _run(["--run", "skyrl-run", "--alias", "skyrl-best"], shared, s3_endpoint, bucket)
    assert "skyrl-best -> skyrl-run-step40 (best: held-out 50.0%, evals/watch_step_40)" in best.stdout, best.stdout


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


class _DenyingS3(BaseHTTPRequestHandler):
    """An S3 stand-in that lists one adapter folder but refuses to show its manifest (403, as a bucket policy does)."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        body = (b'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult><Name>b</Name><Prefix>p/adapters/</Prefix>'
                b"<KeyCount>1</KeyCount><IsTruncated>false</IsTruncated>"
                b"<CommonPrefixes><Prefix>p/adapters/denied/</Prefix></CommonPrefixes></ListBucketResult>")
        self.send_response(200)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_HEAD(self):
        self.send_response(403)
        self.end_headers()


def test_listing_adapters_surfaces_errors_other_than_not_found(tmp_path):
    """An adapter whose manifest S3 refuses to show (403, throttling) is an error to report, not a missing adapter."""
    from botocore.exceptions import ClientError

    server = ThreadingHTTPServer(("127.0.0.1", 0), _DenyingS3)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        store = AdapterStore("s3://b/p", f"http://127.0.0.1:{server.server_port}", cache_dir=tmp_path)
        with pytest.raises(ClientError, match="403"):
            store.list()
    finally:
        server.shutdown()


def test_an_adapter_names_its_base_by_the_path_it_was_loaded_from(exported_run, tiny_model_dir, s3_endpoint, bucket):
    """SkyRL builds its policy with PEFT's get_peft_model, which records the folder the base was loaded from as
    `base_model_name_or_path` (e.g. /shared/models/visgym-mixed-qwen3vl-8b). The exporter takes such an adapter when
    that folder is the run's base model (by path, or by identical weights elsewhere) and refuses one for another."""
    volume, run_id = exported_run
    source = volume.export(run_id, 2)

    def run_with_base(name: str, recorded: str) -> Path:
        folder = volume.export(name, 2)
        if not folder.exists():
            with staged_dir(folder) as tmp:
                for item in ("adapter_model.safetensors", "adapter_config.json"):
                    shutil.copy(source / item, tmp / item)
                config = json.loads((tmp / "adapter_config.json").read_text())
                (tmp / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": recorded}))
        return folder

    run_with_base("loaded-here", str(tiny_model_dir))
    copy = volume.model("tiny-copy")
    if not copy.exists():
        shutil.copytree(tiny_model_dir, copy)
    base = [f"model.path={copy.name}", "model.base_model_id=tiny-qwen3vl-sft"]
    same_files = _run(["--run", "loaded-here", *base], volume.root, s3_endpoint, bucket)
    assert same_files.returncode == 0 and "loaded-here-step2: uploaded" in same_files.stdout, same_files.stdout
    manifest = AdapterStore(bucket, s3_endpoint, cache_dir=volume.root / "cache-base").manifest("loaded-here-step2")
    assert manifest["base_model"] == "tiny-qwen3vl-sft" and manifest["trained_on"] == str(tiny_model_dir)

    run_with_base("elsewhere", "/shared/models/visgym-mixed-qwen3vl-8b")
    other = _run(["--run", "elsewhere", *base], volume.root, s3_endpoint, bucket)
    assert other.returncode != 0
    line = next(x for x in other.stdout.splitlines() if "rejected" in x)
    assert "'/shared/models/visgym-mixed-qwen3vl-8b'" in line and "'tiny-qwen3vl-sft'" in line and "tiny-copy" in line
