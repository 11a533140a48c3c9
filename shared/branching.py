"""What a policy would do at each turn, and what changes when one decision is changed.

`action_scores` asks an engine for its teacher-forced log-probability of each of the five maze actions (four
moves and stop, written as the task's replies) at given turns. `branch` replays an episode's first turns and
forces a different reply at the next one; playing the branch on greedily answers "does changing this one decision
make greedy play succeed". The evaluator's `diagnose` measures with these; the trainer's held-out evals take
their junction accuracy from `solver_decisions`.
"""

from __future__ import annotations

from shared.episodes import Episode, EpisodeSettings, start_episodes
from shared.maze.actions import Action
from shared.maze.core import Maze, moves_ahead
from shared.maze.prompt import solver_reply
from shared.models.contract import Completion, ScoringEngine

ACTIONS: list[Action] = [("move", d) for d in range(4)] + [("stop", "stop")]
REVERSE = {0: 2, 1: 3, 2: 0, 3: 1}  # the move that undoes each move


def action_replies(view: Maze, settings: EpisodeSettings) -> list[str]:
    """Returns the reply that plays each of ACTIONS at `view`, in the episode's reply format."""
    return [solver_reply(view, action, settings.response_format, settings.action_style) for action in ACTIONS]


def turn_views(episode: Episode) -> list[Maze]:
    """Returns the maze as seen before each turn the episode played (the agent where it stood then)."""
    maze = episode.maze
    return [Maze(maze.maze_map, tuple(p), maze.target, maze.env_id, maze.seed) for p in episode.trace[:len(episode.turns)]]


def action_scores(engine: ScoringEngine, contexts: list[list[dict]], views: list[Maze],
                  settings: EpisodeSettings) -> list[list[float]]:
    """Returns, per context (the messages before a turn), the engine's log-probability of each of ACTIONS."""
    if not isinstance(engine, ScoringEngine):
        raise TypeError(f"{type(engine).__name__} cannot score given replies (no score_replies): the decision probes "
                        "need an in-process engine (shared.models.inference.LocalEngine)")
    return engine.score_replies(contexts, [action_replies(view, settings) for view in views])


def branch(episode: Episode, turn: int, reply: str, settings: EpisodeSettings) -> Episode:
    """Returns a fresh episode of the same maze that replays `episode`'s replies before `turn`, then plays `reply`
    at `turn` (and is live after it unless that ended it)."""
    fresh = start_episodes([episode.maze], settings)[0]
    for played in episode.turns[:turn]:
        fresh.take(Completion(played.text, []))
    fresh.take(Completion(reply, []), keep_samples=True)
    return fresh


def is_junction(maze: Maze, position: tuple[int, int], previous: tuple[int, int] | None) -> bool:
    """Returns True where the agent has a real choice: two or more open moves besides going back to `previous`."""
    return len(moves_ahead(maze, position, previous)) >= 2


def solver_decisions(engine: ScoringEngine, mazes: list[Maze], settings: EpisodeSettings) -> list[dict]:
    """Returns the policy's teacher-forced view of every decision on the solver's path of each maze, in the context
    a rollout builds: {"maze", "turn", "junction" (a real choice there), "truth" (the solver's action, an index
    into ACTIONS), "scores" (the policy's log-probability of each action)}."""
    from shared.episodes import solver_episode

    rows, contexts, views = [], [], []
    for index, maze in enumerate(mazes):
        solver = solver_episode(maze, settings)
        trace = solver.trace
        for turn, (messages, _) in enumerate(solver.samples):
            contexts.append(messages)
            views.append(turn_views(solver)[turn])
            rows.append({"maze": index, "turn": turn, "truth": ACTIONS.index(solver.turns[turn].action),
                         "junction": is_junction(maze, tuple(trace[turn]), tuple(trace[turn - 1]) if turn else None)})
    for row, scores in zip(rows, action_scores(engine, contexts, views, settings)):
        row["scores"] = scores
    return rows


def junction_accuracy(decisions: list[dict]) -> dict:
    """Returns how often the policy's most likely action is the solver's at junctions (and at every turn), and the
    mean log-probability it gives the solver's action at junctions (normalised over the five actions)."""
    import math

    def best(row):
        return max(range(len(ACTIONS)), key=lambda i: row["scores"][i])

    def logp(row):
        top = max(row["scores"])
        return row["scores"][row["truth"]] - top - math.log(sum(math.exp(v - top) for v in row["scores"]))

    at = [row for row in decisions if row["junction"]]
    if not at:  # no real choice on these paths (a turn budget shorter than the first junction)
        return {"decisions": 0, "all_turns": len(decisions)}
    return {"decisions": len(at), "accuracy": sum(best(r) == r["truth"] for r in at) / len(at),
            "mean_logprob": sum(logp(r) for r in at) / len(at), "all_turns": len(decisions),
            "all_turns_accuracy": sum(best(r) == r["truth"] for r in decisions) / max(len(decisions), 1)}
