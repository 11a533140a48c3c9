"""The maze task: VisGym parity, perfect-maze invariants, step semantics, rendering, CLI."""

import hashlib
import json
import subprocess
import sys
from collections import deque
from pathlib import Path

import numpy as np
import pytest

from shared.maze import (
    EvalSet,
    MazeState,
    MazeStream,
    generate,
    render_rgb,
    render_text,
    solve,
)
from shared.maze.core import INVALID, MOVED, MOVES, STOPPED, WALL, first_mistake, optimal_action_count, path_progress

REFERENCE = json.loads((Path(__file__).parent / "data" / "visgym_reference.json").read_text())
REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("env_id", ["maze_2d/easy", "maze_2d/hard"])
def test_dump_matches_visgym_generator_cell_for_cell(env_id):
    out = subprocess.run([sys.executable, "-m", "shared.maze", "dump", "--env", env_id, "--seeds", "0-63"],
                         capture_output=True, text=True, check=True, cwd=REPO).stdout.splitlines()
    assert len(out) == 64
    ours = [hashlib.sha256(json.dumps(json.loads(line), separators=(",", ":")).encode()).hexdigest() for line in out]
    assert ours == REFERENCE["envs"][env_id]


def test_generation_is_deterministic_and_seed_sensitive():
    a, b = generate("maze_2d/easy", 123), generate("maze_2d/easy", 123)
    assert np.array_equal(a.maze_map, b.maze_map) and a.agent == b.agent and a.target == b.target
    assert len({generate("maze_2d/easy", s).content_hash() for s in range(50)}) > 40


def _floor(maze):
    return {(r, c) for r, c in zip(*np.nonzero(maze.maze_map == 0))}


@pytest.mark.parametrize("env_id", ["maze_2d/easy", "maze_2d/hard", "maze_2d/13x9"])
def test_perfect_maze_invariants(env_id):
    for seed in range(200):
        maze = generate(env_id, seed)
        h, w = maze.shape
        grid = maze.maze_map
        assert grid[0].all() and grid[-1].all() and grid[:, 0].all() and grid[:, -1].all(), "outer wall"
        floor = _floor(maze)
        assert maze.agent in floor and maze.target in floor and maze.agent != maze.target
        # connected: BFS from the agent reaches every floor cell
        seen, queue = {maze.agent}, deque([maze.agent])
        edges = 0
        while queue:
            r, c = queue.popleft()
            for dr, dc in MOVES.values():
                nxt = (r + dr, c + dc)
                if nxt in floor:
                    edges += 1
                    if nxt not in seen:
                        seen.add(nxt)
                        queue.append(nxt)
        assert seen == floor, "floor connected"
        assert edges // 2 == len(floor) - 1, "a tree: no cycles"


def test_step_semantics_walls_stop_and_budget():
    maze = generate("maze_2d/easy", 0)
    path = solve(maze)
    ep = MazeState(maze, max_turns=15)
    # find a wall move from the start
    wall_dir = next(d for d, (dr, dc) in MOVES.items() if maze.maze_map[maze.agent[0] + dr, maze.agent[1] + dc] == 1)
    assert ep.step(("move", wall_dir)) == WALL and ep.position == maze.agent
    assert ep.step(("move", path[0])) == MOVED and ep.position != maze.agent
    assert ep.step(None) == INVALID and ep.turns == 3
    assert ep.step(("stop", "stop")) == STOPPED and ep.done and not ep.solved  # stop off target

    ep = MazeState(maze, max_turns=50)
    for d in path:
        ep.step(("move", d))
    assert ep.position == maze.target
    assert ep.step(("stop", "stop")) == STOPPED and ep.solved

    ep = MazeState(maze, max_turns=3)
    for d in path[:3]:
        ep.step(("move", d))
    assert ep.done and not ep.solved, "out of turns ends the episode with 0"
    with pytest.raises(RuntimeError):
        ep.step(("stop", "stop"))


