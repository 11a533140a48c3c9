"""Shared fixtures: a tiny Qwen3-VL built once per test session on a temporary shared volume."""

import importlib.util
import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
REPO = Path(__file__).resolve().parent.parent
# tests/skyrl runs SkyRL's own code: in .venv-skyrl (Python 3.12), as `make test`'s second pytest run.
collect_ignore = [] if importlib.util.find_spec("skyrl") else ["skyrl"]


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("shared")


@pytest.fixture(scope="session")
def tiny_cfg(shared_dir):
    from shared.config import load_config

    return load_config(REPO / "configs" / "tiny-cpu.yaml", [f"storage.shared_dir={shared_dir}"], environ={})


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_cfg) -> Path:
    from shared.models.tiny import ensure_tiny_model

    return ensure_tiny_model(tiny_cfg, log=lambda *_: None)


@pytest.fixture(scope="session")
def tiny(tiny_model_dir):
    from shared.models.engine import load_model

    return load_model(tiny_model_dir)


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3-compatible HTTP server (moto in server mode) on loopback, for the whole session."""
    from services.exporter.local_s3 import start_server

    proc, url = start_server()
    yield url
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="session")
def exported_run(tiny_cfg, tiny_model_dir):
    """A run folder with two real LoRA exports (steps 2 and 4) of the tiny model, as the trainer writes them."""
    import torch

    from services.trainer.rollout import build_policy
    from shared.storage import SharedVolume, atomic_write_json, staged_dir

    volume = SharedVolume(tiny_cfg.shared_path())
    run_id = "exp-run"
    lora = tiny_cfg.lora.model_copy(update={"rank": 4, "alpha": 8})
    model, _ = build_policy(tiny_model_dir, lora, tiny_cfg.model.base_model_id)
    for step, rate in ((2, 0.25), (4, 0.125)):
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.fill_(0.01 * step)
        with staged_dir(volume.export(run_id, step)) as tmp:
            model.save_pretrained(str(tmp), save_embedding_layers=False)
        # The trainer's eval of that step (fixture data: which step is "best" is what the exporter reads).
        atomic_write_json(volume.eval(run_id, f"global_step_{step}") / "summary.json",
                          {"solve_rate": rate, "solved": int(rate * 64), "total": 64, "step": step})
    return volume, run_id
