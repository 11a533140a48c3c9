"""Waiting for a local HTTP service to come up."""

from __future__ import annotations

import time

import httpx


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