def test_first_mistake_names_the_first_move_a_perfect_agent_would_not_make():
    maze = generate("maze_2d/easy", 3)
    assert render_text(maze) == "\n".join([
        "#########",
        "#A  # # #",
        "# # # # #",
        "# #     #",
        "### #####",
        "# #     #",
        "# # #####",
        "#      T#",
        "#########",
    ])
    right, up, left, down = (("move", d) for d in range(4))
    stop = ("stop", "stop")
    perfect = [("move", d) for d in solve(maze)]
    assert perfect[:3] == [right, right, down]
    assert first_mistake(maze, perfect + [stop]) is None
    assert first_mistake(maze, perfect[:5]) is None, "perfect so far, only cut short"
    # down from the start enters a dead end of two floor cells, in plain sight
    assert first_mistake(maze, [down, up, right]) == {"turn": 0, "kind": "wrong_branch", "branch_cells": 2}
    # at (3, 3) right leads into the 8-cell branch (3,4)-(3,7), (2,5), (1,5), (2,7), (1,7)
    assert first_mistake(maze, [right, right, down, down, right]) == {"turn": 4, "kind": "wrong_branch", "branch_cells": 8}
    assert first_mistake(maze, [right, up]) == {"turn": 1, "kind": "wall"}
    assert first_mistake(maze, [right, left]) == {"turn": 1, "kind": "backtrack"}
    assert first_mistake(maze, [right, stop]) == {"turn": 1, "kind": "stop_early"}
    assert first_mistake(maze, [right, None]) == {"turn": 1, "kind": "unparsed"}
    assert first_mistake(maze, perfect + [left]) == {"turn": len(perfect), "kind": "missed_stop"}


def test_the_explorer_follows_corridors_and_picks_junctions_uniformly_with_no_eye_for_the_target():
    """The interface warm start's demonstrations: never a wall, never back the way it came except out of a dead end,
    stops moving on the target, and at a junction every open way ahead about equally often, target-ward or not."""
    import random
    from collections import Counter

    from shared.maze.core import explore_walk

    toward, away = Counter(), Counter()
    for seed in range(600):
        maze = generate("maze_2d/easy", seed)
        moves = explore_walk(maze, random.Random(seed), 14)
        cell, previous = maze.agent, None
        for index, d in enumerate(moves):
            assert cell != maze.target, "it moved on after reaching the target"
            ways = [w for w, (dr, dc) in MOVES.items() if maze.maze_map[cell[0] + dr, cell[1] + dc] == 0]
            ahead = [w for w in ways if (cell[0] + MOVES[w][0], cell[1] + MOVES[w][1]) != previous]
            assert d in (ahead or ways), f"seed {seed}, move {index}: {d} is a wall or a needless turn back"
            if len(ahead) >= 2:  # a junction: count target-ward choices against the rest
                here = abs(cell[0] - maze.target[0]) + abs(cell[1] - maze.target[1])
                nearer = {w for w in ahead if abs(cell[0] + MOVES[w][0] - maze.target[0])
                          + abs(cell[1] + MOVES[w][1] - maze.target[1]) < here}
                if 0 < len(nearer) < len(ahead):
                    (toward if d in nearer else away)[len(ahead)] += 1
            previous, cell = cell, (cell[0] + MOVES[d][0], cell[1] + MOVES[d][1])
        assert len(moves) == 14 or cell == maze.target
    # Two-way junctions with one way nearer the target: uniform choice takes it about half the time (the solver,
    # by construction, always would).
    share = toward[2] / (toward[2] + away[2])
    assert toward[2] + away[2] > 400 and 0.42 < share < 0.58, (toward, away)


def test_path_progress_follows_the_shortest_path_not_the_straight_line():
    maze = generate("maze_2d/easy", 2)
    path = solve(maze)
    ep = MazeState(maze, max_turns=50)
    seen = [path_progress(maze, ep.position)]
    for d in path:
        ep.step(("move", d))
        seen.append(path_progress(maze, ep.position))
    assert seen == pytest.approx([i / len(path) for i in range(len(path) + 1)])
    # a floor cell off the path that is no closer to the target than the start scores 0, never below
    far = max((cell for cell in zip(*np.nonzero(maze.maze_map == 0))), key=lambda c: len(solve(maze, tuple(c))))
    assert len(solve(maze, tuple(far))) >= len(path) and path_progress(maze, tuple(far)) == 0.0


def test_render_colours_and_size():
    maze = generate("maze_2d/easy", 3)
    img = render_rgb(maze)
    assert img.shape == (9 * 25, 9 * 25, 3) and img.dtype == np.uint8
    assert tuple(img[2, 2]) == (169, 169, 169)  # corner wall
    tr, tc = maze.target
    assert tuple(img[tr * 25 + 2, tc * 25 + 2]) == (255, 0, 0)
    ar, ac = maze.agent
    assert tuple(img[ar * 25 + 12, ac * 25 + 12]) == (0, 0, 255)  # disc centre
    assert tuple(img[ar * 25 + 1, ac * 25 + 1]) == (255, 255, 255)  # outside the disc: floor
    assert render_rgb(maze, 32).shape == (288, 288, 3)
    text = render_text(maze).splitlines()
    assert text[ar][ac] == "A" and text[tr][tc] == "T" and text[0] == "#" * 9


