"""The `skyrl` backend: the same run config driving SkyRL's GRPO (vLLM rollout engines + FSDP) on GPUs.

`skyrl_overrides` maps our config onto SkyRL's; `run` writes the data files, registers our skyrl-gym env and runs
SkyRL's `BasePPOExp` (with exports sealed as SkyRL writes them: `sealing_experiment`); `dry_run` and `preflight`
check it all before GPU hours. `skyrl` is imported only inside functions. See docs/hyperpod.md.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shlex
import sys
import tempfile
from pathlib import Path

from shared.config import REPO_ROOT, RunConfig
from shared.evaluation.skyrl import SKYRL_SOLVE_RATE_METRIC
from shared.maze.dataset import EvalSet, MazeStream, excluded_from_training, parse_seeds
from shared.maze.skyrl_env import ENV_CLASS, register_env
from shared.storage.files import atomic_write_text
from shared.storage.skyrl_exports import seal_export
from shared.storage.volume import SharedVolume

log = logging.getLogger(__name__)


def _skyrl_pin() -> str:
    """Returns the SkyRL requirement from pyproject's `gpu` extra, the one place the pin lives."""
    import re
    import tomllib

    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return next(r for r in extras["gpu"] if re.match(r"skyrl\b", r))


SKYRL_PIN = _skyrl_pin()
SKYRL_VERSION = SKYRL_PIN.split("==")[1]
TRAIN_TICKETS_PER_STEP_MARGIN = 2


class SkyRLRejected(ValueError):
    """SkyRL's own config code refused the overrides made from a profile."""


def training_gpus(cfg: RunConfig) -> int:
    """Returns the data-parallel size of the FSDP policy: every GPU of every worker."""
    return max(cfg.cluster.num_workers, 1) * max(cfg.cluster.gpus_per_worker, 1)


def skyrl_problems(cfg: RunConfig) -> list[str]:
    """Returns why SkyRL would trim the profile's batches or cannot take its settings (empty when all is well).

    SkyRL drops trailing mazes until `mazes x n_samples_per_prompt` divides over the training GPUs
    (`RayPPOTrainer._remove_tail_data`), silently; a profile must not rely on that. SkyRL logs to one tracker.
    """
    gpus, n = training_gpus(cfg), cfg.rollout.n_samples_per_prompt
    stride = gpus // math.gcd(gpus, n)  # maze counts that split evenly are the multiples of this
    problems = []
    for key, mazes in (("rollout.train_batch_size", cfg.rollout.train_batch_size),
                       ("algorithm.mini_batch_size", cfg.algorithm.mini_batch_size)):
        if mazes and mazes % stride:
            fits = ", ".join(str(stride * k) for k in range(1, 5))
            problems.append(f"{key}={mazes}: {mazes} mazes x {n} samples do not split over {gpus} GPUs, so SkyRL "
                            f"would drop mazes every step; use a multiple of {stride} (e.g. {fits})")
    trackers = [name for name in cfg.trainer.logger if name != "console"]
    if len(trackers) > 1:
        problems.append(f"trainer.logger={cfg.trainer.logger}: SkyRL {SKYRL_VERSION} logs to one backend (its "
                        f"trainer.logger is one name); keep one of {', '.join(trackers)}")
    return problems


def skyrl_logger(cfg: RunConfig) -> str:
    """Returns SkyRL's trainer.logger for the profile's: its one tracker (tensorboard, wandb), else console."""
    trackers = [name for name in cfg.trainer.logger if name != "console"]
    return trackers[0] if trackers else "console"


def data_paths(cfg: RunConfig) -> tuple[Path, Path]:
    """Returns where a run's SkyRL train and val data live (runs/<run>/data/), without writing anything."""
    folder = SharedVolume(cfg.shared_path()).run(cfg.run_id) / "data"
    return folder / "train.jsonl", folder / "val.jsonl"


