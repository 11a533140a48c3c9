"""A run's evaluations of its own policy, apart from the training loop: the 64 held-out mazes at each eval step
(with the teacher-forced junction probe) and the extended set at both ends, greedy and sampled.

Each evaluation lands in `runs/<id>/evals/<name>/` with the identity it was scored under: the eval settings, the
temperature it played at, the policy (the warm start's files, and after step 0 the run's training settings and the
step) and the episodes per maze. A folder with the same identity is reused after a restart (a replayed step
reproduces that policy); one scored under another identity stops the run, before it starts (`check_ahead` looks
at every eval the run will reach), or is scored again when the run continues with --allow-changed-settings.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from shared.branching import junction_accuracy, solver_decisions
from shared.config import ConfigError, RunConfig, ScheduleConfig, eval_settings
from shared.episodes import EpisodeSettings
from shared.evaluation import describe, evaluate
from shared.maze.dataset import EvalSet
from shared.models.contract import ScoringEngine
from shared.models.loading import MergedCopy
from shared.storage.files import append_jsonl, atomic_write_text, read_jsonl
from shared.storage.volume import SharedVolume

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PolicyIdentity:
    """What identifies the run's policy at a step: the warm start's files and the run's training settings."""

    base_model: str
    run_settings: str

    def at(self, step: int) -> dict:
        """Returns the identity of the policy at `step` (step 0: the warm start itself)."""
        if step == 0:
            return {"base_model": self.base_model}
        return {"base_model": self.base_model, "run_settings": self.run_settings, "step": step}


