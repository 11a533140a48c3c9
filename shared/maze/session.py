"""The turn protocol: one maze episode as a model plays it, the one object every player goes through.

A `MazeSession` starts with the task prompt and the maze picture, then takes one reply per `step` and says
what it did (`TurnResult`, as skyrl-gym's `BaseTextEnvStepOutput` does for SkyRL). Rollouts and evaluations
(`shared.episodes`), the SFT warm start (the solver's replies, `services.trainer.sft`) and SkyRL's env
(`shared.maze.skyrl_env`) all play through it, so the texts, pictures and rules cannot drift apart. Its
defaults are the config schema's (`shared.config.EnvConfig`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from shared.config import EnvConfig
from shared.maze.actions import Action, episode_reward, turn_is_well_formatted
from shared.maze.core import Maze, MazeState, path_progress
from shared.maze.prompt import PromptStyle
from shared.maze.render import render_rgb

_ENV_DEFAULTS = EnvConfig()


@dataclass(frozen=True)
class TurnResult:
    """What one reply did: the action read (None: unreadable or refused), the feedback text, where the agent
    stands now, whether the episode ended (and was solved), and the next picture (None once it ended)."""

    text: str
    action: Action | None
    feedback: str
    position: tuple[int, int]
    done: bool
    solved: bool
    picture: np.ndarray | None


@dataclass
class MazeSession:
    """One episode of one maze: `start()` gives the first user turn, `step(reply)` plays each reply."""

    maze: Maze
    max_turns: int = _ENV_DEFAULTS.max_turns
    cell_px: int = _ENV_DEFAULTS.cell_px
    style: PromptStyle = field(default_factory=PromptStyle)
    state: MazeState = field(init=False)
    replies: list[str] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self.state = MazeState(self.maze, self.max_turns)

    def start(self) -> tuple[str, np.ndarray]:
        """Returns the first user turn: the task prompt's text and the maze picture (RGB)."""
        return self.style.task_prompt(self.maze), render_rgb(self.maze, self.cell_px)

    def step(self, reply: str) -> TurnResult:
        """Plays one reply (an unreadable one costs a turn and moves nothing); returns what it did."""
        self.replies.append(reply)
        action, feedback = self.style.play_turn(self.state, reply)
        done = self.state.done
        picture = None if done else render_rgb(self.state.view(), self.cell_px)
        return TurnResult(reply, action, feedback, tuple(self.state.position), done, self.state.solved, picture)

    @property
    def done(self) -> bool:
        return self.state.done

    @property
    def solved(self) -> bool:
        return self.state.solved

    def reward(self, mode: str) -> float:
        """Returns the episode's reward under `env.reward`'s mode (0 until it ends, for the task modes)."""
        progress = path_progress(self.maze, self.state.position) if mode == "task_progress" else 0.0
        return episode_reward(self.state.solved, self.replies, mode, progress)

    def format_rate(self) -> float:
        return sum(turn_is_well_formatted(r) for r in self.replies) / max(len(self.replies), 1)
