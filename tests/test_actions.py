"""Parsing what models emit: tolerant, never raising; the recipe's format reward."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.maze.actions import episode_reward, parse_action, read_tuple_reply, turn_is_well_formatted
from shared.maze.core import MazeState, generate
from shared.maze.prompt import PromptStyle


@pytest.mark.parametrize(
    "text, expected",
    [
        ("('move', 0)", ("move", 0)),
        ('("move", 3)', ("move", 3)),
        ("(move, 1)", ("move", 1)),
        ("<action>('move', 2)</action>", ("move", 2)),
        ("`('move', 1)`", ("move", 1)),
        ("I should go right first, like ('move', 1)? No: ('move', 0)", ("move", 0)),
        ("<observation>x</observation><justification>y</justification><action>('stop', 'stop')</action>", ("stop", "stop")),
        ("(stop, stop)", ("stop", "stop")),
        ("  ( 'MOVE' , 3 )  ", ("move", 3)),
        ("('move', 7)", None),
        ("move right", None),
        ("", None),
        ("<action></action>", None),
    ],
)
def test_parse_action(text, expected):
    assert parse_action(text) == expected


def test_action_tag_wins_over_reasoning():
    assert parse_action("maybe ('move', 3) ... <action>('move', 1)</action>") == ("move", 1)


def test_keyword_style_by_option():
    assert parse_action("<action>left</action>") is None
    assert parse_action("<action>left</action>", style="keyword") == ("move", 2)
    assert parse_action("<action>Down</action>", style="keyword") == ("move", 3)
    assert parse_action("<action>stop</action>", style="keyword") == ("stop", "stop")


@settings(max_examples=400, deadline=None)
@given(st.text())
def test_parser_never_raises(text):
    result = parse_action(text)
    assert result is None or result[0] in ("move", "stop")
    parse_action(text, style="keyword")
    turn_is_well_formatted(text)


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet="()[]'\",\\ movestpjum0123\n", max_size=60))
def test_tuple_reader_and_visgym_turns_never_raise(text):
    reply = read_tuple_reply(text)
    assert reply is None or (isinstance(reply, tuple) and len(reply) == 2)
    action, feedback = PromptStyle("visgym").play_turn(MazeState(generate("maze_2d/easy", 0)), text)
    assert feedback and (action is None or action[0] in ("move", "stop"))


def test_rewards():
    good = "<observation>a</observation><justification>b</justification><action>('move', 0)</action>"
    assert turn_is_well_formatted(good) and not turn_is_well_formatted("<action>('move', 0)</action>")
    assert episode_reward(True, ["x"], "task") == 1.0
    assert episode_reward(False, [good, "x"], "task_format") == pytest.approx(0.1)
    assert episode_reward(True, [good, good], "task_format") == pytest.approx(1.0)
    assert episode_reward(True, ["x"], "task_progress", progress=0.25) == 1.0
    assert episode_reward(False, ["x"], "task_progress", progress=0.25) == pytest.approx(0.125)
    assert episode_reward(False, ["x"], "task_progress", progress=1.0) == 0.5, "on the target without stop: half"
    assert episode_reward(False, ["x"], "task_progress", progress=-0.3) == 0.0
    with pytest.raises(ValueError):
        episode_reward(True, [], "bogus")
