"""One run config for every service and both scales: a pydantic schema, YAML profiles, env and CLI overrides.

    cfg = load_config("configs/tiny-cpu.yaml", ["rollout.temperature=0.5"])

A bad key or value raises `ConfigError` whose message is one line naming the key, the value and the fix. By concern:
`schema` (the sections and their bounds), `loading` (profile, environment, overrides), `rules` (settings that do
not go together, or cannot train), `identity` (which settings decide a training step, an evaluation, a warm start),
`cli` (the command line every service shares). Everything is importable from `shared.config`.
"""

from shared.config.cli import (
    CommandLineParser,
    add_config_arguments,
    command_line,
    config_from_args,
    reveal,
    subcommand,
)
from shared.config.identity import (
    changed_settings,
    deciding_keys,
    eval_settings,
    flat_settings,
    settings_hash,
    sft_settings,
    training_settings,
)
from shared.config.loading import (
    ENV_FALLBACKS,
    ENV_OVERRIDES,
    SECRET_KEYS,
    dump_config,
    from_environment,
    load_config,
    parse_config,
)
from shared.config.rules import check_consistent, check_trainable
from shared.config.schema import (
    DEFAULT_CONFIG,
    REPO_ROOT,
    AlgorithmConfig,
    ClusterConfig,
    ConfigError,
    DashboardsConfig,
    EnvConfig,
    LoraConfig,
    ModelConfig,
    RolloutConfig,
    RunConfig,
    ScheduleConfig,
    Section,
    ServerConfig,
    SftConfig,
    StorageConfig,
    TrainerConfig,
)

__all__ = [
    "CommandLineParser", "add_config_arguments", "command_line", "config_from_args", "reveal", "subcommand",
    "changed_settings", "deciding_keys", "eval_settings", "flat_settings", "settings_hash",
    "sft_settings", "training_settings",
    "ENV_FALLBACKS", "ENV_OVERRIDES", "SECRET_KEYS", "dump_config", "from_environment", "load_config", "parse_config",
    "check_consistent", "check_trainable",
    "DEFAULT_CONFIG", "REPO_ROOT", "AlgorithmConfig", "ClusterConfig", "ConfigError", "DashboardsConfig", "EnvConfig",
    "LoraConfig", "ModelConfig", "RolloutConfig", "RunConfig", "ScheduleConfig", "Section", "ServerConfig",
    "SftConfig", "StorageConfig", "TrainerConfig",
]
