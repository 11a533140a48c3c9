"""GRPO trainer: the math by hand, a 2-step end-to-end run, kill-and-resume equivalence."""

import dataclasses
import functools
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import TRANSFER
from safetensors.torch import load_file

from services.trainer.algorithm import (
    ESTIMATORS,
    branch_advantages,
    credit_turns,
    group_advantages,
    grpo_advantages,
    loss_row_weights,
    ppo_clip_loss,
    register_estimator,
)
from services.trainer.report import plot_title
from services.trainer.rollout import MazeGroup, ScoredEpisode
from shared.config import AlgorithmConfig
from shared.models.contract import Completion
from shared.models.training import TrainingSample
from shared.storage.manifest import verify_manifest

REPO = Path(__file__).resolve().parent.parent

# A minimal run: 2 mazes x 2 samples, 4-turn episodes, a 4-maze eval set, a few-second SFT. No maze can be solved in
# 4 turns, so the reward is the share of the shortest path covered (the trainer refuses `task` there).
MINIMAL = [
    "sft.num_mazes=12", "sft.batch_size=16", "rollout.train_batch_size=2", "rollout.n_samples_per_prompt=2",
    "env.max_turns=4", "env.reward=task_progress", "env.eval_seeds=0-3", "env.extended_eval_seeds=4-11",
    "rollout.max_new_tokens=8", "rollout.eval_samples=2",
    "schedule.total_steps=2",
    "schedule.eval_interval=1", "schedule.ckpt_interval=1", "schedule.hf_save_interval=1",
    "lora.rank=4", "lora.alpha=8", "algorithm.lr=0.01", "rollout.temperature=1.0",
    # The branch advantage and one optimizer step per maze group: the states travel from the Ray workers, resume
    # stays exact
    "algorithm.advantage_estimator=branch", "algorithm.mini_batch_size=1",
]


def test_equal_rewards_give_zero_advantage():
    rewards = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 1.0]])
    adv = group_advantages(rewards, std_normalize=True)
    assert torch.equal(adv[0], torch.zeros(4)) and torch.equal(adv[1], torch.zeros(4))
    # mean 0.5, unbiased std sqrt(1/3): (1 - 0.5) / 0.57735 = 0.866
    assert torch.allclose(adv[2], torch.tensor([0.8660, -0.8660, -0.8660, 0.8660]), atol=1e-3)
    assert torch.allclose(group_advantages(rewards, std_normalize=False)[2], torch.tensor([0.5, -0.5, -0.5, 0.5]))


def test_branch_advantages_credit_only_the_turns_after_which_outcomes_differ():
    # Four episodes of one maze from A. Two go A -> B -> D and solve; one goes A -> B -> E and fails; one goes
    # A -> C and fails. Node values (mean reward of the episodes there): A 1/2, B 2/3, C 0, D 1, E 0.
    rewards = [1.0, 0.0, 0.0, 1.0]
    states = [["A", "B", "D"], ["A", "B", "E"], ["A", "C"], ["A", "B", "D"]]
    plain = branch_advantages(rewards, states, std_normalize=False)
    assert plain[0] == pytest.approx([2 / 3 - 1 / 2, 1 - 2 / 3, 0.0]) and plain[3] == plain[0]
    assert plain[1] == pytest.approx([2 / 3 - 1 / 2, 0 - 2 / 3, 0.0])
    assert plain[2] == pytest.approx([0 - 1 / 2, 0.0])
    # Each episode's advantages sum to GRPO's (reward minus the group mean); past the last branch exactly 0.
    grpo = group_advantages(torch.tensor([rewards]), std_normalize=False)[0].tolist()
    assert [sum(turns) for turns in plain] == pytest.approx(grpo)
    assert plain[0][2] == 0.0 and plain[2][1] == 0.0
    normed = branch_advantages(rewards, states, std_normalize=True)
    std = torch.tensor(rewards).std().item()
    assert sum(normed, []) == pytest.approx([a / std for a in sum(plain, [])], rel=1e-5)
    # A shared opening and equal outcomes carry nothing.
    assert branch_advantages([0.0, 0.0], [["A", "B"], ["A", "B", "B"]]) == [[0.0, 0.0], [0.0, 0.0, 0.0]]


def test_the_estimator_registry_is_what_the_config_offers():
    """Each registered estimator is a pure function [episode][turn] -> advantage; the config offers exactly them."""
    from typing import get_args

    assert set(ESTIMATORS) == set(get_args(AlgorithmConfig.model_fields["advantage_estimator"].annotation))
    assert ESTIMATORS["grpo"] is grpo_advantages and ESTIMATORS["branch"] is branch_advantages
    # grpo: reward minus the group mean (mean 0.25), the same on every turn of an episode, whatever its states
    by_hand = grpo_advantages([1.0, 0.0, 0.0, 0.0], [["A", "B"], ["A"], ["A", "C", "D"], ["E"]], std_normalize=False)
    assert [len(turns) for turns in by_hand] == [2, 1, 3, 1]
    assert sum(by_hand, []) == pytest.approx([0.75, 0.75, -0.25, -0.25, -0.25, -0.25, -0.25])
    with pytest.raises(ValueError, match="already registered"):
        register_estimator("grpo")(grpo_advantages)


def _played(turns: int, states: list, reward: float) -> ScoredEpisode:
    samples = [TrainingSample(input_ids=[t], response_mask=[1], images=[]) for t in range(turns)]
    return ScoredEpisode(reward=reward, solved=reward == 1.0, num_turns=turns, parse_failures=0, format_rate=1.0,
                         training_samples=samples, states=states)


