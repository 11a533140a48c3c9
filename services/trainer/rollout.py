"""Rollout workers: Ray actors that hold the base model plus the live LoRA adapter and play mazes.

A worker loads the adapter the learner last wrote to `runs/<id>/lora_sync/` before each step (the
reference's weight sync through the shared volume), then plays all of its episodes as one batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import ray

from shared.models.training import TrainingSample


def build_policy(base_dir: str | Path, lora_cfg, base_model_id: str, dtype: str = "float32", trainable: bool = False):
    """Returns (peft model, processor): the base checkpoint with a fresh LoRA of the configured shape."""
    from peft import LoraConfig, get_peft_model

    from shared.models.loading import load_model, lora_target_regex

    model, processor = load_model(base_dir, dtype)
    config = LoraConfig(
        r=lora_cfg.rank,
        lora_alpha=lora_cfg.alpha,
        lora_dropout=lora_cfg.dropout,
        target_modules=lora_target_regex(lora_cfg.target_modules, lora_cfg.language_model_only),
        init_lora_weights=True,
    )
    model = get_peft_model(model, config)
    model.peft_config["default"].base_model_name_or_path = base_model_id
    if not trainable:
        model.eval()
    return model, processor


def load_adapter_weights(model, adapter_dir: str | Path) -> None:
    """Loads adapter_model.safetensors from adapter_dir into a peft model in place."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    state = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
    result = set_peft_model_state_dict(model, state)
    missing = [k for k in getattr(result, "unexpected_keys", []) if "lora" in k]
    if missing:
        raise RuntimeError(f"adapter at {adapter_dir} does not fit the policy: unexpected keys {missing[:3]}")


@ray.remote
class RolloutWorker:
    """Plays episodes with the base model + the current adapter; returns scored episodes and samples."""

    def __init__(self, cfg_dict: dict, base_dir: str, threads: int):
        import torch

        from shared.config import RunConfig
        from shared.models.inference import LocalEngine

        torch.set_num_threads(threads)
        self.cfg = RunConfig.model_validate(cfg_dict)
        if self.cfg.rollout.engine == "vllm":
            from shared.models.vllm_engine import VllmEngine

            # The vLLM actor reserves no CPU: it works on this worker's behalf, while this worker waits.
            self.engine = VllmEngine(self.cfg, base_dir, name=self.cfg.model.base_model_id, num_cpus=0)
        else:
            from shared.models.loading import MergedCopy

            model, processor = build_policy(base_dir, self.cfg.lora, self.cfg.model.base_model_id, self.cfg.model.dtype)
            self.policy = MergedCopy(model)  # plays at the base model's speed; refreshed at each sync
            self.engine = LocalEngine.for_model(self.cfg, self.policy.model, processor, name=self.cfg.model.base_model_id)
        self.adapter_step = -1

    def sync(self, adapter_dir: str, step: int) -> int:
        """Loads the adapter written for `step` (no-op if already loaded); returns the loaded step."""
        if step != self.adapter_step:
            if self.cfg.rollout.engine == "vllm":
                self.engine.load_adapter(adapter_dir, step)  # vLLM re-reads lora_sync/ under a new id
            else:
                load_adapter_weights(self.policy.peft_model, adapter_dir)
                self.policy.refresh()
            self.adapter_step = step
        return self.adapter_step

    def rollout(self, seeds_env: list[tuple[str, int]], n_samples: int, seed: int) -> list[MazeGroup]:
        """Plays each maze: n_samples sampled episodes, or (rollout.strategy=greedy_branch) its greedy anchor and the
        branches that change one of its decisions; returns one group per maze, with training samples."""
        if self.cfg.rollout.strategy == "greedy_branch":
            groups = play_greedy_branches(self.engine, self.cfg, seeds_env)
        else:
            groups = play_rollouts(self.engine, self.cfg, seeds_env, n_samples, seed)
        if any(group.errors for group in groups):
            from shared.local_ray import worker_log

            log = getattr(self.engine, "log_path", None) or worker_log()
            for group in groups:
                group.log = log
        return groups


