"""The skyrl backend, proven against SkyRL's own config source (read with ast, never imported)."""

import ast
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from services.trainer.skyrl_backend import SKYRL_VERSION, data_files, skyrl_overrides, to_cli
from shared.config import load_config

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".cache" / "wheels"


@pytest.fixture(scope="module")
def skyrl_config_source() -> str:
    """Returns skyrl/train/config/config.py from the pinned wheel, downloaded once and cached in .cache/."""
    wheel = CACHE / f"skyrl-{SKYRL_VERSION}-py3-none-any.whl"
    if not wheel.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"skyrl=={SKYRL_VERSION}",
                               "--python-version", "3.12", "--only-binary=:all:", "-d", str(CACHE)],
                              capture_output=True, text=True, timeout=300)
        if proc.returncode != 0 or not wheel.exists():
            pytest.skip(f"could not download skyrl=={SKYRL_VERSION}: {proc.stderr[-300:]}")
    with zipfile.ZipFile(wheel) as archive:
        return archive.read("skyrl/train/config/config.py").decode()


class Schema:
    """Dataclass fields of SkyRL's config module: class name -> {field: annotation source}."""

    def __init__(self, source: str):
        tree = ast.parse(source)
        self.classes = {}
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                fields = {}
                for item in node.body:
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        fields[item.target.id] = ast.unparse(item.annotation)
                self.classes[node.name] = fields

    def field(self, dotted: str) -> str:
        cls = "SkyRLTrainConfig"
        parts = dotted.split(".")
        for i, part in enumerate(parts):
            fields = self.classes[cls]
            assert part in fields, f"{dotted}: SkyRL's {cls} has no field {part!r}"
            annotation = fields[part]
            if i == len(parts) - 1:
                return annotation
            nested = [name for name in self.classes if name in annotation]
            assert nested, f"{dotted}: {cls}.{part} ({annotation}) is not a nested config"
            cls = max(nested, key=len)
        raise AssertionError(dotted)

    def accepts(self, annotation: str, value) -> bool:
        node = ast.parse(annotation, mode="eval").body
        return self._accepts(node, value)

    def _accepts(self, node, value) -> bool:
        if isinstance(node, ast.Constant) and node.value is None:
            return value is None
        if isinstance(node, ast.Name):
            name = node.id
            if name in self.classes:
                return isinstance(value, dict) and all(
                    key in self.classes[name] and self.accepts(self.classes[name][key], v) for key, v in value.items())
            simple = {"int": int, "float": (int, float), "str": str, "bool": bool, "dict": dict, "list": list, "Any": object}
            if name == "int":
                return isinstance(value, int) and not isinstance(value, bool)
            return isinstance(value, simple[name])
        if isinstance(node, ast.Subscript):
            head = ast.unparse(node.value)
            args = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            if head == "Optional":
                return value is None or self._accepts(args[0], value)
            if head == "Union":
                return any(self._accepts(a, value) for a in args)
            if head in ("List", "list"):
                return isinstance(value, list) and all(self._accepts(args[0], v) for v in value)
            if head in ("Dict", "dict"):
                return isinstance(value, dict) and all(self._accepts(args[1], v) for v in value.values())
            if head == "Literal":
                return value in [a.value for a in args]
        if isinstance(node, ast.BinOp):  # X | Y
            return self._accepts(node.left, value) or self._accepts(node.right, value)
        raise AssertionError(f"annotation form not handled: {ast.unparse(node)}")


@pytest.mark.parametrize("profile", ["configs/qwen3vl-8b-hyperpod.yaml", "configs/tiny-cpu.yaml"])
def test_every_generated_key_exists_with_the_right_type(skyrl_config_source, profile, tmp_path):
    schema = Schema(skyrl_config_source)
    cfg = load_config(REPO / profile, [f"storage.shared_dir={tmp_path}"], environ={})
    overrides = skyrl_overrides(cfg, tmp_path / "train.jsonl", tmp_path / "val.jsonl")
    for key, value in overrides.items():
        annotation = schema.field(key)
        assert schema.accepts(annotation, value), f"{key}={value!r} does not fit SkyRL's type {annotation}"


def test_reference_recipe_lands_in_skyrl_keys(tmp_path):
    cfg = load_config(REPO / "configs/qwen3vl-8b-hyperpod.yaml", [f"storage.shared_dir={tmp_path}"], environ={})
    o = skyrl_overrides(cfg, tmp_path / "t", tmp_path / "v")
    assert o["trainer.policy.model.lora.rank"] == 32 and o["trainer.policy.optimizer_config.lr"] == 1e-6
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
    assert o["trainer.policy_mini_batch_size"] == o["trainer.train_batch_size"], "unset: one update per step"
    tiny = load_config(REPO / "configs/tiny-cpu.yaml", [f"storage.shared_dir={tmp_path}"], environ={})
    assert skyrl_overrides(tiny, tmp_path / "t", tmp_path / "v")["trainer.policy_mini_batch_size"] == 2


def test_data_files_hold_tickets_and_the_eval_set(tmp_path):
    cfg = load_config(REPO / "configs/qwen3vl-8b-hyperpod.yaml", [f"storage.shared_dir={tmp_path}", "schedule.total_steps=2"],
                      environ={})
    train, val = data_files(cfg)
    val_rows = [json.loads(line) for line in val.read_text().splitlines()]
    assert [r["seed"] for r in val_rows] == list(range(64)) and val_rows[0]["env_class"] == "maze_2d"
    train_rows = [json.loads(line) for line in train.read_text().splitlines()]
    assert len(train_rows) == 16 * 2 * 2 and not {r["seed"] for r in train_rows} & set(range(64))


def test_dry_run_prints_and_records_overrides(tmp_path):
    env = {**os.environ, "SHARED_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "services.trainer", "--backend", "skyrl", "--config",
                           "configs/qwen3vl-8b-hyperpod.yaml", "--dry-run", f"storage.shared_dir={tmp_path}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert "generator.vision_language_generator=true" in lines
    assert lines[-1].startswith("# command: python -m services.trainer --backend skyrl")
    run = tmp_path / "runs" / "qwen3vl-8b-maze-grpo"
    assert (run / "skyrl_overrides.txt").read_text().splitlines() == lines[:-1]
    assert (run / "skyrl_command.txt").exists()
    assert to_cli({"a": [1], "b": True, "c": None, "d": 0.5}) == ["a=[1]", "b=true", "c=null", "d=0.5"]


def test_skyrl_run_without_skyrl_says_what_it_needs(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "services.trainer", "--backend", "skyrl", "--config",
                           "configs/qwen3vl-8b-hyperpod.yaml", f"storage.shared_dir={tmp_path}"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "skyrl[fsdp]==0.4.0" in proc.stderr and "Python >= 3.12" in proc.stderr


def test_the_pin_lives_in_one_place():
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    files = [REPO / name for name in tracked if not name.startswith("tests/") and (REPO / name).is_file()]
    holders = [p.relative_to(REPO).as_posix() for p in files if f"=={SKYRL_VERSION}" in p.read_text(errors="ignore")
               and "skyrl" in p.read_text(errors="ignore")]
    assert holders == ["pyproject.toml"], holders
    assert "gpu" in (REPO / "docker" / "Dockerfile.gpu").read_text()
