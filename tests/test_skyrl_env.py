"""The skyrl-gym env round trip, with images, through skyrl_gym.make as SkyRL calls it."""

import skyrl_gym

from shared.maze import generate, solve
from shared.maze.actions import format_action
from shared.maze.render import decode_data_uri
from shared.maze.skyrl_env import register_env


def _play(actions, **extras):
    register_env()
    register_env()  # idempotent
    env = skyrl_gym.make("maze_2d", env_config={}, extras={"env_id": "maze_2d/easy", "seed": 5, "cell_px": 32, **extras})
    messages, meta = env.init([])
    outputs = [env.step(a) for a in actions]
    return env, messages, meta, outputs


def test_round_trip_solves_with_images():
    maze = generate("maze_2d/easy", 5)
    actions = [format_action(("move", d)) for d in solve(maze)] + ["<action>('stop', 'stop')</action>"]
    env, messages, meta, outputs = _play(actions, max_turns=40)
    assert meta["seed"] == 5 and meta["content_hash"] == maze.content_hash()
    parts = messages[0]["content"]
    assert parts[0]["type"] == "text" and "maze" in parts[0]["text"]
    image = decode_data_uri(parts[1]["image_url"]["url"])
    assert image.size == (288, 288)
    for out in outputs[:-1]:
        assert not out["done"] and out["reward"] == 0.0
        assert out["observations"][0]["content"][1]["type"] == "image_url"
    assert outputs[-1]["done"] and outputs[-1]["reward"] == 1.0 and outputs[-1]["metadata"]["solved"]
    assert tuple(outputs[-2]["metadata"]["position"]) == maze.target
    assert env.get_metrics()["solved"] == 1.0


def test_garbage_costs_a_turn_and_budget_ends_it():
    env, _, _, outputs = _play(["I am not sure", "('move', 9)", "((("], max_turns=3)
    assert [o["done"] for o in outputs] == [False, False, True]
    assert "Invalid action" in outputs[0]["metadata"]["feedback"] and outputs[-1]["reward"] == 0.0


def test_format_reward_mode():
    good = "<observation>o</observation><justification>j</justification><action>('stop', 'stop')</action>"
    _, _, _, outputs = _play([good], reward="task_format")
    assert outputs[0]["done"] and abs(outputs[0]["reward"] - 0.2) < 1e-9
