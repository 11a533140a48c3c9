"""Rollouts: episodes per second of the GRPO rollout path, the shared-prefix decoder against `model.generate`.

One step's rollout as a worker plays it (train_batch_size mazes x n_samples_per_prompt episodes at the rollout
temperature, rendering, prompts, generation and the training samples included), with both decoders of
`LocalEngine` on the same model, interleaved in this process. Then both play the 64 held-out mazes greedily: the
replies must be identical, turn for turn. The model is the profile's SFT checkpoint when it exists (as in
training), else the untrained tiny model.
"""

import statistics
import time

from services.trainer.rollout import play_rollouts
from shared.config import load_config
from shared.episodes import EpisodeSettings, run_episodes
from shared.maze.dataset import EvalSet, MazeStream, excluded_from_training
from shared.models.inference import LocalEngine
from shared.models.tiny import ensure_tiny_model
from shared.storage.manifest import is_complete
from shared.storage.volume import SharedVolume

REPEATS = 3
DECODERS = ("transformers", "shared")


def engines_for_bench():
    """Returns (config, {decoder: engine} on one loaded model, the model's name)."""
    cfg = load_config()
    sft_dir = SharedVolume(cfg.shared_path()).model(cfg.model.path)
    model_dir = sft_dir if is_complete(sft_dir) else ensure_tiny_model(cfg, log=lambda *_: None)
    shared = LocalEngine.from_config(cfg, model_dir)
    reference = LocalEngine(shared.model, shared.processor, shared.max_images, name=shared.name,
                            max_turns_in_context=shared.context_turns, decoder="transformers")
    return cfg, {"transformers": reference, "shared": shared}, model_dir.name


def run():
    cfg, engines, name = engines_for_bench()
    n = cfg.rollout.n_samples_per_prompt
    stream = MazeStream.for_rl(cfg.env, excluded_from_training(cfg.env))
    rates = {d: [] for d in DECODERS}
    for repeat in range(REPEATS):
        mazes = [(m.env_id, m.seed) for m in stream.take(cfg.rollout.train_batch_size)]  # a fresh step each repeat
        for decoder in DECODERS:  # interleaved so machine noise hits both alike
            started = time.perf_counter()
            groups = play_rollouts(engines[decoder], cfg, mazes, n, seed=repeat)
            rates[decoder].append(sum(len(g.episodes) for g in groups) / (time.perf_counter() - started))
    # Greedy play of the held-out mazes: the same replies from both decoders, and how fast each plays them.
    settings = EpisodeSettings.from_config(cfg)
    held_out = EvalSet.held_out(cfg.env).mazes()
    plays, eval_rates = {}, {}
    for decoder in DECODERS:
        started = time.perf_counter()
        episodes = run_episodes(engines[decoder], held_out, settings)
        eval_rates[decoder] = len(episodes) / (time.perf_counter() - started)
        plays[decoder] = [[turn.text for turn in e.turns] for e in episodes]
    identical = sum(a == b for a, b in zip(plays["transformers"], plays["shared"]))
    old, new = (statistics.median(rates[d]) for d in DECODERS)
    note = (f"{cfg.rollout.train_batch_size} mazes x {n} samples, T={cfg.rollout.temperature}, {name}, "
            f"median of {REPEATS}")
    return [
        {"benchmark": "rollout", "metric": "model.generate episodes/s", "value": old, "unit": "episodes/s", "note": note},
        {"benchmark": "rollout", "metric": "shared-prefix decoder episodes/s", "value": new, "unit": "episodes/s",
         "note": note},
        {"benchmark": "rollout", "metric": "rollout speed-up", "value": new / old, "unit": "x", "note": "target >= 3x"},
        {"benchmark": "rollout", "metric": "greedy held-out speed-up", "value": eval_rates["shared"] / eval_rates["transformers"],
         "unit": "x", "note": f"{len(held_out)} mazes, one run each"},
        {"benchmark": "rollout", "metric": "identical greedy episodes", "value": identical, "unit": f"of {len(held_out)}",
         "note": "every reply of every turn equal"},
    ]
