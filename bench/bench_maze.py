"""Maze throughput: generation, and one env step + render + PNG encode (what every rollout turn pays)."""

import statistics
import time

from shared.maze import MazeState, generate, solve
from shared.maze.render import png_bytes, render_rgb


def _rate(fn, count: int, repeats: int = 5) -> float:
    rates = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn(count)
        rates.append(count / (time.perf_counter() - started))
    return statistics.median(rates)


def _generate(count):
    for seed in range(count):
        generate("maze_2d/easy", seed)


def _steps(count):
    maze = generate("maze_2d/easy", 3)
    moves = solve(maze)
    done = 0
    while done < count:
        episode = MazeState(maze, max_turns=10_000)
        for d in moves:
            episode.step(("move", d))
            png_bytes(render_rgb(episode.view(), 32))
            done += 1


def run():
    return [
        {"benchmark": "maze", "metric": "mazes generated (easy)", "value": _rate(_generate, 2000), "unit": "mazes/s",
         "note": "median of 5"},
        {"benchmark": "maze", "metric": "env step + render + PNG encode", "value": _rate(_steps, 600), "unit": "steps/s",
         "note": "median of 5, 288x288 px"},
    ]
