"""GRPO on Ray, local backend: rollout -> reward -> advantage -> loss -> update -> sync, one step at a time.

Rollout workers (Ray actors) hold the base model and the live LoRA; the learner (this process) holds the
same base with a trainable LoRA. After each update the learner writes the adapter atomically to
`runs/<id>/lora_sync/` and the workers load it before the next step, as the reference's engines do.
Every artifact follows the shared-volume contract (shared/storage/); kill it at any moment and it resumes from the last
complete checkpoint, reproducing the uninterrupted run (rollout seeds depend only on seed and step).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import shutil
import statistics
import time
from pathlib import Path

import numpy as np
import ray
import torch
from tqdm import tqdm

from services.trainer.rollout import MazeGroup, RolloutWorker, build_policy, load_adapter_weights
from services.trainer.sft import ensure_sft
from shared.config import RunConfig, dump_config
from shared.episodes import EpisodeSettings
from shared.evaluation import (
    describe,
    evaluate,
    paired_comparison,
    plot_solve_rate,
    solved_by_seed,
    wilson_interval,
)
from shared.maze.dataset import EvalSet, TrainingTickets, excluded_from_training
from shared.models.engine import LocalEngine, TrainingSample, collate, token_logprobs
from shared.storage.files import append_jsonl, atomic_write_text, read_jsonl, staged_dir
from shared.storage.volume import LATEST_STEP_FILE, SharedVolume, latest_complete_step, step_dirs

# ---- the math ---------------------------------------------------------------------------------------


def group_advantages(rewards: torch.Tensor, std_normalize: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Returns GRPO advantages for rewards [groups, n_samples]: reward minus its group's mean (/ std).

    A group whose rewards are all equal has zero advantage: it carries no learning signal.
    """
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if std_normalize:
        centred = centred / (rewards.std(dim=1, keepdim=True, unbiased=True) + eps)
    return centred


def step_advantages(rewards: list[float], states: list[list], gamma: float, std_normalize: bool = True,
                    eps: float = 1e-6) -> list[list[float]]:
    """Returns GiGPO's step-level advantages for one group: the episodes of one maze, [episode][turn].

    Turn t of an episode that ends after T turns with reward r returns gamma**(T-1-t) * r. Turns taken from
    the same anchor state (`states[e][t]`: what the agent saw, here its position in the maze) form a step
    group; a turn's advantage is its return minus its step group's mean (/ std). A state seen once gives 0.
    This credits the turn that decided an episode, e.g. the branch taken at a junction, rather than every turn.
    """
    returns = [[gamma ** (len(turns) - 1 - t) * reward for t in range(len(turns))]
               for reward, turns in zip(rewards, states)]
    by_state: dict = {}
    for e, turns in enumerate(states):
        for t, state in enumerate(turns):
            by_state.setdefault(state, []).append((e, t))
    out = [[0.0] * len(turns) for turns in states]
    for members in by_state.values():
        if len(members) < 2:
            continue
        values = torch.tensor([returns[e][t] for e, t in members], dtype=torch.float64)
        centred = values - values.mean()
        if std_normalize:
            centred = centred / (values.std(unbiased=True) + eps)
        for (e, t), value in zip(members, centred.tolist()):
            out[e][t] = value
    return out


def branch_advantages(rewards: list[float], states: list[list], std_normalize: bool = True,
                      eps: float = 1e-6) -> list[list[float]]:
    """Returns GRPO's advantage split over the turns where one group's episodes branch, [episode][turn].

    The value of (turn t, state s) is the mean reward of the group's episodes that were in s before turn t;
    a turn's advantage is the value of where it led (the next turn's node, or the episode's own reward after
    its last turn) minus the value of where it was taken. In a deterministic maze that is Q(s, a) - V(s)
    estimated from the group. An episode's advantages sum to its reward minus the group mean, GRPO's
    advantage, but only the turns after which outcomes differ get any: the shared opening of a group and
    everything past the last branch get exactly zero. Divided by the group's reward std as in GRPO.
    """
    members: dict = {}
    for e, turns in enumerate(states):
        for t, state in enumerate(turns):
            members.setdefault((t, state), []).append(e)
    value = {node: math.fsum(rewards[e] for e in group) / len(group) for node, group in members.items()}
    scale = 1.0 / (statistics.stdev(rewards) + eps) if std_normalize and len(rewards) > 1 else 1.0
    out = []
    for e, turns in enumerate(states):
        here = [value[(t, state)] for t, state in enumerate(turns)]
        after = here[1:] + [rewards[e]]
        out.append([(a - h) * scale for h, a in zip(here, after)])  # equal values give exactly 0.0
    return out


