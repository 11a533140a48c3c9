"""A run's checkpoints and exports on the shared volume: what a GRPO step leaves so the run resumes exactly.

`ckpts/global_step_N/` holds the adapter, the optimizer, the random state, the maze stream's cursor and the
training settings that produced it (a resume under other settings is refused by the trainer); exports are the
adapter alone, in SkyRL's layout. Every folder is staged and renamed, so a kill leaves nothing half-written.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from services.trainer.rollout import load_adapter_weights
from shared.config import settings_hash
from shared.maze.dataset import MazeStream
from shared.storage.files import atomic_write_text, staged_dir
from shared.storage.volume import LATEST_STEP_FILE, SharedVolume, step_dirs


def save_adapter(model, folder: Path) -> None:
    """Writes SkyRL's export layout: adapter_model.safetensors + adapter_config.json."""
    # save_embedding_layers=False: peft would otherwise look the base model up on a hub.
    model.save_pretrained(str(folder), safe_serialization=True, save_embedding_layers=False)


def save_checkpoint(volume: SharedVolume, run_id: str, step: int, model, optimizer, stream: MazeStream,
                    settings: dict, keep: int | None = None, base_identity: str | None = None,
                    metrics: dict | None = None) -> Path:
    """Writes ckpts/global_step_N (adapter, optimizer, RNG, step, data cursor, the settings that trained it, the
    identity of the warm start under it and the step's metrics line) atomically, then the pointer; keeps the newest
    `keep`."""
    final = volume.ckpt(run_id, step)
    with staged_dir(final) as tmp:
        save_adapter(model, tmp / "policy")
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        state = {"step": step, "maze_stream": stream.state(), "python_rng": repr(random.getstate()),
                 "settings_hash": settings_hash(settings), "settings": settings, "base_model": base_identity,
                 "metrics": metrics}
        torch.save({"torch": torch.get_rng_state(), "numpy": np.random.get_state()}, tmp / "rng.pt")
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2))
    atomic_write_text(volume.ckpts(run_id) / LATEST_STEP_FILE, f"{step}\n")
    if keep:
        # Oldest first, and only after the pointer names the new one: a crash here leaves extra checkpoints, never none.
        for _, older in step_dirs(volume.ckpts(run_id))[:-keep]:
            shutil.rmtree(older, ignore_errors=True)
    return final


def checkpoint_settings(folder: Path) -> dict | None:
    """Returns the training settings a checkpoint records (None for one written before they were recorded)."""
    return json.loads((folder / "trainer_state.json").read_text()).get("settings")


def checkpoint_base(folder: Path) -> str | None:
    """Returns the identity of the warm start a checkpoint was trained on (None where it records none)."""
    return json.loads((folder / "trainer_state.json").read_text()).get("base_model")


def checkpoint_metrics(folder: Path) -> dict | None:
    """Returns the metrics line of the step a checkpoint ends (None for one written before they were recorded)."""
    return json.loads((folder / "trainer_state.json").read_text()).get("metrics")


def load_checkpoint(folder: Path, model, optimizer, stream: MazeStream) -> int:
    """Restores adapter, optimizer, RNG and data cursor from a verified checkpoint; returns its step."""
    load_adapter_weights(model, folder / "policy")
    optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=False))
    rng = torch.load(folder / "rng.pt", weights_only=False)
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    state = json.loads((folder / "trainer_state.json").read_text())
    stream.load_state(state["maze_stream"])
    return int(state["step"])
