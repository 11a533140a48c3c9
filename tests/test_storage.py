"""The shared-volume contract: atomic writes, manifests, latest complete step."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from shared.storage.files import atomic_write_bytes, read_jsonl, staged_dir
from shared.storage.ids import check_adapter_id
from shared.storage.manifest import ManifestError, verify_manifest, write_manifest
from shared.storage.s3 import split_s3_uri
from shared.storage.volume import SharedVolume, latest_complete_step


def test_paths_follow_the_contract(tmp_path):
    v = SharedVolume(tmp_path)
    assert v.ckpt("r", 20) == tmp_path / "runs/r/ckpts/global_step_20"
    assert v.export("r", 20) == tmp_path / "runs/r/exports/global_step_20/policy"
    assert v.eval("r", "global_step_10") == tmp_path / "runs/r/evals/global_step_10"
    assert v.lora_sync("r") == tmp_path / "runs/r/lora_sync"
    assert v.model("m") == tmp_path / "models/m" and v.model("/abs/m").as_posix() == "/abs/m"
    assert v.dataset("maze_2d/easy") == tmp_path / "datasets/maze_2d/easy"


def test_manifest_round_trip_and_tamper(tmp_path):
    folder = tmp_path / "d"
    with staged_dir(folder) as tmp:
        (tmp / "a.bin").write_bytes(b"x" * 1000)
        (tmp / "sub").mkdir()
        (tmp / "sub" / "b.txt").write_text("hello")
    manifest = verify_manifest(folder)
    assert set(manifest["files"]) == {"a.bin", "sub/b.txt"}
    (folder / "sub" / "b.txt").write_text("jello")  # same size, other bytes
    with pytest.raises(ManifestError, match="sha256"):
        verify_manifest(folder)
    (folder / "a.bin").write_bytes(b"x")
    with pytest.raises(ManifestError, match="bytes"):
        verify_manifest(folder)
    (folder / "manifest.json").write_text("{not json")
    with pytest.raises(ManifestError, match="unreadable"):
        verify_manifest(folder)


WRITER = """
import sys, time
from shared.storage.files import staged_dir
with staged_dir(sys.argv[1]) as tmp:
    for i in range(1000):
        (tmp / f"part{i}.bin").write_bytes(b"y" * 100_000)
        time.sleep(0.01)
"""


def test_writer_killed_mid_write_leaves_nothing_that_verifies(tmp_path):
    final = tmp_path / "ckpts" / "global_step_3"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(final)], cwd=os.path.dirname(os.path.dirname(__file__)))
    time.sleep(1.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not final.exists(), "the final name appears only once the manifest is written"
    leftovers = list((tmp_path / "ckpts").iterdir())
    assert leftovers and all(p.name.startswith(".tmp-") for p in leftovers)
    assert latest_complete_step(tmp_path / "ckpts") is None
    # A later writer of the same folder clears the leftovers.
    with staged_dir(final) as tmp:
        (tmp / "ok").write_text("ok")
    assert [p.name for p in (tmp_path / "ckpts").iterdir()] == ["global_step_3"]


def test_latest_complete_step_skips_half_written_and_corrupt(tmp_path):
    ckpts = tmp_path / "ckpts"
    for step in (10, 20, 30):
        with staged_dir(ckpts / f"global_step_{step}") as tmp:
            (tmp / "w").write_text(str(step))
    (ckpts / "global_step_40").mkdir()  # half-written: no manifest
    (ckpts / "global_step_40" / "w").write_text("partial")
    (ckpts / "global_step_30" / "w").write_text("bad")  # corrupt
    warnings = []
    step, folder = latest_complete_step(ckpts, warn=warnings.append)
    assert step == 20 and folder.name == "global_step_20"
    assert len(warnings) == 2 and "global_step_40" in warnings[0] and "global_step_30" in warnings[1]


def test_atomic_write_and_torn_jsonl(tmp_path):
    atomic_write_bytes(tmp_path / "f", b"abc")
    assert (tmp_path / "f").read_bytes() == b"abc" and len(list(tmp_path.iterdir())) == 1
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"step": 1}) + "\n" + '{"step": 2, "tor')
    assert read_jsonl(path) == [{"step": 1}]


def test_write_manifest_extra_and_ids(tmp_path):
    (tmp_path / "x").write_text("1")
    assert write_manifest(tmp_path, {"run_id": "r"})["run_id"] == "r"
    assert split_s3_uri("s3://bucket/a/b/") == ("bucket", "a/b")
    with pytest.raises(ValueError):
        split_s3_uri("http://x")
    assert check_adapter_id("run-1.step_20") == "run-1.step_20"
    for bad in ("../x", "a/b", "", "a:b", ".."):
        with pytest.raises(ValueError):
            check_adapter_id(bad)


def test_s3_client_for_a_local_endpoint_leaves_the_environment_alone(monkeypatch, s3_endpoint):
    """A local S3-compatible server takes any credentials: the client carries them, os.environ stays as it was."""
    from shared.storage.s3 import LOCAL_CREDENTIALS, endpoint_credentials, s3_client

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    before = dict(os.environ)
    client = s3_client(s3_endpoint)
    client.create_bucket(Bucket="no-env-creds")
    assert "no-env-creds" in {b["Name"] for b in client.list_buckets()["Buckets"]}
    assert dict(os.environ) == before
    assert endpoint_credentials(s3_endpoint) == LOCAL_CREDENTIALS and endpoint_credentials(None) == {}
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "mine")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "mine")
    assert endpoint_credentials(s3_endpoint) == {}, "credentials of one's own are used as they are"


def test_staging_removes_only_its_own_leftovers(tmp_path):
    """Staging `tiny-qwen3vl` must not delete an in-progress `tiny-qwen3vl-sft` (or `tiny-qwen3vl.v2`) temporary."""
    models = tmp_path / "models"
    with staged_dir(models / "tiny-qwen3vl-sft") as other:
        (other / "weights").write_text("half written")
        with staged_dir(models / "tiny-qwen3vl.v2") as dotted:
            (dotted / "weights").write_text("half written")
            with staged_dir(models / "tiny-qwen3vl") as mine:
                (mine / "weights").write_text("done")
            assert other.exists() and dotted.exists(), "a neighbour's temporary folder was removed"
            assert (models / "tiny-qwen3vl" / "weights").read_text() == "done"
    assert sorted(p.name for p in models.iterdir()) == ["tiny-qwen3vl", "tiny-qwen3vl-sft", "tiny-qwen3vl.v2"]


def test_free_ports_come_from_below_the_ephemeral_range(monkeypatch, tmp_path):
    """A port from bind(0) lies where outgoing connections take theirs, so a server bound to it later can lose it;
    free_port chooses below that range, and bindable now."""
    import socket

    from shared import net

    kernel_range = tmp_path / "ip_local_port_range"
    kernel_range.write_text("40000\t60999\n")
    monkeypatch.setattr(net, "EPHEMERAL_RANGE", kernel_range)
    ports = {net.free_port() for _ in range(20)}
    assert all(net.FIRST_PORT <= port < 40000 for port in ports), sorted(ports)  # never Ray's worker ports
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", min(ports)))
    kernel_range.write_text("1024\t65535\n")  # no room below it: the kernel's choice
    assert net.ephemeral_ports() == (1024, 65535) and 1024 <= net.free_port() <= 65535
