"""The maze_2d task: VisGym-identical generation, step semantics and an optimal solver.

Generation reproduces VisGym's `maze_2d` seed for seed (the rules are in the README's "The maze" section): numpy's
PCG64 generator seeded like gymnasium, one draw for Wilson's loop-erased random walk (run on
`random.Random`), one draw for the corner pair. Nothing here knows about models or images.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import deque
from dataclasses import dataclass, field

import numpy as np

ENV_SIZES = {"maze_2d/easy": (9, 9), "maze_2d/hard": (11, 11)}

# Direction index -> (d_row, d_col); 0=right, 1=up, 2=left, 3=down (VisGym's action codes).
MOVES = {0: (0, 1), 1: (-1, 0), 2: (0, -1), 3: (1, 0)}
DIRECTION_NAMES = {0: "right", 1: "up", 2: "left", 3: "down"}

# What one action did (shared.maze.prompt words each for the model).
MOVED, WALL, INVALID, STOPPED = "moved", "wall", "invalid", "stopped"

# Wilson's walk directions over the inner cell lattice (row, col), in VisGym's order.
_WALK_DIRECTIONS = [(0, 1), (1, 0), (0, -1), (-1, 0)]


def env_size(env_id: str) -> tuple[int, int]:
    """Returns (height, width) for an env id such as `maze_2d/easy` or `maze_2d/13x15`."""
    if env_id in ENV_SIZES:
        return ENV_SIZES[env_id]
    prefix, _, size = env_id.partition("/")
    try:
        height, width = (int(x) for x in size.split("x"))
    except ValueError:
        height = width = 0
    if prefix != "maze_2d" or height < 5 or width < 5 or height % 2 == 0 or width % 2 == 0:
        raise ValueError(
            f"unknown env id {env_id!r}: use maze_2d/easy, maze_2d/hard or maze_2d/HxW with odd H, W >= 5"
        )
    return height, width


def wilson_inner_grid(height: int, width: int, seed: int) -> list[list[int]]:
    """Returns the inner maze as rows of 1 (carved floor) / 0 (wall), Wilson's algorithm."""
    r = random.Random(seed)
    grid = [[0] * width for _ in range(height)]
    unvisited = [(i, j) for i in range(height) for j in range(width) if i % 2 == 0 and j % 2 == 0]
    visited: set[tuple[int, int]] = set()

    def inside(cell: tuple[int, int], d: int) -> bool:
        i, j = cell[0] + 2 * _WALK_DIRECTIONS[d][0], cell[1] + 2 * _WALK_DIRECTIONS[d][1]
        return 0 <= i < height and 0 <= j < width

    first = unvisited.pop(r.randint(0, len(unvisited) - 1))
    visited.add(first)
    grid[first[0]][first[1]] = 1
    while unvisited:
        start = unvisited[r.randint(0, len(unvisited) - 1)]
        path: dict[tuple[int, int], int] = {}
        cell = start
        while True:  # random walk until it hits the tree; overwriting path[] erases loops
            d = r.randint(0, 3)
            while not inside(cell, d):
                d = r.randint(0, 3)
            path[cell] = d
            cell = (cell[0] + 2 * _WALK_DIRECTIONS[d][0], cell[1] + 2 * _WALK_DIRECTIONS[d][1])
            if cell in visited:
                break
        cell = start
        while True:  # carve the loop-erased path into the tree
            visited.add(cell)
            unvisited.remove(cell)
            grid[cell[0]][cell[1]] = 1
            di, dj = _WALK_DIRECTIONS[path[cell]]
            grid[cell[0] + di][cell[1] + dj] = 1
            cell = (cell[0] + 2 * di, cell[1] + 2 * dj)
            if cell in visited:
                break
    return grid


