"""The skyrl backend where SkyRL is not installed (the main venv): overrides, data files, messages.

SkyRL's own code checks the same overrides in tests/skyrl_checks (run in .venv-skyrl by `make test`).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from services.trainer.skyrl_backend import SKYRL_VERSION, data_files, skyrl_overrides, to_cli
from shared.config import load_config

REPO = Path(__file__).resolve().parent.parent


def test_reference_recipe_lands_in_skyrl_keys(tmp_path):
    cfg = load_config(REPO / "configs/qwen3vl-8b-hyperpod.yaml", [f"storage.shared_dir={tmp_path}"], environ={})
    o = skyrl_overrides(cfg, tmp_path / "t", tmp_path / "v")
    # LoRA at 10x the example's full fine-tune rate (1e-6), as SkyRL's LoRA guide advises
    assert o["trainer.policy.model.lora.rank"] == 32 and o["trainer.policy.optimizer_config.lr"] == 1e-5
    assert o["generator.n_samples_per_prompt"] == 8 and o["generator.max_turns"] == 15
    assert o["generator.sampling_params"]["temperature"] == 0.7 and o["trainer.algorithm.use_kl_loss"] is False
    assert (o["trainer.eval_interval"], o["trainer.ckpt_interval"], o["trainer.hf_save_interval"]) == (10, 20, 20)
    assert o["generator.inference_engine.num_engines"] == 6 and o["trainer.placement.colocate_all"] is True
    assert o["generator.inference_engine.gpu_memory_utilization"] == 0.45
    assert o["generator.vision_language_generator"] is True and o["generator.batched"] is False
    assert o["trainer.remove_microbatch_padding"] is False and o["trainer.resume_mode"] == "latest"
    run = tmp_path / "runs" / cfg.run_id
    assert o["trainer.ckpt_path"] == str(run / "ckpts") and o["trainer.export_path"] == str(run / "exports")
    assert o["trainer.policy.model.lora.lora_sync_path"] == str(run / "lora_sync")
    assert o["environment.env_class"] == "maze_2d"
    assert (o["trainer.train_batch_size"], o["trainer.policy_mini_batch_size"]) == (24, 12), "two updates a step"
    assert o["trainer.policy.model.lora.target_modules"] == cfg.lora.target_modules, "names: SkyRL list()s the value"
    assert o["generator.inference_engine.engine_init_kwargs"]["max_model_len"] == 60000
    tiny = load_config(REPO / "configs/tiny-cpu.yaml", [f"storage.shared_dir={tmp_path}"], environ={})
    assert skyrl_overrides(tiny, tmp_path / "t", tmp_path / "v")["trainer.policy_mini_batch_size"] == 2


def test_data_files_hold_the_training_stream_and_the_eval_set(tmp_path):
    cfg = load_config(REPO / "configs/qwen3vl-8b-hyperpod.yaml", [f"storage.shared_dir={tmp_path}", "schedule.total_steps=2"],
                      environ={})
    train, val = data_files(cfg)
    val_rows = [json.loads(line) for line in val.read_text().splitlines()]
    assert [r["seed"] for r in val_rows] == list(range(64)) and val_rows[0]["env_class"] == "maze_2d"
    train_rows = [json.loads(line) for line in train.read_text().splitlines()]
    assert len(train_rows) == 24 * 2 * 2 and not {r["seed"] for r in train_rows} & set(range(64))


def test_dry_run_prints_the_overrides_and_writes_only_to_a_temp_folder(tmp_path):
    """A dry run works on a laptop without the profile's volume: the overrides name the run's data files, and the
    data, the overrides and the command land in a temp folder (its last line), never on the volume."""
    shared = tmp_path / "shared"
    shared.mkdir()
    env = {**os.environ, "SHARED_DIR": str(shared)}
    proc = subprocess.run([sys.executable, "-m", "services.trainer", "--backend", "skyrl", "--config",
                           "configs/qwen3vl-8b-hyperpod.yaml", "--dry-run", f"storage.shared_dir={shared}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert "generator.vision_language_generator=true" in lines
    assert "trainer.logger=tensorboard" in lines, "the profile's tracker, SkyRL's one backend"
    run = shared / "runs" / "qwen3vl-8b-maze-grpo"
    assert f'data.train_data=["{run / "data" / "train.jsonl"}"]' in lines
    assert lines[-2].startswith("# command: python -m services.trainer --backend skyrl")
    assert lines[-3].startswith("# not validated: SkyRL is not installed here")
    assert not any(shared.iterdir()), "a dry run writes nothing on the volume"
    folder = Path(lines[-1].split(" to ", 1)[1].split(" (", 1)[0])
    try:
        assert folder.name.startswith("maze-grpo-dry-run-qwen3vl-8b-maze-grpo-")
        assert (folder / "skyrl_overrides.txt").read_text().splitlines() == lines[:-3]
        assert (folder / "skyrl_command.txt").read_text().strip() == lines[-2].removeprefix("# command: ")
        assert len((folder / "val.jsonl").read_text().splitlines()) == 64
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    assert to_cli({"a": [1], "b": True, "c": None, "d": 0.5}) == ["a=[1]", "b=true", "c=null", "d=0.5"]


def test_submit_dry_run_submits_nothing_and_writes_nothing_outside_a_temp_folder(tmp_path):
    shared, home = tmp_path / "shared", tmp_path / "home"
    shared.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(SHARED_DIR=str(shared), HOME=str(home))
    proc = subprocess.run([sys.executable, "-m", "services.trainer", "submit", "--config",
                           "configs/qwen3vl-8b-hyperpod.yaml", "--dry-run"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("# would submit to sagemaker_ray://") and "python -m services.trainer --config configs/qwen3vl-8b-hyperpod.yaml" in lines[0]
    assert "nothing was submitted" in lines[1] and "generator.vision_language_generator=true" in lines
    assert not any(shared.iterdir()) and not home.exists(), "no job record, nothing on the volume"
    shutil.rmtree(lines[-1].split(" to ", 1)[1].split(" (", 1)[0], ignore_errors=True)


def test_skyrl_takes_one_tracker_and_a_profile_naming_two_is_refused_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "services.trainer", "--backend", "skyrl", "--config",
                           "configs/qwen3vl-8b-hyperpod.yaml", "--dry-run", f"storage.shared_dir={tmp_path}",
                           "trainer.logger=[console,tensorboard,wandb]"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0 and proc.stderr.count("\n") == 1, proc.stderr
    assert "SkyRL 0.4.0 logs to one backend" in proc.stderr and "keep one of tensorboard, wandb" in proc.stderr


def test_skyrl_run_without_skyrl_says_what_it_needs(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "services.trainer", "--backend", "skyrl", "--config",
                           "configs/qwen3vl-8b-hyperpod.yaml", f"storage.shared_dir={tmp_path}"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "skyrl[fsdp]==0.4.0" in proc.stderr and "Python >= 3.12" in proc.stderr


def test_the_pin_lives_in_one_place():
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    # envs/locks/ is written from pyproject.toml by `make lock`; test_skyrl_lock.py checks the venv matches it
    files = [REPO / name for name in tracked if not name.startswith(("tests/", "envs/locks/")) and (REPO / name).is_file()]
    holders = [p.relative_to(REPO).as_posix() for p in files if f"=={SKYRL_VERSION}" in p.read_text(errors="ignore")
               and "skyrl" in p.read_text(errors="ignore")]
    assert holders == ["pyproject.toml"], holders
    assert "gpu" in (REPO / "docker" / "Dockerfile.gpu").read_text()
