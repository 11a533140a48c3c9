"""The GRPO math, apart from the loop that runs it (services/trainer/grpo.py): advantage estimators, the PPO-clip
loss and its reductions, the policy update and the KL it moved. Pure functions of tensors and samples; no Ray, no
volume, no config file.

Advantage estimators live in a registry, as SkyRL's `register_advantage_estimator` does: each takes one maze group's
episode rewards and where each episode stood before each of its turns, and returns every turn's advantage. A new one
is a decorated function here plus its name in `AlgorithmConfig.advantage_estimator` (a test checks the two agree).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from shared.models.training import TrainingSample, collate, token_logprobs

if TYPE_CHECKING:
    from services.trainer.rollout import MazeGroup

Estimator = Callable[[list[float], list[list], bool], list[list[float]]]
ESTIMATORS: dict[str, Estimator] = {}


def register_estimator(name: str) -> Callable[[Estimator], Estimator]:
    """Registers an advantage estimator under `name` (the value of algorithm.advantage_estimator)."""
    def add(estimator: Estimator) -> Estimator:
        if name in ESTIMATORS:
            raise ValueError(f"an advantage estimator named {name!r} is already registered")
        ESTIMATORS[name] = estimator
        return estimator
    return add


def group_advantages(rewards: torch.Tensor, std_normalize: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Returns GRPO advantages for rewards [groups, n_samples]: reward minus its group's mean (/ std).

    A group whose rewards are all equal has zero advantage: it carries no learning signal.
    """
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if std_normalize:
        centred = centred / (rewards.std(dim=1, keepdim=True, unbiased=True) + eps)
    return centred


@register_estimator("grpo")
def grpo_advantages(rewards: list[float], states: list[list], std_normalize: bool = True) -> list[list[float]]:
    """GRPO: each episode's advantage (`group_advantages`) on every one of its turns."""
    row = group_advantages(torch.tensor([rewards], dtype=torch.float32), std_normalize)[0].tolist()
    return [[advantage] * len(turns) for advantage, turns in zip(row, states)]


@register_estimator("branch")
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
            group = members.setdefault((t, state), [])
            if e not in group:  # an episode back at a state it visited counts once there
                group.append(e)
    value = {n: math.fsum(rewards[e] for e in group) / len(group) for n, group in members.items()}
    scale = 1.0 / (statistics.stdev(rewards) + eps) if std_normalize and len(rewards) > 1 else 1.0
    out = []
    for e, turns in enumerate(states):
        here = [value[(t, state)] for t, state in enumerate(turns)]
        after = here[1:] + [rewards[e]]
        out.append([(a - h) * scale for h, a in zip(here, after)])  # equal values give exactly 0.0
    return out


@dataclasses.dataclass
class SignalGroup:
    """The samples of one maze group that carry a learning signal, and the size of the whole group they came from
    (every credited sample, zero advantage included: what SkyRL's token_mean and sequence_mean divide by)."""

    samples: list[TrainingSample]
    tokens: int  # response tokens of every credited sample of the group
    count: int  # credited samples of the group


def _signal(credited: list[TrainingSample], keep_all: bool = False) -> SignalGroup | None:
    kept = credited if keep_all else [s for s in credited if s.advantage != 0.0]
    if not kept:
        return None
    return SignalGroup(kept, sum(sum(s.response_mask) for s in credited), len(credited))


def credit_turns(groups: list[MazeGroup], algo) -> tuple[list[TrainingSample], list[SignalGroup]]:
    """Returns (every turn's sample with its advantage, the samples of each group that carries signal).

    A turn's advantage comes from the configured estimator (ESTIMATORS: `grpo_advantages`, `branch_advantages`).
    Zero-advantage samples give zero policy gradient (no KL term by default), so they are left out of the groups to
    train on; so is a group left with fewer than two episodes (the engine failed the others), which has no baseline. The samples come back as copies: the
    rollout's own stay as played.
    """
    samples, signal = [], []
    for group in groups:
        states = [e.states for e in group.episodes]
        if len(group.episodes) < 2:
            per_turn = [[0.0] * len(e.training_samples) for e in group.episodes]
        else:
            per_turn = ESTIMATORS[algo.advantage_estimator](group.rewards, states, algo.std_normalize)
        credited = [dataclasses.replace(sample, advantage=advantage)
                    for episode, advantages in zip(group.episodes, per_turn)
                    for sample, advantage in zip(episode.training_samples, advantages)]
        samples.extend(credited)
        if (found := _signal(credited, keep_all=algo.use_kl_loss)) is not None:
            signal.append(found)
    return samples, signal


