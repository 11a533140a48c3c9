"""Sealing the LoRA exports SkyRL writes: `exports/global_step_N/policy/` with its adapter files but no
`manifest.json`, which every reader of the volume requires.

Two explicit ways, never a side effect of reading:
- the skyrl backend seals each export right after SkyRL's `save_models` returns (`seal_export`): SkyRL
  writes the folder under a temporary name and renames it, so it is whole by then;
- `python -m services.exporter adopt --run RUN` seals the exports of a SkyRL run made some other way, once
  their files have not changed for `min_age_s` (`adopt_settled_exports`).
"""

from __future__ import annotations

import time
from pathlib import Path

from shared.storage.manifest import write_manifest
from shared.storage.volume import ADAPTER_FILES, SharedVolume, step_dirs, unsealed


def seal_export(policy: str | Path, how: str) -> dict:
    """Writes the manifest of a whole export folder (both adapter files present); returns it. ValueError if not whole."""
    policy = Path(policy)
    missing = [name for name in ADAPTER_FILES if not (policy / name).is_file()]
    if missing:
        raise ValueError(f"{policy} lacks {', '.join(missing)}: not a LoRA export (was the run trained with LoRA?)")
    return write_manifest(policy, {"sealed": how})


def adopt_settled_exports(volume: SharedVolume, run_id: str, min_age_s: float = 60.0) -> tuple[list[int], list[int]]:
    """Seals each unsealed export of a run whose files have not changed for `min_age_s`.

    Returns (sealed steps, steps still settling). Exports that already have a manifest are left alone.
    """
    sealed, settling = [], []
    for step, folder in step_dirs(volume.exports(run_id)):
        policy = folder / "policy"
        if not unsealed(policy):
            continue
        if time.time() - max((policy / name).stat().st_mtime for name in ADAPTER_FILES) < min_age_s:
            settling.append(step)
            continue
        seal_export(policy, f"adopted: its files had not changed for {min_age_s:g} s")
        sealed.append(step)
    return sealed, settling
