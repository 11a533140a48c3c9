"""The one episode runner: plays many mazes at once against any engine, turn by turn.

Every evaluation (SFT warm-start, trainer, evaluator service, server client) and every GRPO rollout
goes through `run_episodes` / `play_episodes`. Each turn, all live episodes are sent to the engine as one batch;
the engine is anything that keeps `shared.models.contract.Engine`'s contract. See docs/trainer.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from PIL import Image

from shared.config import EnvConfig, RolloutConfig
from shared.maze.core import Maze, first_mistake, optimal_action_count
from shared.maze.prompt import PromptStyle
from shared.maze.session import MazeSession
from shared.models.chat import assistant_turn, user_turn
from shared.models.contract import Completion, Engine

_ENV, _ROLLOUT = EnvConfig(), RolloutConfig()


@dataclass
class EpisodeSettings:
    """How episodes are played; every default is the config schema's."""

    max_turns: int = _ENV.max_turns
    cell_px: int = _ENV.cell_px
    response_format: str = _ENV.response_format
    action_style: str = _ENV.action_style
    prompt_style: str = _ENV.prompt_style
    temperature: float = _ROLLOUT.eval_temperature
    max_new_tokens: int = _ROLLOUT.max_new_tokens
    reward: str = _ENV.reward  # what an evaluation's pass_at_1 counts (reward above 0); play itself ignores it

    @classmethod
    def from_config(cls, cfg, temperature: float | None = None) -> EpisodeSettings:
        return cls(
            max_turns=cfg.env.max_turns,
            cell_px=cfg.env.cell_px,
            response_format=cfg.env.response_format,
            action_style=cfg.env.action_style,
            prompt_style=cfg.env.prompt_style,
            temperature=cfg.rollout.eval_temperature if temperature is None else temperature,
            max_new_tokens=cfg.rollout.max_new_tokens,
            reward=cfg.env.reward,
        )

    @classmethod
    def for_eval(cls, cfg, samples: int = 1) -> EpisodeSettings:
        """Returns the settings of an evaluation playing each maze `samples` times: one greedy episode at
        rollout.eval_temperature, or several (mean@k, pass@k) at the rollout temperature the policy trains at."""
        return cls.from_config(cfg, temperature=cfg.rollout.temperature if samples > 1 else cfg.rollout.eval_temperature)

    def style(self) -> PromptStyle:
        """Returns the texts this run's conversations use."""
        return PromptStyle(self.prompt_style, self.response_format, self.action_style)

    def session(self, maze: Maze) -> MazeSession:
        """Returns a fresh episode of `maze` under these settings."""
        return MazeSession(maze, self.max_turns, self.cell_px, self.style())


@dataclass(frozen=True)
class Turn:
    """One played turn: the model's text, the action read from it (None: unreadable or refused), the feedback it got
    and where the agent stood after it."""

    text: str
    action: tuple | None
    feedback: str
    position: tuple[int, int]

    def record(self) -> dict:
        """Returns the turn as `episodes.jsonl` holds it (one of an episode's `steps`)."""
        return {"text": self.text, "action": list(self.action) if self.action else None, "feedback": self.feedback,
                "position": list(self.position)}


@dataclass
class Episode:
    """One played maze: the turns as the model saw and wrote them, and how it ended."""

    session: MazeSession
    messages: list[dict]
    turns: list[Turn] = field(default_factory=list)
    samples: list = field(default_factory=list)  # (context messages, Completion) per turn, for training
    error: str | None = None  # set when the engine failed for this maze (scored as failed)

    @property
    def maze(self) -> Maze:
        return self.session.maze

    @property
    def trace(self) -> list[tuple[int, int]]:
        """Where the agent stood: at the start, then after each turn."""
        return self.session.state.trace

    def fail(self, error: str) -> None:
        """Ends the episode unplayed from here: the engine could not answer it (scored failed, the reason kept)."""
        self.error = error
        self.session.state.done = True

    @property
    def solved(self) -> bool:
        return self.session.solved

    @property
    def parse_failures(self) -> int:
        return sum(turn.action is None for turn in self.turns)

    def reward(self, mode: str) -> float:
        return self.session.reward(mode)

    @property
    def format_rate(self) -> float:
        """The share of its replies in the profile's response format (as ScoredEpisode.format_rate holds it)."""
        return self.session.format_rate()

    def take(self, completion, keep_samples: bool = False) -> None:
        """Plays one reply (a Completion: the engine's, or one forced on the episode) and appends the next user turn."""
        if keep_samples:
            self.samples.append((list(self.messages), completion))
        result = self.session.step(completion.text)
        self.turns.append(Turn(result.text, tuple(result.action) if result.action else None, result.feedback,
                               tuple(result.position)))
        self.messages.append(assistant_turn(completion.text))
        if not result.done:
            self.messages.append(user_turn(result.feedback, Image.fromarray(result.picture)))

    def record(self) -> dict:
        """Returns the JSON line `episodes.jsonl` holds for this episode."""
        return {
            "seed": self.maze.seed,
            "env": self.maze.env_id,
            "solved": self.solved,
            "turns": len(self.turns),
            "optimal_actions": optimal_action_count(self.maze),
            "parse_failures": self.parse_failures,
            "error": self.error,
            "first_mistake": first_mistake(self.maze, [turn.action for turn in self.turns]),
            "trace": [list(p) for p in self.trace],
            "steps": [turn.record() for turn in self.turns],
        }


