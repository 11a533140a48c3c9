"""Turning model text into maze actions, and scoring the recipe's tag format. Never raises on model output."""

from __future__ import annotations

import ast
import re
from typing import Any, Literal

from shared.maze.core import DIRECTION_NAMES

Action = tuple[str, int | str]
ActionStyle = Literal["tuple", "keyword"]

# Every pattern here runs in time linear in the reply: no two repeats can share the same characters (an optional
# quote swallows its own trailing spaces), so a reply built to backtrack (`(` and 4,000 spaces) fails at once.
_Q = r"""(?:[`'"]\s*)?"""
_TUPLE = re.compile(rf"""\(\s*{_Q}(move|stop)\s*{_Q},\s*{_Q}([0-3]|stop)\s*{_Q}\)""", re.IGNORECASE)
_KEYWORDS = {name: d for d, name in DIRECTION_NAMES.items()}
_KEYWORD = re.compile(r"\b(right|up|left|down|stop)\b", re.IGNORECASE)
FORMAT_TAGS = ("observation", "justification", "action")
# The opening of a tuple reply, `('name',` (quoted) or `(name,`: where SkyRL's VisGym example starts reading.
_QUOTED_OPENING = re.compile(r"""\(\s*['"](\w+)['"]\s*,""")
_BARE_OPENING = re.compile(r"""\(\s*(\w+)\s*,""")


def tag_content(text: str, tag: str) -> str | None:
    """Returns the stripped content of the last `<tag>...</tag>` in text, or None if there is none.

    Two reverse searches (linear): the last closing tag, then the opening tag nearest before it.
    """
    lower = text.lower()
    close = lower.rfind(f"</{tag}>")
    opening = lower.rfind(f"<{tag}>", 0, close) if close >= 0 else -1
    return text[opening + len(tag) + 2 : close].strip() if opening >= 0 else None


def parse_action(text: str, style: ActionStyle = "tuple") -> Action | None:
    """Returns ('move', d) or ('stop', 'stop') from model text, or None when no valid action is found.

    Looks inside the last `<action>` tag when there is one, else in the whole text, and takes the last
    action written there (models reason first, then act). `style="keyword"` also accepts
    `<action>left</action>` (the instruct recipe's form).
    """
    if not isinstance(text, str):
        return None
    region = tag_content(text, "action")
    if region is None:
        region = text
    matches = _TUPLE.findall(region)
    if matches:
        name, payload = matches[-1]
        name, payload = name.lower(), payload.lower()
        if name == "stop" and payload == "stop":
            return ("stop", "stop")
        if name == "move" and payload.isdigit():
            return ("move", int(payload))
        return None
    if style == "keyword":
        words = _KEYWORD.findall(region)
        if words:
            word = words[-1].lower()
            return ("stop", "stop") if word == "stop" else ("move", _KEYWORDS[word])
    return None


def _bracketed(text: str, start: int, limit: int = 256) -> str | None:
    """Returns text[start:] up to the bracket that closes the `(` at `start` (quotes respected), or None.

    An action tuple is short: the scan stops after `limit` characters, so many openings cost linear time."""
    depth, quote, i = 0, None, start
    end = min(len(text), start + limit)
    while i < end:
        char = text[i]
        if quote:
            if char == "\\":
                i += 1  # the escaped character cannot close the string
            elif char == quote:
                quote = None
        elif char in "'\"":
            quote = char
        elif char in "([":
            depth += 1
        elif char in ")]":
            depth -= 1
            if depth == 0:
                return text[start : i + 1]
        i += 1
    return None


def _as_pair(literal: str) -> tuple[Any, Any] | None:
    try:
        value = ast.literal_eval(literal)
    except Exception:  # literal_eval raises several types on model text
        return None
    return value if isinstance(value, tuple) and len(value) == 2 else None


def read_tuple_reply(text: str) -> tuple[Any, Any] | None:
    """Returns the first `(name, payload)` Python 2-tuple written in text, as SkyRL's VisGym SFT example reads
    replies (its `extract_action`), or None when there is none.

    Unlike `parse_action` it takes the first tuple anywhere (tags are not looked at), is case-sensitive and
    returns any payload: VisGym's rules, not the reader, reject `('move', 7)` or `('jump', 1)`. Tuples with a
    quoted name are tried before `(name, payload)` with a bare one, which is quoted before evaluation.
    """
    if not isinstance(text, str):
        return None
    for match in _QUOTED_OPENING.finditer(text):
        literal = _bracketed(text, match.start())
        pair = _as_pair(literal) if literal else None
        if pair is not None:
            return pair
    for match in _BARE_OPENING.finditer(text):
        literal = _bracketed(text, match.start())
        name = match.group(1)
        pair = _as_pair(literal.replace(name, f"'{name}'", 1)) if literal else None
        if pair is not None:
            return pair
    return None


def format_action(action: Action, style: ActionStyle = "tuple") -> str:
    """Returns the canonical text of an action: `('move', 0)` or, in keyword style, `right`."""
    if style == "keyword":
        return "stop" if action[0] == "stop" else DIRECTION_NAMES[int(action[1])]
    return "('stop', 'stop')" if action[0] == "stop" else f"('move', {int(action[1])})"


def turn_is_well_formatted(text: str) -> bool:
    """Returns True when a turn has non-empty `<observation>`, `<justification>` and `<action>` tags."""
    return all(tag_content(text, tag) for tag in FORMAT_TAGS)


def episode_reward(solved: bool, turn_texts: list[str], mode: str, progress: float = 0.0) -> float:
    """Returns the episode reward for one reward mode.

    `task` = success; `task_format` = 0.8 success + 0.2 share of well-formatted turns (the SFT recipe);
    `task_progress` = success, else half the share of the shortest path covered (`progress`, 0..1): a
    denser signal for small models, where most groups of 8 would otherwise all fail or all succeed alike.
    """
    task = 1.0 if solved else 0.0
    if mode == "task":
        return task
    if mode == "task_format":
        share = sum(turn_is_well_formatted(t) for t in turn_texts) / max(len(turn_texts), 1)
        return 0.8 * task + 0.2 * share
    if mode == "task_progress":
        return task if solved else 0.5 * min(max(progress, 0.0), 1.0)
    raise ValueError(f"unknown reward mode {mode!r}: use 'task', 'task_format' or 'task_progress'")
