"""The maze as a skyrl-gym environment, usable as is by SkyRL's vision-language generator.

`init` returns the task prompt with the maze picture as an OpenAI `image_url` data URI; `step` takes
the model's text and returns the next picture, the reward (at the end of the episode), done and
metadata. Extras (per dataset row): env_id, seed, max_turns, reward (mode), cell_px, response_format,
action_style, prompt_style (`short` or `visgym`: see shared.maze.prompt).
"""

from __future__ import annotations

from typing import Any

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from shared.maze.actions import score_episode
from shared.maze.core import MazeEpisode, generate
from shared.maze.prompt import PromptStyle
from shared.maze.render import data_uri, render_rgb

ENV_CLASS = "maze_2d"


def _image_part(array) -> dict:
    return {"type": "image_url", "image_url": {"url": data_uri(array)}}


class MazeEnv(BaseTextEnv):
    """One maze episode per instance, as SkyRL creates them (one per trajectory)."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None):
        super().__init__()
        extras = dict(extras or {})
        self.env_id = extras.get("env_id", "maze_2d/easy")
        self.seed = int(extras.get("seed", 0))
        self.max_turns = int(extras.get("max_turns", 15))
        self.reward_mode = extras.get("reward", "task")
        self.cell_px = int(extras.get("cell_px", 25))
        self.response_format = extras.get("response_format", "plain")
        self.action_style = extras.get("action_style", "tuple")
        self.style = PromptStyle(extras.get("prompt_style", "short"), self.response_format, self.action_style)
        self.maze = generate(self.env_id, self.seed)
        self.episode = MazeEpisode(self.maze, self.max_turns)
        self.texts: list[str] = []

    def init(self, prompt=None):
        """Returns ([user message with prompt text + maze image], metadata); a given prompt is replaced."""
        text = self.style.task_prompt(self.maze)
        message = {"role": "user", "content": [{"type": "text", "text": text}, _image_part(render_rgb(self.maze, self.cell_px))]}
        return [message], {"env_id": self.env_id, "seed": self.seed, "content_hash": self.maze.content_hash()}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        self.texts.append(action if isinstance(action, str) else "")
        parsed, _, feedback = self.style.play_turn(self.episode, action)
        done = self.episode.done
        reward = score_episode(self.episode, self.texts, self.reward_mode) if done else 0.0
        observations = []
        if not done:
            picture = render_rgb(self.episode.view(), self.cell_px)
            observations = [{"role": "user", "content": [{"type": "text", "text": feedback}, _image_part(picture)]}]
        metadata = {"feedback": feedback, "position": list(self.episode.position), "solved": self.episode.solved,
                    "parsed_action": list(parsed) if parsed else None}
        return BaseTextEnvStepOutput(observations=observations, reward=reward, done=done, metadata=metadata,
                                     postprocessed_action=action)

    def get_metrics(self) -> dict[str, Any]:
        return {"solved": float(self.episode.solved), "turns": self.episode.turns}


def register_env() -> None:
    """Registers `maze_2d` with skyrl_gym (idempotent), as SkyRL's entrypoints expect before training."""
    import skyrl_gym
    from skyrl_gym.envs.registration import registry

    if ENV_CLASS not in registry:
        skyrl_gym.register(id=ENV_CLASS, entry_point="shared.maze.skyrl_env:MazeEnv")
