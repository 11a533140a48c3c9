"""GRPO trainer: the math by hand, a 2-step end-to-end run, kill-and-resume equivalence."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from services.trainer.grpo import (
    branch_advantages,
    credit_turns,
    group_advantages,
    loss_row_weights,
    ppo_clip_loss,
    step_advantages,
)
from services.trainer.rollout import MazeGroup, PlayedEpisode
from shared.config import AlgorithmConfig
from shared.models.engine import TrainingSample
from shared.storage.manifest import verify_manifest

REPO = Path(__file__).resolve().parent.parent

# A minimal run: 2 mazes x 2 samples, 4-turn episodes, a 4-maze eval set, a few-second SFT.
MINIMAL = [
    "sft.num_mazes=12", "sft.batch_size=16", "rollout.train_batch_size=2", "rollout.n_samples_per_prompt=2",
    "env.max_turns=4", "env.eval_seeds=0-3", "env.extended_eval_seeds=4-11", "rollout.max_new_tokens=8",
    "schedule.total_steps=2",
    "schedule.eval_interval=1", "schedule.ckpt_interval=1", "schedule.hf_save_interval=1",
    "lora.rank=4", "lora.alpha=8", "algorithm.lr=0.01", "rollout.temperature=1.0",
    # GiGPO and one optimizer step per maze group: the states travel from the Ray workers, resume stays exact
    "algorithm.advantage_estimator=gigpo", "algorithm.mini_batch_size=1",
]


def test_equal_rewards_give_zero_advantage():
    rewards = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 1.0]])
    adv = group_advantages(rewards, std_normalize=True)
    assert torch.equal(adv[0], torch.zeros(4)) and torch.equal(adv[1], torch.zeros(4))
    # mean 0.5, unbiased std sqrt(1/3): (1 - 0.5) / 0.57735 = 0.866
    assert torch.allclose(adv[2], torch.tensor([0.8660, -0.8660, -0.8660, 0.8660]), atol=1e-3)
    assert torch.allclose(group_advantages(rewards, std_normalize=False)[2], torch.tensor([0.5, -0.5, -0.5, 0.5]))


def test_step_advantages_credit_the_turn_taken_from_a_shared_state():
    # One maze, two episodes from start A. Episode 0 goes A -> B and solves in 2 turns; episode 1 goes A -> C,
    # back to A and runs out of turns. gamma 0.5: episode 0's returns are [0.5, 1.0], episode 1's all 0.
    rewards, states = [1.0, 0.0], [["A", "B"], ["A", "C", "A"]]
    # State A was left 3 times with returns 0.5, 0, 0 (mean 1/6); B and C were seen once: no step advantage.
    plain = step_advantages(rewards, states, gamma=0.5, std_normalize=False)
    assert [len(turns) for turns in plain] == [2, 3]
    assert sum(plain, []) == pytest.approx([1 / 3, 0.0, -1 / 6, 0.0, -1 / 6])
    std = torch.tensor([0.5, 0.0, 0.0]).std().item()  # unbiased, 0.2887
    normed = step_advantages(rewards, states, gamma=0.5, std_normalize=True)
    assert sum(normed, []) == pytest.approx([1 / 3 / std, 0.0, -1 / 6 / std, 0.0, -1 / 6 / std], rel=1e-4)
    # Equal returns from every shared state (here all failed) give nothing, as in GRPO.
    assert step_advantages([0.0, 0.0], states, gamma=0.5) == [[0.0, 0.0], [0.0, 0.0, 0.0]]


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


def _played(turns: int, states: list, reward: float) -> PlayedEpisode:
    samples = [TrainingSample(input_ids=[t], response_mask=[1], images=[]) for t in range(turns)]
    return PlayedEpisode(reward=reward, solved=reward == 1.0, turns=turns, parse_failures=0, format_rate=1.0,
                         samples=samples, states=states)


def test_credit_turns_grpo_and_gigpo():
    # Group 0: both solved, one with a detour through C (3 turns vs 2). Group 1: one of two solved.
    groups_played = [MazeGroup("maze_2d/easy", 1, [_played(2, ["A", "B"], 1.0), _played(3, ["A", "C", "A"], 1.0)]),
                     MazeGroup("maze_2d/easy", 2, [_played(1, ["A"], 1.0), _played(2, ["A", "D"], 0.0)])]
    grpo = AlgorithmConfig(std_normalize=False)
    samples, groups = credit_turns(groups_played, grpo)
    assert len(samples) == 8
    assert all(s.advantage == 0.0 for g in groups_played for e in g.episodes for s in e.samples), "rollouts untouched"
    assert [[s.advantage for s in g] for g in groups] == [[0.5, -0.5, -0.5]], "the all-solved group has no signal"

    gigpo = AlgorithmConfig(std_normalize=False, advantage_estimator="gigpo", gamma=0.5, step_advantage_weight=2.0)
    samples, groups = credit_turns(groups_played, gigpo)
    # Group 0: episode advantages 0; from A the returns were 0.5 (ep 0) and 0.25, 1.0 (ep 1), mean 7/12.
    assert [s.advantage for s in groups[0]] == pytest.approx([2 * (0.5 - 7 / 12), 2 * (0.25 - 7 / 12), 2 * (1.0 - 7 / 12)])
    # Group 1: from A the returns were 1.0 and 0.5 * 0: step advantages +-0.5 on top of GRPO's +-0.5.
    assert [s.advantage for s in groups[1]] == pytest.approx([0.5 + 2 * 0.5, -0.5 - 2 * 0.5, -0.5])


def test_credit_turns_branch_keeps_only_turns_with_advantage():
    played = [_played(3, ["A", "B", "D"], 1.0), _played(3, ["A", "B", "E"], 0.0), _played(2, ["A", "C"], 0.0),
              _played(3, ["A", "B", "D"], 1.0)]
    samples, groups = credit_turns([MazeGroup("maze_2d/easy", 1, played)],
                                   AlgorithmConfig(std_normalize=False, advantage_estimator="branch"))
    assert len(samples) == 11
    assert [s.advantage for s in groups[0]] == pytest.approx([1 / 6, 1 / 3, 1 / 6, -2 / 3, -1 / 2, 1 / 6, 1 / 3])


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


def _train(shared: Path, run_id: str, extra=(), wait=True):
    cmd = [sys.executable, "-m", "services.trainer", *MINIMAL, f"run_id={run_id}", *extra]
    env = {**os.environ, "SHARED_DIR": str(shared), "PYTHONUNBUFFERED": "1"}
    if wait:
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    shared = tmp_path_factory.mktemp("trainer")
    proc = _train(shared, "full")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return shared, proc


def test_two_step_run_writes_every_artifact(trained):
    shared, proc = trained
    run = shared / "runs" / "full"
    assert (run / "run.yaml").exists()
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    for key in ("reward/mean", "train/solve_rate", "train/format_rate", "train/parse_failures", "train/mean_turns",
                "policy/entropy", "policy/clip_fraction", "policy/grad_norm", "policy/updates", "timing/rollout_s", "timing/train_s",
                "timing/sync_s", "throughput/rollout_tokens_per_s"):
        assert key in metrics[0], key
    for step in (0, 1, 2):
        summary = json.loads((run / "evals" / f"global_step_{step}" / "summary.json").read_text())
        for key in ("env", "seeds", "max_turns", "total", "solved", "solve_rate", "oracle_solved", "format_rate",
                    "parse_failures", "mean_turns", "model", "adapter"):
            assert key in summary, key
        assert summary["seeds"] == "0-3" and summary["total"] == 4
    for step in (1, 2):
        verify_manifest(run / "ckpts" / f"global_step_{step}")
        export = run / "exports" / f"global_step_{step}" / "policy"
        verify_manifest(export)
        config = json.loads((export / "adapter_config.json").read_text())
        assert config["r"] == 4 and config["base_model_name_or_path"] == "tiny-qwen3vl-sft"
        weights = load_file(str(export / "adapter_model.safetensors"))
        assert weights and all("lora_" in k for k in weights)
        assert all("language_model" in k for k in weights), "LoRA on the language model only"
    assert (run / "ckpts" / "latest_ckpt_global_step.txt").read_text().strip() == "2"
    verify_manifest(run / "lora_sync")
    assert (run / "solve_rate_vs_step.png").stat().st_size > 1000
    sft_summary = json.loads((shared / "models" / "tiny-qwen3vl-sft" / "eval" / "summary.json").read_text())
    assert sft_summary["sft_seeds"].startswith("1000000-")
    # The extended set scored the warm start (adapter off) and the final policy; the summary pairs them.
    for step, adapter in ((0, None), (2, "full@global_step_2")):
        extended = json.loads((run / "evals" / f"extended_step_{step}" / "summary.json").read_text())
        assert (extended["seeds"], extended["total"], extended["adapter"]) == ("4-11", 8, adapter)
    summary = json.loads((run / "summary.json").read_text())
    assert list(summary["curve"]) == ["0", "1", "2"] and summary["steps"] == 2 and summary["wall_s"] > 0
    assert set(summary["comparisons"]) == {"held-out 4", "extended 8"}
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


def test_kill_and_resume_reproduces_the_uninterrupted_run(trained):
    shared, _ = trained
    # Share the built models so only the GRPO part runs again.
    proc = _train(shared, "killed", wait=False)
    deadline = time.time() + 600
    ckpt1 = shared / "runs" / "killed" / "ckpts" / "global_step_1" / "manifest.json"
    while not ckpt1.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert ckpt1.exists(), "the run should have reached its first checkpoint"
    if (shared / "runs" / "killed" / "ckpts" / "global_step_2" / "manifest.json").exists():
        pytest.skip("the trainer finished before it was killed")
    resumed = _train(shared, "killed")
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert "resuming killed" in resumed.stdout
    full = load_file(str(shared / "runs/full/exports/global_step_2/policy/adapter_model.safetensors"))
    again = load_file(str(shared / "runs/killed/exports/global_step_2/policy/adapter_model.safetensors"))
    assert full.keys() == again.keys()
    for key in full:
        assert torch.allclose(full[key], again[key], atol=1e-5), key
    def lines(run):
        return [json.loads(x) for x in (shared / "runs" / run / "metrics.jsonl").read_text().splitlines()]
    assert [m["reward/mean"] for m in lines("full")] == [m["reward/mean"] for m in lines("killed")]


def test_corrupt_checkpoint_is_skipped_with_a_warning(trained):
    shared, _ = trained
    import shutil

    run = shared / "runs" / "corrupt"
    shutil.copytree(shared / "runs" / "full", run)
    with open(run / "ckpts" / "global_step_2" / "optimizer.pt", "ab") as handle:
        handle.write(b"tampered")
    proc = _train(shared, "corrupt", extra=["schedule.total_steps=2"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "skipping" in proc.stdout and "global_step_2" in proc.stdout
    assert "resuming corrupt" in proc.stdout and "(step 1)" in proc.stdout


def test_restart_from_scratch_keeps_every_eval_in_history(trained):
    shared, _ = trained
    import shutil

    run = shared / "runs" / "fresh"
    shutil.copytree(shared / "runs" / "full", run)
    shutil.rmtree(run / "ckpts")  # no checkpoint: the run starts again from step 0, its evals already on disk
    proc = _train(shared, "fresh")
    assert proc.returncode == 0, proc.stderr[-2000:]
    history = [json.loads(line)["step"] for line in (run / "evals" / "history.jsonl").read_text().splitlines()]
    assert sorted(history) == [0, 1, 2], history
    assert list(json.loads((run / "summary.json").read_text())["curve"]) == ["0", "1", "2"]
    assert "held-out curve (step: solve rate): 0: " in proc.stdout


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