def test_ceiling_cli_and_eval_set():
    out = subprocess.run([sys.executable, "-m", "shared.maze", "ceiling", "--env", "maze_2d/easy", "--seeds", "0-63",
                          "--max-turns", "15"], capture_output=True, text=True, check=True, cwd=REPO).stdout
    eval_set = EvalSet("maze_2d/easy", list(range(64)), 15)
    brute = sum(len(solve(m)) + 1 <= 15 for m in eval_set.mazes())
    assert out.strip().splitlines()[-1] == f"oracle ceiling: {brute}/64"
    assert eval_set.oracle_solved() == brute == 50


def test_render_cli_writes_png_and_gif(tmp_path):
    for name in ("m.png", "m.gif"):
        subprocess.run([sys.executable, "-m", "shared.maze", "render", "--seed", "4", "--out", str(tmp_path / name)],
                       check=True, cwd=REPO, capture_output=True)
        assert (tmp_path / name).stat().st_size > 100
    from PIL import Image

    gif = Image.open(tmp_path / "m.gif")
    assert gif.n_frames == len(solve(generate("maze_2d/easy", 4))) + 1


def test_cli_rejects_bad_seed_range():
    proc = subprocess.run([sys.executable, "-m", "shared.maze", "dump", "--seeds", "9-3"], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode != 0 and "9-3" in proc.stderr


def test_training_maze_streams_exclude_eval_mazes_by_content():
    eval_set = EvalSet("maze_2d/easy", list(range(64)), 15)
    hashes = eval_set.content_hashes()
    # Starting the stream at seed 0 must skip every eval maze, by content, and count them.
    stream = MazeStream("maze_2d/easy", hashes, start=0)
    taken = stream.take(100)
    assert not {m.content_hash() for m in taken} & hashes
    assert stream.rejected >= 64
    # The cursor resumes the identical stream.
    resumed = MazeStream("maze_2d/easy", hashes, start=0)
    resumed.load_state(MazeStream("maze_2d/easy", hashes, start=0).state())
    assert [m.seed for m in resumed.take(10)] == [m.seed for m in taken[:10]]


def test_sft_and_rl_draw_disjoint_streams_that_skip_every_held_out_set():
    from shared.config import ConfigError, load_config
    from shared.maze.dataset import excluded_from_training

    cfg = load_config(overrides=["sft.num_mazes=40", "env.sft_seed_start=500", "env.rl_seed_start=700"], environ={})
    excluded = excluded_from_training(cfg.env)
    held_out = EvalSet.held_out(cfg.env).content_hashes() | EvalSet.extended(cfg.env).content_hashes()
    assert excluded == held_out and len(held_out) == 575  # seeds 0-575: one maze of 64-575 repeats another
    sft = MazeStream.for_sft(cfg.env, excluded)
    sft_mazes = sft.take(40)
    rl = MazeStream.for_rl(cfg.env, excluded)
    rl_mazes = rl.take(40)
    # Seeds 500-575 are held out (the extended set): the SFT stream skipped them by content.
    assert not {m.content_hash() for m in sft_mazes + rl_mazes} & held_out
    assert sft.rejected == 76 and sft_mazes[0].seed == 576
    assert max(m.seed for m in sft_mazes) < min(m.seed for m in rl_mazes)
    assert sft.seed_range() == "500-615" and rl.seed_range().startswith("700-")
    # The SFT stream stops where GRPO's starts instead of drawing GRPO's mazes.
    with pytest.raises(ValueError, match="raise env.rl_seed_start"):
        MazeStream.for_sft(cfg.env, excluded).take(200)
    with pytest.raises(ConfigError, match="env.rl_seed_start = 10 must lie past the SFT mazes"):
        load_config(overrides=["sft.num_mazes=40", "env.sft_seed_start=0", "env.rl_seed_start=10"], environ={})


def test_training_maze_streams_can_skip_mazes_no_agent_solves_in_budget():
    every = MazeStream("maze_2d/easy", set(), start=1_000_000).take(60)
    solvable = MazeStream("maze_2d/easy", set(), start=1_000_000, max_actions=15).take(30)
    assert any(optimal_action_count(m) > 15 for m in every), "the plain stream holds unsolvable mazes"
    assert all(optimal_action_count(m) <= 15 for m in solvable)
    assert [m.seed for m in solvable] == [m.seed for m in every if optimal_action_count(m) <= 15][:30]


def test_scripted_rules_order_as_the_headroom_table_says():
    """`python -m shared.maze policies`: random < the explorer < stepping toward the target <= the solver."""
    proc = subprocess.run([sys.executable, "-m", "shared.maze", "policies", "--env", "maze_2d/7x7", "--seeds", "0-127",
                           "--max-turns", "10", "--repeats", "2"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    counts = {line.split()[0]: float(line.split()[1]) for line in proc.stdout.splitlines()[1:]}
    assert set(counts) == {"random", "explore", "toward", "solver"}
    assert counts["random"] < counts["explore"] < counts["toward"] <= counts["solver"] <= 128, counts