def start_episodes(mazes: list[Maze], settings: EpisodeSettings) -> list[Episode]:
    """Returns a fresh episode per maze: the task prompt and the maze picture, nothing played yet."""
    episodes = []
    for maze in mazes:
        session = settings.session(maze)
        text, picture = session.start()
        episodes.append(Episode(session=session, messages=[user_turn(text, Image.fromarray(picture))]))
    return episodes


def solver_episode(maze: Maze, settings: EpisodeSettings) -> Episode:
    """Returns the episode a perfect agent plays on `maze`: the solver's replies through the same turn protocol
    every rollout goes through (what the solver warm start learns from, and what teacher-forced scores follow)."""
    from shared.maze.core import solve

    return demonstration(maze, settings, solve(maze), "solver")


def explore_episode(maze: Maze, settings: EpisodeSettings, rng) -> Episode:
    """Returns the episode of an explorer on `maze` (`explore_walk`: corridors followed, junctions chosen uniformly,
    no target preference), stopping when it stands on the target: what the interface warm start learns from."""
    from shared.maze.core import explore_walk

    return demonstration(maze, settings, explore_walk(maze, rng, settings.max_turns - 1), "explorer")


def demonstration(maze: Maze, settings: EpisodeSettings, moves: list[int], planner: str) -> Episode:
    """Plays `moves` on `maze`, then `stop` if they end on the target, through the rollouts' turn protocol."""
    from shared.maze.prompt import solver_reply

    episode = start_episodes([maze], settings)[0]
    for action in [("move", d) for d in moves] + [("stop", "stop")]:
        if episode.session.done or (action[0] == "stop" and episode.session.state.position != maze.target):
            break
        reply = solver_reply(episode.session.state.view(), action, settings.response_format, settings.action_style,
                             planner)
        episode.take(Completion(reply, []), keep_samples=True)
        if episode.turns[-1].action != tuple(action):
            raise RuntimeError(f"the {planner}'s reply {reply!r} reads as {episode.turns[-1].action}, not {action}")
    return episode


def run_episodes(engine: Engine, mazes: list[Maze], settings: EpisodeSettings, keep_samples: bool = False,
                 seed: int | None = None, progress=None, batched: bool = True) -> list[Episode]:
    """Plays every maze to the end; returns the episodes in input order.

    `batched=False` sends one conversation per engine call (one episode at a time).
    `seed` makes sampling reproducible: episode i samples turn t with its own seed (`episode_seed`), so what an
    episode plays does not depend on which others share its batch.
    """
    return play_episodes(engine, start_episodes(mazes, settings), settings, keep_samples, seed, progress, batched)


def play_episodes(engine: Engine, episodes: list[Episode], settings: EpisodeSettings, keep_samples: bool = False,
                  seed: int | None = None, progress=None, batched: bool = True) -> list[Episode]:
    """Plays episodes (fresh, or already some turns in) to the end with the engine; returns them, in order."""
    rounds = 0
    while True:
        live = [(i, e) for i, e in enumerate(episodes) if not e.session.done]
        if not live:
            break
        for batch in [live] if batched else [[one] for one in live]:
            group = [e for _, e in batch]
            seeds = None if seed is None else [episode_seed(seed, i, len(e.turns)) for i, e in batch]
            try:
                completions = engine.generate([e.messages for e in group], settings.temperature, settings.max_new_tokens, seeds)
            except Exception as exc:  # an engine failure ends these episodes, scored failed, and the run goes on
                for e in group:
                    e.fail(f"{type(exc).__name__}: {exc}")
                continue
            for e, completion in zip(group, completions):
                if getattr(completion, "error", None):
                    e.fail(completion.error)
                    continue
                e.take(completion, keep_samples)
        rounds += 1
        if progress is not None:
            progress(rounds, sum(e.session.done for e in episodes), len(episodes))
    return episodes


def episode_seed(seed: int, episode: int, turn: int) -> int:
    """Returns the sampling seed of one episode's turn in a seeded call of `run_episodes`."""
    return seed * 1_000_003 + episode * 1009 + turn
