"""Local ports: choosing a free one, and waiting for a local HTTP service to come up."""

from __future__ import annotations

import random
import socket
import time
from pathlib import Path

import httpx

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
FIRST_PORT = 20000  # above Ray's default worker ports, 10002-19999


def ephemeral_ports() -> tuple[int, int]:
    """Returns the kernel's ephemeral port range (the ports outgoing connections and bind(0) take)."""
    try:
        low, high = (int(part) for part in EPHEMERAL_RANGE.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """Returns a TCP port free on `host` now, for a server started next to bind.

    Chosen below the ephemeral range: a port from bind(0) lies in that range, where any process's outgoing
    connection can take it before the server binds it (a Ray head lost its metrics port that way in a `make test`
    run, beside vLLM and Docker). And above Ray's worker ports (10002-19999 by default), which its workers take and
    `ray start` refuses for its own components. Falls back to bind(0) when that leaves no room."""
    low, _ = ephemeral_ports()
    if low > FIRST_PORT + 1000:
        for port in random.SystemRandom().sample(range(FIRST_PORT, low), 50):  # never the seeded global generator
            with socket.socket() as sock:
                try:
                    sock.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def wait_for_http(url: str, timeout_s: float = 30.0, status: int | None = 200, alive=None) -> None:
    """Returns once GET url answers (with `status`, if given); TimeoutError naming the URL otherwise.

    `alive`, if given, is called each poll and should raise when the process behind the URL has died.
    """
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if alive is not None:
            alive()
        try:
            response = httpx.get(url, timeout=2.0)
            if status is None or response.status_code == status:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} did not answer within {timeout_s:.0f}s")
