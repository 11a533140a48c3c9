"""The engine contract: what every player of episodes gives an engine and gets back.

An `Engine` answers a batch of conversations (`generate`); the episode runner (shared/episodes.py) needs nothing
more. A `TokenizingEngine` also builds its own prompts (`prompt`, `processor`, the context limits): what turning its
turns into training samples needs (shared/models/training.py). A `ScoringEngine` also reads given replies. No torch
here: the HTTP client of a served model (shared/models/endpoint.py) keeps the contract without it, so a command that
plays through an endpoint starts without the seconds torch takes to import.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

_FRESH_SEEDS = random.Random()  # seeds for unseeded rows (this module's own generator: torch's global one is left alone)


@dataclass
class Completion:
    """One generated reply: its text, its token ids (end-of-turn included) and their logprobs."""

    text: str
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    error: str | None = None  # set by remote engines when this one request failed after retries
    prompt_ids: list[int] | None = None  # what a local engine's model read before replying (pictures expanded)


class Engine(Protocol):
    """What plays episodes: answers a batch of conversations, one Completion each (an `error` for one it could not
    answer). Conversation i samples with seed + i (or seed[i]); greedy when temperature is 0."""

    name: str

    def generate(self, conversations: list[list[dict]], temperature: float = 0.0, max_new_tokens: int = 24,
                 seed: int | Sequence[int | None] | None = None) -> list[Completion]: ...


class TokenizingEngine(Engine, Protocol):
    """An engine whose prompts this project builds: its processor, its context limits, and the prompt it reads."""

    processor: Any
    max_images: int
    context_turns: int | None

    def prompt(self, messages: list[dict]) -> tuple[str, list]: ...


@runtime_checkable
class ScoringEngine(TokenizingEngine, Protocol):
    """An engine that also reads given replies teacher-forced: the log-probability of each candidate reply in each
    conversation (the evaluator's decision probes and the trainer's junction accuracy need it; the in-process engine
    has it, an HTTP or vLLM engine does not)."""

    def score_replies(self, conversations: list[list[dict]], candidates: list[list[str]]) -> list[list[float]]: ...


def row_seeds(seed: int | Sequence[int | None] | None, count: int) -> list[int]:
    """Returns one sampling seed per row of a batch: seed + i for an int, the given ones for a list (None: fresh)."""
    if seed is None or isinstance(seed, int):
        given = [None if seed is None else seed + i for i in range(count)]
    else:
        given = list(seed)
        if len(given) != count:
            raise ValueError(f"{len(given)} seeds for {count} conversations")
    return [_FRESH_SEEDS.getrandbits(63) if s is None else int(s) % 2**63 for s in given]