def data_files(cfg: RunConfig, folder: Path | None = None) -> tuple[Path, Path]:
    """Writes SkyRL's train and val data (JSON lines: prompt, env_class, extras) under the run, or into `folder`;
    returns both."""
    train, val = data_paths(cfg) if folder is None else (folder / "train.jsonl", folder / "val.jsonl")
    env = cfg.env
    extras = {"max_turns": env.max_turns, "reward": env.reward, "cell_px": env.cell_px,
              "response_format": env.response_format, "action_style": env.action_style, "prompt_style": env.prompt_style}
    placeholder = [{"role": "user", "content": "maze"}]  # the env's init() replaces it with the picture prompt

    def rows(env_id: str, seeds: list[int]) -> str:
        return "".join(json.dumps({"prompt": placeholder, "env_class": ENV_CLASS, "env_id": env_id, "seed": s, **extras}) + "\n"
                       for s in seeds)

    eval_set = EvalSet.held_out(env)
    stream = MazeStream.for_rl(env, excluded_from_training(env))
    count = cfg.rollout.train_batch_size * max(cfg.schedule.total_steps, 1) * TRAIN_TICKETS_PER_STEP_MARGIN
    atomic_write_text(train, rows(env.id, [m.seed for m in stream.take(count)]))
    atomic_write_text(val, rows(env.eval_env, eval_set.seeds))
    return train, val


def skyrl_overrides(cfg: RunConfig, train: Path, val: Path) -> dict:
    """Returns SkyRL config overrides (dot keys) for a run config: the data, then the algorithm and policy, the
    trainer's placement and schedule, and the generator."""
    return {"data.train_data": [str(train)], "data.val_data": [str(val)], **policy_overrides(cfg),
            **trainer_overrides(cfg), **generator_overrides(cfg), "environment.env_class": ENV_CLASS}


def policy_overrides(cfg: RunConfig) -> dict:
    """SkyRL's algorithm, model, LoRA and optimizer keys."""
    volume = SharedVolume(cfg.shared_path())
    a, lo = cfg.algorithm, cfg.lora
    return {
        "trainer.algorithm.advantage_estimator": "grpo",
        "trainer.algorithm.grpo_norm_by_std": a.std_normalize,
        "trainer.algorithm.use_kl_loss": a.use_kl_loss,
        "trainer.algorithm.kl_loss_coef": a.kl_loss_coef,
        "trainer.algorithm.loss_reduction": a.loss_reduction,
        "trainer.algorithm.eps_clip_low": a.eps_clip_low,
        "trainer.algorithm.eps_clip_high": a.eps_clip_high,
        "trainer.policy.model.path": str(volume.model(cfg.model.path)),
        "trainer.policy.model.lora.rank": lo.rank,
        "trainer.policy.model.lora.alpha": lo.alpha,
        "trainer.policy.model.lora.dropout": lo.dropout,
        # Module names, not a regex: SkyRL writes `list(target_modules)` into every adapter_config.json it saves,
        # which turns a regex string into single characters. Qwen3-VL's vision tower has none of these names
        # (its layers are qkv/proj/linear_fc1/linear_fc2), so the adapter stays on the language model.
        "trainer.policy.model.lora.target_modules": list(lo.target_modules),
        "trainer.policy.model.lora.lora_sync_path": str(volume.lora_sync(cfg.run_id)),
        "trainer.policy.optimizer_config.lr": a.lr,
        "trainer.policy.optimizer_config.weight_decay": a.weight_decay,
        "trainer.policy.optimizer_config.max_grad_norm": a.max_grad_norm,
    }


