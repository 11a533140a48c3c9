"""Bad input to the command-line services: one clear line naming the input and the fix, a non-zero exit, never a
traceback; and an evaluation some of whose mazes could not be scored exits non-zero."""

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _run(module: str, *args, shared: Path, env_extra=None, timeout=180):
    env = {**os.environ, "SHARED_DIR": str(shared), "RAY_USAGE_STATS_ENABLED": "0", **(env_extra or {})}
    env.pop("S3_URI", None)
    env.pop("AWS_ENDPOINT_URL", None)
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _assert_one_line(proc, *words):
    err = proc.stderr.strip()
    assert proc.returncode != 0, (proc.returncode, proc.stdout[-500:], err[-1500:])
    assert "Traceback" not in err and "Traceback" not in proc.stdout, err[-3000:]
    assert len(err.splitlines()) == 1, err[-3000:]
    for word in words:
        assert word in err, (word, err)


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bad")
    latin1 = folder / "latin1.yaml"
    latin1.write_bytes("run_id: caf\xe9\n".encode("latin-1"))
    a_file = folder / "a-file"
    a_file.write_text("not a folder")
    return folder, latin1, a_file


SERVICES = ["services.trainer", "services.evaluator", "services.exporter", "services.server"]


@pytest.mark.parametrize("module", SERVICES)
def test_unreadable_configs_give_one_line(module, bad_files, tmp_path):
    folder, latin1, _ = bad_files
    _assert_one_line(_run(module, "--config", str(latin1), shared=tmp_path), "UTF-8", str(latin1))
    _assert_one_line(_run(module, "--config", str(folder), shared=tmp_path), "is a folder", "--config")


def test_shared_dir_naming_a_file(bad_files):
    _, _, a_file = bad_files
    for module in ("services.evaluator", "services.trainer"):
        _assert_one_line(_run(module, shared=a_file), "SHARED_DIR", "is a file")


def test_trainer_model_path_that_is_no_model(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "notes.txt").write_text("not a model")
    _assert_one_line(_run("services.trainer", f"model.path={empty}", "model.bootstrap=none", "run_id=m1", shared=tmp_path),
                     "no model at", str(empty))
    _assert_one_line(_run("services.trainer", f"model.path={stray}", "run_id=m2", shared=tmp_path),
                     "model.path", "not a complete model")


@pytest.mark.parametrize("args,words", [
    (["--seeds", "abc"], ["--seeds", "abc"]),
    (["--seeds", "5-1"], ["--seeds", "5-1"]),
    (["--max-turns", "-3"], ["--max-turns", "-3"]),
    (["--max-turns", "x"], ["--max-turns"]),
    (["--run", "../../etc"], ["--run", "../../etc"]),
    (["--watch", "a/b", "--once"], ["--watch", "a/b"]),
    (["--name", "../../x"], ["--name", "../../x"]),
    (["--compare", "/nope/a", "/nope/b"], ["--compare", "/nope/a", "not an evaluation folder"]),
])
def test_evaluator_arguments(args, words, tmp_path):
    _assert_one_line(_run("services.evaluator", *args, shared=tmp_path), *words)


def test_exporter_refuses_ids_with_a_newline(tmp_path):
    _assert_one_line(_run("services.exporter", "--alias", "evil\n", shared=tmp_path), "--alias", "invalid")
    _assert_one_line(_run("services.exporter", "--run", "../x", shared=tmp_path), "--run", "invalid")
    _assert_one_line(_run("services.trainer", "run_id=../x", shared=tmp_path), "run_id", "invalid")
    _assert_one_line(_run("services.trainer", "run_id=\"x\\n\"", shared=tmp_path), "run_id", "invalid")


def test_dashboards_out_that_cannot_be_written(tmp_path):
    _assert_one_line(_run("services.dashboards", "--out", "/proc/nope", shared=tmp_path), "--out", "/proc/nope")


class DyingEndpoint(BaseHTTPRequestHandler):
    """An OpenAI-compatible endpoint that answers its first chat requests, then fails every one (it died)."""

    def log_message(self, *args):
        pass

    def _send(self, status, body: bytes):
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send(200, b'{"object": "list", "data": [{"id": "m"}]}')

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        with self.server.lock:
            self.server.answered += 1
            alive = self.server.answered <= 2
        if alive:
            return self._send(200, json.dumps({"choices": [{"message": {"content": "('move', 0)"}}]}).encode())
        self._send(503, b'{"error": {"message": "gone"}}')


def test_evaluator_exits_non_zero_when_mazes_could_not_be_scored(tmp_path):
    endpoint = ThreadingHTTPServer(("127.0.0.1", 0), DyingEndpoint)
    endpoint.answered, endpoint.lock = 0, threading.Lock()
    threading.Thread(target=endpoint.serve_forever, daemon=True).start()
    out = tmp_path / "eval"
    try:
        proc = _run("services.evaluator", "--base-url", f"http://127.0.0.1:{endpoint.server_address[1]}",
                    "--model-name", "m", "--seeds", "0-3", "--max-turns", "3", "--no-gifs", "--out", str(out),
                    shared=tmp_path)
    finally:
        endpoint.shutdown()
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "Traceback" not in proc.stderr
    assert "4 of 4 mazes could not be scored" in proc.stderr.strip().splitlines()[-1], proc.stderr[-1500:]
    assert "ERRORS 4" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["errors"] == 4 and summary["failures"].get("engine_error") == 4, summary["failures"]
