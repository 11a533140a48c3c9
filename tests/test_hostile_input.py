"""Hostile input, read as an attacker or a careless user would write it: files planted in S3 or on the volume, replies
built to stall a parser, settings that cannot train. Each test names what it refuses; the server's hostile requests
live in test_server_hostile.py (they need the running server), the trainer's in test_trainer.py (they need a
trained run). Tests that start a service are marked slow (make test-fast leaves them out)."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shared.net import free_port
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


@pytest.mark.parametrize("name", ["../../planted", "ABSOLUTE", "sub/../../planted", "a\\..\\b", "..", "manifest.json"])
def test_an_s3_manifest_naming_files_outside_its_folder_is_refused_before_any_download(name, s3_endpoint, tmp_path):
    absolute = tmp_path / "elsewhere" / "planted"  # an absolute name, unique to this test
    name = str(absolute) if name == "ABSOLUTE" else name
    bucket = f"plant-{abs(hash(name)) % 10**8}"
    store = _plant(s3_endpoint, bucket, "evil", ["adapter_config.json", name])
    store.cache_dir = tmp_path / "cache" / "adapters"
    with pytest.raises(ManifestError, match="not a plain file name"):
        store.fetch("evil")
    # Nothing was written anywhere: not the planted name, not even the legitimate file beside it.
    assert not absolute.exists() and not list(tmp_path.rglob("planted"))
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


@pytest.mark.slow  # runs a service or a server
def test_s3_down_stops_only_the_server_it_started(tmp_path):
    """After a reboot endpoint.json's pid can be any process: s3-down must leave it alone."""
    from shared.storage import local_s3

    bystander = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        path = local_s3.state_file(tmp_path)
        path.parent.mkdir(parents=True)
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


@pytest.mark.slow  # runs a service or a server
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


# ---- replies built to stall a parser, endpoints that stall or flood -----------------------------------------------


@pytest.mark.parametrize("reply", ["(" + " " * 100_000, "<action>" * 12_500, "( '" * 30_000, "(move " * 15_000,
                                   "<action>(" + " " * 50_000 + "</action>"])
def test_the_reply_parser_is_linear_in_the_reply(reply):
    from shared.maze.actions import parse_action, read_tuple_reply, turn_is_well_formatted

    started = time.perf_counter()
    parse_action(reply)
    parse_action(reply, "keyword")
    read_tuple_reply(reply)
    turn_is_well_formatted(reply)
    # About 0.05 s here; the quadratic parser took 0.5 s for 4,000 spaces and minutes for 100 KB.
    assert time.perf_counter() - started < 2.0