@dataclass
class ScoredEpisode:
    """One played episode as the learner needs it: its reward and how it went, one training sample per turn (a
    greedy-anchored branch: its one changed turn), and where the agent stood before each turn."""

    reward: float
    solved: bool
    turns: int
    parse_failures: int
    format_rate: float
    samples: list[TrainingSample]
    states: list[tuple[int, int]]  # where the agent stood before each turn (what it saw)
    branch_turn: int | None = None  # a greedy-anchored branch: the turn it changed (its one sample); None otherwise
    reply_probs: list[float] | None = None  # greedy_branch: the policy's probability of each sample's reply


@dataclass
class MazeGroup:
    """The episodes one maze got in a step: a GRPO group. Episodes the engine failed to play are never in it: only
    their errors are kept (and the log that says more), so nothing trains on them."""

    env_id: str
    seed: int
    episodes: list[ScoredEpisode]  # greedy_branch: the greedy anchor first, then its branches
    errors: list[str] = field(default_factory=list)
    log: str = ""
    anchored: bool = False

    @property
    def rewards(self) -> list[float]:
        return [e.reward for e in self.episodes]


def play_rollouts(engine, cfg, seeds_env: list[tuple[str, int]], n_samples: int, seed: int) -> list[MazeGroup]:
    """Plays each maze n_samples times at the rollout temperature, all episodes batched; returns one group per
    maze, in order (what a rollout worker sends the learner)."""
    from shared.episodes import EpisodeSettings, run_episodes
    from shared.maze.core import generate
    from shared.models.training import encode_turn

    settings = EpisodeSettings.from_config(cfg, temperature=cfg.rollout.temperature)
    mazes = [generate(env_id, s) for env_id, s in seeds_env for _ in range(n_samples)]
    episodes = run_episodes(engine, mazes, settings, keep_samples=True, seed=seed, batched=cfg.rollout.batched)
    groups = [MazeGroup(env_id, s, []) for env_id, s in seeds_env]
    for index, episode in enumerate(episodes):
        group = groups[index // n_samples]
        if episode.error is not None:
            group.errors.append(episode.error)
            continue
        samples = [encode_turn(engine, messages, completion) for messages, completion in episode.samples]
        group.episodes.append(scored(episode, samples, cfg.env.reward))
    return groups


def scored(episode, samples: list[TrainingSample], reward_mode: str, branch_turn: int | None = None,
           reply_probs: list[float] | None = None) -> ScoredEpisode:
    """Returns what the learner needs of a played episode (shared.episodes.Episode) and its training samples."""
    return ScoredEpisode(reward=episode.reward(reward_mode), solved=episode.solved, turns=len(episode.turns),
                         parse_failures=episode.parse_failures, format_rate=episode.format_rate(), samples=samples,
                         states=[tuple(p) for p in episode.trace[: len(episode.turns)]], branch_turn=branch_turn,
                         reply_probs=reply_probs)


def branch_points(scores: list[list[float]], taken: list, positions: list, maze, rollout) -> list[tuple[int, list[int]]]:
    """Returns where a greedy anchor branches: [(turn, indices into ACTIONS to play there instead)].

    The `branch_turns` turns where the policy's best other action is most likely (at least `branch_min_prob`, over
    the five actions), each with its `branch_actions` most likely other actions; with `branch_step_back`, also the
    turn after each move that left a junction, undoing that move (a step back out of a side branch costs the two
    spare turns of a maze solvable in 13 of 15)."""
    import math

    from shared.branching import ACTIONS, REVERSE, is_junction

    options = []
    for turn, (row, action) in enumerate(zip(scores, taken)):
        top = max(row)
        probs = [math.exp(v - top) for v in row]
        total = sum(probs)
        others = sorted((i for i in range(len(ACTIONS)) if action is None or list(ACTIONS[i]) != list(action)),
                        key=lambda i: -probs[i])
        if probs[others[0]] / total >= rollout.branch_min_prob:
            options.append((probs[others[0]] / total, turn, others[: rollout.branch_actions]))
    chosen = {turn: alternatives for _, turn, alternatives in sorted(options, reverse=True)[: rollout.branch_turns]}
    if rollout.branch_step_back:
        for turn in range(len(taken) - 1):
            action = taken[turn]
            left = positions[turn + 1] != positions[turn]
            if action and action[0] == "move" and left and is_junction(maze, positions[turn],
                                                                       positions[turn - 1] if turn else None):
                back = ACTIONS.index(("move", REVERSE[int(action[1])]))
                chosen.setdefault(turn + 1, [])
                if back not in chosen[turn + 1]:
                    chosen[turn + 1] = chosen[turn + 1] + [back]
    return sorted(chosen.items())


def play_greedy_branches(engine, cfg, seeds_env: list[tuple[str, int]]) -> list[MazeGroup]:
    """Plays each maze's greedy anchor, then branches that change one of its decisions and play on greedily; returns
    one anchored group per maze. Each branch asks "does changing this one decision make greedy play succeed": the
    learner compares the branch's outcome with the anchor's at the turn it changed (`decision_advantages`).
    Greedy play samples nothing, so the rollouts need no seed."""
    from shared.branching import action_replies, action_scores, branch, turn_views
    from shared.episodes import EpisodeSettings, play_episodes, run_episodes
    from shared.maze.core import generate
    from shared.models.training import encode_turn, reply_sample

    settings = EpisodeSettings.from_config(cfg, temperature=0.0)
    mazes = [generate(env_id, s) for env_id, s in seeds_env]
    anchors = run_episodes(engine, mazes, settings, keep_samples=True)
    playable = [a for a in anchors if a.error is None]
    views = {id(a): turn_views(a) for a in playable}
    contexts = [messages for a in playable for messages, _ in a.samples]
    scores = iter(action_scores(engine, contexts, [v for a in playable for v in views[id(a)]], settings))
    plans, rows_of = {}, {}
    for anchor in playable:
        rows_of[id(anchor)] = rows = [next(scores) for _ in anchor.samples]
        plans[id(anchor)] = branch_points(rows, [t["action"] for t in anchor.turns],
                                          [tuple(p) for p in anchor.trace], anchor.maze, cfg.rollout)
    branches = [(anchor, turn, index,
                 branch(anchor, turn, action_replies(views[id(anchor)][turn], settings)[index], settings))
                for anchor in playable for turn, indices in plans[id(anchor)] for index in indices]
    play_episodes(engine, [b for *_, b in branches], settings)
    groups = []
    for env_seed, anchor in zip(seeds_env, anchors):
        group = MazeGroup(*env_seed, [], anchored=True)
        groups.append(group)
        if anchor.error is not None:
            group.errors.append(anchor.error)
            continue
        # The learner recomputes these samples' log-probabilities itself (old_logprobs=None): the forced replies
        # were never sampled, and the anchor's were sampled greedily.
        samples = [encode_turn(engine, messages, completion) for messages, completion in anchor.samples]
        for sample in samples:
            sample.old_logprobs = None
        # The policy's probability of each reply it gave (greedy: temperature 1 log-probabilities) ...
        probs = [math.exp(sum(completion.logprobs)) if completion.logprobs else None for _, completion in anchor.samples]
        group.episodes.append(scored(anchor, samples, cfg.env.reward, reply_probs=probs))
        for owner, turn, index, played in branches:
            if owner is not anchor:
                continue
            if played.error is not None:
                group.errors.append(played.error)
                continue
            messages, completion = played.samples[0]
            sample = reply_sample(engine.processor, messages, completion.text, engine.max_images, engine.context_turns)
            # ... and of each reply forced in its stead (its teacher-forced score)
            group.episodes.append(scored(played, [sample], cfg.env.reward, branch_turn=turn,
                                          reply_probs=[math.exp(rows_of[id(anchor)][turn][index])]))
    return groups
