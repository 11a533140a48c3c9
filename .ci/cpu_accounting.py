"""Which job of `make test` spent the CPU: the kernel's process accounting, joined to each process's job.

`.ci/measure --cpu-by-job` turns process accounting on for the run (acct(2): one record per process as it exits, with
the CPU time it took) and records, every 0.2 s, each new process's command line, parent and job: tests/suite.py
names the job in every job's environment (JOB_VARIABLE), and every process a job starts inherits it, Ray's daemons
and workers and vLLM's engines included. A process whose environment lacks it (a test's subprocess with an
environment of its own, a container's process with its image's) takes its nearest recorded ancestor's job: the
image builds' steps and the containers count in the Docker engine's job (`engine`), whose shims start them. The
measurement itself counts as outside the jobs. Standard library only.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import struct
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from suite import JOB_VARIABLE  # noqa: E402  (tests/suite.py)

OUTSIDE = "outside the jobs"
# struct acct_v3 (linux/acct.h), 64 bytes: flag, version, tty, exitcode, uid, gid, pid, ppid, btime (epoch seconds),
# etime (float, in AHZ ticks), eight comp_t (utime, stime, mem, io, rw, minflt, majflt, swaps), comm[16].
RECORD = struct.Struct("<BBHIIIIIIf8H16s")
AHZ = 100


def comp_t(value: int) -> int:
    """Decodes the kernel's comp_t: a 13-bit mantissa and a 3-bit exponent of base 8."""
    return (value & 0x1FFF) << (3 * (value >> 13))


@dataclass(frozen=True)
class Exited:
    """One accounting record: a process that ended."""

    pid: int
    ppid: int
    started: int  # epoch seconds
    cpu_s: float
    wall_s: float
    comm: str  # the name of its last thread to end, not always its program's


def read_records(path: Path) -> list[Exited]:
    data = Path(path).read_bytes()
    records = []
    for offset in range(0, len(data) - RECORD.size + 1, RECORD.size):
        _, version, _, _, _, _, pid, ppid, btime, etime, utime, stime, *_, comm = RECORD.unpack_from(data, offset)
        if version & 0x7F != 3:
            raise ValueError(f"{path}: record {offset // RECORD.size} is not a version-3 process accounting record")
        records.append(Exited(pid, ppid, btime, (comp_t(utime) + comp_t(stime)) / AHZ, etime / AHZ,
                              comm.split(b"\0")[0].decode(errors="replace")))
    return records


@contextlib.contextmanager
def accounting(path: Path) -> Iterator[None]:
    """The kernel's process accounting into `path` while the block runs (root; one file for the whole machine)."""
    libc = ctypes.CDLL(None, use_errno=True)
    Path(path).touch()
    if libc.acct(str(path).encode()) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"process accounting could not start ({os.strerror(errno)})")
    try:
        yield
    finally:
        libc.acct(None)


@dataclass
class Seen:
    pid: int
    ppid: int
    started: float  # epoch seconds
    command: str
    job: str  # its own JOB_VARIABLE, "" where it has none
    first_seen: float


