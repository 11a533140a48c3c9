"""`manifest.json`: the sha256 and size of every file in a folder, written last. A folder is complete only
once its manifest exists and every listed file matches it; readers trust nothing else."""

from __future__ import annotations

import hashlib
import json
import re
import time
from pathlib import Path

from shared.storage.files import atomic_write_json

MANIFEST = "manifest.json"
# One component of a file name a manifest may list: letters, digits, '.', '_', '-' (never '.' or '..' alone).
_NAME_PART = re.compile(r"[A-Za-z0-9._-]{1,128}")


class ManifestError(ValueError):
    """A folder whose manifest is missing, unreadable, or disagrees with the files."""


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def list_files(folder: str | Path) -> list[str]:
    """Returns the relative paths of the files a manifest covers (all but the manifest and temp files)."""
    folder = Path(folder)
    names = []
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if path.is_file() and rel != MANIFEST and not any(p.startswith(".tmp-") or p.endswith(".tmp") for p in rel.split("/")):
            names.append(rel)
    return names


def write_manifest(folder: str | Path, extra: dict | None = None) -> dict:
    """Writes `manifest.json` (sha256 + size per file) last, atomically; returns it."""
    folder = Path(folder)
    manifest = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "files": {name: {"sha256": sha256_file(folder / name), "size": (folder / name).stat().st_size} for name in list_files(folder)},
    }
    if extra:
        manifest.update(extra)
    atomic_write_json(folder / MANIFEST, manifest)
    return manifest


def check_file_names(manifest: dict, where: str, nested: bool = True) -> dict:
    """Returns the manifest when every file it lists is a plain relative name inside its folder; else ManifestError.

    Checked before any file is read or downloaded: a manifest is input (anyone who can write to the bucket or the
    volume writes it), and a name like `../../x` or `/etc/x` would reach outside the folder. `nested=False` (an
    adapter in S3, whose layout is flat) allows no `/` at all.
    """
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        raise ManifestError(f"{where}: the manifest has no 'files' object")
    for name in files:
        parts = name.split("/") if nested else [name]
        if not all(_NAME_PART.fullmatch(part) and part not in (".", "..") for part in parts) or name == MANIFEST:
            raise ManifestError(f"{where}: the manifest lists {name[:80]!r}, which is not a plain file name inside "
                                "its folder (letters, digits, '.', '_', '-'; no '..', no absolute path): refused, "
                                "nothing was read or downloaded")
        if not isinstance(files[name], dict):
            raise ManifestError(f"{where}: the manifest's entry for {name!r} is not an object with sha256 and size")
    return manifest


def read_manifest(folder: str | Path) -> dict:
    """Returns a folder's manifest; ManifestError if it is missing, unreadable, or names files outside the folder."""
    path = Path(folder) / MANIFEST
    if not path.exists():
        raise ManifestError(f"{folder} has no {MANIFEST}: it is incomplete (a writer stopped before finishing)")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{path} is unreadable ({exc}); delete the folder and write it again") from None
    return check_file_names(manifest, str(path))


def verify_manifest(folder: str | Path) -> dict:
    """Returns the manifest when every listed file exists with its size and sha256; else ManifestError."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    if not manifest["files"]:
        raise ManifestError(f"{folder}: manifest lists no files")
    for name, meta in manifest["files"].items():
        path = folder / name
        if path.is_symlink():
            raise ManifestError(f"{folder}: {name} is a symbolic link: a folder holds its files themselves, never "
                                "links to files elsewhere (refused)")
        if not path.is_file():
            raise ManifestError(f"{folder}: {name} is listed in the manifest but missing")
        if path.stat().st_size != meta["size"]:
            raise ManifestError(f"{folder}: {name} has {path.stat().st_size} bytes, manifest says {meta['size']}")
        if sha256_file(path) != meta["sha256"]:
            raise ManifestError(f"{folder}: {name} does not match its sha256 in the manifest (corrupt or tampered)")
    return manifest


def is_complete(folder: str | Path) -> bool:
    try:
        verify_manifest(folder)
        return True
    except ManifestError:
        return False


def model_identity(model_dir: Path) -> str | None:
    """Returns a digest naming a model: its weights' (model.safetensors), else its manifest's (which lists every
    file's sha256); None for a folder with neither."""
    for name in ("model.safetensors", MANIFEST):
        if (Path(model_dir) / name).is_file():
            return sha256_file(Path(model_dir) / name)[:16]
    return None
