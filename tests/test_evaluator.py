"""Evaluator: outputs and report (checked in headless Chromium), compare, watch, bad endpoints, parity."""

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from shared.episodes import EpisodeSettings, run_episodes
from shared.maze import generate
from shared.models.contract import Completion
from shared.models.endpoint import OpenAIEngine
from shared.models.inference import LocalEngine

REPO = Path(__file__).resolve().parent.parent
QUICK = ["env.max_turns=2", "rollout.max_new_tokens=4"]


def _evaluate(shared, *args):
    env = {**os.environ, "SHARED_DIR": str(shared)}
    return subprocess.run([sys.executable, "-m", "services.evaluator", *args, *QUICK], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def evaluation(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval") / "base"
    proc = _evaluate(tiny_model_dir.parent.parent, "--model", str(tiny_model_dir), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out, proc


def test_outputs(evaluation):
    out, proc = evaluation
    summary = json.loads((out / "summary.json").read_text())
    for key in ("env", "seeds", "max_turns", "total", "solved", "solve_rate", "oracle_solved", "format_rate",
                "parse_failures", "mean_turns", "model", "adapter", "share_of_ceiling", "by_optimal_actions", "model_sha256"):
        assert key in summary, key
    assert summary["total"] == 64 and summary["seeds"] == "0-63" and summary["max_turns"] == 2
    assert summary["oracle_solved"] == 0  # no maze is solvable in 2 turns
    assert summary["failures"] == {"beyond_ceiling": 64} and summary["wrong_branch_cells"] == {}
    lines = (out / "episodes.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    assert len(lines) == 64 and {"text", "action", "feedback", "position"} <= set(first["steps"][0])
    assert "first_mistake" in first
    assert len(list((out / "gifs").glob("seed_*.gif"))) == 64
    assert "oracle ceiling 0/64" in proc.stdout


def _chromium():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    return None


@pytest.mark.skipif(_chromium() is None, reason="Debian's chromium is not installed")
def test_report_renders_in_headless_chromium(evaluation, tmp_path):
    out, _ = evaluation
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}"]
    url = (out / "report.html").as_uri()
    # The DOM after load: 64 episode cards, each with its GIF.
    dom = subprocess.run([_chromium(), *flags, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert dom.stdout.count('class="episode ') == 64
    assert dom.stdout.count("gifs/seed_") == 64
    # Console errors (a missing GIF, a script error) are logged at level >= 2 with --enable-logging.
    log = subprocess.run([_chromium(), *flags, "--enable-logging=stderr", "--v=0", "--virtual-time-budget=3000",
                          "--screenshot=" + str(tmp_path / "report.png"), "--window-size=1200,900", url],
                         capture_output=True, text=True, timeout=120)
    console = [line for line in log.stderr.splitlines() if "CONSOLE" in line or "Failed to load resource" in line]
    assert not console, console
    assert (tmp_path / "report.png").stat().st_size > 10_000


def test_compare(evaluation, tmp_path):
    out, _ = evaluation
    proc = subprocess.run([sys.executable, "-m", "services.evaluator", "--compare", str(out), str(out), "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    page = (tmp_path / "compare.html").read_text()
    assert page.count("<tr><td>") == 64 and "only A: []" in page
    assert "played identically: 64/64" in proc.stdout and "played identically: 64/64" in page
    # One reply changed in one episode: that episode no longer counts as identical, whatever its outcome.
    other = tmp_path / "b"
    shutil.copytree(out, other)
    episodes = [json.loads(line) for line in (other / "episodes.jsonl").read_text().splitlines()]
    episodes[5]["steps"][0]["text"] += " "
    (other / "episodes.jsonl").write_text("".join(json.dumps(e) + "\n" for e in episodes))
    proc = subprocess.run([sys.executable, "-m", "services.evaluator", "--compare", str(out), str(other), "--out",
                           str(tmp_path / "cmp")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "played identically: 63/64" in proc.stdout


def test_watch_evaluates_each_export_once(exported_run, tiny_model_dir):
    volume, run_id = exported_run
    # SkyRL's eval dump of step 4, in the form SkyRL writes it (tests/skyrl_checks checks SkyRL's own writer against the reader).
    dump = volume.run(run_id) / "exports" / "dumped_evals" / "global_step_4_evals" / "aggregated_results.jsonl"
    dump.parent.mkdir(parents=True, exist_ok=True)
    dump.write_text(json.dumps({"eval/all/pass_at_1": 1.0, "eval/all/environment/solved": 0.25}) + "\n")
    args = ["--watch", run_id, "--once", f"model.path={tiny_model_dir}", "env.eval_seeds=0-3"]
    first = _evaluate(volume.root, *args)
    assert first.returncode == 0, first.stderr[-2000:]
    history = volume.run(run_id) / "evals" / "watch" / "history.jsonl"
    rows = [json.loads(line) for line in history.read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4]
    assert "skyrl_solve_rate" not in rows[0] and rows[1]["skyrl_solve_rate"] == 0.25, "solved, never pass_at_1"
    assert "step 4: SkyRL's in-loop eval solved 25.0%" in first.stdout
    assert (history.parent / "solve_rate_vs_step.png").exists()
    again = _evaluate(volume.root, *args)
    assert again.returncode == 0 and "solved" not in again.stdout  # nothing redone
    assert len(history.read_text().splitlines()) == 2


def test_missing_model_or_adapter_fails_at_start(tmp_path, tiny_model_dir):
    proc = _evaluate(tmp_path, "--model", str(tmp_path / "nope"))
    assert proc.returncode != 0 and "no model at" in proc.stderr
    proc = _evaluate(tmp_path, "--model", str(tiny_model_dir), "--adapter", str(tmp_path))
    assert proc.returncode != 0 and "no LoRA adapter" in proc.stderr
    proc = _evaluate(tmp_path, "--base-url", "http://127.0.0.1:9")
    assert proc.returncode != 0 and "not reachable" in proc.stderr


class Misbehaving(BaseHTTPRequestHandler):
    """Answers /v1/models; chat requests get 503, garbage, a hang, or a valid reply, by maze."""

    def log_message(self, *args):
        pass

    def _send(self, status, body: bytes):
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send(200, b'{"data": []}')

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        text = body["messages"][0]["content"][0]["text"]
        mode = "ok"
        if "9x9" in text:
            mode = self.server.modes.pop(0) if self.server.modes else "ok"
        if mode == "refuse":
            return self._send(503, b'{"error": "overloaded"}')
        if mode == "garbage":
            return self._send(200, b"<html>not json</html>")
        if mode == "hang":
            time.sleep(3)
        self._send(200, json.dumps({"choices": [{"message": {"content": "('stop', 'stop')"}}]}).encode())


def test_bad_endpoint_gets_retries_then_failed_with_reason():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Misbehaving)
    server.modes = ["refuse", "garbage", "ok"] + ["refuse"] * 3 + ["hang"] * 3
    threading.Thread(target=server.serve_forever, daemon=True).start()
    engine = OpenAIEngine(f"http://127.0.0.1:{server.server_address[1]}", "m", timeout_s=1.0, retries=2, backoff_s=0.01)
    settings = EpisodeSettings(max_turns=3, cell_px=16)
    # One maze recovers after a 503 and garbage; the next ones exhaust their retries (503s, then time-outs).
    episodes = run_episodes(engine, [generate("maze_2d/easy", 0)], settings)
    assert episodes[0].error is None and len(episodes[0].turns) == 1
    episodes = run_episodes(engine, [generate("maze_2d/easy", 1)], settings)
    assert episodes[0].error and "503" in episodes[0].error and "gave up after 3 tries" in episodes[0].error
    episodes = run_episodes(engine, [generate("maze_2d/easy", 2)], settings)
    assert episodes[0].error and "Timeout" in episodes[0].error
    server.shutdown()


def test_an_evaluation_through_an_endpoint_never_imports_torch(tmp_path):
    """`--base-url` plays through HTTP only (shared/models/contract.py keeps the engine contract without torch), so an
    evaluation of a served model starts without the seconds torch takes to import."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), Misbehaving)
    server.modes = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    argv = ["evaluator", "--base-url", f"http://127.0.0.1:{server.server_address[1]}", "--model-name", "m",
            "--seeds", "0-1", "--out", str(tmp_path / "out"), *QUICK]
    probe = ("import runpy, sys\n"
             f"sys.argv = {argv!r}\n"
             "try:\n"
             "    runpy.run_module('services.evaluator', run_name='__main__', alter_sys=True)\n"
             "finally:\n"
             "    print('heavy modules:', [m for m in ('torch', 'transformers') if m in sys.modules], file=sys.stderr)\n")
    try:
        proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env={**os.environ, "SHARED_DIR": str(tmp_path)},
                              capture_output=True, text=True, timeout=120)
    finally:
        server.shutdown()
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len((tmp_path / "out" / "episodes.jsonl").read_text().splitlines()) == 2
    assert proc.stderr.strip().splitlines()[-1] == "heavy modules: []", proc.stderr[-2000:]
    machine = json.loads((tmp_path / "out" / "summary.json").read_text())["machine"]
    assert machine["replies_from"] == argv[2] and "torch" not in machine["client"], machine


def test_parity_of_two_independent_in_process_engines(exported_run, tiny_cfg, tiny_model_dir):
    volume, run_id = exported_run
    adapter = volume.export(run_id, 4)
    a = LocalEngine.from_config(tiny_cfg, tiny_model_dir, adapter)
    b = LocalEngine.from_config(tiny_cfg, tiny_model_dir, adapter)
    mazes = [generate("maze_2d/easy", s) for s in range(6)]
    settings = EpisodeSettings(max_turns=3, cell_px=16, max_new_tokens=6)
    ea, eb = run_episodes(a, mazes, settings), run_episodes(b, mazes, settings, batched=False)
    assert [[t.text for t in e.turns] for e in ea] == [[t.text for t in e.turns] for e in eb]


class _ScriptedPlayer:
    """Stands in for a model: each episode (known by its conversation) replies from its own script."""

    def __init__(self, scripts: list[list[str]]):
        self.scripts = [iter(script) for script in scripts]
        self.episode_of: dict[int, int] = {}

    def generate(self, conversations, temperature, max_new_tokens, seed):
        replies = []
        for messages in conversations:
            index = self.episode_of.setdefault(id(messages), len(self.episode_of))
            replies.append(Completion(text=next(self.scripts[index], "('stop', 'stop')"), token_ids=[]))
        return replies


def test_summary_names_why_each_unsolved_maze_failed(tmp_path):
    """Solved, into a wall, unreadable, and beyond the ceiling: each maze's failure is named and counted."""
    from shared.evaluation import evaluate
    from shared.maze.actions import format_action
    from shared.maze.core import MOVES, optimal_action_count, solve
    from shared.maze.dataset import EvalSet

    mazes = [generate("maze_2d/easy", seed) for seed in range(64)]
    solvable = [m for m in mazes if optimal_action_count(m) <= 15][:3]
    beyond = next(m for m in mazes if optimal_action_count(m) > 15)
    first, walled, garbled = solvable
    into_wall = next(d for d, (di, dj) in MOVES.items()
                     if walled.maze_map[walled.agent[0] + di][walled.agent[1] + dj] == 1)
    scripts = [
        [format_action(("move", d)) for d in solve(first)] + ["('stop', 'stop')"],   # solved
        [format_action(("move", into_wall))] * 3 + [format_action(("move", d)) for d in solve(walled)],  # 3 turns lost
        ["go left please"] * 15,                                                      # never readable
        [format_action(("move", d)) for d in solve(beyond)],                          # no agent solves it in 15
    ]
    eval_set = EvalSet("maze_2d/easy", [m.seed for m in (first, walled, garbled, beyond)], 15)
    summary, episodes = evaluate(_ScriptedPlayer(scripts), eval_set, EpisodeSettings(max_turns=15, cell_px=16),
                                 tmp_path, model="scripted")
    assert [e.solved for e in episodes] == [True, False, False, False]
    assert summary["failures"] == {"wall": 1, "unparsed": 1, "beyond_ceiling": 1}
    assert (summary["solved"], summary["oracle_solved"], summary["parse_failures"]) == (1, 3, 15)
