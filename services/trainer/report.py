"""The end of a local run: warm start against final policy on each eval set, printed, plotted and as a page.

`shared.evaluation.statistics.compare_evals` / `compare_sampled` pair the two policies maze by maze;
`run_summary` is the block the trainer prints; `write_run_report` writes `solve_rate_vs_step.png` and `report.html`
(the held-out curve, the extended set's greedy and sampled scores, and the success on the training mazes per step).
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path

from shared.config import RunConfig, dump_config
from shared.evaluation.model_card import model_card
from shared.evaluation.plots import plot_solve_rate
from shared.storage.files import atomic_write_text


def _rate(end: dict) -> str:
    return (f"{end['solved']}/{end['total']} {100 * end['solved'] / end['total']:.1f}% "
            f"[{100 * end['ci_low']:.1f}-{100 * end['ci_high']:.1f}]")


def warm_start_kind(path: str, sft_summary: dict) -> str:
    """Names the warm start a run started from: its folder and, when this project's SFT built it, its demonstrations."""
    settings = sft_summary.get("sft_settings")
    if settings is None:
        return f"{path} (not built by this project's SFT)"
    demos = settings.get("sft.demos", "solver")  # warm starts built before the setting existed imitated the solver
    what = {"explore": "interface: explorer demonstrations, no route taught", "solver": "imitates the optimal solver"}
    return f"{path} (sft.demos={demos}: {what.get(demos, demos)})"


def plot_title(result: dict) -> str:
    """Returns the plot's title: the run and its warm start with the demonstrations it imitated, as in `sft.demos`."""
    warm_start = result.get("warm_start") or "n/a"
    label, cut, _ = warm_start.partition(": ")  # "path (sft.demos=solver: what that means)" -> "path (sft.demos=solver)"
    return f"{result['run_id']}, from {label}{')' if cut else ''}"


def summary_rows(result: dict) -> list[list[str]]:
    """Returns the summary table: a header, then one row per comparison (warm start, final, change, ceiling)."""
    table = [["", "warm start (95% CI)", "final (95% CI)", "change (paired 95% CI, p)", "ceiling"]]
    for name, c in result["comparisons"].items():
        p = c["paired"]
        table.append([name, _rate(c["before"]), _rate(c["after"]),
                      f"{100 * p['difference']:+.1f} pts [{100 * p['ci_low']:+.1f}, {100 * p['ci_high']:+.1f}] "
                      f"p={p['p_value']:.2g}", f"{c['after']['oracle_solved']}/{c['after']['total']}"])
    return table


def run_summary(result: dict) -> str:
    """Returns the end-of-run block: warm start vs final per eval set, the ceiling, the curve, the wall time."""
    table = summary_rows(result)
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = [f"== {result['run_id']}: {result['steps']} GRPO steps, {result['wall_s'] / 60:.1f} min wall ==",
             f"warm start: {result.get('warm_start') or 'n/a'}"]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in table]
    curve = " -> ".join(f"{s}: {100 * r:.1f}%" for s, r in result["curve"].items())
    lines.append(f"held-out curve (step: solve rate): {curve}")
    for c in result["comparisons"].values():
        for end in (c["before"], c["after"]):
            if end["errors"]:
                lines.append(f"WARNING: {end['errors']} mazes could not be scored in {end['folder']} (counted as "
                             "failed; see its episodes.jsonl): delete the folder and run again to re-score")
    passes = [f"{name}: {100 * c['before']['pass_at_1']:.1f}% -> {100 * c['after']['pass_at_1']:.1f}%"
              for name, c in result["comparisons"].items() if c["before"].get("pass_at_1") is not None]
    if passes:
        lines.append(f"SkyRL's pass_at_1 (reward above 0 under env.reward={result.get('reward')!r}; the metric AWS's "
                     f"28 -> 62 of 64 was most likely read from, not bounded by the ceiling): " + "; ".join(passes))
    lines.append(f"data: sft seeds {result['sft_seeds'] or 'n/a'}, rl seeds {result['rl_seeds'] or 'n/a'}")
    machine = result.get("machine") or {}
    if machine:
        lines.append(f"machine: {machine['cpu']} ({machine['cpu_capability']}), {machine['threads']} threads, "
                     f"torch {machine['torch']}")
    return "\n".join(dict.fromkeys(lines))  # an eval folder shared by two rows warns once