def trainer_overrides(cfg: RunConfig) -> dict:
    """SkyRL's placement, batch sizes, schedule, checkpoint and logging keys."""
    run = SharedVolume(cfg.shared_path()).run(cfg.run_id)
    c, a, r, s, env = cfg.cluster, cfg.algorithm, cfg.rollout, cfg.schedule, cfg.env
    return {
        "trainer.strategy": c.strategy,
        "trainer.placement.colocate_all": c.colocate_all,
        "trainer.placement.policy_num_nodes": max(c.num_workers, 1),
        "trainer.placement.policy_num_gpus_per_node": max(c.gpus_per_worker, 1),
        "trainer.seed": cfg.seed,
        "trainer.epochs": 1,
        "trainer.max_training_steps": s.total_steps,
        "trainer.train_batch_size": r.train_batch_size,
        "trainer.policy_mini_batch_size": a.mini_batch_size or r.train_batch_size,
        "trainer.micro_train_batch_size_per_gpu": a.micro_batch_size,
        "trainer.micro_forward_batch_size_per_gpu": a.micro_batch_size,
        "trainer.update_epochs_per_batch": a.update_epochs,
        "trainer.eval_batch_size": len(parse_seeds(env.eval_seeds)),
        "trainer.eval_before_train": s.eval_before_train,
        "trainer.eval_interval": s.eval_interval,
        "trainer.ckpt_interval": s.ckpt_interval,
        "trainer.max_ckpts_to_keep": s.max_ckpts_to_keep or -1,
        "trainer.hf_save_interval": s.hf_save_interval,
        "trainer.resume_mode": s.resume_mode if s.resume_mode == "latest" else "none",
        "trainer.ckpt_path": str(run / "ckpts"),
        "trainer.export_path": str(run / "exports"),
        # exports/dumped_evals/global_step_N_evals/aggregated_results.jsonl: where the solve rate is read (shared.evaluation.skyrl.skyrl_solve_rates).
        "trainer.dump_eval_results": True,
        "trainer.log_path": str(run / "logs"),
        "trainer.run_name": cfg.run_id,
        "trainer.project_name": cfg.trainer.project_name,
        # SkyRL logs to one backend; its TensorBoard files go to runs/<id>/tensorboard (SealingPPOExp.get_tracker).
        "trainer.logger": skyrl_logger(cfg),
    }