@dataclass(frozen=True)
class Maze:
    """One maze instance: layout (1 = wall), start and target as (row, col)."""

    maze_map: np.ndarray
    agent: tuple[int, int]
    target: tuple[int, int]
    env_id: str = "maze_2d/easy"
    seed: int | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.maze_map.shape)  # type: ignore[return-value]

    def content_hash(self) -> str:
        """Returns a sha256 over layout, start and target: the identity of a maze, whatever its seed."""
        payload = json.dumps(
            {"maze_map": self.maze_map.tolist(), "agent": list(self.agent), "target": list(self.target)},
            separators=(",", ":"),
        )
        return hashlib.sha256(payload.encode()).hexdigest()

    def to_json(self) -> dict:
        return {
            "seed": self.seed,
            "maze_map": self.maze_map.tolist(),
            "agent": list(self.agent),
            "target": list(self.target),
        }


def generate(env_id: str, seed: int) -> Maze:
    """Returns the maze VisGym's `maze_2d` builds for `reset(seed=seed)`."""
    height, width = env_size(env_id)
    rng = np.random.default_rng(seed)  # == gymnasium.utils.seeding.np_random(seed)
    inner = wilson_inner_grid(height - 2, width - 2, int(rng.integers(2**32)))
    maze_map = np.ones((height, width), dtype=np.int8)
    maze_map[1:-1, 1:-1] = 1 - np.asarray(inner, dtype=np.int8)
    corners = [
        ((1, 1), (height - 2, width - 2)),
        ((height - 2, width - 2), (1, 1)),
        ((height - 2, 1), (1, width - 2)),
        ((1, width - 2), (height - 2, 1)),
    ]
    agent, target = corners[int(rng.integers(0, len(corners)))]
    return Maze(maze_map=maze_map, agent=agent, target=target, env_id=env_id, seed=seed)


def distances_from(maze: Maze, origin: tuple[int, int], blocked: tuple[int, int] | None = None) -> dict[tuple[int, int], int]:
    """Returns the shortest-path distance (in moves) from `origin` to every floor cell it reaches without
    passing through `blocked`."""
    dist = {origin: 0}
    queue = deque([origin])
    while queue:
        cell = queue.popleft()
        for dr, dc in MOVES.values():
            nxt = (cell[0] + dr, cell[1] + dc)
            if maze.maze_map[nxt] == 0 and nxt not in dist and nxt != blocked:
                dist[nxt] = dist[cell] + 1
                queue.append(nxt)
    return dist


def solve(maze: Maze, start: tuple[int, int] | None = None) -> list[int]:
    """Returns the shortest list of move directions from `start` (default: the agent) to the target."""
    cell = start or maze.agent
    dist = distances_from(maze, maze.target)
    if cell not in dist:
        raise ValueError(f"maze seed={maze.seed} has no path from {cell} to {maze.target}")
    moves: list[int] = []
    while cell != maze.target:
        d, cell = next((d, (cell[0] + dr, cell[1] + dc)) for d, (dr, dc) in MOVES.items()
                       if dist.get((cell[0] + dr, cell[1] + dc)) == dist[cell] - 1)  # one step closer
        moves.append(d)
    return moves


def open_moves(maze: Maze, position: tuple[int, int]) -> list[int]:
    """Returns the move directions that do not run into a wall at `position`."""
    return [d for d, (dr, dc) in MOVES.items() if maze.maze_map[position[0] + dr, position[1] + dc] == 0]


def moves_ahead(maze: Maze, position: tuple[int, int], previous: tuple[int, int] | None) -> list[int]:
    """Returns the open moves at `position` other than going back to `previous` (the cell the agent came from; None,
    or its own cell after a wasted turn, when there is none). Two or more: a junction."""
    return [d for d in open_moves(maze, position)
            if previous is None or (position[0] + MOVES[d][0], position[1] + MOVES[d][1]) != tuple(previous)]


def explore_walk(maze: Maze, rng: random.Random, max_moves: int) -> list[int]:
    """Returns the moves of an explorer with no target preference and no planning: it follows corridors, turns
    back only at a dead end, picks uniformly among the open non-reverse moves at a junction, and stops moving
    once it stands on the target (or after `max_moves`). What the interface warm start imitates."""
    cell, previous, moves = maze.agent, None, []
    while cell != maze.target and len(moves) < max_moves:
        d = rng.choice(moves_ahead(maze, cell, previous) or open_moves(maze, cell))
        previous, cell = cell, (cell[0] + MOVES[d][0], cell[1] + MOVES[d][1])
        moves.append(d)
    return moves


