"""Where a local run's step metrics go beside metrics.jsonl (`trainer.logger`): TensorBoard event files under the
run (`tensorboard --logdir runs/<id>/tensorboard`), and W&B when asked for.

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


class Tracker:
    def __init__(self, cfg: RunConfig, run_dir: Path, start_step: int):
        self.tensorboard = self.wandb = None
        if "tensorboard" in cfg.trainer.logger:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=str(run_dir / "tensorboard"),
                                             purge_step=start_step + 1 if start_step else None)
        if "wandb" in cfg.trainer.logger:
            self.wandb = start_wandb(cfg, run_dir)

    def log(self, metrics: dict, step: int) -> None:
        numbers = scalars(metrics)
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
