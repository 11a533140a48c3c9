"""The shared-volume and S3 contract as code (the layout is in the README's Architecture section).

Every writer writes to a temporary name and renames; a directory is complete only once its
`manifest.json` (sha256 and size of every file) exists, and the manifest is written last.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

MANIFEST = "manifest.json"
LATEST_STEP_FILE = "latest_ckpt_global_step.txt"
# Ids become folder names and S3 keys: matched whole (fullmatch; `$` would let a trailing newline through).
ADAPTER_ID = re.compile(r"[A-Za-z0-9._-]+")


class ManifestError(ValueError):
    """A folder whose manifest is missing, unreadable, or disagrees with the files."""


# ---- paths ----------------------------------------------------------------------------------------


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


# ---- atomic writes --------------------------------------------------------------------------------


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Writes bytes to path via a temporary file in the same folder and a rename (never half-written)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def append_jsonl(path: str | Path, record: dict) -> None:
    """Appends one JSON line and fsyncs (metrics survive a crash up to the last full line)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        handle.write(json.dumps(record, sort_keys=True) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def read_jsonl(path: str | Path) -> list[dict]:
    """Returns the complete JSON lines of a file (a torn last line from a crash is dropped)."""
    path = Path(path)
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


@contextmanager
def staged_dir(final: str | Path) -> Iterator[Path]:
    """Yields a temporary sibling folder; on success writes its manifest and renames it to `final`.

    A crash leaves only a `.tmp-*` folder, which no reader trusts and the next run removes.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(f".tmp-{final.name}-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        yield tmp
        write_manifest(tmp)
        if final.exists():
            trash = final.with_name(f".tmp-{final.name}-old-{os.getpid()}")
            os.replace(final, trash)
            os.replace(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ---- manifests ------------------------------------------------------------------------------------


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


def read_manifest(folder: str | Path) -> dict:
    """Returns a folder's manifest; ManifestError if it is missing or unreadable."""
    path = Path(folder) / MANIFEST
    if not path.exists():
        raise ManifestError(f"{folder} has no {MANIFEST}: it is incomplete (a writer stopped before finishing)")
    try:
        manifest = json.loads(path.read_text())
        manifest["files"].items()
    except (json.JSONDecodeError, KeyError, AttributeError, TypeError) as exc:
        raise ManifestError(f"{path} is unreadable ({exc}); delete the folder and write it again") from None
    return manifest


def verify_manifest(folder: str | Path) -> dict:
    """Returns the manifest when every listed file exists with its size and sha256; else ManifestError."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    if not manifest["files"]:
        raise ManifestError(f"{folder}: manifest lists no files")
    for name, meta in manifest["files"].items():
        path = folder / name
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


# ---- steps ----------------------------------------------------------------------------------------

_STEP_DIR = re.compile(r"^global_step_(\d+)$")


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


# ---- S3 -------------------------------------------------------------------------------------------


def split_s3_uri(uri: str) -> tuple[str, str]:
    """Returns (bucket, prefix) of `s3://bucket/prefix` (prefix without trailing slash)."""
    if not uri or not uri.startswith("s3://"):
        raise ValueError(f"S3 URI {uri!r} must look like s3://bucket/prefix")
    bucket, _, prefix = uri[5:].partition("/")
    if not bucket:
        raise ValueError(f"S3 URI {uri!r} has no bucket")
    return bucket, prefix.strip("/")


def s3_client(endpoint_url: str | None = None, retries: int = 5, timeout_s: float = 10.0):
    """Returns a boto3 S3 client honouring AWS_ENDPOINT_URL (a local S3-compatible server, or AWS)."""
    import boto3
    from botocore.config import Config

    endpoint_url = endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or None
    config = Config(
        retries={"max_attempts": retries, "mode": "standard"},
        connect_timeout=timeout_s,
        read_timeout=timeout_s * 3,
        s3={"addressing_style": "path"} if endpoint_url else {},
    )
    if endpoint_url:
        # Local S3-compatible servers accept any credentials; AWS uses the normal credential chain.
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "local")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "local")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    return boto3.client("s3", endpoint_url=endpoint_url, region_name=region, config=config)


def check_adapter_id(adapter_id: str, what: str = "adapter id") -> str:
    """Returns the id if all of it matches [A-Za-z0-9._-]+ (and it is not '.' or '..'); else ValueError."""
    if not isinstance(adapter_id, str) or not ADAPTER_ID.fullmatch(adapter_id) or adapter_id in {".", ".."}:
        raise ValueError(f"{what} {adapter_id!r} is invalid: use only letters, digits, '.', '_' and '-' "
                         "(and not '.' or '..')")
    return adapter_id


def check_run_id(run_id: str) -> str:
    """Returns the run id if it is a plain folder name under runs/ (same rule as adapter ids); else ValueError."""
    return check_adapter_id(run_id, "run id")


# ---- exports --------------------------------------------------------------------------------------

EXPORT_FILES = ("adapter_config.json", "adapter_model.safetensors")


def adopt_settled_export(policy: Path, min_age_s: float = 60.0) -> bool:
    """Writes a manifest for an export another writer (SkyRL) left without one, once its files have settled.

    SkyRL writes `exports/global_step_N/policy/` but no manifest.json; when both adapter files exist and
    none has changed for `min_age_s`, the folder is taken as complete. Returns whether it was adopted.
    """
    files = [policy / name for name in EXPORT_FILES]
    if (policy / MANIFEST).exists() or not all(f.is_file() for f in files):
        return False
    if time.time() - max(f.stat().st_mtime for f in files) < min_age_s:
        return False
    write_manifest(policy, {"adopted": "written by the reader: the export had no manifest (SkyRL layout)"})
    return True


def complete_exports(volume: SharedVolume, run_id: str, warn=None, min_age_s: float = 60.0) -> list[tuple[int, Path]]:
    """Returns (step, policy folder) of every export whose manifest verifies (settled SkyRL exports adopted)."""
    found = []
    for step, folder in step_dirs(volume.exports(run_id)):
        policy = folder / "policy"
        adopt_settled_export(policy, min_age_s)
        try:
            verify_manifest(policy)
            found.append((step, policy))
        except ManifestError as exc:
            if warn:
                warn(f"skipping incomplete export {folder}: {exc}")
    return found
