"""Intervals and paired tests over evaluation folders: how sure a solve rate is, and whether two policies differ on
the same mazes (`compare_evals` for greedy sets, `compare_sampled` for mean@k and pass@k)."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

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


def _end(folder: Path, solved: int, total: int) -> dict:
    summary = json.loads((folder / "summary.json").read_text())
    low, high = wilson_interval(solved, total)
    return {"step": summary.get("step"), "solved": solved, "total": total, "ci_low": low, "ci_high": high,
            "oracle_solved": summary["oracle_solved"], "errors": summary.get("errors", 0), "folder": str(folder),
            "pass_at_1": summary.get("pass_at_1")}


def compare_evals(before_dir: Path, after_dir: Path) -> dict:
    """Returns warm start vs final on one greedy eval set: counts, 95% intervals, the paired test, the ceiling."""
    before, after = solved_by_seed(before_dir), solved_by_seed(after_dir)
    return {"before": _end(before_dir, sum(before.values()), len(before)),
            "after": _end(after_dir, sum(after.values()), len(after)), "paired": paired_comparison(before, after)}


def compare_sampled(before_dir: Path, after_dir: Path) -> dict[str, dict]:
    """Returns {row name: comparison} for a sampled eval set: mean@k (per-maze success share, paired over mazes)
    and pass@k (a maze counts when any of its k samples solved it, McNemar as for greedy)."""
    before, after = success_by_maze(before_dir), success_by_maze(after_dir)
    summary = json.loads((after_dir / "summary.json").read_text())
    k, mazes, temperature = summary["samples_per_maze"], summary["mazes"], summary["temperature"]
    episodes = mazes * k
    mean = {"before": _end(before_dir, sum(map(sum, before.values())), episodes),
            "after": _end(after_dir, sum(map(sum, after.values())), episodes),
            "paired": paired_mean_difference({s: sum(v) / k for s, v in before.items()},
                                             {s: sum(v) / k for s, v in after.items()})}
    hit_before, hit_after = ({s: any(v) for s, v in side.items()} for side in (before, after))
    passed = {"before": _end(before_dir, sum(hit_before.values()), mazes),
              "after": _end(after_dir, sum(hit_after.values()), mazes),
              "paired": paired_comparison(hit_before, hit_after)}
    for end in (passed["before"], passed["after"]):
        end["oracle_solved"] //= k  # mazes, not episodes
        end["pass_at_1"] = None  # an episode-level share: it belongs to the mean@k row
    return {f"extended {mazes} mean@{k} T={temperature:g}": mean, f"extended {mazes} pass@{k}": passed}
