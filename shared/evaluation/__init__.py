"""Held-out evaluation: play an eval set with an engine, write summary.json and episodes.jsonl.

The summary schema is the same wherever an evaluation runs (the SFT warm start, the trainer, the evaluator
service, the server client). Beside it: `statistics` (intervals and paired tests), `plots`, and `skyrl` (SkyRL's
own eval metrics, read from its dumps). See docs/evaluator.md.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path

from tqdm import tqdm

from shared.episodes import Episode, EpisodeSettings, run_episodes
from shared.evaluation.skyrl import pass_at_1_definition
from shared.machine import machine_info
from shared.maze.dataset import EvalSet
from shared.storage.files import atomic_write_json, atomic_write_text


def summarize(episodes: list[Episode], eval_set: EvalSet, model: str, adapter: str | None, extra: dict | None = None,
              samples: int = 1, reward: str = "task", machine: dict | None = None) -> dict:
    """Returns the summary.json dict for finished episodes (`samples` per maze, in maze order); `machine` is where
    the replies were computed (default: this process, `machine_info()`)."""
    total = len(episodes)
    solved = sum(e.solved for e in episodes)
    oracle = eval_set.oracle_solved() * samples
    by_length: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    failures: dict[str, int] = defaultdict(int)
    branch_cells: dict[int, int] = defaultdict(int)
    for e in episodes:
        record = e.record()
        bucket = by_length[record["optimal_actions"]]
        bucket[0] += int(e.solved)
        bucket[1] += 1
        if not e.solved:
            kind = failure_kind(record, eval_set.max_turns)
            failures[kind] += 1
            if kind == "wrong_branch":
                branch_cells[record["first_mistake"]["branch_cells"]] += 1
    turns = [len(e.turns) for e in episodes]
    summary = {
        "env": eval_set.env_id,
        "seeds": eval_set.seeds_spec,
        "max_turns": eval_set.max_turns,
        "total": total,
        "solved": solved,
        "solve_rate": solved / total if total else 0.0,
        "mean_reward": sum(e.reward(reward) for e in episodes) / total if total else 0.0,
        "pass_at_1": sum(e.reward(reward) > 0 for e in episodes) / total if total else 0.0,
        "pass_at_1_definition": pass_at_1_definition(reward),
        "oracle_solved": oracle,
        "share_of_ceiling": solved / oracle if oracle else 0.0,
        "format_rate": sum(e.format_rate for e in episodes) / max(total, 1),
        "parse_failures": sum(e.parse_failures for e in episodes),
        "mean_turns": sum(turns) / max(total, 1),
        "errors": sum(e.error is not None for e in episodes),
        "first_error": next((e.error[:300] for e in episodes if e.error), None),
        "by_optimal_actions": {str(k): {"solved": v[0], "total": v[1]} for k, v in sorted(by_length.items())},
        "failures": dict(sorted(failures.items())),  # why unsolved mazes failed: see failure_kind
        "wrong_branch_cells": {str(k): v for k, v in sorted(branch_cells.items())},
        "model": model,
        "adapter": adapter,
        "machine": machine if machine is not None else machine_info(),
    }
    if samples > 1:
        by_maze = [episodes[i : i + samples] for i in range(0, total, samples)]
        summary.update({"samples_per_maze": samples, "mazes": len(by_maze), "mean_success": summary["solve_rate"],
                        "pass_at_k": sum(any(e.solved for e in group) for group in by_maze) / max(len(by_maze), 1)})
    summary.update(extra or {})
    return summary


def failure_kind(record: dict, max_turns: int) -> str:
    """Returns why an unsolved episode (an `episodes.jsonl` record) failed: `engine_error` when the engine could
    not play it, `beyond_ceiling` when no agent solves its maze in `max_turns`, else its first mistake's kind."""
    if record["error"]:  # first: a maze that was never played is an error, whatever its ceiling
        return "engine_error"
    if record["optimal_actions"] > max_turns:
        return "beyond_ceiling"
    return record["first_mistake"]["kind"]


