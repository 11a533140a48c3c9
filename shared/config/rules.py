"""Rules across fields: settings each valid on their own that do not go together, or under which nothing trains."""

from __future__ import annotations

from shared.config.schema import ConfigError, RunConfig


def check_consistent(cfg: RunConfig) -> None:
    """Raises ConfigError (one line, with the fix) where settings each valid on their own do not go together."""
    shared = cfg.shared_path()
    if shared.exists() and not shared.is_dir():
        raise ConfigError(f"config error: storage.shared_dir (SHARED_DIR) = {str(shared)!r} is a file, not a folder: "
                          "point it at a folder (it is created when missing)")
    algo, rollout = cfg.algorithm, cfg.rollout
    if algo.mini_batch_size and rollout.train_batch_size % algo.mini_batch_size:
        raise ConfigError(f"config error: algorithm.mini_batch_size = {algo.mini_batch_size} must divide "
                          f"rollout.train_batch_size = {rollout.train_batch_size} (SkyRL requires it too)")
    if cfg.env.prompt_style == "visgym" and cfg.env.action_style != "tuple":
        raise ConfigError(f"config error: env.action_style = {cfg.env.action_style!r} does not go with env.prompt_style = "
                          "'visgym' (VisGym's prompt asks for ('move', d) tuples): set env.action_style=tuple")
    env = cfg.env
    if not env.sft_seed_start + cfg.sft.num_mazes <= env.rl_seed_start:
        raise ConfigError(f"config error: env.rl_seed_start = {env.rl_seed_start} must lie past the SFT mazes' seeds "
                          f"(env.sft_seed_start = {env.sft_seed_start} + sft.num_mazes = {cfg.sft.num_mazes}): "
                          "GRPO trains on fresh mazes, never on the warm start's")
    if cfg.backend == "skyrl" and algo.advantage_estimator != "grpo":
        raise ConfigError(f"config error: algorithm.advantage_estimator = {algo.advantage_estimator!r} runs on the "
                          "local backend only; SkyRL's GRPO has no turn-level advantage: use grpo with backend=skyrl")


def check_trainable(cfg: RunConfig) -> None:
    """Raises ConfigError (one line, with the fix) for settings under which no training step can have a gradient."""
    from shared.maze.core import fewest_actions

    algo, rollout, env = cfg.algorithm, cfg.rollout, cfg.env
    if rollout.n_samples_per_prompt < 2:
        raise ConfigError(f"config error: rollout.n_samples_per_prompt = {rollout.n_samples_per_prompt} gives each maze "
                          f"a group of one, and algorithm.advantage_estimator = {algo.advantage_estimator!r} scores an "
                          "episode against its maze's other episodes: no step would have a gradient; use "
                          "rollout.n_samples_per_prompt >= 2 (the recipe: 8)")
    if rollout.temperature == 0:
        raise ConfigError("config error: rollout.temperature = 0 plays every sample of a maze greedily, so a group's "
                          "episodes are identical and every advantage is 0; use a temperature above 0 (the recipe: 0.7)")
    if env.reward == "task" and env.max_turns < fewest_actions(env.id):
        raise ConfigError(f"config error: env.max_turns = {env.max_turns} is below the {fewest_actions(env.id)} actions "
                          f"every {env.id} maze needs (corner to corner, then stop): under env.reward = 'task' no "
                          "episode can be rewarded; raise env.max_turns (the recipe: 15) or use env.reward=task_progress")