class Recorder(threading.Thread):
    """Every `interval_s`, the command line, parent and job of each process not seen before (by pid and start time);
    a young process's command line is read again for a second (a fork runs its parent's until it execs)."""

    def __init__(self, interval_s: float = 0.2, proc: Path = Path("/proc"), variable: str = JOB_VARIABLE):
        super().__init__(daemon=True)
        self.interval_s, self.proc = interval_s, proc
        self.prefix = variable.encode() + b"="
        self.seen: dict[tuple[int, int], Seen] = {}
        self.done = threading.Event()
        self.tick = os.sysconf("SC_CLK_TCK")
        self.boot = next(int(line.split()[1]) for line in (proc / "stat").read_text().splitlines()
                         if line.startswith("btime "))

    def run(self) -> None:
        while not self.done.is_set():
            self.scan()
            self.done.wait(self.interval_s)

    def stop(self) -> None:
        self.done.set()
        self.join()

    def scan(self) -> None:
        now = time.time()
        for name in os.listdir(self.proc):
            if not name.isdigit():
                continue
            try:
                stat = (self.proc / name / "stat").read_text()
                fields = stat[stat.rindex(")") + 2:].split()
                key = (int(name), int(fields[19]))
                known = self.seen.get(key)
                if known and now - known.first_seen > 1.0:
                    continue
                command = (self.proc / name / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                if known:
                    known.command = command.strip() or known.command
                    continue
                environ = (self.proc / name / "environ").read_bytes().split(b"\0")
            except (OSError, ValueError, IndexError):
                continue
            job = next((item[len(self.prefix):].decode(errors="replace") for item in environ
                        if item.startswith(self.prefix)), "")
            self.seen[key] = Seen(key[0], int(fields[1]), self.boot + key[1] / self.tick, command.strip(), job, now)


def attribute(records: list[Exited], seen: list[Seen]) -> list[tuple[Exited, str, str, int]]:
    """Returns (record, job, command, parent pid) for each record: the recorded process of the same pid that started
    within 2 s of it, its job its own or its nearest recorded ancestor's, its parent the one it had when first seen;
    a process never recorded (it lived under 0.2 s) takes its parent's job, its name for a command and the record's
    parent."""
    by_pid: dict[int, list[Seen]] = {}
    for process in seen:
        by_pid.setdefault(process.pid, []).append(process)

    def find(pid: int, started: float) -> Seen | None:
        near = [p for p in by_pid.get(pid, []) if abs(p.started - started) <= 2]
        return min(near, key=lambda p: abs(p.started - started)) if near else None

    def parent(ppid: int, started: float) -> Seen | None:
        """The latest recorded process of pid `ppid` started before a child started at `started`."""
        candidates = [p for p in by_pid.get(ppid, []) if p.started <= started + 2]
        return max(candidates, key=lambda p: p.started) if candidates else None

    def job_of(process: Seen | None) -> str:
        for _ in range(64):
            if process is None or process.job:
                break
            process = parent(process.ppid, process.started)
        return process.job if process else ""

    out = []
    for record in records:
        process = find(record.pid, record.started)
        if process:
            out.append((record, job_of(process) or OUTSIDE, process.command or record.comm, process.ppid))
        else:
            out.append((record, job_of(parent(record.ppid, record.started)) or OUTSIDE, record.comm, record.ppid))
    return out


def trees(attributed: list[tuple[Exited, str, str, int]]) -> list[tuple[float, int, Exited, str, str]]:
    """Returns (CPU-seconds, processes, root's record, job, root's command) of each process tree a job's own process
    started, the heaviest first: a test's subprocess, a fixture's server or Ray head, an install step, with everything
    under it (a Ray head's tree holds the workers of the runs that joined it). A job's own process (its parent of
    another job: the one tests/suite.py started) is a tree of its own CPU only; processes under an unrecorded parent
    (one alive when the accounting stopped, or init for a daemon) make one tree under their top."""
    by_pid: dict[int, list[tuple[Exited, str, str, int]]] = {}
    for item in attributed:
        by_pid.setdefault(item[0].pid, []).append(item)

    def parent(item):
        """The record of the item's parent pid that was alive when it started (pids are reused)."""
        record = item[0]
        alive = [p for p in by_pid.get(item[3], []) if p is not item
                 and p[0].started - 1 <= record.started <= p[0].started + p[0].wall_s + 1]
        return max(alive, key=lambda p: p[0].started) if alive else None

    cpu, count, root_of = Counter(), Counter(), {}
    for item in attributed:
        chain, own = [item], False
        for _ in range(64):
            up = parent(chain[-1])
            if up is None or any(up is c for c in chain):
                break  # its top has no recorded parent (alive past the run, or adopted by init): the tree is all of it
            if up[1] != item[1]:
                own = True  # chain[-1] is the job's own process: the tree is what it started
                break
            chain.append(up)
        root = chain[-2] if own and len(chain) > 1 else chain[-1]
        cpu[id(root)] += item[0].cpu_s
        count[id(root)] += 1
        root_of[id(root)] = root
    return [(seconds, count[key], *root_of[key][:3]) for key, seconds in cpu.most_common()]


def report(attributed: list[tuple[Exited, str, str, int]], machine_cpu_s: float, top: int = 30) -> tuple[str, str]:
    """Returns (a table of CPU-seconds by job, the processes and the process trees that took the most; one line by
    job)."""
    cpu, count = Counter(), Counter()
    for record, job, *_ in attributed:
        cpu[job] += record.cpu_s
        count[job] += 1
    total = sum(cpu.values())
    lines = [f"CPU-seconds by job of `make test`: {total:,.0f} CPU-s in {len(attributed):,} processes' accounting records, "
             f"of {machine_cpu_s:,.0f} the machine spent (the rest: the kernel's own work and what was still running)",
             "", f"{'job':<24} {'CPU-s':>8} {'share':>6} {'processes':>9}"]
    for job, seconds in cpu.most_common():
        lines.append(f"{job:<24} {seconds:8.1f} {100 * seconds / max(total, 1e-9):5.1f}% {count[job]:9,}")
    lines += ["", f"the {top} processes that took the most (wall: how long each lived):",
              f"{'CPU-s':>7} {'wall-s':>7}  {'job':<22} command"]
    for record, job, command, _ in sorted(attributed, key=lambda item: -item[0].cpu_s)[:top]:
        lines.append(f"{record.cpu_s:7.1f} {record.wall_s:7.1f}  {job:<22} {' '.join(command.split())[:160]}")
    lines += ["", f"the {top} process trees that took the most (each a process a job's own process started, with "
              "everything under it; wall: how long its first process lived):",
              f"{'CPU-s':>7} {'wall-s':>7} {'procs':>6}  {'job':<22} command"]
    for seconds, processes, record, job, command in trees(attributed)[:top]:
        lines.append(f"{seconds:7.1f} {record.wall_s:7.1f} {processes:6,}  {job:<22} {' '.join(command.split())[:160]}")
    line = "cpu by job: " + " | ".join(f"{job} {seconds:,.0f}" for job, seconds in cpu.most_common())
    return "\n".join(lines) + "\n", line


def write_processes(path: Path, attributed: list[tuple[Exited, str, str, int]]) -> None:
    """Writes one JSON line per accounting record: pid, parent, job, CPU-seconds, lifetime, start (epoch seconds) and
    command; the heaviest first."""
    with open(path, "w") as out:
        for record, job, command, ppid in sorted(attributed, key=lambda item: -item[0].cpu_s):
            out.write(json.dumps({"pid": record.pid, "ppid": ppid, "job": job, "cpu_s": round(record.cpu_s, 2),
                                  "wall_s": round(record.wall_s, 2), "started": record.started,
                                  "command": " ".join(command.split())}) + "\n")