def generator_overrides(cfg: RunConfig) -> dict:
    """SkyRL's generator and inference-engine keys (multi-turn, one picture per turn)."""
    c, r, env = cfg.cluster, cfg.rollout, cfg.env
    sampling = {"temperature": r.temperature, "max_generate_length": r.max_new_tokens, "top_p": 1.0, "logprobs": 1}
    eval_sampling = {"temperature": r.eval_temperature, "max_generate_length": r.max_new_tokens, "top_p": 1.0}
    engine_kwargs = {"limit_mm_per_prompt": {"image": cfg.model.max_images_in_context}}
    if c.max_model_len:
        engine_kwargs["max_model_len"] = c.max_model_len
    return {
        # SkyRL's VisGym example: the first prompt (text + one picture) within 2048 tokens, the whole
        # multi-turn conversation within 8192.
        "trainer.max_prompt_length": 2048,
        "generator.max_input_length": 8192,
        # SkyRL's VLM path: multi-turn conversations re-rendered per turn, no sample packing.
        "trainer.remove_microbatch_padding": False,
        "generator.vision_language_generator": True,
        "generator.batched": False,
        "generator.n_samples_per_prompt": r.n_samples_per_prompt,
        "generator.eval_n_samples_per_prompt": 1,
        "generator.max_turns": env.max_turns,
        "generator.sampling_params": sampling,
        "generator.eval_sampling_params": eval_sampling,
        "generator.inference_engine.num_engines": c.num_engines,
        "generator.inference_engine.gpu_memory_utilization": c.gpu_memory_utilization,
        "generator.inference_engine.model_dtype": cfg.model.dtype,
        "generator.inference_engine.tensor_parallel_size": max(1, training_gpus(cfg) // c.num_engines),
        "generator.inference_engine.engine_init_kwargs": engine_kwargs,
    }


def to_cli(overrides: dict) -> list[str]:
    """Returns `key=value` strings as SkyRL's CLI parses them (JSON for lists, dicts, bools and None)."""
    out = []
    for key, value in overrides.items():
        if isinstance(value, (list, dict, bool)) or value is None:
            text = json.dumps(value)
        else:
            text = str(value)
        out.append(f"{key}={text}")
    return out


def command(cfg: RunConfig, config_path: str | None) -> str:
    args = ["python", "-m", "services.trainer", "--backend", "skyrl", "--config", config_path or "configs/tiny-cpu.yaml"]
    return shlex.join(args)


def skyrl_config(cfg: RunConfig, write_data: bool = True):
    """Returns SkyRL's own config for a run, built and validated by SkyRL's code; raises SkyRLRejected. With
    `write_data` false the run's data files are named, not written (SkyRL's checks do not read them)."""
    from skyrl.train.config import SkyRLTrainConfig
    from skyrl.train.utils import validate_cfg

    problems = skyrl_problems(cfg)
    if problems:
        raise SkyRLRejected("; ".join(problems))
    train, val = data_files(cfg) if write_data else data_paths(cfg)
    try:
        skyrl_cfg = SkyRLTrainConfig.from_cli_overrides(to_cli(skyrl_overrides(cfg, train, val)))
        validate_cfg(skyrl_cfg)
    except (ValueError, AssertionError, TypeError, KeyError) as exc:
        raise SkyRLRejected(f"SkyRL {SKYRL_VERSION} rejects the overrides made from this profile: {exc}") from None
    return skyrl_cfg


def skyrl_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("skyrl") is not None


def dry_run(cfg: RunConfig, config_path: str | None = None) -> tuple[list[str], Path]:
    """Prints one override per line and the command; returns the lines and the temp folder that holds them.

    Where SkyRL is installed (the GPU image, `.venv-skyrl`), SkyRL's own config code validates them first. The
    overrides name the run's own data files (runs/<run>/data/, written when the run starts); the dry run writes
    nothing there: that data, the overrides and the command go to a new temp folder, named on the last line.
    """
    if skyrl_installed():
        skyrl_config(cfg, write_data=False)
        verdict = f"# validated by SkyRL {SKYRL_VERSION} (SkyRLTrainConfig.from_cli_overrides + validate_cfg)"
    elif problems := skyrl_problems(cfg):
        raise SkyRLRejected("; ".join(problems))
    else:
        verdict = f"# not validated: SkyRL is not installed here ({SKYRL_PIN} needs Python >= 3.12; use .venv-skyrl)"
    lines = to_cli(skyrl_overrides(cfg, *data_paths(cfg)))
    folder = Path(tempfile.mkdtemp(prefix=f"maze-grpo-dry-run-{cfg.run_id}-"))
    data_files(cfg, folder)
    atomic_write_text(folder / "skyrl_overrides.txt", "\n".join(lines) + "\n")
    atomic_write_text(folder / "skyrl_command.txt", command(cfg, config_path) + "\n")
    for line in lines:
        print(line)
    print(verdict)
    print(f"# command: {command(cfg, config_path)}")
    print(f"# wrote the data, overrides and command to {folder} (the run's folder is left as it is)")
    return lines, folder


def _set_up(cfg: RunConfig):
    """Does what a skyrl run does before its GPU work: SkyRL's config, our env registered, SkyRL's Ray set-up.

    Returns (ray, SkyRL's config). SkyRL's `initialize_ray` builds the runtime env its workers get and joins the
    cluster (RAY_ADDRESS) with it.
    """
    try:
        import ray
        from skyrl.train.utils.utils import initialize_ray
    except ImportError as exc:
        sys.exit(f"the skyrl backend needs {SKYRL_PIN} on Python >= 3.12 with GPUs ({exc}); use the trainer GPU image "
                 "(docker/Dockerfile.gpu) or backend=local")
    skyrl_cfg = skyrl_config(cfg)
    register_env()
    initialize_ray(skyrl_cfg)
    return ray, skyrl_cfg


def preflight(cfg: RunConfig) -> dict:
    """Runs a skyrl run's set-up up to the GPU work (SkyRL config, Ray runtime env, env in a worker); returns what it saw."""
    ray, skyrl_cfg = _set_up(cfg)

    @ray.remote(num_cpus=1)
    def make_env_in_worker(row: dict) -> dict:
        """What a rollout worker sees: our env made by skyrl_gym, and the runtime env SkyRL set up."""
        import skyrl_gym

        register_env()
        _, meta = skyrl_gym.make(ENV_CLASS, env_config={}, extras=row).init([])
        return {"content_hash": meta["content_hash"], "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE"),
                "node_id": ray.get_runtime_context().get_node_id()}

    first_val = json.loads(Path(skyrl_cfg.data.val_data[0]).read_text().splitlines()[0])
    seen = ray.get(make_env_in_worker.remote(first_val))
    node_id = seen.pop("node_id")
    node = next(n for n in ray.nodes() if n["NodeID"] == node_id)
    # SkyRL's trainer loop is a 1-CPU task like this one: it runs where the CPUs are (the GPU workers on HyperPod).
    report = {"skyrl": SKYRL_VERSION, "ray_address": ray.get_runtime_context().gcs_address, **seen,
              "task_node_gpus": node["Resources"].get("GPU", 0), "solve_rate_metric": SKYRL_SOLVE_RATE_METRIC}
    log.info(f"preflight ok: {json.dumps(report)}")
    return report


