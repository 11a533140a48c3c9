"""Our profiles through SkyRL 0.4.0's own code: its config parser and validation, its dataset, its batch trimming."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from skyrl.train.config import SkyRLTrainConfig
from skyrl.train.dataset import PromptDataset
from skyrl.train.trainer import RayPPOTrainer
from skyrl.train.utils import validate_cfg
from transformers import AutoTokenizer

from services.trainer.skyrl_backend import (
    SkyRLRejected,
    data_files,
    skyrl_config,
    skyrl_overrides,
    skyrl_problems,
    to_cli,
    training_gpus,
)
from shared.config import load_config

REPO = Path(__file__).resolve().parents[2]
HYPERPOD = "configs/qwen3vl-8b-hyperpod.yaml"
# The tiny profile on one 2-GPU node (its CPU micro-batch of 32 exceeds what SkyRL splits per GPU there), with
# SkyRL's GRPO advantage (its local `branch` advantage is ours alone).
PROFILES = {HYPERPOD: [], "configs/tiny-cpu.yaml": [
    "backend=skyrl", "cluster.num_workers=1", "cluster.num_engines=2", "algorithm.micro_batch_size=8",
    "algorithm.advantage_estimator=grpo"]}


def load(profile: str, shared: Path, *overrides: str):
    return load_config(REPO / profile, [f"storage.shared_dir={shared}", *PROFILES[profile], *overrides], environ={})


def read(node, dotted: str):
    for part in dotted.split("."):
        node = node[part] if isinstance(node, dict) else getattr(node, part)
    return node


@pytest.mark.parametrize("profile", list(PROFILES))
def test_profile_passes_skyrls_parser_and_validation_unchanged(profile, tmp_path):
    cfg = load(profile, tmp_path)
    train, val = data_files(cfg)
    overrides = skyrl_overrides(cfg, train, val)
    parsed = SkyRLTrainConfig.from_cli_overrides(to_cli(overrides))
    validate_cfg(parsed)
    for key, value in overrides.items():  # every value landed on the key we meant, none renamed or dropped
        landed = read(parsed, key)
        if dataclasses.is_dataclass(landed):
            landed = {k: getattr(landed, k) for k in value}
        assert landed == value, key
    assert parsed.trainer.strategy == "fsdp" and parsed.trainer.dump_eval_results
    assert parsed.trainer.policy.model.lora.target_modules == cfg.lora.target_modules


def test_hyperpod_profile_states_what_the_example_leaves_open(tmp_path):
    parsed = skyrl_config(load(HYPERPOD, tmp_path))
    assert parsed.generator.inference_engine.engine_init_kwargs["max_model_len"] == 60000
    assert parsed.trainer.max_ckpts_to_keep == 2
    assert (parsed.trainer.train_batch_size * parsed.generator.n_samples_per_prompt) % 6 == 0


def test_our_data_files_through_skyrls_prompt_dataset(tmp_path, tiny_model_dir):
    cfg = load(HYPERPOD, tmp_path, "schedule.total_steps=2")
    train, val = data_files(cfg)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for path, env_id, count in ((train, "maze_2d/easy", 24 * 2 * 2), (val, "maze_2d/easy", 64)):
        dataset = PromptDataset([str(path)], tokenizer, max_prompt_length=2048, num_workers=1)
        assert len(dataset) == count, "SkyRL's length filter dropped rows"
        batch = dataset.collate_fn([dataset[i] for i in range(len(dataset))])
        assert {row["env_class"] for row in batch} == {"maze_2d"}
        assert {row["env_extras"]["env_id"] for row in batch} == {env_id}
    seeds = [row["env_extras"]["seed"] for row in batch]
    assert seeds == list(range(64))


@pytest.mark.parametrize("mazes,samples,gpus", [(16, 8, 6), (24, 8, 6), (12, 8, 6), (10, 4, 4), (8, 8, 2), (7, 3, 6)])
def test_batch_check_agrees_with_skyrls_trimming(mazes, samples, gpus, tmp_path):
    host = SimpleNamespace(dispatch=SimpleNamespace(get_lcm_dp_size=lambda: gpus),
                           cfg=SimpleNamespace(generator=SimpleNamespace(n_samples_per_prompt=samples)))
    kept = RayPPOTrainer._remove_tail_data(host, list(range(mazes)))
    cfg = load(HYPERPOD, tmp_path, f"rollout.train_batch_size={mazes}", f"rollout.n_samples_per_prompt={samples}",
               f"cluster.num_workers={gpus // 2}", "cluster.gpus_per_worker=2", f"cluster.num_engines={gpus}",
               "algorithm.mini_batch_size=null")  # one update a step: the profile's 12 divides 24 mazes only
    assert training_gpus(cfg) == gpus
    assert (len(kept) == mazes) == (not skyrl_problems(cfg)), (mazes, samples, gpus, len(kept))


def test_the_old_batch_of_16_loses_a_maze_every_step_and_is_refused(tmp_path):
    host = SimpleNamespace(dispatch=SimpleNamespace(get_lcm_dp_size=lambda: 6),
                           cfg=SimpleNamespace(generator=SimpleNamespace(n_samples_per_prompt=8)))
    assert len(RayPPOTrainer._remove_tail_data(host, list(range(16)))) == 15
    with pytest.raises(SkyRLRejected, match=r"rollout.train_batch_size=16.*multiple of 3"):
        skyrl_config(load(HYPERPOD, tmp_path, "rollout.train_batch_size=16", "algorithm.mini_batch_size=8"))


def trainer_cli(tmp_path, *args):
    env = {**os.environ, "SHARED_DIR": str(tmp_path)}
    return subprocess.run([sys.executable, "-m", "services.trainer", "--backend", "skyrl", "--config", HYPERPOD,
                           f"storage.shared_dir={tmp_path}", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


def test_dry_run_is_validated_by_skyrl(tmp_path):
    proc = trainer_cli(tmp_path, "--dry-run")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert "# validated by SkyRL 0.4.0 (SkyRLTrainConfig.from_cli_overrides + validate_cfg)" in lines
    assert 'trainer.policy.model.lora.target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]' in lines


@pytest.mark.parametrize("override,message", [
    ("algorithm.micro_batch_size=5", "should be divisible by micro_train_batch_size_per_gpu 5"),
    ("rollout.train_batch_size=16 algorithm.mini_batch_size=8",
     "rollout.train_batch_size=16: 16 mazes x 8 samples do not split over 6 GPUs"),
])
def test_a_profile_skyrl_rejects_fails_at_dry_run_in_one_line(tmp_path, override, message):
    proc = trainer_cli(tmp_path, "--dry-run", *override.split())
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], proc.stderr[-2000:]
    assert not (tmp_path / "runs" / "qwen3vl-8b-maze-grpo" / "skyrl_overrides.txt").exists()


def test_data_rows_name_the_env_and_seed(tmp_path):
    train, _ = data_files(load(HYPERPOD, tmp_path, "schedule.total_steps=1"))
    row = json.loads(train.read_text().splitlines()[0])
    assert row["env_class"] == "maze_2d" and row["seed"] >= 1_000_000 and row["max_turns"] == 15
