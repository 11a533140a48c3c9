"""What the model reads and writes each turn: the task prompt, feedback turns and solver-written replies."""

from __future__ import annotations

from shared.maze.actions import Action, format_action
from shared.maze.core import DIRECTION_NAMES, Maze


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


def solver_reply(view: Maze, action: Action, response_format: str = "plain", action_style: str = "tuple") -> str:
    """Returns the assistant turn an expert writes at `view` (used for SFT; the same format RL samples)."""
    action_text = format_action(action, action_style)
    if response_format != "tagged":
        return action_text
    where = f"I am at row {view.agent[0]}, column {view.agent[1]}; the target is at row {view.target[0]}, column {view.target[1]}."
    if action[0] == "stop":
        why = "I am on the target, so I stop."
    else:
        why = f"The shortest open path continues {DIRECTION_NAMES[int(action[1])]}."
    return f"<observation>{where}</observation><justification>{why}</justification><action>{action_text}</action>"
