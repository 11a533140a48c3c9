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
from shared.machine import machine_info
from shared.maze.dataset import EvalSet
from shared.storage.files import atomic_write_json, atomic_write_text

# SkyRL's solve rate: the env's `solved` metric averaged over the held-out episodes. Not `eval/all/pass_at_1`,
# which counts an episode as passed when its reward is above 0: under `reward: task_format` an unsolved but
# well-formatted episode scores 0.2 and would count. Every summary reports both, with the ceiling.
SKYRL_SOLVE_RATE_METRIC = "eval/all/environment/solved"
SKYRL_PASS_AT_1_METRIC = "eval/all/pass_at_1"


def pass_at_1_definition(reward: str) -> str:
    """Returns what `pass_at_1` counts, as every summary states it."""
    return (f"share of episodes with reward above 0 under env.reward={reward!r}: SkyRL's eval/all/pass_at_1, the metric "
            "AWS's 28 -> 62 of 64 was most likely read from; under task_format a well-tagged unsolved episode counts, "
            "so it can exceed the oracle ceiling, which bounds solve_rate only")
_SKYRL_EVAL_DUMP = re.compile(r"global_step_(\d+)_evals")


def skyrl_eval_metrics(run_dir: str | Path) -> dict[int, dict[str, float]]:
    """Returns {step: {"solve_rate", "pass_at_1"}} from a SkyRL run's eval dumps
    (exports/dumped_evals/global_step_N_evals/): SkyRL's own solved share and its pass_at_1, side by side."""
    found = {}
    for folder in sorted(Path(run_dir, "exports", "dumped_evals").glob("global_step_*_evals")):
        match = _SKYRL_EVAL_DUMP.fullmatch(folder.name)
        dump = folder / "aggregated_results.jsonl"
        if match and dump.exists():
            lines = dump.read_text().splitlines()
            metrics = json.loads(lines[-1]) if lines else {}
            if SKYRL_SOLVE_RATE_METRIC in metrics:
                found[int(match.group(1))] = {"solve_rate": float(metrics[SKYRL_SOLVE_RATE_METRIC]),
                                              "pass_at_1": metrics.get(SKYRL_PASS_AT_1_METRIC)}
    return found


def skyrl_solve_rates(run_dir: str | Path) -> dict[int, float]:
    """Returns {step: solve rate} from a SkyRL run's eval dumps."""
    return {step: m["solve_rate"] for step, m in skyrl_eval_metrics(run_dir).items()}


def summarize(episodes: list[Episode], eval_set: EvalSet, model: str, adapter: str | None, extra: dict | None = None,
              samples: int = 1, reward: str = "task") -> dict:
    """Returns the summary.json dict for finished episodes (`samples` per maze, in maze order)."""
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
        "format_rate": sum(e.format_rate() for e in episodes) / max(total, 1),
        "parse_failures": sum(e.parse_failures for e in episodes),
        "mean_turns": sum(turns) / max(total, 1),
        "errors": sum(e.error is not None for e in episodes),
        "by_optimal_actions": {str(k): {"solved": v[0], "total": v[1]} for k, v in sorted(by_length.items())},
        "failures": dict(sorted(failures.items())),  # why unsolved mazes failed: see failure_kind
        "wrong_branch_cells": {str(k): v for k, v in sorted(branch_cells.items())},
        "model": model,
        "adapter": adapter,
        "machine": machine_info(),
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
             progress: str | None = None, samples: int = 1, seed: int = 0) -> tuple[dict, list[Episode]]:
    """Plays the eval set (greedy unless settings say otherwise); writes summary.json + episodes.jsonl.

    `adapter` is what the summary names as the adapter (default: the engine's); `progress` names a progress bar
    over turns, with the finished mazes beside it (none when None). `samples` > 1 plays every maze that many times
    at the settings' temperature (seeded): the summary then counts episodes, and adds mean@k and pass@k."""
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
                        samples=samples, reward=settings.reward)
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