def credit_turns(groups: list[MazeGroup], algo) -> tuple[list[TrainingSample], list[list[TrainingSample]]]:
    """Returns (every turn's sample with its advantage, the samples of each group that carries signal).

    A turn's advantage is its episode's GRPO advantage (reward minus the group's mean, / std), plus
    `step_advantage_weight` x its step-level advantage under gigpo; under branch it is the episode's GRPO
    advantage split over its turns (`branch_advantages`). Zero-advantage samples give zero policy gradient
    (no KL term by default), so they are left out of the groups to train on. The samples come back as copies:
    the rollout's own stay as played.
    """
    samples, signal = [], []
    rewards = torch.tensor([group.rewards for group in groups], dtype=torch.float32)  # [groups, n]
    for group, row in zip(groups, group_advantages(rewards, algo.std_normalize).tolist()):
        states = [e.states for e in group.episodes]
        if algo.advantage_estimator == "branch":
            per_turn = branch_advantages(group.rewards, states, algo.std_normalize)
        else:
            per_turn = [[advantage] * len(e.samples) for advantage, e in zip(row, group.episodes)]
        if algo.advantage_estimator == "gigpo":
            steps = step_advantages(group.rewards, states, algo.gamma, algo.std_normalize)
            per_turn = [[a + algo.step_advantage_weight * b for a, b in zip(turns, extra)]
                        for turns, extra in zip(per_turn, steps)]
        credited = [dataclasses.replace(sample, advantage=advantage)
                    for episode, advantages in zip(group.episodes, per_turn)
                    for sample, advantage in zip(episode.samples, advantages)]
        samples.extend(credited)
        kept = credited if algo.use_kl_loss else [s for s in credited if s.advantage != 0.0]
        if kept:
            signal.append(kept)
    return samples, signal


def ppo_clip_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  response_mask: torch.Tensor, eps_low: float = 0.2, eps_high: float = 0.2,
                  row_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (summed loss over response tokens, clipped-token count) of the token-level PPO-clip objective.

    logprobs, old_logprobs, response_mask: [B, L]; advantages: [B] (one per sample, spread over its tokens).
    row_weights [B] scales each sample's tokens (see `loss_row_weights`); without it the caller divides the
    sum by the number of response tokens (token_mean).
    """
    ratio = torch.exp(logprobs - old_logprobs)
    adv = advantages[:, None]
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv
    per_token = -torch.minimum(unclipped, clipped) * response_mask
    was_clipped = ((unclipped != clipped) & (clipped < unclipped)).float() * response_mask
    if row_weights is not None:
        per_token = per_token * row_weights[:, None]
    return per_token.sum(), was_clipped.sum()


def loss_row_weights(response_mask: torch.Tensor, reduction: str, total_tokens: int, total_samples: int) -> torch.Tensor:
    """Returns per-sample loss weights [B] that turn a summed loss into the configured reduction over the step.

    token_mean: every response token of the step weighs the same (1 / all response tokens);
    sequence_mean: every sample weighs the same, its tokens averaged (1 / (its tokens x all samples)).
    """
    if reduction == "token_mean":
        return torch.full((response_mask.shape[0],), 1.0 / max(total_tokens, 1))
    if reduction == "sequence_mean":
        return 1.0 / (response_mask.sum(dim=1).clamp(min=1) * max(total_samples, 1))
    raise ValueError(f"unknown loss_reduction {reduction!r}: use 'token_mean' or 'sequence_mean'")


# ---- checkpoints ------------------------------------------------------------------------------------


def save_adapter(model, folder: Path) -> None:
    """Writes SkyRL's export layout: adapter_model.safetensors + adapter_config.json."""
    # save_embedding_layers=False: peft would otherwise look the base model up on a hub.
    model.save_pretrained(str(folder), safe_serialization=True, save_embedding_layers=False)


