"""A Ray started by this process for local work (the CPU server, the local trainer): listening on loopback
only, and never outliving the process that started it.

    enter_loopback(keep_port)   # at a command's start: re-runs the command once with the bind shim preloaded
    init_local_ray(**kwargs)    # ray.init on the loopback node IP, plus a watchdog for a SIGKILLed parent

Loopback: Ray 2.57's gRPC servers (GCS, raylet, every worker) bind 0.0.0.0 whatever the node IP, and
`ray.init` turns 127.0.0.1 into the machine's external IP. So the command re-executes itself with a small
bind() shim preloaded (local_ray_loopback.c, built with the system C compiler on first use and cached) that
turns wildcard binds into binds to LOOPBACK_NODE_IP, and Ray runs with that node IP (127.0.0.2: on loopback,
but not the "localhost" Ray rewrites). Linux only; elsewhere, or without a C compiler, a warning says so.

Watchdog: a SIGKILLed driver cannot stop the Ray processes it started (dashboard and runtime-env agents,
workers), so a small process in its own session watches the driver and ends them when it dies.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

LOOPBACK_NODE_IP = "127.0.0.2"
ACTIVE = "MAZE_LOOPBACK_ACTIVE"
SHIM_SOURCE = Path(__file__).with_name("local_ray_loopback.c")


def _warn(message: str) -> None:
    log.warning(message)


def build_shim() -> Path | None:
    """Returns the compiled bind shim (built once per source version into a cache folder); None if it cannot be."""
    source = SHIM_SOURCE.read_bytes()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "maze-grpo"
    target = cache / f"local_ray_loopback-{hashlib.sha256(source).hexdigest()[:12]}.so"
    if target.exists():
        return target
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        return None
    try:
        cache.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".so", dir=cache)
        os.close(fd)
    except OSError:
        return None
    try:
        subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", tmp, str(SHIM_SOURCE), "-ldl"], check=True,
                       capture_output=True, timeout=120)
        os.replace(tmp, target)
    except (OSError, subprocess.SubprocessError):
        Path(tmp).unlink(missing_ok=True)
        return None
    return target


def enter_loopback(keep_port: int | None = None) -> None:
    """Re-executes this command with the bind shim preloaded, unless it already is; returns when in place.

    `keep_port` is left bound as asked (the HTTP server when it is deliberately public). Call it before any
    thread or heavy import starts: the process image is replaced.
    """
    if os.environ.get(ACTIVE) == "1":
        return
    if not sys.platform.startswith("linux"):
        _warn("Ray's servers will listen on all interfaces: binding them to loopback needs Linux")
        return
    shim = build_shim()
    if shim is None:
        _warn("Ray's servers will listen on all interfaces: no C compiler (cc) to build the loopback bind shim")
        return
    preload = " ".join(p for p in (os.environ.get("LD_PRELOAD", ""), str(shim)) if p)
    env = {**os.environ, ACTIVE: "1", "LD_PRELOAD": preload, "MAZE_LOOPBACK_IP": LOOPBACK_NODE_IP,
           "MAZE_LOOPBACK_KEEP_PORT": str(keep_port or "")}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def loopback_env_for_vllm() -> dict[str, str]:
    """Returns the env a vLLM engine started under the shim needs, so its own sockets meet on the same address.

    The shim turns vLLM's wildcard binds (its ZMQ queues, gloo's store) into binds on Ray's node IP, so vLLM
    must also connect there rather than to 127.0.0.1 or the host's IP. Empty when the shim is not active.
    """
    if os.environ.get(ACTIVE) != "1":
        return {}
    ip = os.environ.get("MAZE_LOOPBACK_IP", LOOPBACK_NODE_IP)
    return {"VLLM_HOST_IP": ip, "VLLM_LOOPBACK_IP": ip}


def init_local_ray(**kwargs) -> None:
    """Starts Ray in this process on the loopback node IP (when the shim is in place) and its watchdog."""
    import ray

    node_ip = LOOPBACK_NODE_IP if os.environ.get(ACTIVE) == "1" else "127.0.0.1"
    ray.init(_node_ip_address=node_ip, include_dashboard=False, **kwargs)
    start_watchdog()


def start_watchdog() -> subprocess.Popen:
    """Starts the process that ends this process's Ray children if this process dies without stopping them."""
    return subprocess.Popen([sys.executable, "-m", "shared.local_ray", "watch", str(os.getpid())],
                            cwd=Path(__file__).resolve().parent.parent, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"})


def alive(process) -> bool:
    """Whether a psutil process still runs (a zombie, killed and waiting for its parent, does not)."""
    import psutil

    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def watch(parent_pid: int, poll_s: float = 0.5, grace_s: float = 3.0) -> None:
    """Records the parent's descendants while it lives; once it is gone, terminates (then kills) those left."""
    import psutil

    try:
        parent = psutil.Process(parent_pid)
    except psutil.NoSuchProcess:
        return
    me = os.getpid()
    known: dict[int, psutil.Process] = {}
    while alive(parent):
        try:
            for child in parent.children(recursive=True):
                if child.pid != me:
                    known.setdefault(child.pid, child)
        except psutil.Error:
            pass
        time.sleep(poll_s)
    left = []
    for process in known.values():
        try:
            # is_running() compares the start time too: a reused pid is not ours to kill.
            if process.is_running():
                left += [process, *process.children(recursive=True)]
        except psutil.Error:
            continue
    for process in left:
        try:
            process.terminate()
        except psutil.Error:
            pass
    _, still_running = psutil.wait_procs(left, timeout=grace_s)
    for process in still_running:
        try:
            process.kill()
        except psutil.Error:
            pass


def ray_processes_started_in(temp_dir: str | Path) -> list:
    """Returns the live processes of the `ray start --temp-dir=temp_dir` node(s), as psutil processes.

    A process is the node's when its command line names temp_dir, when it holds a file under temp_dir open, or when
    it descends from one that does. The command line alone misses some: Ray's agents retitle themselves
    (`ray::DashboardAgent`, `ray::RuntimeEnvAgent`) and the client server names only the GCS address, but each
    writes its log under temp_dir. Left running once their node is gone, those agents spin on a core for a minute
    or more before they notice.
    """
    import psutil

    root = str(Path(temp_dir).resolve())
    found: dict[int, psutil.Process] = {}
    for process in psutil.process_iter(["cmdline"]):
        if process.pid == os.getpid():  # a driver here that joined the node has its log open under temp_dir
            continue
        try:
            if any(root in part or str(temp_dir) in part for part in process.info["cmdline"] or []) or any(
                    f.path.startswith(root + os.sep) for f in process.open_files()):
                found[process.pid] = process
                found.update((child.pid, child) for child in process.children(recursive=True))
        except psutil.Error:
            pass
    found.pop(os.getpid(), None)  # this process, should it descend from one of them
    return list(found.values())


def stop_ray_started_in(temp_dir: str | Path, timeout_s: float = 10) -> None:
    """Kills the processes of the `ray start --temp-dir=temp_dir` node(s) only (`ray_processes_started_in`) and waits
    up to timeout_s for them to end.

    `ray stop` would end every Ray on the machine, another user's or another test run's included.
    """
    import psutil

    processes = ray_processes_started_in(temp_dir)
    for process in processes:
        try:
            process.kill()
        except psutil.Error:
            pass
    deadline = time.monotonic() + timeout_s
    while any(alive(process) for process in processes) and time.monotonic() < deadline:
        time.sleep(0.1)



if __name__ == "__main__":
    if sys.argv[1:2] == ["watch"] and len(sys.argv) == 3:
        watch(int(sys.argv[2]))
    else:
        sys.exit("usage: python -m shared.local_ray watch PARENT_PID")


def worker_log() -> str:
    """Returns where this Ray worker's stderr goes (its `worker-*-<pid>.err`), or Ray's log folder; '' outside Ray."""
    try:
        import ray

        logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path())
    except Exception:  # not in a Ray worker (or a Ray without that layout): nothing to point at
        return ""
    found = sorted(logs.glob(f"worker-*-{os.getpid()}.err"))
    return str(found[0] if found else logs)