def test_credit_turns_grpo():
    # Group 0: both solved, one with a detour through C (3 turns vs 2). Group 1: one of two solved.
    groups_played = [MazeGroup("maze_2d/easy", 1, [_played(2, ["A", "B"], 1.0), _played(3, ["A", "C", "A"], 1.0)]),
                     MazeGroup("maze_2d/easy", 2, [_played(1, ["A"], 1.0), _played(2, ["A", "D"], 0.0)])]
    grpo = AlgorithmConfig(std_normalize=False)
    samples, groups = credit_turns(groups_played, grpo)
    assert len(samples) == 8
    assert all(s.advantage == 0.0 for g in groups_played for e in g.episodes for s in e.training_samples), "rollouts untouched"
    assert [[s.advantage for s in g.samples] for g in groups] == [[0.5, -0.5, -0.5]], "the all-solved group has no signal"
    assert (groups[0].tokens, groups[0].count) == (3, 3)


def test_credit_turns_branch_keeps_only_turns_with_advantage():
    played = [_played(3, ["A", "B", "D"], 1.0), _played(3, ["A", "B", "E"], 0.0), _played(2, ["A", "C"], 0.0),
              _played(3, ["A", "B", "D"], 1.0)]
    samples, groups = credit_turns([MazeGroup("maze_2d/easy", 1, played)],
                                   AlgorithmConfig(std_normalize=False, advantage_estimator="branch"))
    assert len(samples) == 11
    assert [s.advantage for s in groups[0].samples] == pytest.approx([1 / 6, 1 / 3, 1 / 6, -2 / 3, -1 / 2, 1 / 6, 1 / 3])
    assert groups[0].tokens == 11, "the zero-advantage turns count in SkyRL's token_mean"


def test_ppo_clip_loss_by_hand_and_masks():
    logprobs = torch.log(torch.tensor([[0.5, 0.5, 0.9, 0.1]]))
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5]]))
    # token 0 is a prompt token, 3 an observation token: both masked out
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    loss, clipped = ppo_clip_loss(logprobs, old, torch.tensor([2.0]), mask, 0.2, 0.2)
    # token 1: ratio 1 -> -2.0; token 2: ratio 1.8 clipped to 1.2 -> -2.4
    assert loss.item() == pytest.approx(-4.4, abs=1e-5) and clipped.item() == 1
    loss, clipped = ppo_clip_loss(logprobs, old, torch.tensor([-1.0]), mask)
    # negative advantage: token 2 min(-1.8, -1.2) = -1.8 -> loss 1.8 (unclipped); token 1 -> 1.0
    assert loss.item() == pytest.approx(2.8, abs=1e-5) and clipped.item() == 0
    changed = torch.log(torch.tensor([[0.01, 0.5, 0.9, 0.99]]))
    assert ppo_clip_loss(changed, old, torch.tensor([2.0]), mask)[0].item() == pytest.approx(-4.4, abs=1e-5)


def test_loss_reductions_weigh_tokens_or_samples():
    # two samples in a step: one with 1 response token, one with 3; each token's loss is -advantage
    mask = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 1.0, 1.0, 1.0]])
    zeros, adv = torch.zeros(2, 4), torch.tensor([1.0, 1.0])
    token = loss_row_weights(mask, "token_mean", total_tokens=4, total_samples=2)
    assert ppo_clip_loss(zeros, zeros, adv, mask, row_weights=token)[0].item() == pytest.approx(-1.0)
    sequence = loss_row_weights(mask, "sequence_mean", total_tokens=4, total_samples=2)
    assert torch.allclose(sequence, torch.tensor([1 / 2, 1 / 6]))
    # token_mean: the long sample gets 3/4 of the weight; sequence_mean: each sample gets half
    only_long = torch.tensor([0.0, 1.0])
    assert ppo_clip_loss(zeros, zeros, only_long, mask, row_weights=token)[0].item() == pytest.approx(-0.75)
    assert ppo_clip_loss(zeros, zeros, only_long, mask, row_weights=sequence)[0].item() == pytest.approx(-0.5)
    with pytest.raises(ValueError, match="loss_reduction"):
        loss_row_weights(mask, "sum", 4, 2)


def _train(shared: Path, run_id: str, extra=(), wait=True, ray_address: str | None = None):
    cmd = [sys.executable, "-m", "services.trainer", *MINIMAL, f"run_id={run_id}", *extra]
    # W&B, where a test asks for it (trainer.logger), logs offline: into the run's folder, no account.
    env = {**os.environ, "SHARED_DIR": str(shared), "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline"}
    if ray_address:
        env["RAY_ADDRESS"] = ray_address
    if wait:
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _tensorboard(run: Path) -> dict[str, list[tuple[int, float]]]:
    """Returns {tag: [(step, value), ...]} from the run's TensorBoard event files, read by TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _wandb_history(run_file: Path) -> dict[int, dict]:
    """Returns {step: logged values} from an offline W&B run file (run-<id>.wandb): W&B's record log (32 KiB blocks
    of length-prefixed chunks after a 7-byte header), each record one of W&B's own protobuf messages."""
    import struct

    from wandb.proto import wandb_internal_pb2

    raw, pos, block, chunks, records = run_file.read_bytes(), 7, 32768, b"", []
    assert raw[:4] == b":W&B"
    while pos + 7 <= len(raw):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        if length == 0 and kind == 0:  # the rest of a block left empty
            pos += left
            continue
        chunks += raw[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or its last chunk
            records.append(chunks)
            chunks = b""
    history = {}
    for data in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history.setdefault(items.get("_step", record.history.step.num), {}).update(items)
    return history


@pytest.fixture(scope="module")
def train(ray_head_address):
    """`_train` joining the session's Ray head: the trainer runs below share one Ray instead of starting one each."""
    return functools.partial(_train, ray_address=ray_head_address)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, train):
    shared = tmp_path_factory.mktemp("trainer")
    proc = train(shared, "full")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return shared, proc