def save_checkpoint(volume: SharedVolume, run_id: str, step: int, model, optimizer, tickets: TrainingTickets,
                    keep: int | None = None) -> Path:
    """Writes ckpts/global_step_N (adapter, optimizer, RNG, step, data cursor) atomically, then the pointer; keeps the newest `keep`."""
    final = volume.ckpt(run_id, step)
    with staged_dir(final) as tmp:
        save_adapter(model, tmp / "policy")
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        state = {"step": step, "tickets": tickets.state(), "python_rng": repr(random.getstate())}
        torch.save({"torch": torch.get_rng_state(), "numpy": np.random.get_state()}, tmp / "rng.pt")
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2))
    atomic_write_text(volume.ckpts(run_id) / LATEST_STEP_FILE, f"{step}\n")
    if keep:
        # Oldest first, and only after the pointer names the new one: a crash here leaves extra checkpoints, never none.
        for _, older in step_dirs(volume.ckpts(run_id))[:-keep]:
            shutil.rmtree(older, ignore_errors=True)
    return final


def load_checkpoint(folder: Path, model, optimizer, tickets: TrainingTickets) -> int:
    """Restores adapter, optimizer, RNG and data cursor from a verified checkpoint; returns its step."""
    load_adapter_weights(model, folder / "policy")
    optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=False))
    rng = torch.load(folder / "rng.pt", weights_only=False)
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    state = json.loads((folder / "trainer_state.json").read_text())
    tickets.load_state(state["tickets"])
    return int(state["step"])


# ---- the loop ---------------------------------------------------------------------------------------


