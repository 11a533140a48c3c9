"""The `visgym` prompt style says exactly what the VisGym SFT checkpoint was trained on.

tests/data/visgym_prompt_reference.json was recorded by running the upstream code (VisGym's maze_2d and
SkyRL's VisGym SFT example, commits named in the file): prompts, step feedback, the parse-error text and
what SkyRL's reader makes of a set of replies. Both our paths must reproduce it: the skyrl-gym env (as
SkyRL's generator drives it) and our episode runner.
"""

import json
from pathlib import Path

import pytest
import skyrl_gym

from shared.config import ConfigError, load_config
from shared.episodes import EpisodeSettings, run_episodes
from shared.maze import generate
from shared.maze.skyrl_env import register_env
from shared.models.contract import Completion

REPO = Path(__file__).resolve().parent.parent
REFERENCE = json.loads((Path(__file__).parent / "data" / "visgym_prompt_reference.json").read_text())
CASES = [(env_id, int(seed)) for env_id, env in REFERENCE["envs"].items() for seed in env["seeds"]]


def _skyrl_env(env_id: str, seed: int, max_turns: int = 15):
    register_env()
    extras = {"env_id": env_id, "seed": seed, "max_turns": max_turns, "cell_px": 25, "reward": "task_format",
              "response_format": "tagged", "action_style": "tuple", "prompt_style": "visgym"}
    return skyrl_gym.make("maze_2d", env_config={}, extras=extras)


def _feedback_text(output) -> str:
    (message,) = output["observations"]
    assert [part["type"] for part in message["content"]] == REFERENCE["message_content_types"]
    return message["content"][0]["text"]


class ScriptedEngine:
    """Stands in for a model: answers every live conversation with the next scripted reply."""

    def __init__(self, replies: list[str]):
        self.replies = list(replies)
        self.seen: list[list[dict]] = []

    def generate(self, conversations, temperature, max_new_tokens, seed):
        self.seen = [list(c) for c in conversations]
        return [Completion(text=self.replies.pop(0), token_ids=[]) for _ in conversations]


def _run(env_id: str, seed: int, replies: list[str]):
    settings = EpisodeSettings(max_turns=15, cell_px=25, response_format="tagged",
                               prompt_style="visgym")
    engine = ScriptedEngine(replies)
    (episode,) = run_episodes(engine, [generate(env_id, seed)], settings)
    return episode


@pytest.mark.parametrize("env_id, seed", CASES)
def test_skyrl_env_prompts_and_answers_as_upstream(env_id, seed):
    expected = REFERENCE["envs"][env_id]["seeds"][str(seed)]
    env = _skyrl_env(env_id, seed)
    messages, _ = env.init([])
    (first,) = messages
    assert first["role"] == "user"
    assert [part["type"] for part in first["content"]] == REFERENCE["message_content_types"]
    assert first["content"][0]["text"] == expected["prompt"]
    assert list(env.maze.agent) == expected["agent"]  # the same maze as VisGym's
    for step in expected["steps"]:  # a wall, a legal move, then refusals VisGym words itself
        output = env.step(step["action"])
        assert _feedback_text(output) == step["env_feedback"]
        assert output["metadata"]["position"] == step["agent"]
    assert _feedback_text(env.step("I am not sure")) == REFERENCE["envs"][env_id]["parse_error"]


@pytest.mark.parametrize("env_id, seed", CASES)
def test_episode_runner_prompts_and_answers_as_upstream(env_id, seed):
    expected = REFERENCE["envs"][env_id]["seeds"][str(seed)]
    replies = [step["action"] for step in expected["steps"]] + ["I am not sure", "('stop', 'stop')"]
    episode = _run(env_id, seed, replies)
    first = episode.messages[0]
    assert [part["type"] for part in first["content"]] == ["text", "image"]  # our engines' form of image_url
    assert first["content"][0]["text"] == expected["prompt"]
    feedback = [turn.feedback for turn in episode.turns]
    assert feedback[:-1] == [step["env_feedback"] for step in expected["steps"]] + [REFERENCE["envs"][env_id]["parse_error"]]
    assert [list(turn.position) for turn in episode.turns[: len(expected["steps"])]] == [s["agent"] for s in expected["steps"]]
    user_texts = [m["content"][0]["text"] for m in episode.messages[1:] if m["role"] == "user"]
    assert user_texts == feedback[:-1]  # what the model reads back is that feedback, picture after text
    assert episode.session.done and not episode.solved


@pytest.mark.parametrize("case", REFERENCE["extract_action"], ids=lambda case: case["text"])
def test_replies_are_read_as_skyrl_reads_them(case):
    env = _skyrl_env("maze_2d/easy", 0)
    env.init([])
    output = env.step(case["text"])
    assert output["done"] == case["terminated"]
    assert output["metadata"]["position"] == case["agent"]
    if not case["terminated"]:
        assert _feedback_text(output) == case["feedback"]
    episode = _run("maze_2d/easy", 0, [case["text"], "('stop', 'stop')"])
    assert list(episode.turns[0].position) == case["agent"]
    if not case["terminated"]:
        assert episode.turns[0].feedback == case["feedback"]


def test_profiles_pick_their_prompt_style():
    assert load_config(REPO / "configs/qwen3vl-8b-hyperpod.yaml", environ={}).env.prompt_style == "visgym"
    assert load_config(environ={}).env.prompt_style == "short"
    with pytest.raises(ConfigError, match="env.action_style = 'keyword' does not go with env.prompt_style"):
        load_config(None, ["env.prompt_style=visgym", "env.action_style=keyword"], environ={})
    with pytest.raises(ConfigError, match="env.prompt_style"):
        load_config(None, ["env.prompt_style=long"], environ={})