def sealing_experiment():
    """Returns SkyRL's `BasePPOExp` with one change: its trainer seals each LoRA export once written.

    SkyRL's `save_models` returns after its rank 0 has written `exports/global_step_N/policy/` whole (under a
    temporary name, then renamed); the manifest written then is what every reader of the volume waits for.
    """
    from skyrl.train.entrypoints.main_base import BasePPOExp
    from skyrl.train.trainer import RayPPOTrainer

    class SealingTrainer(RayPPOTrainer):
        def save_models(self):
            super().save_models()
            policy = Path(self.cfg.trainer.export_path) / f"global_step_{self.global_step}" / "policy"
            try:
                seal_export(policy, "by the skyrl backend, after SkyRL's save_models")
            except (OSError, ValueError) as exc:  # a long run goes on; the export waits for `exporter adopt`
                log.warning(f"export not sealed, readers skip it until `python -m services.exporter adopt "
                      f"--run {policy.parents[2].name}`: {exc}", file=sys.stderr, flush=True)

    class SealingPPOExp(BasePPOExp):
        trainer_class = SealingTrainer

        def get_tracker(self):
            # SkyRL's TensorBoard tracker writes to $TENSORBOARD_DIR (default: ./tensorboard_log, wherever the task
            # runs): the run's own folder on the volume instead, beside its exports.
            os.environ.setdefault("TENSORBOARD_DIR", str(Path(self.cfg.trainer.export_path).parent / "tensorboard"))
            return super().get_tracker()

        def get_trainer(self, cfg, tracker, tokenizer, train_dataset, eval_dataset, inference_engine_client,
                        generator, colocate_pg):
            return self.trainer_class(cfg=cfg, tracker=tracker, tokenizer=tokenizer, train_dataset=train_dataset,
                                  eval_dataset=eval_dataset, inference_engine_client=inference_engine_client,
                                  generator=generator, colocate_pg=colocate_pg)

    return SealingPPOExp


def run(cfg: RunConfig) -> None:
    """Runs SkyRL's BasePPOExp inside a Ray task (needs GPUs, Python >= 3.12 and `skyrl[fsdp]`)."""
    ray, skyrl_cfg = _set_up(cfg)

    # SkyRL's trainer loop is a 1-CPU task: on HyperPod it lands on a GPU worker (the head advertises no CPUs).
    @ray.remote(num_cpus=1)
    def entrypoint(config):
        register_env()  # the task's process needs the env registered too
        sealing_experiment()(config).run()

    ray.get(entrypoint.remote(skyrl_cfg))
