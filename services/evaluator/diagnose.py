"""Where a policy's greedy play has headroom, measured before any training (`python -m services.evaluator diagnose`).

- **one flip**: for every greedy failure on a solvable maze, change one decision (at each turn up to and including
  its first mistake, in turn, to the policy's own best other action) and play on greedily: the share of failures
  some single flip rescues bounds what greedy-anchored branching can teach. Later turns are left out: past the first
  mistake the agent is off the solver's path, which the step-back measure covers.
- **step back**: for every failure that starts by stepping into a side branch, undo that move on the next turn and
  play on greedily: the share rescued by one step back.
- **junction accuracy**: along the solver's path of every maze, in the context a rollout builds, how often the
  policy's most likely action is the solver's where there is a real choice (two or more ways on), and the mean
  log-probability it gives the solver's action there: a continuous, low-noise score of what RL transfers.
"""

from __future__ import annotations

import logging
from collections import Counter

from shared.branching import (
    ACTIONS,
    REVERSE,
    action_replies,
    action_scores,
    branch,
    junction_accuracy,
    solver_decisions,
    turn_views,
)
from shared.episodes import EpisodeSettings, play_episodes, run_episodes
from shared.maze.core import first_mistake, optimal_action_count
from shared.maze.dataset import EvalSet

logger = logging.getLogger(__name__)


def _best_other(scores: list[float], taken) -> int:
    """Returns the index in ACTIONS of the highest-scored action other than `taken` (a parsed action or None)."""
    order = sorted(range(len(ACTIONS)), key=lambda i: -scores[i])
    return next(i for i in order if taken is None or list(ACTIONS[i]) != list(taken))


def diagnose(engine, eval_set: EvalSet, settings: EpisodeSettings, log=logger.info) -> dict:
    """Returns the one-flip, step-back and junction-accuracy measurements of the engine's policy on eval_set."""
    greedy_settings = EpisodeSettings(**{**settings.__dict__, "temperature": 0.0, "max_turns": eval_set.max_turns})
    mazes = eval_set.mazes()
    greedy = run_episodes(engine, mazes, greedy_settings, keep_samples=True)
    solvable = [optimal_action_count(m) <= eval_set.max_turns for m in mazes]
    failures = [e for e, ok in zip(greedy, solvable) if ok and not e.solved and e.error is None]
    log(f"greedy: {sum(e.solved for e in greedy)}/{len(mazes)} solved, {len(failures)} failures on solvable mazes")

    # one flip: every turn up to the first mistake of every failure, to the policy's best other action
    mistakes = [first_mistake(e.maze, [t.action for t in e.turns]) for e in failures]
    turns = [[(index, turn) for turn in range((m["turn"] if m else len(e.turns) - 1) + 1)]
             for index, (e, m) in enumerate(zip(failures, mistakes))]
    turns = [pair for pairs in turns for pair in pairs]
    views = [turn_views(failures[i])[t] for i, t in turns]
    scores = action_scores(engine, [failures[i].samples[t][0] for i, t in turns], views, greedy_settings)
    flips, owners = [], []
    for (index, turn), view, score in zip(turns, views, scores):
        e, mistake = failures[index], mistakes[index]
        other = _best_other(score, e.turns[turn].action)
        flips.append(branch(e, turn, action_replies(view, greedy_settings)[other], greedy_settings))
        owners.append((index, turn - (mistake["turn"] if mistake else turn)))
    play_episodes(engine, flips, greedy_settings)
    rescued, where = set(), Counter()
    for (index, offset), flipped in zip(owners, flips):
        if flipped.solved:
            if index not in rescued:
                where["at the first mistake" if offset == 0 else "before it" if offset < 0 else "after it"] += 1
            rescued.add(index)

    # step back: undo a first step into a side branch
    backs, back_cells = [], []
    for e in failures:
        mistake = first_mistake(e.maze, [t.action for t in e.turns])
        if mistake and mistake["kind"] == "wrong_branch" and mistake["turn"] + 1 < len(e.turns):
            into = int(e.turns[mistake["turn"]].action[1])
            view = turn_views(e)[mistake["turn"] + 1]
            reply = action_replies(view, greedy_settings)[ACTIONS.index(("move", REVERSE[into]))]
            backs.append(branch(e, mistake["turn"] + 1, reply, greedy_settings))
            back_cells.append(mistake["branch_cells"])
    play_episodes(engine, backs, greedy_settings)
    back_rescued = Counter(cells for cells, b in zip(back_cells, backs) if b.solved)

    # junction accuracy along the solver's path, in the rollout's context
    junctions = junction_accuracy(solver_decisions(engine, mazes, greedy_settings))
    return {
        "env": eval_set.env_id, "seeds": eval_set.seeds_spec, "max_turns": eval_set.max_turns, "mazes": len(mazes),
        "greedy_solved": sum(e.solved for e in greedy), "oracle_solved": sum(solvable),
        "solvable_failures": len(failures),
        "one_flip": {"rescued": len(rescued), "share": len(rescued) / max(len(failures), 1),
                     "rescued_by_a_flip": dict(where), "branches_played": len(flips)},
        "step_back": {"first_step_into_a_side_branch": len(backs), "rescued": sum(back_rescued.values()),
                      "share_of_failures": sum(back_rescued.values()) / max(len(failures), 1),
                      "rescued_by_branch_cells": {str(k): v for k, v in sorted(back_rescued.items())},
                      "tried_by_branch_cells": {str(k): v for k, v in sorted(Counter(back_cells).items())}},
        "junctions": junctions,
    }


def describe_diagnosis(d: dict) -> str:
    """Returns the diagnosis as a few lines a person reads."""
    flip, back, junctions = d["one_flip"], d["step_back"], d["junctions"]
    return "\n".join([
        f"{d['env']} seeds {d['seeds']} @ {d['max_turns']} turns: greedy solved {d['greedy_solved']}/{d['mazes']} "
        f"(ceiling {d['oracle_solved']}), {d['solvable_failures']} failures on solvable mazes",
        f"one flip then greedy rescues {flip['rescued']}/{d['solvable_failures']} ({100 * flip['share']:.1f}%) "
        f"of them: {flip['rescued_by_a_flip']}",
        f"one step back out of a side branch rescues {back['rescued']} of the {back['first_step_into_a_side_branch']} "
        f"that start by entering one ({100 * back['share_of_failures']:.1f}% of failures); by branch size "
        f"{back['rescued_by_branch_cells']} of {back['tried_by_branch_cells']}",
        (f"teacher-forced on the solver's path: junction accuracy {100 * junctions['accuracy']:.1f}% over "
         f"{junctions['decisions']} decisions (mean log-prob of the right action {junctions['mean_logprob']:.3f}); "
         f"all turns {100 * junctions['all_turns_accuracy']:.1f}%") if junctions["decisions"] else
        "teacher-forced on the solver's path: no junction within the turn budget",
    ])