def paired_mean_difference(before: dict[int, float], after: dict[int, float], z: float = Z95) -> dict:
    """Compares two policies' per-maze success shares (e.g. mean@k) on the same mazes: the mean difference with
    its paired 95% interval (normal approximation over mazes) and a two-sided p-value."""
    seeds = sorted(before)
    if sorted(after) != seeds:
        raise ValueError("a paired comparison needs the same mazes on both sides")
    n = len(seeds)
    diffs = [after[s] - before[s] for s in seeds]
    mean = math.fsum(diffs) / n if n else 0.0
    sd = math.sqrt(math.fsum((d - mean) ** 2 for d in diffs) / (n - 1)) if n > 1 else 0.0
    se = sd / math.sqrt(n) if n else 0.0
    p = math.erfc(abs(mean) / se / math.sqrt(2)) if se > 0 else (1.0 if mean == 0 else 0.0)
    return {"mazes": n, "difference": mean, "ci_low": mean - z * se, "ci_high": mean + z * se, "p_value": p}


def success_by_maze(eval_dir: str | Path) -> dict[int, list[bool]]:
    """Returns {seed: [solved, ...]} from an evaluation folder's episodes.jsonl (one entry per sample played)."""
    by_seed: dict[int, list[bool]] = defaultdict(list)
    for line in Path(eval_dir, "episodes.jsonl").read_text().splitlines():
        if line:
            record = json.loads(line)
            by_seed[int(record["seed"])].append(bool(record["solved"]))
    return dict(by_seed)


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


def plot_solve_rate(path: Path, steps: list[int], rates: list[float], ceiling: float, title: str,
                    extended: list[dict] | None = None, training: dict | None = None) -> None:
    """Writes the held-out solve rate per step, with the oracle ceiling, as a PNG.

    `extended` (a list of {"label", "points": [(step, solved, total, ci_low, ci_high)], "ceiling"}) adds a larger
    set's scores with their 95% intervals beside the curve (greedy, mean@k); `training` ({"label", "steps",
    "rates"}) draws the success on the training mazes per step in a second panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 if training else 1, figsize=(11 if training else 6, 3.8), dpi=120, squeeze=False)
    ax = axes[0][0]
    ax.plot(steps, [100 * r for r in rates], marker="o", label="held-out solve rate (greedy)")
    ax.axhline(100 * ceiling, color="grey", linestyle="--", label=f"oracle ceiling ({100 * ceiling:.1f}%)")
    for series, (colour, marker) in zip(extended or [], [("tab:orange", "s"), ("tab:green", "D"), ("tab:red", "^")]):
        xs = [p[0] for p in series["points"]]
        ys = [100 * p[1] / p[2] for p in series["points"]]
        errors = [[y - 100 * p[3] for y, p in zip(ys, series["points"])],
                  [100 * p[4] - y for y, p in zip(ys, series["points"])]]
        ax.errorbar(xs, ys, yerr=errors, fmt=marker, color=colour, capsize=4, label=f"{series['label']} (95% CI)")
    if extended:
        ax.axhline(100 * extended[0]["ceiling"], color="tab:orange", linestyle=":", alpha=0.6,
                   label=f"its ceiling ({100 * extended[0]['ceiling']:.1f}%)")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("solved (%)")
    ax.set_ylim(0, 100)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=7)
    if training:
        right = axes[0][1]
        right.plot(training["steps"], [100 * r for r in training["rates"]], color="tab:purple", alpha=0.35,
                   label="per step")
        window = max(1, len(training["rates"]) // 20)
        smooth = [100 * sum(training["rates"][max(0, i - window + 1): i + 1]) / len(training["rates"][max(0, i - window + 1): i + 1])
                  for i in range(len(training["rates"]))]
        right.plot(training["steps"], smooth, color="tab:purple", label=f"moving mean of {window}")
        right.set_xlabel("GRPO step")
        right.set_ylabel("solved (%)")
        right.set_ylim(0, 100)
        right.set_title(training["label"])
        right.grid(alpha=0.3)
        right.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)
