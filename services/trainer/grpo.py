"""GRPO on Ray, local backend: rollout -> reward -> advantage -> loss -> update -> sync, one step at a time.

Rollout workers (Ray actors) hold the base model and the live LoRA; the learner (this process) holds the
same base with a trainable LoRA. After each update the learner writes the adapter atomically to
`runs/<id>/lora_sync/` and the workers load it before the next step, as the reference's engines do.
Every artifact follows the shared-volume contract (shared/storage/); kill it at any moment and it resumes from the last
complete checkpoint, reproducing the uninterrupted run (rollout seeds depend only on seed and step).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import random
import time

import numpy as np
import ray
import torch
from tqdm import tqdm

from services.trainer.algorithm import TrainingStopped, credit_turns, update_policy
from services.trainer.checkpoints import (
    checkpoint_base,
    checkpoint_metrics,
    checkpoint_settings,
    load_checkpoint,
    save_adapter,
    save_checkpoint,
)
from services.trainer.report import export_card, landed, run_summary, warm_start_kind, write_run_report
from services.trainer.rollout import MazeGroup, RolloutWorker, build_policy
from services.trainer.run_evals import PolicyIdentity, RunEvals, held_out_due
from services.trainer.sft import ensure_sft
from services.trainer.tracking import Tracker
from shared.config import (
    ConfigError,
    RunConfig,
    changed_settings,
    check_trainable,
    dump_config,
    settings_hash,
    training_settings,
)
from shared.evaluation.model_card import CARD
from shared.evaluation.statistics import compare_evals, compare_sampled
from shared.machine import machine_info
from shared.maze.dataset import EvalSet, MazeStream, excluded_from_training
from shared.models.inference import LocalEngine
from shared.models.loading import MergedCopy
from shared.storage.files import append_jsonl, atomic_write_text, read_jsonl, staged_dir
from shared.storage.manifest import model_identity
from shared.storage.volume import SharedVolume, complete_exports, latest_complete_step, step_dirs

logger = logging.getLogger(__name__)

def check_rollout_errors(played: list[MazeGroup], max_fraction: float, step: int) -> None:
    """Raises TrainingStopped when more than `max_fraction` of the step's episodes failed in the engine."""
    failed = [(error, group.log) for group in played for error in group.errors]
    total = sum(len(group.episodes) + len(group.errors) for group in played)
    if failed and len(failed) > max_fraction * total:
        error, log = failed[0]
        where = f"; the worker log says more: {log}" if log else ""
        raise TrainingStopped(
            f"step {step}: {len(failed)} of {total} rollout episodes failed in the engine (more than "
            f"rollout.max_error_fraction = {max_fraction}), first: {error.splitlines()[0][:300]}{where}")


def eval_metrics(summary: dict) -> dict:
    """Returns the metrics a held-out eval adds to its step's line: the solve rate and the junction probe's numbers."""
    metrics = {"eval/solve_rate": summary["solve_rate"]}
    for key in ("accuracy", "mean_logprob", "changed_since_warm_start"):
        if key in (summary.get("junctions") or {}):
            metrics[f"eval/junction_{key}"] = summary["junctions"][key]
    return metrics


