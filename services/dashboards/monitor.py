"""A local Prometheus (Debian's `prometheus` package) on loopback, scraping Ray's metrics.

Ray writes the addresses of its metrics endpoints to a service-discovery file in its session folder;
Prometheus reads it with `file_sd_configs`, so every node and worker Ray starts is scraped.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import httpx

RAY_SD_FILE = "/tmp/ray/prom_metrics_service_discovery.json"


def ensure_prometheus() -> str:
    """Returns the prometheus binary, installing Debian's package when it is missing (needs root + apt)."""
    found = shutil.which("prometheus")
    if found:
        return found
    if shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", "prometheus"], check=False,
                       env={"DEBIAN_FRONTEND": "noninteractive", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
    found = shutil.which("prometheus")
    if not found:
        raise RuntimeError("prometheus is not installed and could not be installed: apt-get install prometheus")
    return found


def write_config(folder: Path, sd_file: str = RAY_SD_FILE, interval_s: int = 5) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "prometheus.yml"
    config.write_text(
        f"global:\n  scrape_interval: {interval_s}s\n  evaluation_interval: {interval_s}s\n"
        f"scrape_configs:\n  - job_name: ray\n    file_sd_configs:\n      - files: ['{sd_file}']\n"
        f"        refresh_interval: {interval_s}s\n"
    )
    return config


def start_prometheus(folder: Path, port: int = 9090, sd_file: str = RAY_SD_FILE, interval_s: int = 5,
                     wait_s: float = 30.0) -> str:
    """Starts Prometheus in the background on 127.0.0.1:port; returns its URL once it is ready."""
    binary = ensure_prometheus()
    config = write_config(folder, sd_file, interval_s)
    log = open(folder / "prometheus.log", "ab")
    proc = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=log, start_new_session=True,
    )
    (folder / "prometheus.pid").write_text(str(proc.pid))
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + wait_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prometheus exited with {proc.returncode}; see {folder / 'prometheus.log'}")
        try:
            if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise TimeoutError(f"prometheus did not become ready on {url}")
