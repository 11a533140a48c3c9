"""Hostile input, read as an attacker or a careless user would write it: files planted in S3 or on the volume, replies
built to stall a parser, settings that cannot train. Each test names what it refuses; the server's hostile requests
live in test_server_hostile.py (they need the running server)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shared.storage.adapters import AdapterStore
from shared.storage.manifest import ManifestError, read_manifest, write_manifest

REPO = Path(__file__).resolve().parent.parent


def _plant(s3_endpoint, bucket: str, adapter_id: str, names: list[str]) -> AdapterStore:
    """Writes an adapter manifest listing `names` (and each name's object) into a fresh bucket; returns its store."""
    from shared.storage.s3 import s3_client

    client = s3_client(s3_endpoint)
    client.create_bucket(Bucket=bucket)
    files = {name: {"sha256": "0" * 64, "size": 1} for name in names}
    for name in names:
        client.put_object(Bucket=bucket, Key=f"p/adapters/{adapter_id}/{name}", Body=b"x")
    client.put_object(Bucket=bucket, Key=f"p/adapters/{adapter_id}/manifest.json", Body=json.dumps({"files": files}))
    return AdapterStore(f"s3://{bucket}/p", s3_endpoint)


@pytest.mark.parametrize("name", ["../../planted", "/tmp/maze-grpo-planted-abs", "sub/../../planted", "a\\..\\b",
                                  "..", "manifest.json"])
def test_an_s3_manifest_naming_files_outside_its_folder_is_refused_before_any_download(name, s3_endpoint, tmp_path):
    bucket = f"plant-{abs(hash(name)) % 10**8}"
    store = _plant(s3_endpoint, bucket, "evil", ["adapter_config.json", name])
    store.cache_dir = tmp_path / "cache" / "adapters"
    with pytest.raises(ManifestError, match="not a plain file name"):
        store.fetch("evil")
    # Nothing was written anywhere: not the planted name, not even the legitimate file beside it.
    assert not Path("/tmp/maze-grpo-planted-abs").exists()
    assert not (tmp_path / "planted").exists() and not (tmp_path / "cache" / "planted").exists()
    assert not list((tmp_path / "cache").rglob("adapter_config.json"))


def test_a_volume_manifest_naming_files_outside_its_folder_is_refused(tmp_path):
    folder = tmp_path / "runs" / "r" / "exports" / "global_step_1" / "policy"
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text("{}")
    write_manifest(folder)
    assert read_manifest(folder)["files"]  # the honest manifest reads
    (tmp_path / "secret").write_text("outside")
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"]["../../../../secret"] = {"sha256": "0" * 64, "size": 7}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match="not a plain file name"):
        read_manifest(folder)


def test_s3_down_stops_only_the_server_it_started(tmp_path):
    """After a reboot endpoint.json's pid can be any process: s3-down must leave it alone."""
    from shared.storage import local_s3

    bystander = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        path = local_s3.state_file(tmp_path)
        path.parent.mkdir(parents=True)
        import socket

        path.write_text(json.dumps({"endpoint_url": "http://127.0.0.1:9", "s3_uri": "s3://maze-grpo/local",
                                    "host": socket.gethostname(), "pid": bystander.pid}))
        assert local_s3.running_endpoint(tmp_path) is None, "a stranger's pid is not our endpoint"
        proc = subprocess.run([sys.executable, "-m", "services.exporter", "s3-down"], cwd=REPO, capture_output=True,
                              text=True, env={**os.environ, "SHARED_DIR": str(tmp_path)}, timeout=120)
        assert proc.returncode == 0 and "no local S3 endpoint was running" in proc.stdout, proc.stderr
        time.sleep(0.5)
        assert bystander.poll() is None, "s3-down signalled a process it did not start"
        # The real one is found and stopped.
        state = local_s3.up(tmp_path)
        assert local_s3.running_endpoint(tmp_path)["pid"] == state["pid"]
        assert local_s3.down(tmp_path) is True
    finally:
        os.killpg(bystander.pid, signal.SIGKILL)
        bystander.wait()


def test_an_export_holding_a_link_to_a_file_outside_the_run_is_refused(exported_run, s3_endpoint, tmp_path):
    from shared.storage.s3 import s3_client

    volume, run_id = exported_run
    source = volume.export(run_id, 2)
    run = "linked"
    policy = volume.export(run, 1)
    shutil.copytree(source, policy)
    secret = tmp_path / "secret.safetensors"  # the same bytes, so the manifest's checksums still match
    (policy / "adapter_model.safetensors").rename(secret)
    (policy / "adapter_model.safetensors").symlink_to(secret)
    s3_client(s3_endpoint).create_bucket(Bucket="linked")
    env = {**os.environ, "SHARED_DIR": str(volume.root), "AWS_ENDPOINT_URL": s3_endpoint, "S3_URI": "s3://linked/p"}
    proc = subprocess.run([sys.executable, "-m", "services.exporter", "--run", run], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=180)
    assert "symbolic link" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    listed = s3_client(s3_endpoint).list_objects_v2(Bucket="linked").get("Contents", [])
    assert not listed, f"uploaded through a link: {[o['Key'] for o in listed]}"
