"""Held-out evaluation: play an eval set with an engine, write summary.json and episodes.jsonl.

The summary schema is the same wherever an evaluation runs. SkyRL's in-loop evals are read
from its own dumps (`skyrl_solve_rates`).
"""

from __future__ import annotations

import json
import math
import re
import time
from collections import defaultdict
from pathlib import Path

from tqdm import tqdm

from shared.episodes import Episode, EpisodeSettings, run_episodes
from shared.maze.dataset import EvalSet
from shared.storage.files import atomic_write_json, atomic_write_text

# SkyRL's solve rate: the env's `solved` metric averaged over the held-out episodes. Not `eval/all/pass_at_1`,
# which counts an episode as passed when its reward is above 0: under `reward: task_format` an unsolved but
# well-formatted episode scores 0.2 and would count.
SKYRL_SOLVE_RATE_METRIC = "eval/all/environment/solved"
_SKYRL_EVAL_DUMP = re.compile(r"global_step_(\d+)_evals")


def skyrl_solve_rates(run_dir: str | Path) -> dict[int, float]:
    """Returns {step: solve rate} from a SkyRL run's eval dumps (exports/dumped_evals/global_step_N_evals/)."""
    rates = {}
    for folder in sorted(Path(run_dir, "exports", "dumped_evals").glob("global_step_*_evals")):
        match = _SKYRL_EVAL_DUMP.fullmatch(folder.name)
        dump = folder / "aggregated_results.jsonl"
        if match and dump.exists():
            lines = dump.read_text().splitlines()
            metrics = json.loads(lines[-1]) if lines else {}
            if SKYRL_SOLVE_RATE_METRIC in metrics:
                rates[int(match.group(1))] = float(metrics[SKYRL_SOLVE_RATE_METRIC])
    return rates


def summarize(episodes: list[Episode], eval_set: EvalSet, model: str, adapter: str | None, extra: dict | None = None) -> dict:
    """Returns the summary.json dict for finished episodes."""
    total = len(episodes)
    solved = sum(e.solved for e in episodes)
    oracle = eval_set.oracle_solved()
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
        "oracle_solved": oracle,
        "share_of_ceiling": solved / oracle if oracle else 0.0,
        "format_rate": sum(e.format_rate() for e in episodes) / max(total, 1),
        "parse_failures": sum(e.parse_failures for e in episodes),
        "mean_turns": sum(turns) / max(total, 1),
        "errors": sum(e.error is not None for e in episodes),
        "by_optimal_actions": {str(k): {"solved": v[0], "total": v[1]} for k, v in sorted(by_length.items())},
        "failures": dict(sorted(failures.items())),  # why unsolved mazes failed: see failure_kind
        "wrong_branch_cells": {str(k): v for k, v in sorted(branch_cells.items())},
        "model": model,
        "adapter": adapter,
    }
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
             progress: str | None = None) -> tuple[dict, list[Episode]]:
    """Plays the eval set (greedy unless settings say otherwise); writes summary.json + episodes.jsonl.

    `adapter` is what the summary names as the adapter (default: the engine's); `progress` names a progress bar
    over turns, with the finished mazes beside it (none when None)."""
    settings = EpisodeSettings(**{**settings.__dict__, "max_turns": eval_set.max_turns})
    started = time.perf_counter()
    bar = tqdm(total=eval_set.max_turns, desc=progress, unit="turn", leave=False) if progress else None

    def update(turn: int, done: int, total: int) -> None:
        bar.update(turn - bar.n)
        bar.set_postfix(finished=f"{done}/{total}")

    episodes = run_episodes(engine, eval_set.mazes(), settings, progress=update if bar else None)
    if bar:
        bar.close()
    elapsed = time.perf_counter() - started
    summary = summarize(episodes, eval_set, model or getattr(engine, "name", "?"),
                        getattr(engine, "adapter", None) if adapter is ... else adapter,
                        {"elapsed_s": round(elapsed, 2), "temperature": settings.temperature, **(extra or {})})
    if out_dir is not None:
        out_dir = Path(out_dir)
        atomic_write_text(out_dir / "episodes.jsonl", "".join(json.dumps(e.record()) + "\n" for e in episodes))
        atomic_write_json(out_dir / "summary.json", summary)  # last: a summary means the folder is complete
    return summary, episodes