def fewest_actions(env_id: str) -> int:
    """Returns the fewest actions any maze of `env_id` needs: start and target sit in opposite corners, so the
    shortest path is at least the corner-to-corner Manhattan distance, plus `stop`."""
    height, width = env_size(env_id)
    return (height - 3) + (width - 3) + 1


def optimal_action_count(maze: Maze) -> int:
    """Returns the number of actions a perfect agent needs: the shortest path plus `stop`."""
    return len(solve(maze)) + 1


def path_progress(maze: Maze, position: tuple[int, int]) -> float:
    """Returns the share of the agent's shortest path to the target covered at `position` (0 if no closer)."""
    dist = distances_from(maze, maze.target)
    start = dist[maze.agent]
    if start == 0:
        return 1.0
    return max(0.0, (start - dist[position]) / start)


def first_mistake(maze: Maze, actions: list) -> dict | None:
    """Returns the first action a perfect agent would not take, as {"turn", "kind"}; None if there is none.

    actions: the parsed actions as played, None for an unparseable reply. Kinds: `wrong_branch`
    (a step away from the target into a side branch; `branch_cells` is that branch's size in floor cells:
    2 is a dead end in plain sight, more needs planning), `backtrack` (a step back to the
    previous cell), `wall` (a move into a wall), `stop_early` (stop off the target), `missed_stop` (a move
    off the target instead of stop), `unparsed`. Running out of turns after perfect play is not a mistake:
    that maze is beyond the ceiling.
    """
    dist = distances_from(maze, maze.target)
    position, previous = maze.agent, None
    for turn, action in enumerate(actions):
        if action is None:
            return {"turn": turn, "kind": "unparsed"}
        on_target = position == maze.target
        if action[0] == "stop":
            return None if on_target else {"turn": turn, "kind": "stop_early"}
        dr, dc = MOVES[int(action[1])]
        nxt = (position[0] + dr, position[1] + dc)
        if maze.maze_map[nxt] == 1:
            return {"turn": turn, "kind": "wall"}
        if on_target:
            return {"turn": turn, "kind": "missed_stop"}
        if dist[nxt] > dist[position]:
            if nxt == previous:
                return {"turn": turn, "kind": "backtrack"}
            branch = distances_from(maze, nxt, blocked=position)
            return {"turn": turn, "kind": "wrong_branch", "branch_cells": len(branch)}
        position, previous = nxt, position
    return None


@dataclass
class MazeState:
    """The mutable state of one maze being walked (position, turns used, trace); `step` applies VisGym's rules."""

    maze: Maze
    max_turns: int = 15
    position: tuple[int, int] = field(init=False)
    turns: int = field(default=0, init=False)
    done: bool = field(default=False, init=False)
    solved: bool = field(default=False, init=False)
    trace: list[tuple[int, int]] = field(init=False)

    def __post_init__(self) -> None:
        self.position = self.maze.agent
        self.trace = [self.position]

    def step(self, action: tuple[str, int | str] | None) -> str:
        """Applies one parsed action (None = unparseable, a wasted turn); returns what it did: MOVED, WALL (the agent
        stays), INVALID or STOPPED (solved when on the target)."""
        if self.done:
            raise RuntimeError("the maze walk is over; start a new MazeState")
        self.turns += 1
        outcome = MOVED
        if action is None:
            outcome = INVALID
        elif action[0] == "stop":
            self.done, outcome = True, STOPPED
            self.solved = self.position == self.maze.target
        else:
            dr, dc = MOVES[int(action[1])]
            nxt = (self.position[0] + dr, self.position[1] + dc)
            if self.maze.maze_map[nxt] == 1:
                outcome = WALL
            else:
                self.position = nxt
        self.trace.append(self.position)
        if not self.done and self.turns >= self.max_turns:
            self.done = True  # out of turns, unsolved
        return outcome

    def view(self) -> Maze:
        """Returns the maze with the agent at its current position (what the next image shows)."""
        return Maze(self.maze.maze_map, self.position, self.maze.target, self.maze.env_id, self.maze.seed)
