"""The 64-maze held-out eval of the tiny model (greedy, 15 turns): wall time, median of 3 (target <= 60 s); and the
junction probe the trainer's held-out evals add (each solver-path decision's five actions, teacher-forced)."""

import statistics
import time

from bench.bench_rollout import engines_for_bench
from shared.branching import junction_accuracy, solver_decisions
from shared.episodes import EpisodeSettings
from shared.evaluation import evaluate
from shared.maze.dataset import EvalSet


def run():
    cfg, engines, name = engines_for_bench()
    engine = engines["shared"]  # the default decoder
    eval_set = EvalSet.held_out(cfg.env)
    times, summary = [], None
    for _ in range(3):
        started = time.perf_counter()
        summary, _ = evaluate(engine, eval_set, EpisodeSettings.from_config(cfg))
        times.append(time.perf_counter() - started)
    note = f"{name}, mean turns {summary['mean_turns']:.1f}, solved {summary['solved']}/64; runs {[round(t, 1) for t in times]}"
    settings = EpisodeSettings.for_eval(cfg)
    probe_times, junctions = [], None
    for _ in range(3):
        started = time.perf_counter()
        junctions = junction_accuracy(solver_decisions(engine, eval_set.mazes(), settings))
        probe_times.append(time.perf_counter() - started)
    probe_note = (f"{junctions['all_turns']} solver-path decisions x 5 actions, one forward per batch of candidates; "
                  f"runs {[round(t, 1) for t in probe_times]}")
    return [{"benchmark": "eval", "metric": "64-maze held-out eval", "value": statistics.median(times), "unit": "s",
             "note": note + "; target <= 60 s"},
            {"benchmark": "eval", "metric": "junction probe on the 64", "value": statistics.median(probe_times),
             "unit": "s", "note": probe_note}]
