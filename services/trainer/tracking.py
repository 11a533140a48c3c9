"""Where a local run's step metrics go beside metrics.jsonl (`trainer.logger`): TensorBoard event files under the
run (`tensorboard --logdir runs/<id>/tensorboard`), and W&B when asked for. Always, as Ray metrics: the gauge
`ray_maze_grpo_metric{run_id, metric}` and `ray_maze_grpo_step{run_id}`, exported by Ray's metrics agent beside
Ray's own, so the Prometheus that scrapes Ray holds the training curve ("maze-grpo training" in Grafana).

Every number of a step's metrics line is logged at that step (reward, sampled and held-out solve rates, KL, step
times, tokens/s); the held-out eval of the warm start at step 0. A resumed run replays the steps after its
checkpoint: TensorBoard drops the events it had written for them (`purge_step`), W&B resumes the same run id.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from shared.config import ConfigError, RunConfig, training_settings


def scalars(metrics: dict) -> dict[str, float]:
    """Returns the finite numbers of a metrics line, the step itself left out."""
    return {key: float(value) for key, value in metrics.items()
            if key != "step" and isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)}


class RayMetrics:
    """The step's numbers as Ray gauges (made on first use, once Ray is up; nothing without Ray)."""

    def __init__(self, run_id: str):
        self.run_id = run_id
        self.metric = self.step = None

    def log(self, numbers: dict[str, float], step: int) -> None:
        import ray

        if not ray.is_initialized():
            return
        if self.metric is None:
            from ray.util.metrics import Gauge

            self.metric = Gauge("maze_grpo_metric", description="a GRPO run's step metric (its metrics.jsonl key)",
                                tag_keys=("run_id", "metric"))
            self.step = Gauge("maze_grpo_step", description="the last GRPO step a run finished", tag_keys=("run_id",))
        for key, value in numbers.items():
            self.metric.set(value, tags={"run_id": self.run_id, "metric": key})
        self.step.set(step, tags={"run_id": self.run_id})


class Tracker:
    """The run's trackers from `start_step` on. `replay`, the metrics line of `start_step` itself that a resume
    restored from its checkpoint (the run was killed before it logged that line), is logged again after dropping
    whatever the killed run may have logged for that step."""

    def __init__(self, cfg: RunConfig, run_dir: Path, start_step: int, replay: dict | None = None):
        self.ray = RayMetrics(cfg.run_id)
        self.tensorboard = self.wandb = None
        if "tensorboard" in cfg.trainer.logger:
            from torch.utils.tensorboard import SummaryWriter

            purge = (start_step if replay else start_step + 1) if start_step else None
            self.tensorboard = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=purge)
        if "wandb" in cfg.trainer.logger:
            self.wandb = start_wandb(cfg, run_dir)
        if replay:
            self.log(replay, start_step)

    def log(self, metrics: dict, step: int) -> None:
        numbers = scalars(metrics)
        self.ray.log(numbers, step)
        if self.tensorboard is not None:
            for key, value in numbers.items():
                self.tensorboard.add_scalar(key, value, step)
            self.tensorboard.flush()
        if self.wandb is not None:
            self.wandb.log(numbers, step=step)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


def start_wandb(cfg: RunConfig, run_dir: Path):
    """Starts (or resumes) the run's W&B run, its files under runs/<id>/wandb; ConfigError in one line if it cannot."""
    try:
        import wandb
    except ImportError:
        raise ConfigError("config error: trainer.logger includes wandb, but the wandb package is not installed: "
                          "pip install wandb (make setup installs it), or drop wandb from trainer.logger") from None
    run_id = re.sub(r"[^A-Za-z0-9_-]", "-", cfg.run_id)
    try:
        return wandb.init(project=cfg.trainer.project_name, name=cfg.run_id, id=run_id, resume="allow",
                          dir=str(run_dir), config=training_settings(cfg))
    except Exception as exc:  # wandb raises its own types for a missing key, a refused login, no network
        reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"config error: W&B did not start ({reason}): set WANDB_API_KEY (or run `wandb login`), "
                          "set WANDB_MODE=offline to keep the run under runs/<id>/wandb, or drop wandb from "
                          "trainer.logger") from None