# ---- intervals and the paired test behind the run summary --------------------------------------------------

Z95 = 1.959964  # the normal quantile of a two-sided 95% interval


def wilson_interval(solved: int, total: int, z: float = Z95) -> tuple[float, float]:
    """Returns the 95% Wilson score interval of a solve rate (stays inside [0, 1], sound for small counts)."""
    if total == 0:
        return 0.0, 1.0
    p = solved / total
    centre = (p + z * z / (2 * total)) / (1 + z * z / total)
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / (1 + z * z / total)
    return max(0.0, centre - half), min(1.0, centre + half)


def solved_by_seed(eval_dir: str | Path) -> dict[int, bool]:
    """Returns {seed: solved} from an evaluation folder's episodes.jsonl."""
    lines = Path(eval_dir, "episodes.jsonl").read_text().splitlines()
    return {int(r["seed"]): bool(r["solved"]) for r in map(json.loads, lines) if r}


def paired_comparison(before: dict[int, bool], after: dict[int, bool], z: float = Z95) -> dict:
    """Compares two policies on the same mazes: the change in solve rate with its paired 95% interval.

    Only the discordant mazes carry information: `gained` (solved after, not before) and `lost`. The interval is
    the Wald interval of a difference of paired proportions; `p_value` is McNemar's exact two-sided test."""
    seeds = sorted(before)
    if sorted(after) != seeds:
        raise ValueError("a paired comparison needs the same mazes on both sides")
    n = len(seeds)
    gained = sum(after[s] and not before[s] for s in seeds)
    lost = sum(before[s] and not after[s] for s in seeds)
    diff = (gained - lost) / n if n else 0.0
    se = math.sqrt(max(gained + lost - (gained - lost) ** 2 / n, 0.0)) / n if n else 0.0
    discordant = gained + lost
    tail = sum(math.comb(discordant, k) for k in range(min(gained, lost) + 1)) / 2**discordant if discordant else 1.0
    return {"mazes": n, "gained": gained, "lost": lost, "difference": diff, "ci_low": diff - z * se,
            "ci_high": diff + z * se, "p_value": min(1.0, 2 * tail)}


def describe(summary: dict) -> str:
    """Returns the one-line result people read: solve rate beside the oracle ceiling."""
    return (
        f"{summary['env']} seeds {summary['seeds']} @ {summary['max_turns']} turns: "
        f"solved {summary['solved']}/{summary['total']} ({100 * summary['solve_rate']:.1f}%), "
        f"oracle ceiling {summary['oracle_solved']}/{summary['total']}, "
        f"{100 * summary['share_of_ceiling']:.1f}% of ceiling; parse failures {summary['parse_failures']}, "
        f"mean turns {summary['mean_turns']:.1f}"
        + (f"; ERRORS {summary['errors']}: {summary['errors']} mazes could not be scored" if summary.get("errors") else "")
    )


def plot_solve_rate(path: Path, steps: list[int], rates: list[float], ceiling: float, title: str,
                    extended: dict | None = None) -> None:
    """Writes the held-out solve rate per step, with the oracle ceiling, as a PNG.

    `extended` ({"label", "points": [(step, solved, total, ci_low, ci_high)], "ceiling"}) adds the larger set's
    scores with their 95% intervals beside the curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot(steps, [100 * r for r in rates], marker="o", label="held-out solve rate")
    ax.axhline(100 * ceiling, color="grey", linestyle="--", label=f"oracle ceiling ({100 * ceiling:.1f}%)")
    if extended:
        xs = [p[0] for p in extended["points"]]
        ys = [100 * p[1] / p[2] for p in extended["points"]]
        errors = [[y - 100 * p[3] for y, p in zip(ys, extended["points"])],
                  [100 * p[4] - y for y, p in zip(ys, extended["points"])]]
        ax.errorbar(xs, ys, yerr=errors, fmt="s", color="tab:orange", capsize=4,
                    label=f"{extended['label']} (95% CI)")
        ax.axhline(100 * extended["ceiling"], color="tab:orange", linestyle=":", alpha=0.6,
                   label=f"its ceiling ({100 * extended['ceiling']:.1f}%)")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("solved (%)")
    ax.set_ylim(0, 100)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)