class Trainer:
    """One local GRPO run: `run()` is set-up, resume, the step loop, finish; `train_step(step)` is one step.

    `allow_changed_settings` continues a run whose checkpoint was trained with other settings (and re-scores evals
    on disk that were played under other settings) instead of stopping."""

    def __init__(self, cfg: RunConfig, allow_changed_settings: bool = False, command: str | None = None):
        self.cfg = cfg
        self.command = command  # the command line that started the run, for the exports' model cards
        self.volume = SharedVolume(cfg.shared_path())
        self.run_dir = self.volume.run(cfg.run_id)
        self.allow_changed = allow_changed_settings
        self.settings = training_settings(cfg)

    def run(self) -> dict:
        started = time.perf_counter()
        step = self.set_up()
        try:
            if self.cfg.schedule.eval_before_train and step == 0:
                self.tracker.log(eval_metrics(self.evals.held_out(0)), 0)
            bar = tqdm(total=self.cfg.schedule.total_steps, initial=step, desc=f"grpo {self.cfg.run_id}", unit="step")
            while step < self.cfg.schedule.total_steps:
                step += 1
                metrics = self.train_step(step)
                self.end_step(step, metrics)
                history = self.evals.history
                last_eval = history[max(history)]["solve_rate"] if history else float("nan")
                bar.set_postfix(reward=f"{metrics['reward/mean']:.2f}", solve=f"{metrics['train/solve_rate']:.2f}",
                                eval=f"{last_eval:.2f}", errors=metrics["rollout/errors"])
                bar.update(1)
            bar.close()
            return self.finish(step, time.perf_counter() - started)
        finally:
            self.tracker.close()

    # ---- set-up and resume --------------------------------------------------------------------------

    def set_up(self) -> int:
        """Builds the policy, optimizer, eval sets, maze stream and rollout workers; returns the step to start after."""
        cfg = self.cfg
        check_trainable(cfg)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        base_dir = ensure_sft(cfg, log=logger.info)
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        self.model, self.processor = build_policy(base_dir, cfg.lora, cfg.model.base_model_id, cfg.model.dtype,
                                                  trainable=True)
        check_reply_budget(cfg, self.processor)
        self.base_identity = model_identity(base_dir)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.algorithm.lr, weight_decay=cfg.algorithm.weight_decay)
        eval_sets = EvalSet.held_out(cfg.env), EvalSet.extended(cfg.env)
        for eval_set in eval_sets:
            if eval_set:
                eval_set.save(self.volume.dataset(cfg.env.eval_env))
        self.stream = MazeStream.for_rl(cfg.env, excluded_from_training(cfg.env))

        step, changes = self.resume()
        # Evaluations play a merged copy of the policy (its LoRA folded into the weights): PEFT's speed is not needed.
        self.eval_policy = MergedCopy(self.model)
        engine = LocalEngine.for_model(cfg, self.eval_policy.model, self.processor, name=cfg.model.base_model_id,
                                       adapter=cfg.run_id)
        self.evals = RunEvals(cfg, self.volume, engine, self.eval_policy, *eval_sets,
                              policy=PolicyIdentity(self.base_identity, settings_hash(self.settings)),
                              allow_changed=self.allow_changed)
        self.evals.check_ahead(step)  # a refused start records nothing and starts no Ray
        self._record_settings(step, changes)
        self.tracker = Tracker(cfg, self.run_dir, step, replay=self._truncate_metrics(step))
        self.evals.keep_until(step)
        self._start_ray()
        # The workers share this machine's cores (on a cluster each gets its own node's), each at most as many threads
        # as this process (torch's count: OMP_NUM_THREADS where set).
        threads = max(1, min(torch.get_num_threads(), (os.cpu_count() or 1) // cfg.rollout.num_workers))
        self.workers = [RolloutWorker.remote(cfg.model_dump(mode="json"), str(base_dir), threads)
                        for _ in range(cfg.rollout.num_workers)]
        self._sync(step)
        return step

    def resume(self) -> tuple[int, list[str]]:
        """Loads the latest complete checkpoint (resume_mode=latest); returns (its step, the settings that changed
        since). Other settings than the checkpoint's stop the run unless allow_changed_settings says go on."""
        cfg = self.cfg
        if cfg.schedule.resume_mode != "latest":
            trained = read_jsonl(self.volume.metrics(cfg.run_id))
            if trained or step_dirs(self.volume.ckpts(cfg.run_id)):
                raise ConfigError(
                    f"config error: schedule.resume_mode = 'none' would start run {cfg.run_id!r} over and replace its "
                    f"{len(trained)} steps of metrics and its checkpoints in {self.run_dir}: nothing was changed; use "
                    "a new run_id, or move that folder aside first")
            return 0, []
        found = latest_complete_step(self.volume.ckpts(cfg.run_id), warn=logger.warning)
        if not found:
            return 0, []
        base = checkpoint_base(found[1])
        if base is not None and base != self.base_identity:
            raise ConfigError(
                f"config error: run {cfg.run_id!r} was trained to {found[1].name} from the warm start {base}, but "
                f"model.path ({cfg.model.path}) now holds {self.base_identity}: the warm start was rebuilt; resuming "
                "would put this run's adapter on other weights. Start a new run (run_id=<new id>)")
        recorded = checkpoint_settings(found[1])
        changes = (["(the checkpoint records no settings)"] if recorded is None
                   else changed_settings(recorded, self.settings))
        if changes and not self.allow_changed:
            raise ConfigError(
                f"config error: run {cfg.run_id!r} was trained to {found[1].name} with other settings: "
                f"{', '.join(changes)}; start a new run (run_id=<new id>), or continue this one with the new settings "
                "on purpose with --allow-changed-settings")
        step = load_checkpoint(found[1], self.model, self.optimizer, self.stream)
        logger.info(f"resuming {cfg.run_id} from {found[1]} (step {step})"
                 + (f" with changed settings: {', '.join(changes)}" if changes else ""))
        return step, changes

    def _record_settings(self, step: int, changes: list[str]) -> None:
        """Writes run.yaml (the config now) and appends this start to config_history.jsonl (what every start used)."""
        atomic_write_text(self.run_dir / "run.yaml", dump_config(self.cfg))
        append_jsonl(self.run_dir / "config_history.jsonl", {
            "started_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "from_step": step, "settings_hash": settings_hash(self.settings), "changed": changes,
            "settings": self.settings, "machine": machine_info()})

    # ---- one step -----------------------------------------------------------------------------------

    def train_step(self, step: int) -> dict:
        """Runs GRPO step `step` on the trainer's policy, optimizer, workers and maze stream; returns its metrics."""
        cfg, algo = self.cfg, self.cfg.algorithm
        n = cfg.rollout.n_samples_per_prompt

        # 1. rollout: each worker plays its share of mazes, n samples each, batched across episodes
        started = time.perf_counter()
        mazes = self.stream.take(cfg.rollout.train_batch_size)
        shares = [mazes[i :: len(self.workers)] for i in range(len(self.workers))]
        futures = [w.rollout.remote([(m.env_id, m.seed) for m in share], n, cfg.seed * 100_003 + step * 101 + i)
                   for i, (w, share) in enumerate(zip(self.workers, shares)) if share]
        played: list[MazeGroup] = [group for result in ray.get(futures) for group in result]
        rollout_s = time.perf_counter() - started
        check_rollout_errors(played, cfg.rollout.max_error_fraction, step)

        # 2. reward -> 3. advantage: within each maze's group of n samples
        samples, groups = credit_turns(played, algo)

        # 4. loss -> 5. update
        started = time.perf_counter()
        stats = update_policy(self.model, self.optimizer, self.params, self.processor, groups, algo=algo,
                              temperature=cfg.rollout.temperature,
                              per_update=algo.mini_batch_size or cfg.rollout.train_batch_size, step=step,
                              measure_kl=cfg.trainer.update_kl)
        train_s = time.perf_counter() - started

        episodes = [e for group in played for e in group.episodes]
        active = [s for group in groups for s in group.samples]
        return {
            "step": step,
            "rollout/errors": sum(len(group.errors) for group in played),
            "reward/mean": float(np.mean([e.reward for e in episodes])),
            "train/solve_rate": float(np.mean([e.solved for e in episodes])),
            "train/format_rate": float(np.mean([e.format_rate for e in episodes])),
            "train/parse_failures": int(sum(e.parse_failures for e in episodes)),
            "train/mean_turns": float(np.mean([e.num_turns for e in episodes])),
            "train/groups_with_signal": sum(len(set(group.rewards)) > 1 for group in played),
            "train/samples": len(samples),
            "train/active_samples": len(active),
            **stats,
            "timing/rollout_s": round(rollout_s, 3),
            "timing/train_s": round(train_s, 3),
            "throughput/rollout_tokens_per_s": round(sum(len(s.input_ids) for s in samples) / max(rollout_s, 1e-9), 1),
            "throughput/train_tokens_per_s": round(sum(len(s.input_ids) for s in active) / max(train_s, 1e-9), 1),
            "data/cursor": self.stream.cursor,
        }

    def end_step(self, step: int, metrics: dict) -> None:
        """Syncs the new adapter to the workers, then evaluates, exports and checkpoints on the schedule, and appends
        the step's metrics last: a crash before that line replays the step from the last checkpoint, and a crash
        between a checkpoint and its line is repaired on resume from the copy of the line the checkpoint holds."""
        cfg, sched = self.cfg, self.cfg.schedule
        started = time.perf_counter()
        self._sync(step)
        metrics["timing/sync_s"] = round(time.perf_counter() - started, 3)
        final = step == sched.total_steps
        if held_out_due(sched, step):
            metrics.update(eval_metrics(self.evals.held_out(step)))
        if step % sched.hf_save_interval == 0 or final:
            with staged_dir(self.volume.export(cfg.run_id, step)) as tmp:
                save_adapter(self.model, tmp)
                atomic_write_text(tmp / CARD, export_card(cfg, step, self.evals.history.get(step), self.base_identity,
                                                          self._sft_summary(), self.stream.seed_range(), self.command))
        if step % sched.ckpt_interval == 0 or final:
            save_checkpoint(self.volume, cfg.run_id, step, self.model, self.optimizer, self.stream, self.settings,
                            keep=sched.max_ckpts_to_keep, base_identity=self.base_identity, metrics=metrics)
        append_jsonl(self.volume.metrics(cfg.run_id), metrics)
        self.tracker.log(metrics, step)

    def _sft_summary(self) -> dict:
        """Returns the warm start's own eval summary (what SFT built it from), or {} for a checkpoint from elsewhere."""
        path = self.volume.model(self.cfg.model.path) / "eval" / "summary.json"
        return json.loads(path.read_text()) if path.exists() else {}

    # ---- the end of a run ---------------------------------------------------------------------------

    def finish(self, step: int, wall_s: float) -> dict:
        """Scores warm start and final policy on the extended set, then writes summary.json, the curve (PNG), the
        run's report.html and run.yaml's data ranges, and prints the summary a user reads at a glance."""
        cfg, run_id = self.cfg, self.cfg.run_id
        extended = {0: self.evals.extended(0), step: self.evals.extended(step)} if self.evals.extended_set and step else {}
        history = self.evals.history
        steps = sorted(history)
        sft_summary = self._sft_summary()
        data = {"sft_seeds": sft_summary.get("sft_seeds"), "rl_seeds": self.stream.seed_range()}
        atomic_write_text(self.run_dir / "run.yaml", dump_config(cfg) + "".join(
            f"# {name}: {value or 'none drawn'}  (seeds drawn, inclusive; written at the end of the run)\n"
            for name, value in data.items()))
        comparisons = {}
        if len(steps) > 1:
            before, after = (self.volume.eval(run_id, f"global_step_{s}") for s in (steps[0], steps[-1]))
            comparison = compare_evals(before, after)
            comparisons[f"held-out {comparison['before']['total']}"] = comparison
        if extended:
            greedy = compare_evals(extended[0]["greedy"], extended[step]["greedy"])
            comparisons[f"extended {greedy['before']['total']}"] = greedy
            if "sampled" in extended[0]:
                comparisons.update(compare_sampled(extended[0]["sampled"], extended[step]["sampled"]))
        result = {"run_id": run_id, "steps": steps[-1] if steps else 0, "wall_s": round(wall_s, 1), **data,
                  "first_eval": history[steps[0]]["solve_rate"] if steps else None,
                  "final_eval": history[steps[-1]]["solve_rate"] if steps else None,
                  "curve": {str(s): history[s]["solve_rate"] for s in steps}, "comparisons": comparisons,
                  "settings_hash": settings_hash(self.settings), "reward": cfg.env.reward, "machine": machine_info(),
                  "warm_start": warm_start_kind(cfg.model.path, sft_summary)}
        if steps:
            write_run_report(self.run_dir, result, read_jsonl(self.volume.metrics(run_id)), history)
        atomic_write_text(self.run_dir / "summary.json", json.dumps(result, indent=2) + "\n")
        logger.info(run_summary(result))
        logger.info("\n".join(landed(self.run_dir, run_id, history, complete_exports(self.volume, run_id))))
        return result

    # ---- plumbing -----------------------------------------------------------------------------------

    def _start_ray(self) -> None:
        """Joins RAY_ADDRESS's cluster, or starts an in-process Ray with metrics export on (make monitor scrapes it)."""
        if ray.is_initialized():
            return
        address = self.cfg.cluster.ray_address
        if address and address.startswith(("http://", "https://", "sagemaker_ray://")):
            raise SystemExit(
                f"RAY_ADDRESS={address} is a job-submission address: use `make submit` (python -m services.trainer "
                "submit) to run on that cluster; inside the submitted job Ray sets RAY_ADDRESS to the cluster itself"
            )
        quiet = dict(log_to_driver=False, configure_logging=False)
        if address:
            ray.init(address=address, **quiet)
        else:
            from shared.local_ray import init_local_ray

            init_local_ray(_metrics_export_port=self.cfg.cluster.metrics_export_port, **quiet)

    def _sync(self, step: int) -> None:
        """Writes the adapter to lora_sync/ atomically and has every worker load it."""
        sync_dir = self.volume.lora_sync(self.cfg.run_id)
        with staged_dir(sync_dir) as tmp:
            save_adapter(self.model, tmp)
            (tmp / "step.txt").write_text(f"{step}\n")
        ray.get([w.sync.remote(str(sync_dir), step) for w in self.workers])

    def _truncate_metrics(self, step: int) -> dict | None:
        """On resume, drops metric lines past the checkpoint so the file matches an uninterrupted run, and restores the
        checkpoint's own line where the run was stopped between writing the checkpoint and appending that line;
        returns that restored line (the trackers never got it either), else None."""
        path = self.volume.metrics(self.cfg.run_id)
        records = [r for r in read_jsonl(path) if int(r.get("step", 0)) <= step]
        saved = None
        if step and not any(int(r.get("step", 0)) == step for r in records):
            saved = checkpoint_metrics(self.volume.ckpt(self.cfg.run_id, step))
            records += [saved] if saved else []
        atomic_write_text(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
        return saved


def check_reply_budget(cfg: RunConfig, processor) -> None:
    """Raises ConfigError when rollout.max_new_tokens cannot hold the longest reply the task asks for: every reply
    would be cut before its action, no episode rewarded, no gradient."""
    from shared.maze.core import generate, solve
    from shared.maze.prompt import solver_reply

    maze = generate(cfg.env.id, cfg.env.rl_seed_start)
    actions = [("move", d) for d in sorted(set(solve(maze)))] + [("stop", "stop")]
    longest = max(len(processor.tokenizer(solver_reply(maze, action, cfg.env.response_format, cfg.env.action_style),
                                          add_special_tokens=False)["input_ids"]) for action in actions)
    if cfg.rollout.max_new_tokens < longest:
        raise ConfigError(f"config error: rollout.max_new_tokens = {cfg.rollout.max_new_tokens} is shorter than a "
                          f"{cfg.env.response_format} reply ({longest} tokens): every reply would be cut before its "
                          f"action; use rollout.max_new_tokens >= {longest + 1} (the reply and its end of turn)")
