"""What people look at after an evaluation: a GIF per episode and an offline report.html."""

from __future__ import annotations

import html
import json
from pathlib import Path

from shared.maze.core import Maze, generate
from shared.maze.render import render_rgb, save_gif
from shared.storage.files import atomic_write_text, read_jsonl

STYLE = """
body{font-family:system-ui,sans-serif;margin:24px;color:#222;background:#fafafa}
table.summary td,table.summary th{padding:3px 10px;text-align:left;border-bottom:1px solid #ddd}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(150px,1fr));gap:10px;margin-top:16px}
.episode{background:#fff;border:3px solid #ccc;border-radius:6px;padding:6px;text-align:center;font-size:12px}
.episode.solved{border-color:#2a9d3a}.episode.failed{border-color:#c0392b}
.episode img{width:100%;image-rendering:pixelated}
.badge{font-weight:600}.solved .badge{color:#2a9d3a}.failed .badge{color:#c0392b}
.compare td{padding:2px 8px;text-align:center}.yes{background:#c8efcf}.no{background:#f6d0cc}
"""


def write_gifs(folder: Path, cell_px: int = 25) -> int:
    """Writes gifs/seed_<S>.gif for every episode in folder/episodes.jsonl; returns how many."""
    gif_dir = folder / "gifs"
    gif_dir.mkdir(exist_ok=True)
    count = 0
    for record in read_jsonl(folder / "episodes.jsonl"):
        maze = generate(record["env"], record["seed"])
        frames = [render_rgb(Maze(maze.maze_map, tuple(p), maze.target, maze.env_id, maze.seed), cell_px)
                  for p in record["trace"]]
        save_gif(frames, gif_dir / f"seed_{record['seed']}.gif", frame_ms=300)
        count += 1
    return count


def _summary_rows(summary: dict) -> str:
    keys = ["env", "seeds", "max_turns", "solved", "total", "solve_rate", "oracle_solved", "share_of_ceiling",
            "samples_per_maze", "temperature", "mean_success", "pass_at_k", "format_rate", "parse_failures",
            "mean_turns", "errors", "failures", "model", "adapter", "elapsed_s"]
    keys = [key for key in keys if key in summary or key not in ("samples_per_maze", "mean_success", "pass_at_k")]
    rows = []
    for key in keys:
        value = summary.get(key)
        if isinstance(value, float):
            value = f"{value:.3f}"
        elif isinstance(value, dict):
            value = ", ".join(f"{kind} {count}" for kind, count in value.items()) or "none"
        rows.append(f"<tr><th>{key}</th><td>{html.escape(str(value))}</td></tr>")
    return "\n".join(rows)


def write_report(folder: Path, title: str | None = None) -> Path:
    """Writes folder/report.html: summary table and a grid of every episode's GIF, marked solved/failed."""
    summary = json.loads((folder / "summary.json").read_text())
    cards = []
    # A sampled evaluation plays each maze many times: its page is the summary alone.
    records = read_jsonl(folder / "episodes.jsonl") if summary.get("samples_per_maze", 1) == 1 else []
    for record in records:
        state = "solved" if record["solved"] else "failed"
        reason = f" &middot; {html.escape(record['error'][:60])}" if record.get("error") else ""
        if record.get("first_mistake") and not record["solved"]:
            mistake = record["first_mistake"]
            reason += f" &middot; first mistake: {mistake['kind']} at turn {mistake['turn'] + 1}"
        cards.append(
            f'<div class="episode {state}" data-seed="{record["seed"]}">'
            f'<img src="gifs/seed_{record["seed"]}.gif" alt="seed {record["seed"]}">'
            f'<div><span class="badge">{state}</span> seed {record["seed"]} &middot; {record["turns"]} turns '
            f'(optimal {record["optimal_actions"]}){reason}</div></div>'
        )
    title = title or f"{summary['model']} {summary.get('adapter') or ''}".strip()
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{STYLE}</style></head><body>"
        f"<h1>{html.escape(title)}</h1>"
        f"<p><b>{summary['solved']}/{summary['total']}</b> solved ({100 * summary['solve_rate']:.1f}%) &middot; "
        f"oracle ceiling {summary['oracle_solved']}/{summary['total']} at {summary['max_turns']} turns</p>"
        f"<table class='summary'>{_summary_rows(summary)}</table>"
        f"<div class='grid' id='episodes'>{''.join(cards)}</div></body></html>"
    )
    path = folder / "report.html"
    atomic_write_text(path, page)
    return path


def write_comparison(a: Path, b: Path, out: Path) -> tuple[Path, str]:
    """Writes out/compare.html: which mazes each of two evaluations solves, side by side.

    Returns the page and a one-line summary, which counts the episodes played identically (the same reply at
    every turn): what a change that must not alter behaviour shows as 64/64 on the same checkpoint.
    """
    def load(folder: Path):
        return json.loads((folder / "summary.json").read_text()), {r["seed"]: r for r in read_jsonl(folder / "episodes.jsonl")}

    def replies(record):
        return [step["text"] for step in record["steps"]]

    (sa, ea), (sb, eb) = load(a), load(b)
    seeds = sorted(set(ea) | set(eb))
    both = sum(ea.get(s, {}).get("solved", False) and eb.get(s, {}).get("solved", False) for s in seeds)
    only_a = [s for s in seeds if ea.get(s, {}).get("solved") and not eb.get(s, {}).get("solved")]
    only_b = [s for s in seeds if eb.get(s, {}).get("solved") and not ea.get(s, {}).get("solved")]
    identical = sum(s in ea and s in eb and replies(ea[s]) == replies(eb[s]) for s in seeds)
    line = (f"A solved {sa['solved']}/{sa['total']}, B solved {sb['solved']}/{sb['total']}; both {both}; "
            f"only A: {only_a}; only B: {only_b}; played identically: {identical}/{len(seeds)}")

    def cell(record):
        if record is None:
            return "<td>-</td>"
        return f"<td class='{'yes' if record['solved'] else 'no'}'>{'solved' if record['solved'] else 'failed'}</td>"

    rows = "".join(f"<tr><td>{s}</td>{cell(ea.get(s))}{cell(eb.get(s))}</tr>" for s in seeds)
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>compare</title><style>{STYLE}</style></head><body>"
        f"<h1>A: {html.escape(str(a))}<br>B: {html.escape(str(b))}</h1>"
        f"<p>{html.escape(line)}</p>"
        f"<table class='compare'><tr><th>seed</th><th>A</th><th>B</th></tr>{rows}</table></body></html>"
    )
    out.mkdir(parents=True, exist_ok=True)
    path = out / "compare.html"
    atomic_write_text(path, page)
    return path, line