def evaluate(engine, eval_set: EvalSet, settings: EpisodeSettings, out_dir: str | Path | None = None,
             model: str | None = None, adapter: str | None = ..., extra: dict | None = None,
             progress: str | None = None, samples: int = 1, seed: int = 0,
             machine: dict | None = None) -> tuple[dict, list[Episode]]:
    """Plays the eval set (greedy unless settings say otherwise); writes summary.json + episodes.jsonl.

    `adapter` is what the summary names as the adapter (default: the engine's); `progress` names a progress bar
    over turns, with the finished mazes beside it (none when None). `samples` > 1 plays every maze that many times
    at the settings' temperature (seeded): the summary then counts episodes, and adds mean@k and pass@k. `machine`:
    as `summarize`'s (an engine behind an endpoint passes what it knows of the server's)."""
    settings = EpisodeSettings(**{**settings.__dict__, "max_turns": eval_set.max_turns})
    if samples > 1 and settings.temperature == 0:
        raise ValueError("several samples per maze need a temperature above 0 (greedy play repeats itself)")
    started = time.perf_counter()
    bar = tqdm(total=eval_set.max_turns, desc=progress, unit="turn", leave=False) if progress else None

    def update(turn: int, done: int, total: int) -> None:
        bar.update(turn - bar.n)
        bar.set_postfix(finished=f"{done}/{total}")

    mazes = [maze for maze in eval_set.mazes() for _ in range(samples)]
    episodes = run_episodes(engine, mazes, settings, progress=update if bar else None,
                            seed=seed if settings.temperature > 0 else None)
    if bar:
        bar.close()
    elapsed = time.perf_counter() - started
    summary = summarize(episodes, eval_set, model or getattr(engine, "name", "?"),
                        getattr(engine, "adapter", None) if adapter is ... else adapter,
                        {"elapsed_s": round(elapsed, 2), "temperature": settings.temperature, **(extra or {})},
                        samples=samples, reward=settings.reward, machine=machine)
    if out_dir is not None:
        out_dir = Path(out_dir)
        atomic_write_text(out_dir / "episodes.jsonl", "".join(
            json.dumps({**e.record(), "reward": e.reward(settings.reward)}) + "\n" for e in episodes))
        atomic_write_json(out_dir / "summary.json", summary)  # last: a summary means the folder is complete
    return summary, episodes


def describe(summary: dict) -> str:
    """Returns the one-line result people read: solve rate beside the oracle ceiling."""
    if summary.get("samples_per_maze", 1) > 1:
        return (f"{summary['env']} seeds {summary['seeds']} @ {summary['max_turns']} turns, "
                f"{summary['samples_per_maze']} samples per maze at T={summary['temperature']}: "
                f"mean@{summary['samples_per_maze']} {100 * summary['mean_success']:.1f}%, "
                f"pass@{summary['samples_per_maze']} {100 * summary['pass_at_k']:.1f}% of {summary['mazes']} mazes "
                f"(oracle ceiling {summary['oracle_solved'] // summary['samples_per_maze']}/{summary['mazes']})"
                + (f"; ERRORS {summary['errors']}" if summary.get("errors") else ""))
    return (
        f"{summary['env']} seeds {summary['seeds']} @ {summary['max_turns']} turns: "
        f"solved {summary['solved']}/{summary['total']} ({100 * summary['solve_rate']:.1f}%), "
        f"oracle ceiling {summary['oracle_solved']}/{summary['total']}, "
        f"{100 * summary['share_of_ceiling']:.1f}% of ceiling"
        + (f"; SkyRL's pass_at_1 {100 * summary['pass_at_1']:.1f}%" if "pass_at_1" in summary else "")
        + f"; parse failures {summary['parse_failures']}, "
        f"mean turns {summary['mean_turns']:.1f}"
        + (f"; ERRORS {summary['errors']}: {summary['errors']} mazes could not be scored" if summary.get("errors") else "")
    )