@pytest.mark.slow
def test_two_step_run_writes_every_artifact(trained):
    shared, proc = trained
    run = shared / "runs" / "full"
    assert (run / "run.yaml").exists()
    # The run's log lines, each with its time, level and module; the terminal got the same lines bare.
    logged = (run / "train.log").read_text().splitlines()
    assert any(re.match(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO    services\.trainer\.run_evals: eval @ step 2: ", line)
               for line in logged), logged[-5:]
    assert "eval @ step 2: " in proc.stdout and "INFO" not in proc.stdout
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    for key in ("reward/mean", "train/solve_rate", "train/format_rate", "train/parse_failures", "train/mean_turns",
                "policy/entropy", "policy/clip_fraction", "policy/grad_norm", "policy/updates", "policy/kl",
                "rollout/errors", "timing/rollout_s", "timing/train_s", "timing/sync_s",
                "throughput/rollout_tokens_per_s", "eval/junction_accuracy"):
        assert key in metrics[0], key
    assert all(m["rollout/errors"] == 0 for m in metrics)
    for step in (0, 1, 2):
        summary = json.loads((run / "evals" / f"global_step_{step}" / "summary.json").read_text())
        for key in ("env", "seeds", "max_turns", "total", "solved", "solve_rate", "oracle_solved", "format_rate",
                    "parse_failures", "mean_turns", "model", "adapter", "pass_at_1", "pass_at_1_definition",
                    "machine", "junctions", "eval_settings", "policy"):
            assert key in summary, key
        assert summary["seeds"] == "0-3" and summary["total"] == 4
        assert set(summary["machine"]) >= {"cpu", "cpu_capability", "threads", "torch", "math_library"}
        assert "env.reward='task_progress'" in summary["pass_at_1_definition"]
    for step in (1, 2):
        verify_manifest(run / "ckpts" / f"global_step_{step}")
        export = run / "exports" / f"global_step_{step}" / "policy"
        verify_manifest(export)
        config = json.loads((export / "adapter_config.json").read_text())
        assert config["r"] == 4 and config["base_model_name_or_path"] == "tiny-qwen3vl-sft"
        weights = load_file(str(export / "adapter_model.safetensors"))
        assert weights and all("lora_" in k for k in weights)
        assert all("language_model" in k for k in weights), "LoRA on the language model only"
        # Its model card (covered by the manifest): the base, what trained it, the step's held-out result with its
        # interval and ceiling, and the command and config that made it.
        card = (export / "README.md").read_text()
        front = card.split("\n---\n", 1)[0]
        assert "base_model: tiny-qwen3vl-sft" in front and "library_name: peft" in front and "license: apache-2.0" in front
        assert f"# full, step {step}" in card and "More Information Needed" not in card
        held_out = json.loads((run / "evals" / f"global_step_{step}" / "summary.json").read_text())
        assert f"| maze_2d/easy seeds 0-3, 4 turns | {held_out['solved']}/4 |" in card
        assert f"{step} GRPO steps of run `full`: 2 maze_2d/easy mazes x 2 episodes per step" in card
        assert "python -m services.trainer sft.num_mazes=12" in card and "run_id=full" in card
        assert "run_id: full" in card and "seeds 2000000-" in card
    assert (run / "ckpts" / "latest_ckpt_global_step.txt").read_text().strip() == "2"
    # TensorBoard (trainer.logger's default) holds every number of each step's line, and the held-out evals.
    scalars = _tensorboard(run)
    for key in ("reward/mean", "train/solve_rate", "policy/kl", "timing/rollout_s", "throughput/rollout_tokens_per_s"):
        assert scalars[key] == [(m["step"], pytest.approx(m[key])) for m in metrics], key
    assert [step for step, _ in scalars["eval/solve_rate"]] == [0, 1, 2]
    verify_manifest(run / "lora_sync")
    assert (run / "solve_rate_vs_step.png").stat().st_size > 1000
    page = (run / "report.html").read_text()
    assert "extended 8 mean@2" in page and "data:image/png;base64," in page
    starts = [json.loads(line) for line in (run / "config_history.jsonl").read_text().splitlines()]
    assert len(starts) == 1 and starts[0]["from_step"] == 0 and starts[0]["settings"]["algorithm.lr"] == 0.01
    sft_summary = json.loads((shared / "models" / "tiny-qwen3vl-sft" / "eval" / "summary.json").read_text())
    assert sft_summary["sft_seeds"].startswith("1000000-")
    # The extended set scored the warm start (adapter off) and the final policy; the summary pairs them.
    for step, adapter in ((0, None), (2, "full@global_step_2")):
        extended = json.loads((run / "evals" / f"extended_step_{step}" / "summary.json").read_text())
        assert (extended["seeds"], extended["total"], extended["adapter"]) == ("4-11", 8, adapter)
    summary = json.loads((run / "summary.json").read_text())
    assert list(summary["curve"]) == ["0", "1", "2"] and summary["steps"] == 2 and summary["wall_s"] > 0
    assert set(summary["comparisons"]) == {"held-out 4", "extended 8", "extended 8 mean@2 T=1", "extended 8 pass@2"}
    assert summary["machine"]["cpu"] and "pass_at_1" in proc.stdout and "mean@2" in proc.stdout
    for comparison in summary["comparisons"].values():
        assert (comparison["before"]["step"], comparison["after"]["step"]) == (0, 2)
        paired = comparison["paired"]
        assert paired["difference"] == pytest.approx(
            (comparison["after"]["solved"] - comparison["before"]["solved"]) / comparison["before"]["total"])
        assert paired["ci_low"] <= paired["difference"] <= paired["ci_high"]
    # GRPO's mazes come after SFT's, and run.yaml says which it drew (2 steps x 2 mazes).
    assert summary["sft_seeds"] == sft_summary["sft_seeds"] and summary["rl_seeds"] == "2000000-2000003"
    assert "# rl_seeds: 2000000-2000003" in (run / "run.yaml").read_text()
    assert "== full: 2 GRPO steps" in proc.stdout and "extended 8" in proc.stdout
    # The summary, the page and the plot's title name the warm start the run started from, and what it imitated.
    assert sft_summary["sft_settings"]["sft.demos"] == "solver"
    assert summary["warm_start"] == "tiny-qwen3vl-sft (sft.demos=solver: imitates the optimal solver)"
    assert plot_title(summary) == f"{summary['run_id']}, from tiny-qwen3vl-sft (sft.demos=solver)"  # the PNG's title
    assert f"warm start: {summary['warm_start']}" in proc.stdout and "imitates the optimal solver" in page
    # The run ends saying where its results landed: report, plot, the best export and the commands for it.
    landed = proc.stdout[proc.stdout.index("where it landed:"):]
    assert f"report   {run / 'report.html'}" in landed and f"plot     {run / 'solve_rate_vs_step.png'}" in landed
    rates = {s: json.loads((run / "evals" / f"global_step_{s}" / "summary.json").read_text())["solve_rate"] for s in (1, 2)}
    best = max(rates, key=lambda s: (rates[s], s))
    assert f"best export (step {best}, held-out {100 * rates[best]:.1f}%)  {run / 'exports' / f'global_step_{best}' / 'policy'}" in landed
    assert f'make eval RUN=full ARGS="--adapter {run / "exports" / f"global_step_{best}" / "policy"}"' in landed
    assert 'make export RUN=full ARGS="--alias full-best --pick best"' in landed


@pytest.mark.slow
def test_kill_and_resume_reproduces_the_uninterrupted_run(trained, train):
    shared, _ = trained
    # Share the built models so only the GRPO part runs again.
    loggers = ["trainer.logger=[console,tensorboard,wandb]"]
    proc = train(shared, "killed", extra=loggers, wait=False)
    deadline = time.time() + 600
    ckpts = shared / "runs" / "killed" / "ckpts"
    while not (ckpts / "global_step_1" / "manifest.json").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (ckpts / "global_step_1" / "manifest.json").exists(), "the run should have reached its first checkpoint"
    # Killed just after step 1's checkpoint, whatever the scheduler did meanwhile: a later checkpoint (the kill came
    # late) is taken back, so the resume below always starts from step 1.
    shutil.rmtree(ckpts / "global_step_2", ignore_errors=True)
    (ckpts / "latest_ckpt_global_step.txt").write_text("1\n")
    # And always as if the kill came between that checkpoint and its metrics line (the window CI once hit): the
    # resume restores the line from the checkpoint's own copy.
    metrics = shared / "runs" / "killed" / "metrics.jsonl"
    if metrics.exists():
        metrics.write_text("".join(line + "\n" for line in metrics.read_text().splitlines()
                                   if json.loads(line)["step"] < 1))
    resumed = train(shared, "killed", extra=loggers)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert "resuming killed" in resumed.stdout
    # The steps replayed after the checkpoint appear once in TensorBoard (the killed run's events for them are
    # dropped), with the resumed run's values; W&B's offline run of the resume logged them too.
    killed = [json.loads(x) for x in (shared / "runs" / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert _tensorboard(shared / "runs" / "killed")["reward/mean"] == [(m["step"], pytest.approx(m["reward/mean"]))
                                                                       for m in killed]
    last = sorted((shared / "runs" / "killed" / "wandb").glob("offline-run-*"))[-1]
    history = _wandb_history(next(last.glob("run-*.wandb")))
    assert history[2]["reward/mean"] == pytest.approx(killed[-1]["reward/mean"]) and "policy/kl" in history[2]
    full = load_file(str(shared / "runs/full/exports/global_step_2/policy/adapter_model.safetensors"))
    again = load_file(str(shared / "runs/killed/exports/global_step_2/policy/adapter_model.safetensors"))
    assert full.keys() == again.keys()
    for key in full:
        assert torch.allclose(full[key], again[key], atol=1e-5), key
    def lines(run):
        return [json.loads(x) for x in (shared / "runs" / run / "metrics.jsonl").read_text().splitlines()]
    assert [m["reward/mean"] for m in lines("full")] == [m["reward/mean"] for m in lines("killed")]


@pytest.mark.slow
def test_corrupt_checkpoint_is_skipped_with_a_warning(trained, train):
    shared, _ = trained
    run = shared / "runs" / "corrupt"
    shutil.copytree(shared / "runs" / "full", run)
    with open(run / "ckpts" / "global_step_2" / "optimizer.pt", "ab") as handle:
        handle.write(b"tampered")
    proc = train(shared, "corrupt", extra=["schedule.total_steps=2"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "warning: skipping" in proc.stderr and "global_step_2" in proc.stderr, proc.stderr[-2000:]
    assert "resuming corrupt" in proc.stdout and "(step 1)" in proc.stdout


@pytest.mark.slow
def test_restart_from_scratch_keeps_every_eval_in_history(trained, train):
    shared, _ = trained
    run = shared / "runs" / "fresh"
    shutil.copytree(shared / "runs" / "full", run)
    shutil.rmtree(run / "ckpts")  # no checkpoint: the run starts again from step 0, its evals already on disk
    proc = train(shared, "fresh")
    assert proc.returncode == 0, proc.stderr[-2000:]
    history = [json.loads(line)["step"] for line in (run / "evals" / "history.jsonl").read_text().splitlines()]
    assert sorted(history) == [0, 1, 2], history
    assert list(json.loads((run / "summary.json").read_text())["curve"]) == ["0", "1", "2"]
    assert "held-out curve (step: solve rate): 0: " in proc.stdout


@pytest.mark.slow
def test_changed_settings_stop_a_resume_and_an_eval_reuse_unless_asked(trained, train):
    shared, _ = trained
    run = shared / "runs" / "changed"
    shutil.copytree(shared / "runs" / "full", run)
    history = (run / "config_history.jsonl").read_text().splitlines()
    _refused(shared, "changed", "algorithm.lr=1.0", "rollout.n_samples_per_prompt=4",
             words=("algorithm.lr (0.01 -> 1.0)", "rollout.n_samples_per_prompt (2 -> 4)", "run_id=<new id>",
                    "--allow-changed-settings"))
    assert (run / "config_history.jsonl").read_text().splitlines() == history, "a refused start records nothing"
    # On purpose: the run goes on with the new settings, and its history says what changed when.
    proc = train(shared, "changed", extra=["algorithm.lr=1.0", "rollout.n_samples_per_prompt=4", "rollout.temperature=0.5",
                                            "schedule.total_steps=3", "--allow-changed-settings"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    # The warm start's sampled eval played at the old rollout.temperature: scored again at the new one, with a warning.
    assert "extended_sampled_step_0 was scored under other settings (temperature): scoring it again" in proc.stderr, \
        proc.stderr
    sampled = json.loads((run / "evals" / "extended_sampled_step_0" / "summary.json").read_text())
    assert sampled["temperature"] == 0.5 and sampled["samples_per_maze"] == 2
    starts = [json.loads(x) for x in (run / "config_history.jsonl").read_text().splitlines()]
    assert len(starts) == len(history) + 1 and starts[-1]["from_step"] == 2
    assert any("algorithm.lr" in change for change in starts[-1]["changed"])
    assert starts[0]["settings"]["algorithm.lr"] == 0.01 and starts[-1]["settings"]["algorithm.lr"] == 1.0
    state = json.loads((run / "ckpts" / "global_step_3" / "trainer_state.json").read_text())
    assert state["settings"]["algorithm.lr"] == 1.0 and state["settings_hash"] == starts[-1]["settings_hash"]
    # Evals on disk from other eval settings are never reused silently: a fresh start that would reuse one stops
    # before Ray starts and before anything is recorded, even where that eval would come after a training step.
    fresh = shared / "runs" / "changed-evals"
    shutil.copytree(shared / "runs" / "full", fresh)
    shutil.rmtree(fresh / "ckpts")
    history = (fresh / "config_history.jsonl").read_text()
    _refused(shared, "changed-evals", "rollout.eval_temperature=0.5",
             words=("global_step_0 was scored under other settings (eval_settings, temperature differ)",))
    _refused(shared, "changed-evals", "rollout.eval_temperature=0.5", "schedule.eval_before_train=false",
             words=("global_step_1 was scored under other settings (eval_settings, policy, temperature differ)",))
    assert (fresh / "config_history.jsonl").read_text() == history, "a refused start records nothing"
    # A resume whose checkpoint's settings still hold (rollout.eval_samples decides no training) but whose last eval
    # would reuse the warm start's sampled one, scored with other samples per maze: refused before the steps it adds.
    resumed = shared / "runs" / "more-samples"
    shutil.copytree(shared / "runs" / "full", resumed)
    history = (resumed / "config_history.jsonl").read_text()
    _refused(shared, "more-samples", "rollout.eval_samples=3", "schedule.total_steps=3",
             words=("extended_sampled_step_0 was scored under other settings (samples_per_maze differ)",))
    assert (resumed / "config_history.jsonl").read_text() == history, "a refused start records nothing"
    import ray

    assert not ray.is_initialized(), "refused before Ray starts"


def _refused(shared: Path, run_id: str, *extra, words=()) -> str:
    """Runs the trainer's command (its `main`) in this process, for refusals that come before any Ray starts, and
    returns the one line it exits with, checking it holds each of `words`."""
    from services.trainer.__main__ import main

    with pytest.raises(SystemExit) as stop:
        main([*MINIMAL, f"run_id={run_id}", f"storage.shared_dir={shared}", *extra])
    line = str(stop.value.code)
    assert stop.value.code not in (0, None) and "\n" not in line, line
    for word in words:
        assert word in line, (word, line)
    return line


@pytest.mark.slow
def test_a_resume_on_a_rebuilt_warm_start_is_refused_naming_both(trained):
    """The checkpoint records the warm start's identity: the same model.path holding other weights is refused."""
    from shared.storage.manifest import write_manifest

    shared, _ = trained
    run = shared / "runs" / "rebased"
    shutil.copytree(shared / "runs" / "full", run)
    ckpt = run / "ckpts" / "global_step_2"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["base_model"], "a checkpoint names its warm start"
    state["base_model"] = "0123456789abcdef"  # as if trained on a warm start since rebuilt with other weights
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    write_manifest(ckpt)
    history = (run / "config_history.jsonl").read_text()
    line = _refused(shared, "rebased", "schedule.total_steps=3", words=("0123456789abcdef", "warm start was rebuilt"))
    assert (run / "config_history.jsonl").read_text() == history, line


@pytest.mark.slow
def test_resume_mode_none_never_empties_an_existing_run(trained):
    shared, _ = trained
    run = shared / "runs" / "restart-none"
    shutil.copytree(shared / "runs" / "full", run)
    metrics = (run / "metrics.jsonl").read_text()
    _refused(shared, "restart-none", "schedule.resume_mode=none", words=("resume_mode = 'none'", "nothing was changed"))
    assert (run / "metrics.jsonl").read_text() == metrics and (run / "ckpts" / "global_step_2").is_dir()


@pytest.mark.slow
def test_a_damaged_metrics_line_is_one_line(trained):
    shared, _ = trained
    run = shared / "runs" / "damaged"
    shutil.copytree(shared / "runs" / "full", run)
    with open(run / "metrics.jsonl", "a") as handle:
        handle.write("[1]\n")
    _refused(shared, "damaged", words=("metrics.jsonl line 3 is not a JSON object",))


def test_a_run_lock_holding_garbage_is_taken_over_as_stale(tmp_path):
    from services.trainer.run_lock import RunLock

    for garbage in ("[1]", "5", '{"pid": "x"}', "not json"):
        (tmp_path / "trainer.lock").write_text(garbage)
        warnings = []
        with RunLock(tmp_path, warn=warnings.append):
            assert json.loads((tmp_path / "trainer.lock").read_text())["pid"] == os.getpid()
        assert any("stale run lock from an unreadable lock" in w for w in warnings), (garbage, warnings)


@pytest.mark.slow
def test_a_full_disk_during_a_checkpoint_is_one_line_and_loses_nothing(tmp_path, trained, train):
    """The run's ckpts/ is a 16 KB file system: the first checkpoint cannot be written (a real ENOSPC)."""
    shared = tmp_path
    if os.geteuid() != 0:
        pytest.fail("needs root to mount a small tmpfs (make test runs as root in CI)")
    shutil.copytree(trained[0] / "models", shared / "models")  # the warm start built once: only the step runs
    ckpts = shared / "runs" / "diskfull" / "ckpts"
    ckpts.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(ckpts)], check=True)
    try:
        proc = train(shared, "diskfull", extra=["schedule.total_steps=1"])
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        line = proc.stderr.strip().splitlines()[-1]
        assert "disk is full" in line and "nothing is lost" in line, line
        assert not [p for p in ckpts.iterdir()], f"a partial checkpoint was left: {list(ckpts.iterdir())} ({line})"
        assert not (shared / "runs" / "diskfull" / "metrics.jsonl").read_text().strip(), "the step was recorded as done"
    finally:
        subprocess.run(["umount", str(ckpts)], check=True)


@pytest.mark.slow
def test_sft_does_fixed_work_whatever_the_machine_speed(tiny_cfg, tiny_model_dir, monkeypatch):
    """The warm start runs every batch its config implies, in a seed-fixed order: a machine so slow that each
    clock read is an hour later trains the identical model."""
    import time as clock

    from services.trainer.sft import run_sft
    from shared.config import load_config

    def cfg_for(name):
        return load_config(REPO / "configs" / "tiny-cpu.yaml", [
            f"storage.shared_dir={tiny_cfg.shared_path()}", f"model.path={name}", "sft.num_mazes=12",
            "sft.batch_size=16", "env.eval_seeds=0-1", "env.max_turns=4", "rollout.max_new_tokens=8"], environ={})

    idle = run_sft(cfg_for("sft-idle"), log=lambda *_: None)
    real = clock.perf_counter
    hours = iter(range(10**6))
    monkeypatch.setattr(clock, "perf_counter", lambda: real() + 3600 * next(hours))
    loaded = run_sft(cfg_for("sft-loaded"), log=lambda *_: None)
    monkeypatch.undo()
    summaries = [json.loads((d / "eval" / "summary.json").read_text()) for d in (idle, loaded)]
    assert summaries[0]["sft_batches"] == summaries[1]["sft_batches"] == -(-summaries[0]["sft_samples"] // 16)
    assert summaries[0]["sft_train_s"] < 3600 < summaries[1]["sft_train_s"]  # the slow clock did apply
    first, second = (load_file(str(d / "model.safetensors")) for d in (idle, loaded))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_sft_demos_choose_the_solver_or_the_explorer_and_a_warm_start_remembers_which(tmp_path):
    """sft.demos=solver demonstrates the shortest path and stop; explore, the explorer's walk from a stream of the
    run's seed and the maze's, with stop only where it ends on the target. A warm start built with one refuses a
    profile asking for the other; one built before the setting existed counts as the solver's."""
    import random

    from services.trainer.sft import check_built_with, demo_conversation
    from shared.config import ConfigError, load_config, sft_settings
    from shared.maze import generate, solve
    from shared.maze.core import MOVES, explore_walk

    def replies(messages):
        return [m["content"][0]["text"] for m in messages if m["role"] == "assistant"]

    solver, explore = (load_config(REPO / "configs" / "tiny-cpu.yaml", [f"sft.demos={kind}"], environ={})
                       for kind in ("solver", "explore"))
    reached = 0
    for seed in range(40):
        maze = generate("maze_2d/easy", seed)
        if len(solve(maze)) < solver.env.max_turns:
            assert replies(demo_conversation(maze, solver)) == [f"('move', {d})" for d in solve(maze)] + ["('stop', 'stop')"]
        walk = explore_walk(maze, random.Random(f"{explore.seed}/{maze.seed}"), explore.env.max_turns - 1)
        position = maze.agent
        for d in walk:
            position = (position[0] + MOVES[d][0], position[1] + MOVES[d][1])
        stop = ["('stop', 'stop')"] if position == maze.target else []
        reached += bool(stop)
        assert replies(demo_conversation(maze, explore)) == [f"('move', {d})" for d in walk] + stop
    assert 0 < reached < 40, "some walks end on the target (and stop), most do not"

    built = tmp_path / "model"
    (built / "eval").mkdir(parents=True)
    (built / "eval" / "summary.json").write_text(json.dumps({"sft_settings": sft_settings(solver)}))
    check_built_with(built, solver)
    with pytest.raises(ConfigError, match=r"sft\.demos \('solver' -> 'explore'\)"):
        check_built_with(built, explore)
    older = {k: v for k, v in sft_settings(solver).items() if k != "sft.demos"}
    (built / "eval" / "summary.json").write_text(json.dumps({"sft_settings": older}))
    check_built_with(built, solver)
    with pytest.raises(ConfigError, match=r"sft\.demos"):
        check_built_with(built, explore)


def test_sft_sample_context_is_what_the_rollout_engine_reads(tiny_cfg, tiny):
    """Every SFT turn is trained in the context a rollout plays that turn in: token for token the ids the engine's
    model read before replying (the memory guard counts the exchanges before the reply, never the reply itself)."""
    import random

    from services.trainer.sft import demo_conversation, turn_samples
    from shared.maze import generate
    from shared.models.inference import LocalEngine

    model, processor = tiny
    engine = LocalEngine.for_model(tiny_cfg, model, processor, name="tiny")
    assert tiny_cfg.model.max_turns_in_context == 2, "the profile's guard: this test needs turns past it"
    messages = demo_conversation(generate("maze_2d/easy", 7), tiny_cfg)
    samples = turn_samples(processor, messages, tiny_cfg, keep=1.0, rng=random.Random(0))
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    assert len(samples) == len(replies) > tiny_cfg.model.max_turns_in_context + 1
    completions = engine.generate([messages[:i] for i in replies], temperature=0.0, max_new_tokens=1)
    for turn, (sample, completion, index) in enumerate(zip(samples, completions, replies)):
        context = sample.response_mask.index(1)
        assert sample.input_ids[:context] == completion.prompt_ids, f"turn {turn}: the SFT context differs"
        reply = processor.tokenizer.decode(sample.input_ids[context:])
        assert reply == messages[index]["content"][0]["text"] + "<|im_end|>"
        assert all(sample.response_mask[context:])


class _FlakyEngine:
    """An engine that fails every request of the conversations it is told to (as a remote engine reports a request
    that failed after its retries), and answers the rest with the real tiny model."""

    def __init__(self, engine, failing_prompt_image):
        self.engine, self.failing = engine, failing_prompt_image
        self.processor, self.max_images, self.context_turns = engine.processor, engine.max_images, engine.context_turns

    def prompt(self, messages):
        return self.engine.prompt(messages)

    def generate(self, conversations, temperature=0.0, max_new_tokens=24, seed=None):
        replies = self.engine.generate(conversations, temperature, max_new_tokens, seed)
        return [Completion("", [], error="RuntimeError: the engine failed this request")
                if c[0]["content"][1]["image"].tobytes() == self.failing else r for c, r in zip(conversations, replies)]


def test_rollout_errors_are_counted_never_trained_on_and_stop_the_run(tiny_cfg, tiny):
    from PIL import Image

    from services.trainer.algorithm import TrainingStopped
    from services.trainer.grpo import check_rollout_errors
    from services.trainer.rollout import play_rollouts
    from shared.maze import generate, render_rgb
    from shared.models.inference import LocalEngine

    model, processor = tiny
    cfg = tiny_cfg.model_copy(update={"env": tiny_cfg.env.model_copy(update={"max_turns": 3})})
    failing = Image.fromarray(render_rgb(generate("maze_2d/easy", 2000001), cfg.env.cell_px)).tobytes()
    engine = _FlakyEngine(LocalEngine.for_model(cfg, model, processor, name="tiny"), failing)
    groups = play_rollouts(engine, cfg, [("maze_2d/easy", 2000000), ("maze_2d/easy", 2000001)], 4, seed=1)
    assert [len(g.episodes) for g in groups] == [4, 0] and [len(g.errors) for g in groups] == [0, 4]
    samples, signal = credit_turns(groups, AlgorithmConfig(std_normalize=False))
    assert len(samples) == sum(len(e.training_samples) for e in groups[0].episodes), "nothing of a failed episode is trained on"
    groups[1].log = "/tmp/ray/session_x/logs/worker-1.err"
    with pytest.raises(TrainingStopped, match=r"step 3: 4 of 8 rollout episodes failed.*the engine failed this request"
                                              r".*worker log says more: /tmp/ray/session_x/logs/worker-1.err"):
        check_rollout_errors(groups, 0.25, step=3)
    check_rollout_errors(groups, 0.5, step=3)  # at the tolerated share: goes on


def _group(samples):
    from services.trainer.algorithm import SignalGroup

    return SignalGroup(samples, sum(sum(s.response_mask) for s in samples), len(samples))


def test_non_finite_advantages_or_losses_stop_before_the_optimizer_step(tiny_cfg, tiny_model_dir):
    from services.trainer.algorithm import TrainingStopped, update_policy
    from services.trainer.rollout import build_policy
    from shared.episodes import EpisodeSettings, solver_episode
    from shared.maze import generate
    from shared.models.inference import LocalEngine
    from shared.models.training import encode_turn

    model, processor = build_policy(tiny_model_dir, tiny_cfg.lora, "tiny", trainable=True)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=0.1)
    engine = LocalEngine.for_model(tiny_cfg, model, processor, name="tiny")
    episode = solver_episode(generate("maze_2d/easy", 2000000), EpisodeSettings.from_config(tiny_cfg))
    turns = [encode_turn(engine, messages, engine.generate([messages], 1.0, 6, seed=0)[0])
             for messages, _ in episode.samples[:2]]
    before = [p.detach().clone() for p in params]
    algo = AlgorithmConfig()

    def unchanged():
        return all(torch.equal(a, b) for a, b in zip(before, params))

    nan_advantage = [dataclasses.replace(turns[0], advantage=float("nan")), dataclasses.replace(turns[1], advantage=1.0)]
    with pytest.raises(TrainingStopped, match="step 7: an advantage is not finite"):
        update_policy(model, optimizer, params, processor, [_group(nan_advantage)], algo=algo, temperature=1.0,
                      per_update=1, step=7)
    assert unchanged()
    # A sampler that gave a token probability 0 (log-prob -inf) makes the PPO ratio infinite: the loss is inf.
    impossible = dataclasses.replace(turns[0], advantage=-1.0, old_logprobs=[-math.inf] * len(turns[0].old_logprobs))
    with pytest.raises(TrainingStopped, match="step 8: the loss is not finite"):
        update_policy(model, optimizer, params, processor, [_group([impossible])], algo=algo, temperature=1.0,
                      per_update=1, step=8)
    assert unchanged(), "the optimizer must not step on a non-finite loss"
    stats = update_policy(model, optimizer, params, processor, [_group([dataclasses.replace(turns[0], advantage=1.0)])],
                          algo=algo, temperature=1.0, per_update=1, step=9)
    assert stats["policy/updates"] == 1 and not unchanged()
    # An update that leaves the weights non-finite (a learning rate the config would refuse) stops the run at once.
    for group in optimizer.param_groups:
        group["lr"] = float("inf")
    with pytest.raises(TrainingStopped, match="step 10: the weights are not finite after an optimizer step"):
        update_policy(model, optimizer, params, processor, [_group([dataclasses.replace(turns[1], advantage=1.0)])],
                      algo=algo, temperature=1.0, per_update=1, step=10)


@pytest.mark.slow
def test_settings_that_cannot_train_are_refused_at_start_up(tmp_path):
    from shared.config import ConfigError, check_trainable, load_config

    def refused(*overrides):
        with pytest.raises(ConfigError) as error:
            check_trainable(load_config(None, list(overrides), environ={}))
        return str(error.value)

    for estimator in ("grpo", "branch"):
        assert "rollout.n_samples_per_prompt = 1" in refused("rollout.n_samples_per_prompt=1",
                                                             f"algorithm.advantage_estimator={estimator}")
    assert "rollout.temperature = 0" in refused("rollout.temperature=0")
    assert "env.max_turns = 12 is below the 13 actions" in refused("env.max_turns=12")
    check_trainable(load_config(None, ["env.max_turns=12", "env.reward=task_progress"], environ={}))
    # Through the trainer's command: one line, the fix, a non-zero exit, before anything is built.
    _refused(tmp_path, "n1", "rollout.n_samples_per_prompt=1", words=("rollout.n_samples_per_prompt >= 2",))
    assert not (tmp_path / "models").exists()
    _refused(tmp_path, "short", "rollout.max_new_tokens=3",
             words=("rollout.max_new_tokens = 3 is shorter than a plain reply",))


# Eight GRPO steps on fresh 7x7 mazes from TRANSFER's short warm start (pinned in tests/fixtures), the default's
# branch advantage; the 64 held-out mazes are played greedily before and after (eval_interval=0), never trained on.
GRPO_7X7 = ["rollout.train_batch_size=4", "rollout.n_samples_per_prompt=8", "rollout.temperature=1.0",
            "algorithm.advantage_estimator=branch", "algorithm.lr=0.001", "algorithm.mini_batch_size=null",
            "lora.rank=8", "lora.alpha=16", "schedule.total_steps=8", "schedule.eval_interval=0",
            "schedule.ckpt_interval=8", "schedule.hf_save_interval=8", "rollout.eval_samples=0"]


@pytest.mark.slow
def test_grpo_on_fresh_mazes_transfers_to_mazes_it_never_trained_on(warm_start_7x7, tmp_path, ray_head_address):
    """The transfer test: eight GRPO steps on fresh mazes make the greedy policy solve more of 64 held-out mazes,
    paired maze by maze, with the paired 95% interval of the gain above zero (its own noise). The warm start never
    says `stop` and mostly walks into walls; GRPO teaches it to stop on the target and to bump fewer walls. A
    flipped loss sign or zeroed advantages fail here, under AVX-512 and AVX2 kernels alike (docs/experiments.md,
    "A transfer test" and "The transfer test, pinned"). Its diagnostics are off (the after-step KL pass and the
    junction probe: neither touches what it trains or scores, and they were a quarter of its time), and it joins the
    session's Ray head as the other trainer runs here do."""
    shutil.copytree(warm_start_7x7, tmp_path / "models")
    env = {**os.environ, "SHARED_DIR": str(tmp_path), "PYTHONUNBUFFERED": "1", "RAY_ADDRESS": ray_head_address}
    proc = subprocess.run([sys.executable, "-m", "services.trainer", *TRANSFER, *GRPO_7X7, "run_id=transfer",
                           "trainer.update_kl=false", "schedule.junction_probe=false"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "runs" / "transfer"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert sum(m["policy/updates"] for m in metrics) >= 6, "the steps trained"
    assert not [m for m in metrics if "policy/kl" in m], "trainer.update_kl=false: no after-step KL pass"
    summary = json.loads((run / "summary.json").read_text())
    first_seed = int(summary["rl_seeds"].split("-")[0])
    assert first_seed >= 2_000_000, summary["rl_seeds"]  # GRPO's own stream, never the held-out seeds 0-63
    held_out = summary["comparisons"]["held-out 64"]
    assert (held_out["before"]["step"], held_out["after"]["step"]) == (0, 8)
    paired = held_out["paired"]
    assert paired["ci_low"] > 0 and paired["gained"] > paired["lost"], held_out
    evals = [json.loads(line) for line in (run / "evals" / "history.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 8] and not [e for e in evals if "junctions" in e], "no junction probe"
