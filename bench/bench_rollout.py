"""Rollout generation: episodes per second, batched across live episodes vs one episode at a time.

Both modes play the same mazes with the same model, measured side by side in this process. The model
is the profile's SFT checkpoint when it exists (as in training), else the untrained tiny model.
"""

import statistics
import time

import torch

from shared.config import load_config
from shared.episodes import EpisodeSettings, run_episodes
from shared.maze import generate
from shared.models.engine import LocalEngine
from shared.models.tiny import ensure_tiny_model
from shared.storage import SharedVolume, is_complete

EPISODES = 16
REPEATS = 3


def engine_for_bench():
    cfg = load_config()
    sft_dir = SharedVolume(cfg.shared_path()).model(cfg.model.path)
    model_dir = sft_dir if is_complete(sft_dir) else ensure_tiny_model(cfg, log=lambda *_: None)
    return cfg, LocalEngine.from_config(cfg, model_dir), model_dir.name


def run():
    torch.set_num_threads(torch.get_num_threads())
    cfg, engine, name = engine_for_bench()
    settings = EpisodeSettings.from_config(cfg, temperature=cfg.rollout.temperature)
    mazes = [generate(cfg.env.id, 10_000 + i) for i in range(EPISODES)]
    rates = {True: [], False: []}
    turns = {True: [], False: []}
    for repeat in range(REPEATS):
        for batched in (True, False):  # interleaved so machine noise hits both alike
            started = time.perf_counter()
            episodes = run_episodes(engine, mazes, settings, seed=repeat, batched=batched)
            rates[batched].append(EPISODES / (time.perf_counter() - started))
            turns[batched].append(sum(len(e.turns) for e in episodes))
    batched, single = statistics.median(rates[True]), statistics.median(rates[False])
    note = f"{EPISODES} episodes x up to {cfg.env.max_turns} turns, T={settings.temperature}, {name}, median of {REPEATS}"
    return [
        {"benchmark": "rollout", "metric": "batched episodes/s", "value": batched, "unit": "episodes/s", "note": note},
        {"benchmark": "rollout", "metric": "one-at-a-time episodes/s", "value": single, "unit": "episodes/s", "note": note},
        {"benchmark": "rollout", "metric": "batched speed-up", "value": batched / single, "unit": "x", "note": "target >= 3x"},
    ]
