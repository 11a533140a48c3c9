"""One trainer per run: an exclusive lock file, `runs/<run_id>/trainer.lock`, held for the trainer's life.

The lock names its holder (pid, host, start time). A second trainer on a live run stops with one line
naming it. A lock whose holder is gone is stale and is taken over with a warning: on the same host,
"gone" means its process no longer exists (pid and process start time both checked, so a reused pid
does not count); on another host, that the holder stopped refreshing the lock (a heartbeat touches it
every HEARTBEAT_S) for more than STALE_AFTER_S.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from pathlib import Path

logger = logging.getLogger(__name__)

LOCK_NAME = "trainer.lock"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 300.0


class RunLocked(RuntimeError):
    """Another live trainer holds the run."""


def _process_start(pid: int) -> str | None:
    """Returns the kernel's start time of a process (field 22 of /proc/<pid>/stat), None if it does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]


def _alive(holder: dict, lock: Path) -> bool:
    if holder.get("host") != socket.gethostname():
        return time.time() - lock.stat().st_mtime < STALE_AFTER_S
    pid = holder.get("pid")
    if not isinstance(pid, int):
        return False
    if not Path("/proc/self/stat").exists():  # no /proc (macOS): whether the pid exists is all we can tell
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return _process_start(pid) is not None and _process_start(pid) == holder.get("proc_start")


def _read_holder(lock: Path) -> dict:
    """Returns the lock's record; ValueError when it is not a JSON object with a pid (garbage, or half-written)."""
    holder = json.loads(lock.read_text())
    if not isinstance(holder, dict) or not isinstance(holder.get("pid"), int):
        raise ValueError(f"{lock} holds no trainer record")
    return holder


def _describe(holder: dict) -> str:
    return f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}"


class RunLock:
    """`with RunLock(run_dir, warn):` holds the run for this process; RunLocked names a live holder."""

    def __init__(self, run_dir: Path, warn=logger.warning):
        self.path = Path(run_dir) / LOCK_NAME
        self.warn = warn
        self.me = {"pid": os.getpid(), "host": socket.gethostname(), "proc_start": _process_start(os.getpid()),
                   "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        self._stop = threading.Event()

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._clear_if_stale()
                continue
            with os.fdopen(fd, "w") as handle:
                json.dump(self.me, handle)
            threading.Thread(target=self._heartbeat, name="run-lock-heartbeat", daemon=True).start()
            return
        raise RunLocked(f"could not take the run lock {self.path} (it keeps changing): another trainer is starting")

    def _clear_if_stale(self) -> None:
        try:
            holder = _read_holder(self.path)
        except (OSError, ValueError):
            # Half-written by a trainer starting this instant, or garbage: look again, then treat it as stale.
            time.sleep(0.5)
            try:
                holder = _read_holder(self.path)
            except FileNotFoundError:
                return
            except (OSError, ValueError):
                holder = {}
        try:
            if holder and _alive(holder, self.path):
                raise RunLocked(f"run {self.path.parent.name} is being trained by {_describe(holder)} "
                                f"(lock {self.path}); stop that trainer, or pick another run_id")
            # Move the stale lock aside under a name of our own: of two trainers doing this, one succeeds.
            aside = self.path.with_name(f".{LOCK_NAME}.stale-{os.getpid()}")
            os.replace(self.path, aside)
        except FileNotFoundError:
            return  # the holder released it meanwhile
        try:
            moved = _read_holder(aside)
        except (OSError, ValueError):
            moved = {}
        if moved and moved != holder:  # a new trainer locked the run between our read and the move: give it back
            os.replace(aside, self.path)
            return
        aside.unlink(missing_ok=True)
        self.warn(f"taking over a stale run lock from {_describe(holder) if holder else 'an unreadable lock'} "
                  "(that trainer is gone)")

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                return

    def release(self) -> None:
        self._stop.set()
        try:
            if json.loads(self.path.read_text()).get("pid") == self.me["pid"]:
                self.path.unlink()
        except (OSError, ValueError):
            pass

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