class Trainer:
    def __init__(self, cfg: RunConfig, log=print):
        self.cfg, self.log = cfg, log
        self.volume = SharedVolume(cfg.shared_path())
        self.run_dir = self.volume.run(cfg.run_id)

    def run(self) -> dict:
        cfg, volume, run_id = self.cfg, self.volume, self.cfg.run_id
        started = time.perf_counter()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.run_dir / "run.yaml", dump_config(cfg))
        base_dir = ensure_sft(cfg, log=self.log)
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)

        model, processor = build_policy(base_dir, cfg.lora, cfg.model.base_model_id, cfg.model.dtype, trainable=True)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=cfg.algorithm.lr, weight_decay=cfg.algorithm.weight_decay)
        eval_set = EvalSet.held_out(cfg.env)
        eval_set.save(volume.dataset(cfg.env.eval_env))
        extended = EvalSet.extended(cfg.env)
        if extended:
            extended.save(volume.dataset(cfg.env.eval_env))
        tickets = TrainingTickets.for_rl(cfg.env, excluded_from_training(cfg.env))

        step = 0
        if cfg.schedule.resume_mode == "latest":
            found = latest_complete_step(volume.ckpts(run_id), warn=lambda m: self.log(f"warning: {m}"))
            if found:
                step = load_checkpoint(found[1], model, optimizer, tickets)
                self.log(f"resuming {run_id} from {found[1]} (step {step})")
        self._truncate_metrics(step)

        self._start_ray()
        # The workers share this machine's cores (on a cluster each gets its own node's).
        threads = max(1, (os.cpu_count() or 1) // cfg.rollout.num_workers)
        workers = [RolloutWorker.remote(cfg.model_dump(mode="json"), str(base_dir), threads)
                   for _ in range(cfg.rollout.num_workers)]
        # The trainer's state: what each train_step(step) works on.
        self.model, self.processor, self.params, self.optimizer = model, processor, params, optimizer
        self.workers, self.tickets = workers, tickets
        engine = LocalEngine.for_model(cfg, model, processor, name=cfg.model.base_model_id, adapter=run_id)
        eval_settings = EpisodeSettings.from_config(cfg)
        history = {int(r["step"]): r for r in read_jsonl(self.run_dir / "evals" / "history.jsonl")}

        def run_eval(at_step: int) -> dict:
            out = volume.eval(run_id, f"global_step_{at_step}")
            if (out / "summary.json").exists():
                # Evaluated before a restart (the replayed step reproduces that model): reuse it, and keep
                # history.jsonl and the final table whole, since the restart dropped lines past its checkpoint.
                summary = json.loads((out / "summary.json").read_text())
            else:
                model.eval()
                summary, _ = evaluate(engine, eval_set, eval_settings, out, model=cfg.model.base_model_id,
                                      adapter=f"{run_id}@global_step_{at_step}", extra={"step": at_step})
                self.log(f"eval @ step {at_step}: " + describe(summary))
            if at_step not in history:
                append_jsonl(self.run_dir / "evals" / "history.jsonl", {"step": at_step, **summary})
                history[at_step] = summary
            return summary

        def run_extended(at_step: int) -> Path:
            """Scores the warm start (step 0: the adapter switched off) or the policy on the extended held-out set."""
            out = volume.eval(run_id, f"extended_step_{at_step}")
            if not (out / "summary.json").exists():
                model.eval()
                name = "warm start" if at_step == 0 else f"step {at_step}"
                with model.disable_adapter() if at_step == 0 else contextlib.nullcontext():
                    summary, _ = evaluate(engine, extended, eval_settings, out, model=cfg.model.base_model_id,
                                          adapter=None if at_step == 0 else f"{run_id}@global_step_{at_step}",
                                          extra={"step": at_step}, progress=f"extended eval ({name})")
                self.log(f"extended eval, {name}: " + describe(summary))
            return out

        if cfg.schedule.eval_before_train and step == 0:
            run_eval(0)
        if extended:
            run_extended(0)
        self._sync(model, workers, step)

        bar = tqdm(total=cfg.schedule.total_steps, initial=step, desc=f"grpo {run_id}", unit="step")
        while step < cfg.schedule.total_steps:
            step += 1
            metrics = self.train_step(step)
            sync_started = time.perf_counter()
            self._sync(model, workers, step)
            metrics["timing/sync_s"] = round(time.perf_counter() - sync_started, 3)

            sched = cfg.schedule
            final = step == sched.total_steps
            if (sched.eval_interval and step % sched.eval_interval == 0) or final:
                metrics["eval/solve_rate"] = run_eval(step)["solve_rate"]
            if step % sched.hf_save_interval == 0 or final:
                with staged_dir(volume.export(run_id, step)) as tmp:
                    save_adapter(model, tmp)
            if step % sched.ckpt_interval == 0 or final:
                save_checkpoint(volume, run_id, step, model, optimizer, tickets, keep=sched.max_ckpts_to_keep)
            append_jsonl(volume.metrics(run_id), metrics)
            last_eval = history[max(history)]["solve_rate"] if history else float("nan")
            bar.set_postfix(reward=f"{metrics['reward/mean']:.2f}", solve=f"{metrics['train/solve_rate']:.2f}",
                            eval=f"{last_eval:.2f}")
            bar.update(1)
        bar.close()
        extended_dirs = (run_extended(0), run_extended(step)) if extended and step else None
        return self._finish(history, extended_dirs, tickets, time.perf_counter() - started)

    def train_step(self, step: int) -> dict:
        """Runs GRPO step `step` on the trainer's policy, optimizer, workers and maze stream; returns its metrics."""
        cfg, algo = self.cfg, self.cfg.algorithm
        model, optimizer, processor, params = self.model, self.optimizer, self.processor, self.params
        n = cfg.rollout.n_samples_per_prompt

        # 1. rollout: each worker plays its share of mazes, n samples each, batched across episodes
        started = time.perf_counter()
        mazes = self.tickets.take(cfg.rollout.train_batch_size)
        shares = [mazes[i :: len(self.workers)] for i in range(len(self.workers))]
        futures = [w.rollout.remote([(m.env_id, m.seed) for m in share], n, cfg.seed * 100_003 + step * 101 + i)
                   for i, (w, share) in enumerate(zip(self.workers, shares)) if share]
        played: list[MazeGroup] = [group for result in ray.get(futures) for group in result]
        episodes = [e for group in played for e in group.episodes]
        rollout_s = time.perf_counter() - started

        # 2. reward -> 3. advantage: normalised within each maze's group of n samples
        rewards = torch.tensor([group.rewards for group in played], dtype=torch.float32)  # [groups, n]
        samples, groups = credit_turns(played, algo)
        # Mini-batches of maze groups, one optimizer step each (SkyRL's policy_mini_batch_size); groups without
        # signal were dropped, so every update sees only groups that carry a learning signal.
        per_update = algo.mini_batch_size or cfg.rollout.train_batch_size
        mini_batches = [[s for group in groups[i : i + per_update] for s in group]
                        for i in range(0, len(groups), per_update)]
        active = [s for group in groups for s in group]

        # 4. loss -> 5. update: token-level PPO-clip over assistant tokens, token_mean within each mini-batch
        started = time.perf_counter()
        model.train()
        loss_sum = clipped = entropy_sum = grad_norm_sum = 0.0
        updates = 0
        for _ in range(algo.update_epochs):
            for mini in mini_batches:
                optimizer.zero_grad()
                mini_tokens = sum(sum(s.response_mask) for s in mini)
                for i in range(0, len(mini), algo.micro_batch_size):
                    batch = collate(processor, mini[i : i + algo.micro_batch_size])
                    logprobs, entropy = token_logprobs(model, batch, cfg.rollout.temperature)
                    mask = batch["response_mask"]
                    weights = loss_row_weights(mask, algo.loss_reduction, mini_tokens, len(mini))
                    loss, n_clipped = ppo_clip_loss(logprobs, batch["old_logprobs"], batch["advantages"], mask,
                                                    algo.eps_clip_low, algo.eps_clip_high, weights)
                    if algo.use_kl_loss:
                        with torch.no_grad(), model.disable_adapter():
                            ref_logprobs, _ = token_logprobs(model, batch, cfg.rollout.temperature)
                        log_ratio = ref_logprobs - logprobs
                        kl = (torch.exp(log_ratio) - log_ratio - 1) * mask  # k3 estimator
                        loss = loss + algo.kl_loss_coef * (kl * weights[:, None]).sum()
                    loss.backward()
                    loss_sum += loss.item()
                    clipped += n_clipped.item()
                    entropy_sum += (entropy * mask).sum().item()
                grad_norm_sum += torch.nn.utils.clip_grad_norm_(params, algo.max_grad_norm).item()
                optimizer.step()
                updates += 1
        model.eval()
        train_s = time.perf_counter() - started

        total_tokens = sum(sum(s.response_mask) for s in active)
        all_tokens = sum(len(s.input_ids) for s in samples)
        return {
            "step": step,
            "reward/mean": rewards.mean().item(),
            "train/solve_rate": float(np.mean([e.solved for e in episodes])),
            "train/format_rate": float(np.mean([e.format_rate for e in episodes])),
            "train/parse_failures": int(sum(e.parse_failures for e in episodes)),
            "train/mean_turns": float(np.mean([e.turns for e in episodes])),
            "train/groups_with_signal": int((rewards.std(dim=1) > 0).sum().item()),
            "train/samples": len(samples),
            "train/active_samples": len(active),
            "policy/entropy": entropy_sum / max(total_tokens * algo.update_epochs, 1),
            "policy/clip_fraction": clipped / max(total_tokens * algo.update_epochs, 1),
            "policy/loss": loss_sum / max(updates, 1),
            "policy/grad_norm": grad_norm_sum / max(updates, 1),
            "policy/updates": updates,
            "timing/rollout_s": round(rollout_s, 3),
            "timing/train_s": round(train_s, 3),
            "throughput/rollout_tokens_per_s": round(all_tokens / max(rollout_s, 1e-9), 1),
            "throughput/train_tokens_per_s": round(sum(len(s.input_ids) for s in active) / max(train_s, 1e-9), 1),
            "data/cursor": self.tickets.cursor,
        }

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

    def _sync(self, model, workers, step: int) -> None:
        """Writes the adapter to lora_sync/ atomically and has every worker load it."""
        sync_dir = self.volume.lora_sync(self.cfg.run_id)
        with staged_dir(sync_dir) as tmp:
            save_adapter(model, tmp)
            (tmp / "step.txt").write_text(f"{step}\n")
        ray.get([w.sync.remote(str(sync_dir), step) for w in workers])

    def _truncate_metrics(self, step: int) -> None:
        """On resume, drops metric lines past the checkpoint so the file matches an uninterrupted run."""
        path = self.volume.metrics(self.cfg.run_id)
        records = [r for r in read_jsonl(path) if int(r.get("step", 0)) <= step]
        atomic_write_text(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
        hist = self.run_dir / "evals" / "history.jsonl"
        kept = [r for r in read_jsonl(hist) if int(r.get("step", 0)) <= step]
        atomic_write_text(hist, "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))

    def _finish(self, history: dict, extended_dirs: tuple[Path, Path] | None, tickets: TrainingTickets,
                wall_s: float) -> dict:
        """Writes the curve, summary.json and run.yaml's data ranges; prints the summary a user reads at a glance."""
        cfg, run_id = self.cfg, self.cfg.run_id
        steps = sorted(history)
        sft_eval = self.volume.model(cfg.model.path) / "eval" / "summary.json"
        data = {"sft_seeds": json.loads(sft_eval.read_text()).get("sft_seeds") if sft_eval.exists() else None,
                "rl_seeds": tickets.seed_range()}
        atomic_write_text(self.run_dir / "run.yaml", dump_config(cfg) + "".join(
            f"# {name}: {value or 'none drawn'}  (seeds drawn, inclusive; written at the end of the run)\n"
            for name, value in data.items()))
        pairs = []  # (eval set, its warm-start folder, its final folder)
        if len(steps) > 1:
            pairs.append(("held-out", *(self.volume.eval(run_id, f"global_step_{s}") for s in (steps[0], steps[-1]))))
        if extended_dirs:
            pairs.append(("extended", *extended_dirs))
        comparisons, extended = {}, None
        for kind, before, after in pairs:
            comparison = compare_evals(before, after)
            comparisons[f"{kind} {comparison['before']['total']}"] = comparison
            if kind == "extended":
                extended = comparison
        result = {"run_id": run_id, "steps": steps[-1] if steps else 0, "wall_s": round(wall_s, 1), **data,
                  "first_eval": history[steps[0]]["solve_rate"] if steps else None,
                  "final_eval": history[steps[-1]]["solve_rate"] if steps else None,
                  "curve": {str(s): history[s]["solve_rate"] for s in steps}, "comparisons": comparisons}
        if steps:
            points = extended and {
                "label": f"extended {extended['before']['total']} mazes",
                "ceiling": extended["after"]["oracle_solved"] / extended["after"]["total"],
                "points": [(e["step"], e["solved"], e["total"], e["ci_low"], e["ci_high"])
                           for e in (extended["before"], extended["after"])]}
            plot_solve_rate(self.run_dir / "solve_rate_vs_step.png", steps, [history[s]["solve_rate"] for s in steps],
                            history[steps[0]]["oracle_solved"] / history[steps[0]]["total"], run_id, points)
        atomic_write_text(self.run_dir / "summary.json", json.dumps(result, indent=2) + "\n")
        self.log(run_summary(result))
        return result


def compare_evals(before_dir: Path, after_dir: Path) -> dict:
    """Returns warm start vs final on one eval set: counts, 95% intervals, the paired test, the ceiling."""
    before, after = solved_by_seed(before_dir), solved_by_seed(after_dir)
    ends = {}
    for name, folder, solved in (("before", before_dir, before), ("after", after_dir, after)):
        summary = json.loads((folder / "summary.json").read_text())
        low, high = wilson_interval(sum(solved.values()), len(solved))
        ends[name] = {"step": summary.get("step"), "solved": sum(solved.values()), "total": len(solved),
                      "ci_low": low, "ci_high": high, "oracle_solved": summary["oracle_solved"],
                      "errors": summary.get("errors", 0), "folder": str(folder)}
    return {**ends, "paired": paired_comparison(before, after)}


def run_summary(result: dict) -> str:
    """Returns the end-of-run block: warm start vs final per eval set, the ceiling, the curve, the wall time."""
    def rate(end: dict) -> str:
        return (f"{end['solved']}/{end['total']} {100 * end['solved'] / end['total']:.1f}% "
                f"[{100 * end['ci_low']:.1f}-{100 * end['ci_high']:.1f}]")

    table = [["", "warm start (95% CI)", "final (95% CI)", "change (paired 95% CI, McNemar p)", "ceiling"]]
    for name, c in result["comparisons"].items():
        p = c["paired"]
        table.append([name, rate(c["before"]), rate(c["after"]),
                      f"{100 * p['difference']:+.1f} pts [{100 * p['ci_low']:+.1f}, {100 * p['ci_high']:+.1f}] "
                      f"p={p['p_value']:.2g}", f"{c['after']['oracle_solved']}/{c['after']['total']}"])
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = [f"== {result['run_id']}: {result['steps']} GRPO steps, {result['wall_s'] / 60:.1f} min wall =="]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in table]
    curve = " -> ".join(f"{s}: {100 * r:.1f}%" for s, r in result["curve"].items())
    lines.append(f"held-out curve (step: solve rate): {curve}")
    for c in result["comparisons"].values():
        for end in (c["before"], c["after"]):
            if end["errors"]:
                lines.append(f"WARNING: {end['errors']} mazes could not be scored in {end['folder']} (counted as "
                             "failed; see its episodes.jsonl): delete the folder and run again to re-score")
    lines.append(f"data: sft seeds {result['sft_seeds'] or 'n/a'}, rl seeds {result['rl_seeds'] or 'n/a'}")
    return "\n".join(lines)
