"""python -m shared.maze {dump,ceiling,render,policies}: inspect the mazes the project trains and evaluates on."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from PIL import Image

from shared.config import command_line
from shared.maze.core import MOVES, MazeState, explore_walk, generate, open_moves, solve
from shared.maze.dataset import EvalSet, parse_seeds
from shared.maze.render import VISGYM_CELL_PX, render_rgb, render_text, save_gif


def cmd_dump(args) -> None:
    for seed in parse_seeds(args.seeds):
        print(json.dumps(generate(args.env, seed).to_json(), separators=(", ", ": ")))


def cmd_ceiling(args) -> None:
    eval_set = EvalSet(args.env, parse_seeds(args.seeds), args.max_turns)
    print(f"{args.env} seeds {eval_set.seeds_spec}: optimal action count (stop included) -> mazes")
    for count, mazes in eval_set.histogram().items():
        mark = "ok " if count <= args.max_turns else "too long"
        print(f"  {count:3d}  {mazes:4d}  {'#' * mazes}  {mark}")
    print(f"oracle ceiling: {eval_set.oracle_solved()}/{len(eval_set.seeds)}")


def cmd_render(args) -> None:
    maze = generate(args.env, args.seed)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix.lower() == ".gif":
        episode = MazeState(maze, max_turns=10_000)
        frames = [render_rgb(maze, args.cell_px)]
        for d in solve(maze):
            episode.step(("move", d))
            frames.append(render_rgb(episode.view(), args.cell_px))
        save_gif(frames, out)
    elif out.suffix.lower() == ".png":
        Image.fromarray(render_rgb(maze, args.cell_px)).save(out)
    else:
        sys.exit(f"--out {out}: use a .png (the start) or .gif (the solver's episode) file name")
    print(render_text(maze))
    print(f"wrote {out}")


def scripted_walk(maze, rule: str, rng: random.Random, max_moves: int) -> list[int]:
    """Returns the moves of a scripted rule: `explore` (shared.maze.core.explore_walk), or a memoryless one:
    `random` (uniform over the open moves) or `toward` (uniform over the open moves that shorten the Manhattan
    distance to the target, else over the open moves)."""
    if rule == "explore":
        return explore_walk(maze, rng, max_moves)
    cell, moves = maze.agent, []
    while cell != maze.target and len(moves) < max_moves:
        options = open_moves(maze, cell)
        if rule == "toward":
            options = [d for d in options if _distance(_step(cell, d), maze.target) < _distance(cell, maze.target)] or options
        d = rng.choice(options)
        cell = _step(cell, d)
        moves.append(d)
    return moves


def _step(cell: tuple[int, int], d: int) -> tuple[int, int]:
    return cell[0] + MOVES[d][0], cell[1] + MOVES[d][1]


def _distance(a: tuple[int, int], b: tuple[int, int]) -> int:
    return abs(a[0] - b[0]) + abs(a[1] - b[1])


def _reaches(maze, moves: list[int]) -> bool:
    cell = maze.agent
    for d in moves:
        cell = _step(cell, d)
    return cell == maze.target


def cmd_policies(args) -> None:
    """Prints how many mazes scripted rules bring to the target within the turn budget (a move a turn, `stop` last):
    the headroom of a policy that sees one cell around it, without a model."""
    mazes = [generate(args.env, seed) for seed in parse_seeds(args.seeds)]
    budget = args.max_turns - 1
    print(f"{args.env} seeds {args.seeds}, {args.max_turns} turns: target reached (of {len(mazes)}), "
          f"mean over {args.repeats} seeds of the rules' coin flips")
    for rule in ("random", "explore", "toward"):
        counts = []
        for repeat in range(args.repeats):
            rng = random.Random(repeat)
            counts.append(sum(_reaches(m, scripted_walk(m, rule, rng, budget)) for m in mazes))
        print(f"  {rule:<8} {sum(counts) / len(counts):7.1f}  ({', '.join(map(str, counts))})")
    print(f"  {'solver':<8} {sum(len(solve(m)) <= budget for m in mazes):7d}  (the oracle ceiling)")


def main(argv: list[str] | None = None) -> None:
    parser = command_line("python -m shared.maze", __doc__, config=False)
    sub = parser.add_subparsers(dest="command", required=True)
    dump = sub.add_parser("dump", help="one JSON line per seed: seed, maze_map, agent, target")
    dump.add_argument("--env", default="maze_2d/easy")
    dump.add_argument("--seeds", default="0-63")
    dump.set_defaults(func=cmd_dump)
    ceiling = sub.add_parser("ceiling", help="histogram of optimal action counts and the oracle ceiling")
    ceiling.add_argument("--env", default="maze_2d/easy")
    ceiling.add_argument("--seeds", default="0-63")
    ceiling.add_argument("--max-turns", type=int, default=15)
    ceiling.set_defaults(func=cmd_ceiling)
    render = sub.add_parser("render", help="write a maze's start (.png) or its solved episode (.gif)")
    render.add_argument("--env", default="maze_2d/easy")
    render.add_argument("--seed", type=int, required=True)
    render.add_argument("--out", required=True)
    render.add_argument("--cell-px", type=int, default=VISGYM_CELL_PX)
    render.set_defaults(func=cmd_render)
    policies = sub.add_parser("policies", help="how many mazes scripted rules (random, explorer, step toward the "
                              "target) solve: the headroom without a model")
    policies.add_argument("--env", default="maze_2d/easy")
    policies.add_argument("--seeds", default="64-575")
    policies.add_argument("--max-turns", type=int, default=15)
    policies.add_argument("--repeats", type=int, default=4)
    policies.set_defaults(func=cmd_policies)
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except ValueError as exc:
        sys.exit(f"error: {exc}")


if __name__ == "__main__":
    main()
