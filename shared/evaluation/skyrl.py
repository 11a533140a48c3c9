"""SkyRL's own eval metrics for a SkyRL run, read from its eval dumps, and what pass_at_1 counts."""

from __future__ import annotations

import json
import re
from pathlib import Path

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