def landed(run_dir: Path, run_id: str, history: dict[int, dict], exports: list[tuple[int, Path]]) -> list[str]:
    """Returns the lines that say where a run's results landed: the report, the plot, the best of `exports` ((step,
    policy folder), as `complete_exports` lists them: the highest held-out solve rate among the scored steps, the
    later on a tie; else the latest) and the commands that score and serve it."""
    lines = ["where it landed:", f"  report   {run_dir / 'report.html'}", f"  plot     {run_dir / 'solve_rate_vs_step.png'}",
             f"  summary  {run_dir / 'summary.json'}"]
    if exports:
        folders = dict(exports)
        scored = [s for s in folders if s in history]
        best = max(scored, key=lambda s: (history[s]["solve_rate"], s)) if scored else max(folders)
        rate = f", held-out {100 * history[best]['solve_rate']:.1f}%" if scored else ""
        lines += [f"  best export (step {best}{rate})  {folders[best]}",
                  f"  score it:  make eval RUN={run_id} ARGS=\"--adapter {folders[best]}\"",
                  f"  serve it:  make export RUN={run_id} ARGS=\"--alias {run_id}-best --pick best\", then make serve "
                  f"(the adapter is then {run_id}-best beside the base model)"]
    return lines


def write_run_report(run_dir: Path, result: dict, metrics: list[dict], history: dict[int, dict]) -> None:
    """Writes the run's solve_rate_vs_step.png and report.html (an offline page: the table, the curves)."""
    steps = sorted(history)
    series = []
    for name, c in result["comparisons"].items():
        if name.startswith("extended") and "pass@" not in name:
            series.append({"label": name, "ceiling": c["after"]["oracle_solved"] / c["after"]["total"],
                           "points": [(e["step"], e["solved"], e["total"], e["ci_low"], e["ci_high"])
                                      for e in (c["before"], c["after"])]})
    training = None
    if metrics:
        training = {"label": "training mazes: success per step", "steps": [m["step"] for m in metrics],
                    "rates": [m["train/solve_rate"] for m in metrics]}
    png = run_dir / "solve_rate_vs_step.png"
    plot_solve_rate(png, steps, [history[s]["solve_rate"] for s in steps],
                    history[steps[0]]["oracle_solved"] / history[steps[0]]["total"],
                    plot_title(result), series, training)
    rows = summary_rows(result)
    table = "".join("<tr>" + "".join(f"<t{'h' if i == 0 else 'd'}>{html.escape(cell)}</t{'h' if i == 0 else 'd'}>"
                                     for cell in row) + "</tr>" for i, row in enumerate(rows))
    picture = base64.b64encode(png.read_bytes()).decode()
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(result['run_id'])}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;
padding:4px 8px;text-align:left}}</style></head><body>
<h1>{html.escape(result['run_id'])}: {result['steps']} GRPO steps</h1>
<p>Warm start (the adapter switched off) against the final policy, maze by maze; changes with their paired 95%
interval. Warm start: {html.escape(result.get('warm_start') or 'n/a')}. Wall time {result['wall_s'] / 60:.1f} min; settings {html.escape(result.get('settings_hash') or '')}.</p>
<table>{table}</table>
<p><img alt="held-out solve rate per step and success on the training mazes" src="data:image/png;base64,{picture}"></p>
<p>Machine: {html.escape(json.dumps(result.get('machine') or {}))}</p>
</body></html>
"""
    atomic_write_text(run_dir / "report.html", page)


def export_card(cfg: RunConfig, step: int, evaluation: dict | None, base_identity: str, sft_summary: dict,
                rl_seeds: str | None, command: str | None) -> str:
    """Returns the model card of a local run's export at `step` (its held-out eval when one ran at that step)."""
    a, r, env = cfg.algorithm, cfg.rollout, cfg.env
    trained = [
        f"{step} GRPO steps of run `{cfg.run_id}`: {r.train_batch_size} {env.id} mazes x {r.n_samples_per_prompt} "
        f"episodes per step at temperature {r.temperature}, up to {env.max_turns} turns, reward `{env.reward}`",
        f"advantages `{a.advantage_estimator}`, learning rate {a.lr}, LoRA rank {cfg.lora.rank} (alpha {cfg.lora.alpha}) "
        "on the language model",
        f"from the warm start {warm_start_kind(cfg.model.path, sft_summary)}",
        f"training mazes: seeds {rl_seeds or 'none drawn'} from env.rl_seed_start (SFT's were "
        f"{sft_summary.get('sft_seeds') or 'n/a'}); no held-out maze, by content",
    ]
    return model_card(base_model=cfg.model.base_model_id, title=f"{cfg.run_id}, step {step}", trained=trained,
                      evaluation=evaluation, base_files=f"the warm start in `{cfg.model.path}` (files' identity "
                      f"{base_identity}: the sha256 of its manifest)", command=command, config_yaml=dump_config(cfg))
