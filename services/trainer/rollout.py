"""Rollout workers: Ray actors that hold the base model plus the live LoRA adapter and play mazes.

A worker loads the adapter the learner last wrote to `runs/<id>/lora_sync/` before each step (the
reference's weight sync through the shared volume), then plays all of its episodes as one batch.
"""

from __future__ import annotations

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
        """Plays each maze n_samples times; returns one group per maze, with training samples."""
        groups = play_rollouts(self.engine, self.cfg, seeds_env, n_samples, seed)
        if any(group.errors for group in groups):
            from shared.local_ray import worker_log

            log = getattr(self.engine, "log_path", None) or worker_log()
            for group in groups:
                group.log = log
        return groups


@dataclass
class ScoredEpisode:
    """One played episode as the learner needs it: its reward and how it went, one training sample per turn, and
    where the agent stood before each turn. (shared.episodes.Episode is the episode as played: its `turns` are the
    turns themselves and its `samples` the (messages, completion) pairs these samples are encoded from.)"""

    reward: float
    solved: bool
    num_turns: int
    parse_failures: int
    format_rate: float
    training_samples: list[TrainingSample]
    states: list[tuple[int, int]]  # where the agent stood before each turn (what it saw)


@dataclass
class MazeGroup:
    """The episodes one maze got in a step: a GRPO group. Episodes the engine failed to play are never in it: only
    their errors are kept (and the log that says more), so nothing trains on them."""

    env_id: str
    seed: int
    episodes: list[ScoredEpisode]
    errors: list[str] = field(default_factory=list)
    log: str = ""

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


def scored(episode, samples: list[TrainingSample], reward_mode: str) -> ScoredEpisode:
    """Returns what the learner needs of a played episode (shared.episodes.Episode) and its training samples."""
    return ScoredEpisode(reward=episode.reward(reward_mode), solved=episode.solved, num_turns=len(episode.turns),
                         parse_failures=episode.parse_failures, format_rate=episode.format_rate, training_samples=samples,
                         states=[tuple(p) for p in episode.trace[: len(episode.turns)]])
