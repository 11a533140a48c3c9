"""The maze as a skyrl-gym environment, usable as is by SkyRL's vision-language generator.

`init` returns the task prompt with the maze picture as an OpenAI `image_url` data URI; `step` takes
the model's text and returns the next picture, the reward (at the end of the episode), done and
metadata. Extras (per dataset row): env_id, seed, max_turns, reward (mode), cell_px, response_format,
action_style, prompt_style (`short` or `visgym`: see shared.maze.prompt).
"""

from __future__ import annotations

from typing import Any

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from shared.config import EnvConfig
from shared.maze.core import generate
from shared.maze.prompt import PromptStyle
from shared.maze.render import data_uri
from shared.maze.session import MazeSession

ENV_CLASS = "maze_2d"
_DEFAULTS = EnvConfig()  # extras a dataset row leaves out take the config schema's defaults


def _image_part(array) -> dict:
    return {"type": "image_url", "image_url": {"url": data_uri(array)}}


class MazeEnv(BaseTextEnv):
    """One maze episode per instance, as SkyRL creates them (one per trajectory), played through `MazeSession`."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None):
        super().__init__()
        extras = dict(extras or {})
        self.env_id = extras.get("env_id", _DEFAULTS.id)
        self.seed = int(extras.get("seed", 0))
        self.max_turns = int(extras.get("max_turns", _DEFAULTS.max_turns))
        self.reward_mode = extras.get("reward", _DEFAULTS.reward)
        style = PromptStyle(extras.get("prompt_style", _DEFAULTS.prompt_style),
                            extras.get("response_format", _DEFAULTS.response_format),
                            extras.get("action_style", _DEFAULTS.action_style))
        self.maze = generate(self.env_id, self.seed)
        self.session = MazeSession(self.maze, self.max_turns, int(extras.get("cell_px", _DEFAULTS.cell_px)), style)

    def init(self, prompt=None):
        """Returns ([user message with prompt text + maze image], metadata); a given prompt is replaced."""
        text, picture = self.session.start()
        message = {"role": "user", "content": [{"type": "text", "text": text}, _image_part(picture)]}
        return [message], {"env_id": self.env_id, "seed": self.seed, "content_hash": self.maze.content_hash()}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        result = self.session.step(action if isinstance(action, str) else "")
        reward = self.session.reward(self.reward_mode) if result.done else 0.0
        observations = []
        if not result.done:
            observations = [{"role": "user", "content": [{"type": "text", "text": result.feedback},
                                                         _image_part(result.picture)]}]
        metadata = {"feedback": result.feedback, "position": list(result.position), "solved": result.solved,
                    "parsed_action": list(result.action) if result.action else None}
        return BaseTextEnvStepOutput(observations=observations, reward=reward, done=result.done, metadata=metadata,
                                     postprocessed_action=action)

    def get_metrics(self) -> dict[str, Any]:
        return {"solved": float(self.session.solved), "turns": self.session.state.turns}


def register_env() -> None:
    """Registers `maze_2d` with skyrl_gym (idempotent), as SkyRL's entrypoints expect before training."""
    import skyrl_gym
    from skyrl_gym.envs.registration import registry

    if ENV_CLASS not in registry:
        skyrl_gym.register(id=ENV_CLASS, entry_point="shared.maze.skyrl_env:MazeEnv")
