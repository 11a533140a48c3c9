"""A local S3-compatible endpoint on loopback (moto in server mode), for when no AWS endpoint is given.

`make s3-up` starts it in the background and records its URL, host and process in
$SHARED_DIR/s3/endpoint.json; `make s3-down` stops it, on the host that started it. moto keeps objects in
memory: they last as long as the server runs. `resolve_s3` gives any service (exporter, server, benches,
tests) a config with an S3 endpoint, starting this one when nothing else is configured.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx

from shared.net import free_port, wait_for_http
from shared.storage.s3 import s3_client, split_s3_uri

logger = logging.getLogger(__name__)

DEFAULT_BUCKET = "maze-grpo"


def start_server(port: int | None = None, log_path: Path | None = None) -> tuple[subprocess.Popen, str]:
    """Starts moto's S3 server on 127.0.0.1 and returns (process, endpoint URL) once it answers."""
    port = port or free_port()
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=log, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_http(url, status=None)
    except TimeoutError:
        proc.kill()
        raise
    return proc, url


def ensure_bucket(endpoint_url: str, bucket: str) -> None:
    client = s3_client(endpoint_url)
    existing = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
    if bucket not in existing:
        client.create_bucket(Bucket=bucket)


def state_file(shared_dir: Path) -> Path:
    return shared_dir / "s3" / "endpoint.json"


def is_our_server(pid: int, endpoint_url: str) -> bool:
    """Returns True when process `pid` is the moto S3 server this module starts, on the recorded port.

    A recorded pid alone means nothing after a reboot or a crash: it may have been handed to any other process.
    """
    try:
        args = subprocess.run(["ps", "-o", "args=", "-p", str(int(pid))], capture_output=True, text=True,
                              timeout=10).stdout.split()
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return False
    if "moto.server" not in args or "-p" not in args:
        return False
    flag = args.index("-p")
    return args[flag + 1 : flag + 2] == [endpoint_url.rsplit(":", 1)[-1]]


def read_state(path: Path) -> dict | None:
    """Returns the recorded endpoint, or None (with the file moved aside) when it is not one this module wrote."""
    try:
        state = json.loads(path.read_text())
        if isinstance(state, dict) and isinstance(state.get("pid"), int) and isinstance(state.get("endpoint_url"), str):
            return state
    except (OSError, ValueError):
        pass
    path.replace(path.with_suffix(".unreadable"))
    return None


def running_endpoint(shared_dir: Path) -> dict | None:
    """Returns the recorded local endpoint if its process is alive, is ours and answers, else None."""
    path = state_file(shared_dir)
    if not path.exists():
        return None
    state = read_state(path)
    if state is None or state.get("host") != socket.gethostname():
        return None  # another host's loopback: not reachable from here, and its process id means nothing here
    if not is_our_server(state["pid"], state["endpoint_url"]):
        return None
    try:
        httpx.get(state["endpoint_url"], timeout=2.0)
        return state
    except httpx.HTTPError:
        return None


def up(shared_dir: Path, bucket: str = DEFAULT_BUCKET) -> dict:
    """Starts (or finds) the local endpoint with its bucket; returns {endpoint_url, s3_uri, pid}."""
    state = running_endpoint(shared_dir)
    if state is None:
        path = state_file(shared_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        proc, url = start_server(log_path=path.parent / "moto.log")
        state = {"endpoint_url": url, "s3_uri": f"s3://{bucket}/local", "host": socket.gethostname(), "pid": proc.pid}
        path.write_text(json.dumps(state))
    ensure_bucket(state["endpoint_url"], state["s3_uri"][5:].split("/")[0])
    return state


def down(shared_dir: Path) -> bool:
    """Stops the local endpoint if it runs; returns whether one was stopped."""
    path = state_file(shared_dir)
    if not path.exists():
        return False
    state = read_state(path)
    if state is None:
        return False
    if state.get("host") != socket.gethostname():
        raise RuntimeError(f"the local S3 endpoint in {path} was started on host {state.get('host')!r}: "
                           "stop it there (make s3-down)")
    path.unlink()
    if not is_our_server(state["pid"], state["endpoint_url"]):
        return False  # gone (a reboot): the pid is someone else's now, and is left alone
    try:
        os.killpg(state["pid"], signal.SIGTERM)
        return True
    except OSError:
        return False


def resolve_s3(cfg, log=logger.info):
    """Returns cfg with an S3 endpoint: S3_URI as configured, or a local one on loopback (started when needed)."""
    if cfg.storage.s3_uri:
        if cfg.storage.aws_endpoint_url:
            # An S3-compatible server of one's own (the compose stack's starts empty): make sure the bucket exists.
            ensure_bucket(cfg.storage.aws_endpoint_url, split_s3_uri(cfg.storage.s3_uri)[0])
        return cfg
    if cfg.storage.aws_endpoint_url:
        update = {"s3_uri": f"s3://{DEFAULT_BUCKET}/local"}
        ensure_bucket(cfg.storage.aws_endpoint_url, DEFAULT_BUCKET)
    else:
        state = up(cfg.shared_path())
        log(f"local S3 endpoint: {state['endpoint_url']} ({state['s3_uri']}); stop it with make s3-down")
        update = {"s3_uri": state["s3_uri"], "aws_endpoint_url": state["endpoint_url"]}
    return cfg.model_copy(update={"storage": cfg.storage.model_copy(update=update)})