class RunEvals:
    """Scores the run's policy (through `engine`, which plays `eval_policy`'s merged weights) and keeps the 64-maze
    history (`history`: step -> summary, also in evals/history.jsonl)."""

    def __init__(self, cfg: RunConfig, volume: SharedVolume, engine: ScoringEngine, eval_policy: MergedCopy,
                 held_out_set: EvalSet, extended_set: EvalSet, *, policy: PolicyIdentity, allow_changed: bool):
        self.cfg, self.volume, self.engine, self.eval_policy = cfg, volume, engine, eval_policy
        self.held_out_set, self.extended_set = held_out_set, extended_set
        self.policy, self.allow_changed = policy, allow_changed
        self.history_path = volume.run(cfg.run_id) / "evals" / "history.jsonl"
        self.history: dict[int, dict] = {int(r["step"]): r for r in read_jsonl(self.history_path)}

    def keep_until(self, step: int) -> None:
        """On a start after `step`: drops the history's evals past it (a resume plays those steps again), so the
        history matches an uninterrupted run."""
        kept = [r for r in read_jsonl(self.history_path) if int(r.get("step", 0)) <= step]
        atomic_write_text(self.history_path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))
        self.history = {int(r["step"]): r for r in kept}

    def evaluation(self, name: str, eval_set: EvalSet, step: int, samples: int = 1, probe: bool = False) -> dict:
        """Returns the summary of eval `name` (the policy at `step` on `eval_set`), scored now unless a folder from
        the same policy under the same identity is on disk; one from another identity stops the run (or is scored
        again under allow_changed)."""
        cfg = self.cfg
        out = self.volume.eval(cfg.run_id, name)
        settings = EpisodeSettings.for_eval(cfg, samples)
        identity = self._identity(step, samples)
        if (out / "summary.json").exists():
            summary = json.loads((out / "summary.json").read_text())
            differing = self._differing(out, summary, identity)
            if not differing and (not probe or "junctions" in summary):
                return summary  # played before a restart (a replayed step reproduces that policy)
            if differing:
                logger.warning(f"{out} was scored under other settings ({', '.join(differing)}): scoring it again")
        what = "warm start" if step == 0 else f"step {step}"
        self.eval_policy.refresh(enabled=step != 0)  # the warm start is the base model: the LoRA left out
        extra = {"step": step, **identity}
        if probe:  # teacher-forced on the solver's paths: a low-noise score of what RL transfers to held-out mazes
            decisions = solver_decisions(self.engine, eval_set.mazes(), settings)
            extra.update(junctions=junction_accuracy(decisions),
                         junction_choices=[max(range(len(r["scores"])), key=r["scores"].__getitem__)
                                           for r in decisions if r["junction"]])
        summary, _ = evaluate(self.engine, eval_set, settings, out, model=cfg.model.base_model_id,
                              adapter=None if step == 0 else f"{cfg.run_id}@global_step_{step}",
                              extra=extra, samples=samples, seed=cfg.seed,
                              progress=f"{name} ({what})" if len(eval_set.seeds) * samples > 64 else None)
        return summary

    def check_ahead(self, step: int) -> None:
        """Stops a start from `step` before it is recorded and before Ray starts, where an eval it would reach on its
        way is on disk scored under another identity: the refusal `evaluation` makes, which would otherwise come at
        that eval, after Ray's start and the training steps before it."""
        if self.allow_changed:
            return  # nothing is refused: those evals are scored again when their turn comes
        sched = self.cfg.schedule
        final = max(step, sched.total_steps)
        ahead = [(f"global_step_{s}", s, 1) for s in ([0] if sched.eval_before_train and step == 0 else [])
                 + [s for s in range(step + 1, final + 1) if held_out_due(sched, s)]]
        if self.extended_set and final:
            for s in (0, final):
                ahead += [(name, s, samples) for _, name, samples in self._extended_kinds(s)]
        for name, s, samples in ahead:
            out = self.volume.eval(self.cfg.run_id, name)
            if (out / "summary.json").exists():
                self._differing(out, json.loads((out / "summary.json").read_text()), self._identity(s, samples))

    def _identity(self, step: int, samples: int) -> dict:
        """What an eval of the policy at `step` with `samples` episodes per maze is scored under."""
        # the temperature it played at: a sampled eval plays at rollout.temperature, which eval_settings leave out
        return {"eval_settings": eval_settings(self.cfg), "policy": self.policy.at(step), "samples_per_maze": samples,
                "temperature": EpisodeSettings.for_eval(self.cfg, samples).temperature}

    def _differing(self, out: Path, summary: dict, identity: dict) -> list[str]:
        """Returns the keys of `identity` that the summary in `out` was scored under otherwise; raises ConfigError
        for any unless allow_changed (a reuse under other settings is never silent)."""
        differing = [key for key in identity if summary.get(key) != identity[key]]
        if differing and not self.allow_changed:
            raise ConfigError(f"config error: {out} was scored under other settings ({', '.join(differing)} "
                              "differ); start a new run (run_id=<new id>), delete that folder, or pass "
                              "--allow-changed-settings to score it again")
        return differing

    def held_out(self, step: int) -> dict:
        """Scores the policy at `step` on the 64 held-out mazes (greedy), with its teacher-forced junction accuracy
        on their solver paths and the share of those decisions it makes otherwise than the warm start (unless
        schedule.junction_probe is off); keeps it in the history."""
        summary = self.evaluation(f"global_step_{step}", self.held_out_set, step, probe=self.cfg.schedule.junction_probe)
        start = self.history.get(0) or (summary if step == 0 else None)
        if start and start.get("junction_choices") and summary.get("junction_choices"):
            changed = sum(a != b for a, b in zip(start["junction_choices"], summary["junction_choices"]))
            summary["junctions"]["changed_since_warm_start"] = changed / max(len(summary["junction_choices"]), 1)
        if step not in self.history:
            junctions = summary.get("junctions") or {}
            logger.info(f"eval @ step {step}: " + describe(summary)
                        + (f"; junction accuracy {100 * junctions['accuracy']:.1f}%" if "accuracy" in junctions else ""))
            append_jsonl(self.history_path, {"step": step, **summary})
            self.history[step] = summary
        return summary

    def extended(self, step: int) -> dict[str, Path]:
        """Scores the policy at `step` (0: the warm start) on the extended set: greedy, and k samples per maze at
        the rollout temperature (mean@k, pass@k); returns {kind: folder}."""
        folders = {}
        for kind, name, samples in self._extended_kinds(step):
            summary = self.evaluation(name, self.extended_set, step, samples)
            logger.info(f"extended eval ({kind}), {'warm start' if step == 0 else f'step {step}'}: " + describe(summary))
            folders[kind] = self.volume.eval(self.cfg.run_id, name)
        return folders

    def _extended_kinds(self, step: int) -> list[tuple[str, str, int]]:
        """(kind, eval name, samples per maze) of the extended evals at `step`: greedy, and sampled where asked."""
        kinds = [("greedy", f"extended_step_{step}", 1)]
        if self.cfg.rollout.eval_samples > 1:
            kinds.append(("sampled", f"extended_sampled_step_{step}", self.cfg.rollout.eval_samples))
        return kinds


def held_out_due(schedule: ScheduleConfig, step: int) -> bool:
    """Whether a run scores the 64 held-out mazes at the end of step `step`: every eval_interval, and the last step."""
    return bool(schedule.eval_interval and step % schedule.eval_interval == 0) or step == schedule.total_steps
