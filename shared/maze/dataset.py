"""The held-out eval sets, and the seed-ordered stream of training mazes that never yields a held-out one (by content)."""

from __future__ import annotations

import collections
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from shared.maze.core import Maze, generate, optimal_action_count
from shared.storage.files import atomic_write_json


def parse_seeds(spec: str) -> list[int]:
    """Returns the seeds of `A-B` (inclusive) or `A,B,C`."""
    spec = str(spec).strip()
    try:
        if "-" in spec:
            low, high = (int(x) for x in spec.split("-", 1))
            if high < low:
                raise ValueError
            return list(range(low, high + 1))
        return [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"seed range {spec!r} is invalid: use A-B with A <= B (e.g. 0-63) or A,B,C") from None


@dataclass(frozen=True)
class EvalSet:
    """A fixed list of mazes scored with one turn budget."""

    env_id: str
    seeds: list[int]
    max_turns: int

    @classmethod
    def held_out(cls, env) -> EvalSet:
        """Returns the held-out set an `env` config section names (env.eval_seeds, the reference's 64)."""
        return cls(env.eval_env, parse_seeds(env.eval_seeds), env.max_turns)

    @classmethod
    def extended(cls, env) -> EvalSet | None:
        """Returns the extended held-out set (env.extended_eval_seeds), or None where the config skips it."""
        return cls(env.eval_env, parse_seeds(env.extended_eval_seeds), env.max_turns) if env.extended_eval_seeds else None

    @property
    def seeds_spec(self) -> str:
        contiguous = self.seeds == list(range(self.seeds[0], self.seeds[-1] + 1))
        return f"{self.seeds[0]}-{self.seeds[-1]}" if contiguous else ",".join(map(str, self.seeds))

    def mazes(self) -> list[Maze]:
        return [generate(self.env_id, seed) for seed in self.seeds]

    def content_hashes(self) -> set[str]:
        return {maze.content_hash() for maze in self.mazes()}

    def optimal_counts(self) -> list[int]:
        return [optimal_action_count(maze) for maze in self.mazes()]

    def oracle_solved(self) -> int:
        """Returns how many mazes a perfect agent solves within max_turns (stop counts as a turn)."""
        return sum(count <= self.max_turns for count in self.optimal_counts())

    def histogram(self) -> dict[int, int]:
        return dict(sorted(collections.Counter(self.optimal_counts()).items()))

    def save(self, folder: str | Path) -> Path:
        """Writes `eval_<seeds>_t<turns>.json` (seeds, content hashes, ceiling) under folder; returns its path."""
        path = Path(folder) / f"eval_{self.seeds_spec}_t{self.max_turns}.json"
        if not path.exists():
            mazes = self.mazes()
            atomic_write_json(
                path,
                {
                    "env": self.env_id,
                    "seeds": self.seeds_spec,
                    "max_turns": self.max_turns,
                    "oracle_solved": self.oracle_solved(),
                    "mazes": [
                        {"seed": m.seed, "content_hash": m.content_hash(), "optimal_actions": optimal_action_count(m)}
                        for m in mazes
                    ],
                },
            )
        return path


def excluded_from_training(env) -> set[str]:
    """Returns the content hashes of every held-out maze an `env` section names: no training stream yields one."""
    sets = [EvalSet.held_out(env), EvalSet.extended(env)]
    return set().union(*(s.content_hashes() for s in sets if s is not None))


class MazeStream:
    """Training mazes: seeds from `start` upward, skipping any maze whose content equals an eval maze
    (and, with `max_actions`, any maze that needs more actions than that).

    The cursor is the next seed to try, so a checkpointed cursor resumes the exact same stream.
    """

    def __init__(self, env_id: str, excluded: set[str], start: int, max_actions: int | None = None,
                 stop: int | None = None):
        self.env_id = env_id
        self.excluded = excluded
        self.max_actions = max_actions  # skip mazes whose shortest solution takes more actions (None: keep all)
        self.start = start
        self.stop = stop  # the stream must not reach this seed (another stream's first): ValueError there
        self.cursor = start
        self.rejected = 0
        self.end = start  # one past the highest seed drawn

    @classmethod
    def for_sft(cls, env, excluded: set[str]) -> MazeStream:
        """Returns the SFT warm start's maze stream: from env.sft_seed_start, ending before GRPO's first seed."""
        return cls(env.id, excluded, env.sft_seed_start, stop=env.rl_seed_start)  # the config puts GRPO's start above

    @classmethod
    def for_rl(cls, env, excluded: set[str]) -> MazeStream:
        """Returns GRPO's maze stream (only solvable mazes if the config says so), disjoint from SFT's."""
        return cls(env.id, excluded, env.rl_seed_start, env.max_turns if env.train_solvable_only else None)

    def seed_range(self) -> str:
        """Returns the seeds this stream has drawn so far, `A-B` inclusive (empty before the first)."""
        return f"{self.start}-{self.end - 1}" if self.end > self.start else ""

    def take(self, count: int) -> list[Maze]:
        return [next(self) for _ in range(count)]

    def __iter__(self) -> Iterator[Maze]:
        return self

    def __next__(self) -> Maze:
        while True:
            if self.stop is not None and self.cursor >= self.stop:
                raise ValueError(f"the maze stream from seed {self.start} reached seed {self.stop}, where another "
                                 "stream starts: raise env.rl_seed_start or lower sft.num_mazes")
            maze = generate(self.env_id, self.cursor)
            self.cursor += 1
            self.end = max(self.end, self.cursor)
            if maze.content_hash() in self.excluded:
                self.rejected += 1
                continue
            if self.max_actions is not None and optimal_action_count(maze) > self.max_actions:
                continue
            return maze

    def state(self) -> dict:
        return {"cursor": self.cursor, "rejected": self.rejected, "end": self.end}

    def load_state(self, state: dict) -> None:
        self.cursor, self.rejected = int(state["cursor"]), int(state["rejected"])
        self.end = int(state.get("end", self.cursor))