def update_policy(model, optimizer, params, processor, groups: list[SignalGroup], *, algo, temperature: float,
                  per_update: int, step: int, measure_kl: bool = True) -> dict:
    """Trains the policy on the step's signal-carrying groups; returns the policy/* metrics.

    Mini-batches of `per_update` maze groups, one optimizer step each (SkyRL's policy_mini_batch_size), for
    `update_epochs` passes; token-level PPO-clip over assistant tokens in the configured reduction. Advantages, each
    loss and each gradient norm are checked finite first: a non-finite one raises TrainingStopped before the
    optimizer steps on it. `measure_kl` adds policy/kl (`update_kl`: one more forward pass).
    """
    trained = [s for group in groups for s in group.samples]
    check_finite("an advantage", torch.tensor([s.advantage for s in trained]), step,
                 "Check algorithm.std_normalize and the rewards (env.reward).")
    model.train()
    loss_sum = clipped = entropy_sum = grad_norm_sum = 0.0
    updates = 0
    for _ in range(algo.update_epochs):
        for first in range(0, len(groups), per_update):
            chosen = groups[first : first + per_update]
            mini = [s for group in chosen for s in group.samples]
            tokens, count = loss_denominators(chosen)
            optimizer.zero_grad()
            for i in range(0, len(mini), algo.micro_batch_size):
                batch = collate(processor, mini[i : i + algo.micro_batch_size])
                logprobs, entropy = token_logprobs(model, batch, temperature)
                mask = batch["response_mask"]
                weights = loss_row_weights(mask, algo.loss_reduction, tokens, count)
                loss, n_clipped = ppo_clip_loss(logprobs, batch["old_logprobs"], batch["advantages"], mask,
                                                algo.eps_clip_low, algo.eps_clip_high, weights)
                if algo.use_kl_loss:
                    with torch.no_grad(), model.disable_adapter():
                        ref_logprobs, _ = token_logprobs(model, batch, temperature)
                    log_ratio = ref_logprobs - logprobs
                    kl = k3(log_ratio) * mask
                    loss = loss + algo.kl_loss_coef * (kl * weights[:, None]).sum()
                check_finite("the loss", loss.item(), step, "Lower algorithm.lr, or check the rewards and advantages.")
                loss.backward()
                loss_sum += loss.item()
                clipped += n_clipped.item()
                entropy_sum += (entropy * mask).sum().item()
            grad_norm = torch.nn.utils.clip_grad_norm_(params, algo.max_grad_norm).item()
            check_finite("the gradient norm", grad_norm, step, "Lower algorithm.lr or algorithm.max_grad_norm.")
            grad_norm_sum += grad_norm
            optimizer.step()
            updates += 1
            if not all(bool(torch.isfinite(p).all()) for p in params):
                raise TrainingStopped(f"step {step}: the weights are not finite after an optimizer step (algorithm.lr = "
                                      f"{algo.lr:g}); stopped before anything of this step was saved, so the last "
                                      "checkpoint and export hold finite weights. Lower algorithm.lr.")
    model.eval()
    tokens = sum(sum(s.response_mask) for s in trained) * algo.update_epochs
    stats = {"policy/entropy": entropy_sum / max(tokens, 1), "policy/clip_fraction": clipped / max(tokens, 1),
             "policy/loss": loss_sum / max(updates, 1), "policy/grad_norm": grad_norm_sum / max(updates, 1),
             "policy/updates": updates}
    if measure_kl:
        stats["policy/kl"] = update_kl(model, processor, trained, temperature, algo.micro_batch_size)
    return stats


def loss_denominators(groups: list[SignalGroup]) -> tuple[int, int]:
    """Returns (tokens, samples) a mini-batch's summed loss is divided by: as SkyRL's token_mean and sequence_mean,
    every credited sample of its groups, zero advantage included."""
    return sum(g.tokens for g in groups), sum(g.count for g in groups)


@torch.no_grad()
def update_kl(model, processor, samples: list[TrainingSample], temperature: float, micro_batch_size: int) -> float:
    """Returns how far the step moved the policy on what it trained on: the mean k3 estimate of KL(before || after)
    over the trained reply tokens (the dial for learning rate and batch size)."""
    total = count = 0.0
    for i in range(0, len(samples), micro_batch_size):
        chunk = samples[i : i + micro_batch_size]
        batch = collate(processor, chunk)
        logprobs, _ = token_logprobs(model, batch, temperature)
        mask = batch["response_mask"]
        log_ratio = (logprobs - batch["old_logprobs"]) * mask
        total += (k3(log_ratio) * mask).sum().item()
        count += mask.sum().item()
    return total / max(count, 1)


class TrainingStopped(RuntimeError):
    """A run that must not go on (its rollouts failed, or a loss went non-finite), said in one line; nothing of the
    failing step is written."""


def check_finite(name: str, value: float | torch.Tensor, step: int, hint: str) -> None:
    """Raises TrainingStopped when `value` (a number or tensor) holds a NaN or an infinity."""
    finite = bool(torch.isfinite(value).all()) if isinstance(value, torch.Tensor) else math.isfinite(value)
    if not finite:
        raise TrainingStopped(f"step {step}: {name} is not finite ({value if not isinstance(value, torch.Tensor) else 'NaN/inf'}); "
                              f"stopped before the optimizer step, nothing of this step was written. {hint}")


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

    token_mean: every response token weighs the same (1 / the denominator's tokens);
    sequence_mean: every sample weighs the same, its tokens averaged (1 / (its tokens x all samples)).
    """
    if reduction == "token_mean":
        return torch.full((response_mask.shape[0],), 1.0 / max(total_tokens, 1))
    if reduction == "sequence_mean":
        return 1.0 / (response_mask.sum(dim=1).clamp(min=1) * max(total_samples, 1))
    raise ValueError(f"unknown loss_reduction {reduction!r}: use 'token_mean' or 'sequence_mean'")


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """Returns the k3 estimate of KL per token from log(p/q): exp(r) - r - 1, never negative."""
    return torch.exp(log_ratio) - log_ratio - 1