class _Endpoint:
    """A local OpenAI-compatible endpoint whose chat answers are written by `reply(handler)`."""

    def __init__(self, reply):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                body = b'{"object": "list", "data": [{"id": "m"}]}'
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                try:
                    reply(self)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up, as it should

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        import threading

        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _evaluate(url: str, out: Path, *extra, shared: Path, timeout=180):
    env = {**os.environ, "SHARED_DIR": str(shared)}
    return subprocess.run([sys.executable, "-m", "services.evaluator", "--base-url", url, "--model-name", "m",
                           "--seeds", "0-1", "--max-turns", "2", "--no-gifs", "--out", str(out), *extra],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def _answer(handler, text: str):
    body = json.dumps({"choices": [{"message": {"content": text}}]}).encode()
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


@pytest.mark.slow  # runs a service or a server
def test_long_replies_are_cut_before_they_are_parsed_or_stored(tmp_path):
    endpoint = _Endpoint(lambda h: _answer(h, "x" * 500_000 + "('move', 0)"))
    flood = _Endpoint(lambda h: _answer(h, "y" * 5 * 1024 * 1024))
    try:
        proc = _evaluate(endpoint.url, tmp_path / "long", shared=tmp_path)
        assert proc.returncode == 0, proc.stderr[-2000:]
        steps = [s for line in (tmp_path / "long" / "episodes.jsonl").read_text().splitlines()
                 for s in json.loads(line)["steps"]]
        assert steps and all(len(s["text"]) <= 8192 for s in steps), max(len(s["text"]) for s in steps)
        assert all(s["action"] == ["move", 0] or s["action"] == ("move", 0) for s in steps), steps[0]["action"]
        # A 5 MiB body is refused unread: the mazes are errors, and nothing of it is stored.
        proc = _evaluate(flood.url, tmp_path / "flood", shared=tmp_path)
        assert proc.returncode != 0 and "over 1048576 bytes" in proc.stderr.strip().splitlines()[-1], proc.stderr[-1500:]
        assert (tmp_path / "flood" / "episodes.jsonl").stat().st_size < 100_000
    finally:
        endpoint.close()
        flood.close()


@pytest.mark.slow  # runs a service or a server
def test_an_endpoint_that_drips_one_byte_at_a_time_ends_the_evaluation_at_its_deadline(tmp_path):
    def drip(handler):
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", "1000")
        handler.end_headers()
        for _ in range(60):  # bounded: a minute at most, then the connection closes
            handler.wfile.write(b" ")
            handler.wfile.flush()
            time.sleep(1)

    endpoint = _Endpoint(drip)
    try:
        started = time.monotonic()
        proc = _evaluate(endpoint.url, tmp_path / "drip", "--request-deadline", "4", shared=tmp_path)
        elapsed = time.monotonic() - started
    finally:
        endpoint.close()
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert endpoint.url in line and "within 4 s" in line, line
    assert elapsed < 45, f"took {elapsed:.0f} s: each request must end at its deadline"


@pytest.mark.slow  # runs a service or a server
def test_the_evaluator_refuses_a_temperature_it_cannot_sample_with(tmp_path):
    for value in ("nan", "inf", "-1"):
        proc = subprocess.run([sys.executable, "-m", "services.evaluator", "--temperature", value], cwd=REPO,
                              env={**os.environ, "SHARED_DIR": str(tmp_path)}, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 2 and "--temperature" in proc.stderr and value in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


# ---- settings that cannot train, and config errors that must stay readable ----------------------------------------


@pytest.mark.parametrize("override,words", [
    ("algorithm.lr=inf", ["algorithm.lr", "finite"]), ("algorithm.lr=.nan", ["algorithm.lr", "finite"]),
    ("algorithm.lr=5", ["algorithm.lr", "less than or equal to 1"]), ("rollout.temperature=.inf", ["rollout.temperature"]),
    ("sft.lr=-.inf", ["sft.lr"]), ("env.eval_seeds=5-3", ["env.eval_seeds", "backwards"]),
])
def test_settings_out_of_range_are_refused_in_one_line(override, words):
    from shared.config import ConfigError, load_config

    with pytest.raises(ConfigError) as error:
        load_config(None, [override], environ={})
    message = str(error.value)
    assert "\n" not in message and all(word in message for word in words), message


@pytest.mark.slow  # runs a service or a server
def test_a_config_error_does_not_echo_an_unbounded_value(tmp_path):
    """A YAML alias bomb of a few hundred bytes expands to megabytes; the error line stays short."""
    bomb = ["a: &a [x, x, x, x, x, x, x, x, x, x]"] + [
        f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]"
        for i in range(6)]
    profile = tmp_path / "bomb.yaml"
    profile.write_text("\n".join(bomb) + "\nrun_id: *g\n")
    proc = subprocess.run([sys.executable, "-m", "services.trainer", "--config", str(profile)], cwd=REPO,
                          env={**os.environ, "SHARED_DIR": str(tmp_path)}, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert len(proc.stderr) < 1000 and "characters)" in proc.stderr, proc.stderr[:2000]


# ---- files a user or another tool damaged -------------------------------------------------------------------------


@pytest.mark.slow  # runs a service or a server
def test_adapter_files_that_are_not_what_they_claim_are_rejected_with_one_line(exported_run, tiny_cfg, tmp_path):
    from services.exporter.export import InvalidAdapter, read_safetensors_header, validate_adapter

    volume, run_id = exported_run
    folder = tmp_path / "adapter"
    shutil.copytree(volume.export(run_id, 2), folder)
    cfg = tiny_cfg.model_copy(update={"model": tiny_cfg.model.model_copy(update={"base_model_id": "tiny-qwen3vl-sft"})})
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "r": None}))
    with pytest.raises(InvalidAdapter, match="r = 'None' is not a LoRA rank"):
        validate_adapter(folder, cfg)
    listed = tmp_path / "list.safetensors"
    header = b"[1, 2]"
    listed.write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(InvalidAdapter, match="header is a JSON list"):
        read_safetensors_header(listed)


