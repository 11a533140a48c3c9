"""Paths on the shared volume, named as in the contract, and queries over its step folders.

Everything here only reads the volume (the writers are the trainer, the evaluator's reports and the
exporter's staging, through `shared.storage.files`).
"""

from __future__ import annotations

import re
from pathlib import Path

from shared.storage.manifest import MANIFEST, ManifestError, verify_manifest

LATEST_STEP_FILE = "latest_ckpt_global_step.txt"
# What a LoRA export folder (exports/global_step_N/policy/) holds, and what the exporter stages in S3.
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


class SharedVolume:
    """Paths on the shared volume, named as in the contract."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def model(self, name: str) -> Path:
        path = Path(name)
        return path if path.is_absolute() else self.root / "models" / name

    def dataset(self, env_id: str) -> Path:
        return self.root / "datasets" / env_id

    def run(self, run_id: str) -> Path:
        return self.root / "runs" / run_id

    def ckpts(self, run_id: str) -> Path:
        return self.run(run_id) / "ckpts"

    def ckpt(self, run_id: str, step: int) -> Path:
        return self.ckpts(run_id) / f"global_step_{step}"

    def exports(self, run_id: str) -> Path:
        return self.run(run_id) / "exports"

    def export(self, run_id: str, step: int) -> Path:
        return self.exports(run_id) / f"global_step_{step}" / "policy"

    def eval(self, run_id: str, name: str) -> Path:
        return self.run(run_id) / "evals" / name

    def lora_sync(self, run_id: str) -> Path:
        return self.run(run_id) / "lora_sync"

    def metrics(self, run_id: str) -> Path:
        return self.run(run_id) / "metrics.jsonl"


def step_dirs(parent: str | Path) -> list[tuple[int, Path]]:
    """Returns (step, folder) for every `global_step_N` under parent, ascending."""
    parent = Path(parent)
    if not parent.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in parent.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found)


def latest_complete_step(parent: str | Path, inner: str = "", warn=None) -> tuple[int, Path] | None:
    """Returns the newest (step, folder) whose manifest verifies; incomplete or corrupt ones are skipped.

    `inner` names a sub-folder holding the manifest (e.g. "policy" for exports). `warn` receives a
    message for each folder skipped.
    """
    for step, folder in reversed(step_dirs(parent)):
        target = folder / inner if inner else folder
        try:
            verify_manifest(target)
            return step, folder
        except ManifestError as exc:
            if warn:
                warn(f"skipping {target}: {exc}")
    return None


def unsealed(policy: Path) -> bool:
    """Whether an export folder holds both adapter files but no manifest (SkyRL writes exports so)."""
    return not (policy / MANIFEST).exists() and all((policy / name).is_file() for name in ADAPTER_FILES)


def complete_exports(volume: SharedVolume, run_id: str, warn=None) -> list[tuple[int, Path]]:
    """Returns (step, policy folder) of every export whose manifest verifies; writes nothing.

    An export with its files but no manifest is skipped with the command that seals it (see
    `shared.storage.skyrl_exports`).
    """
    found = []
    for step, folder in step_dirs(volume.exports(run_id)):
        policy = folder / "policy"
        try:
            verify_manifest(policy)
            found.append((step, policy))
        except ManifestError as exc:
            if warn and unsealed(policy):
                warn(f"skipping unsealed export {policy}: it has its adapter files but no {MANIFEST} (SkyRL run "
                     f"outside `python -m services.trainer`?); seal it with `python -m services.exporter adopt --run {run_id}`")
            elif warn:
                warn(f"skipping incomplete export {folder}: {exc}")
    return found
