"""Writes that never leave a half-written file or folder behind: temporary name, fsync, rename."""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


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


def writable_folder(folder: str | Path) -> Path:
    """Creates folder (and its parents) and writes a file in it, so a read-only or foreign volume is found before the
    work whose results would go there; OSError naming folder if this user cannot write it."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(prefix=".write-check-", dir=folder):
            pass
    except OSError as exc:
        if exc.filename and Path(exc.filename).parent == folder.absolute():  # the check's own file: name the folder
            raise OSError(exc.errno, exc.strerror, str(folder)) from None
        raise
    return folder


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


class DamagedFile(ValueError):
    """A file of the project's own whose content is not what its writer writes (edited or damaged by hand)."""


def safetensors_header(path: Path) -> dict:
    """Returns a safetensors file's tensor table (its JSON header less `__metadata__`), having checked that every
    tensor lies inside the file; DamagedFile if it is not a readable safetensors file. Reads the header only."""
    try:
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length <= 0 or length > 100 * 1024 * 1024:
                raise ValueError(f"header length {length} is implausible")
            header = json.loads(handle.read(length))
    except (OSError, struct.error, ValueError) as exc:
        raise DamagedFile(f"{path} is not a readable safetensors file ({exc})") from None
    if not isinstance(header, dict):
        raise DamagedFile(f"{path} is not a readable safetensors file (its header is a JSON "
                          f"{type(header).__name__}, not an object)")
    header.pop("__metadata__", None)
    size = Path(path).stat().st_size
    for name, meta in header.items():
        offsets = meta.get("data_offsets") if isinstance(meta, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise DamagedFile(f"{path}: tensor {name[:80]!r} has no valid data_offsets (not a safetensors file?)")
        start, end = offsets
        if end > size - 8 - length or start > end:
            raise DamagedFile(f"{path}: tensor {name[:80]} points past the end of the file (truncated?)")
    return header


def read_jsonl(path: str | Path) -> list[dict]:
    """Returns the complete JSON lines of a file (a torn line from a crash is dropped); DamagedFile for a line that
    parses but is not a JSON object (nothing the project writes)."""
    path = Path(path)
    if not path.exists():
        return []
    records = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(record, dict):
            raise DamagedFile(f"{path} line {number} is not a JSON object ({line[:60]!r}): the file was edited or "
                              "damaged; remove that line (or the file) and run again")
        records.append(record)
    return records


@contextmanager
def staged_dir(final: str | Path) -> Iterator[Path]:
    """Yields a temporary sibling folder; on success writes its manifest and renames it to `final`.

    A crash leaves only a `.tmp-<name>@<random>` folder, which no reader trusts and the next staging of the same
    name removes; never another name's (`.tmp-model@*` is not `.tmp-model-sft@*`: no run, model or adapter id
    holds an '@').
    """
    from shared.storage.manifest import write_manifest

    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(f".tmp-{final.name}@*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}@", dir=final.parent))
    try:
        yield tmp
        write_manifest(tmp)
        if final.exists():
            trash = final.with_name(f".tmp-{final.name}@old-{os.getpid()}")
            os.replace(final, trash)
            os.replace(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except Exception as exc:
        # Writers that are not Python's own (safetensors, torch.save) report a full disk in words of their own:
        # say it as the OSError it is, so callers tell the user what it means.
        full = not isinstance(exc, OSError) and shutil.disk_usage(tmp).free < (1 << 20)
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise OSError(errno.ENOSPC, f"No space left on device ({type(exc).__name__})", str(final)) from exc
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
