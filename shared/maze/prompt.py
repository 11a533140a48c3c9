"""Every text of a maze conversation: the task prompt, the feedback turns and solver-written replies.

A `PromptStyle` holds one conversation's texts: the first user turn, how a reply is read and what the
feedback turn says (the words for each outcome of `MazeState.step` live here, and only here). `short` is this project's one-line prompt (the tiny model is trained on it);
`visgym` is the conversation the VisGym SFT checkpoint learned in SkyRL's VisGym SFT example
(examples/train/visgym/env_sft.py): VisGym's maze_2d prompt plus SkyRL's format instruction, SkyRL's
tuple reader and parse-error text, and VisGym's step feedback. tests/data/visgym_prompt_reference.json
holds the upstream texts, with the commits they come from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.maze.actions import Action, format_action, parse_action, read_tuple_reply
from shared.maze.core import DIRECTION_NAMES, INVALID, WALL, Maze, MazeState

PROMPT_STYLES = ("short", "visgym")

# The feedback turn after each reply. A legal move and a wall are VisGym's own words, in both styles.
FEEDBACK_OK = "Action executed successfully."
FEEDBACK_WALL = "Cannot move into a wall."
FEEDBACK_INVALID = (
    "Invalid action. Reply with exactly one of: ('move', 0) right, ('move', 1) up, "
    "('move', 2) left, ('move', 3) down, ('stop', 'stop')."
)
FEEDBACK = {WALL: FEEDBACK_WALL, INVALID: FEEDBACK_INVALID}  # any other outcome: FEEDBACK_OK

# VisGym's RandomMaze2DEnv.get_prompt() for an RGB maze with the `move` and `stop` actions.
VISGYM_PROMPT = (
    "You are navigating a {height}x{width} maze. The maze consists of walls (gray) and paths (white). "
    "You are represented by a blue circle, and your goal is to reach the red target square.\n\n"
    "Available actions:\n"
    "1. 'move': Move in one of four directions. Format: `('move', direction)` where direction is an integer:\n"
    "   - 0=right, 1=up, 2=left, 3=down\n"
    "2. 'stop': End the navigation session. Format: `('stop', 'stop')`\n\n"
    "Success: You succeed if you reach the red target square.\n\n"
    "Please respond with exactly one action and its arguments in the specified format. For example:\n"
    "- To move right: `('move', 0)`\n"
    "- To move up: `('move', 1)`\n"
    "- To move left: `('move', 2)`\n"
    "- To move down: `('move', 3)`\n"
    "- To stop: `('stop', 'stop')`"
)
# What SkyRL's VisGym SFT example appends to VisGym's prompt.
SKYRL_FORMAT_INSTRUCTION = (
    "\n\nIMPORTANT: Respond with exactly one action as a Python tuple, "
    "e.g. ('move', 0) or ('stop', 'stop'). "
    "Do not wrap the action in backticks, code blocks, or other formatting."
)
# SkyRL's VisGym SFT example answers a reply with no readable tuple with this (maze_2d's actions listed).
SKYRL_PARSE_ERROR = (
    "Action parsing failed. Could not find a valid action tuple in your response."
    "\nPlease respond with exactly one action as a Python tuple."
    "\nAvailable actions: 'move', 'stop'"
    "\nExample: ('move', 0) or ('stop', 'stop')"
)


def task_prompt(maze: Maze, response_format: str = "plain", action_style: str = "tuple") -> str:
    """Returns the first user turn's text (the image follows it)."""
    height, width = maze.shape
    if action_style == "keyword":
        actions = "Actions: right, up, left, down, stop."
    else:
        actions = "Act with ('move', d), d: 0 right, 1 up, 2 left, 3 down; or ('stop', 'stop')."
    reply = (
        " Reply as <observation>...</observation><justification>...</justification><action>...</action>."
        if response_format == "tagged"
        else ""
    )
    return (
        f"{height}x{width} maze: gray walls, white paths. You are the blue circle; "
        f"reach the red square, then stop. {actions}{reply}"
    )


def solver_reply(view: Maze, action: Action, response_format: str = "plain", action_style: str = "tuple",
                 planner: str = "solver") -> str:
    """Returns the assistant turn a demonstrator writes at `view` (used for SFT; the same format RL samples): the
    solver's, or (`planner="explorer"`) one that gives no route as its reason."""
    action_text = format_action(action, action_style)
    if response_format != "tagged":
        return action_text
    where = f"I am at row {view.agent[0]}, column {view.agent[1]}; the target is at row {view.target[0]}, column {view.target[1]}."
    if action[0] == "stop":
        why = "I am on the target, so I stop."
    else:
        way = DIRECTION_NAMES[int(action[1])]
        why = f"The shortest open path continues {way}." if planner == "solver" else f"I explore the open way {way}."
    return f"<observation>{where}</observation><justification>{why}</justification><action>{action_text}</action>"


def _visgym_action(reply: tuple[Any, Any]) -> tuple[Action | None, str | None]:
    """Returns (the action VisGym's maze_2d plays for a read tuple, or None; VisGym's refusal text, or None)."""
    name, payload = reply
    if name == "move":
        # VisGym's Discrete(4): an int (bool included, as Python counts it) in 0..3; '0' or 1.0 are refused.
        if isinstance(payload, int) and 0 <= payload < 4:
            return ("move", int(payload)), None
    elif name == "stop":
        # VisGym's Text(4): 1 to 4 ASCII letters or digits, so ('stop', 'go') stops too.
        if isinstance(payload, str) and 1 <= len(payload) <= 4 and payload.isascii() and payload.isalnum():
            return ("stop", "stop"), None
    else:
        return None, f"The action name '{name}' is not recognized in the available action space."
    return None, f"The action {payload} is not in the valid action space of {name} so nothing is executed."


@dataclass(frozen=True)
class PromptStyle:
    """The texts of one conversation: `task_prompt` for the first user turn, `play_turn` for each reply."""

    name: str = "short"
    response_format: str = "plain"
    action_style: str = "tuple"

    def __post_init__(self) -> None:
        if self.name not in PROMPT_STYLES:
            raise ValueError(f"unknown prompt style {self.name!r}: use one of {', '.join(PROMPT_STYLES)}")

    def task_prompt(self, maze: Maze) -> str:
        """Returns the first user turn's text (the maze picture follows it in the same message)."""
        if self.name == "visgym":  # upstream asks for no tags whatever response_format says; the reward still scores them
            height, width = maze.shape
            return VISGYM_PROMPT.format(height=height, width=width) + SKYRL_FORMAT_INSTRUCTION
        return task_prompt(maze, self.response_format, self.action_style)

    def play_turn(self, state: MazeState, text: str) -> tuple[Action | None, str]:
        """Reads one reply, plays it on `state`; returns (the action played or None, the feedback text).

        An unreadable or refused reply costs a turn and moves nothing, in both styles.
        """
        if self.name == "short":
            action = parse_action(text, self.action_style)
            return action, FEEDBACK.get(state.step(action), FEEDBACK_OK)
        reply = read_tuple_reply(text)
        action, refusal = _visgym_action(reply) if reply is not None else (None, SKYRL_PARSE_ERROR)
        outcome = state.step(action)
        return action, refusal or FEEDBACK.get(outcome, FEEDBACK_OK)