def _read_only_folder(tmp_path: Path) -> tuple[Path, callable]:
    """Returns (a folder no one can write, its undo): a read-only tmpfs where this is root (root ignores modes)."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    if os.geteuid() == 0:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(folder)], check=True)
        return folder, lambda: subprocess.run(["umount", str(folder)], check=True)
    folder.chmod(0o500)
    return folder, lambda: folder.chmod(0o700)


@pytest.mark.slow  # runs a service or a server
def test_a_read_only_shared_dir_is_one_line(tiny_model_dir, tmp_path):
    """Found before any work whose results would be lost: the evaluator checks its output folder before it loads a
    model or reaches an endpoint (here a model without weights and an address nothing listens on, which it would
    otherwise report first)."""
    folder, undo = _read_only_folder(tmp_path)
    weightless = tmp_path / "weightless"
    weightless.mkdir()
    shutil.copy(tiny_model_dir / "config.json", weightless)
    try:
        env = {**os.environ, "SHARED_DIR": str(folder)}
        local = ["services.evaluator", "--model", str(weightless), "--seeds", "0-0", "--no-gifs"]
        remote = ["services.evaluator", "--base-url", f"http://127.0.0.1:{free_port()}", "--seeds", "0-0", "--no-gifs"]
        for command in (["services.trainer"], local, remote):
            proc = subprocess.run([sys.executable, "-m", *command], cwd=REPO, env=env, capture_output=True,
                                  text=True, timeout=300)
            assert proc.returncode != 0 and "Traceback" not in proc.stderr, (command, proc.stderr[-3000:])
            line = proc.stderr.strip().splitlines()[-1]
            assert line.startswith("error: ") and "Read-only file system" in line, (command, line)
    finally:
        undo()
    proc = subprocess.run([sys.executable, "-m", *local], cwd=REPO, env={**os.environ, "SHARED_DIR": str(tmp_path)},
                          capture_output=True, text=True, timeout=300)
    line = proc.stderr.strip().splitlines()[-1]  # a model that cannot load is not a volume that cannot be written
    assert proc.returncode != 0 and line.startswith(f"error: cannot load the model at {weightless}: "), line


@pytest.mark.slow  # runs a service or a server
def test_a_preflight_for_a_cluster_that_does_not_exist_is_one_line(s3_endpoint, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update({"SAGEMAKER_ENDPOINT_URL": s3_endpoint, "AWS_ACCESS_KEY_ID": "local", "AWS_SECRET_ACCESS_KEY": "local",
                "AWS_REGION": "us-west-2", "SHARED_DIR": str(tmp_path)})
    proc = subprocess.run([sys.executable, "-m", "services.trainer", "submit", "--config",
                           "configs/qwen3vl-8b-hyperpod.yaml", "cluster.hyperpod_cluster=no-such-cluster",
                           f"storage.shared_dir={tmp_path}"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert "no cluster 'no-such-cluster'" in line and "cluster.hyperpod_cluster" in line, line


@pytest.mark.slow  # runs a service or a server
@pytest.mark.parametrize("engine", ["transformers", "vllm"])
@pytest.mark.parametrize("damage", ["not safetensors", "truncated"])
def test_a_damaged_model_is_refused_in_one_line_before_any_engine_starts(engine, damage, tiny_model_dir, tmp_path):
    """Both servers read the weights' headers first: a damaged model is named at once, not after the engine's start-up
    (the vLLM app under Ray Serve takes minutes to find out). Ray never starts: no session folder appears."""
    model_dir = tmp_path / "models" / "broken"
    shutil.copytree(tiny_model_dir, model_dir)
    weights = model_dir / "model.safetensors"
    if damage == "not safetensors":
        weights.write_bytes(b"not a safetensors file")
    else:
        with open(weights, "r+b") as handle:
            handle.truncate(weights.stat().st_size // 2)
    env = {**os.environ, "SHARED_DIR": str(tmp_path), "S3_URI": "s3://bucket/p", "RAY_TMPDIR": str(tmp_path / "ray")}
    proc = subprocess.run([sys.executable, "-m", "services.server", "--engine", engine, "model.path=broken"], env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: the model at {model_dir} cannot be loaded: ") and "rebuild it" in last, proc.stderr
    assert ("truncated" in last) == (damage == "truncated"), last
    assert "Traceback" not in proc.stderr and not (tmp_path / "ray").exists(), "an engine was started"
