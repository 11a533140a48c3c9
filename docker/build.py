"""Builds every service image through the Docker SDK for Python (what `make images` runs).

Each image is tagged with the project version and the git commit, and carries OCI labels.
    python docker/build.py [--only evaluator,exporter] [--registry REG/] [--gpu]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# image name -> (Dockerfile, target); GPU images build only with --gpu (they pull multi-GB CUDA bases).
IMAGES = {
    "trainer-cpu": ("docker/Dockerfile", "trainer-cpu"),
    "evaluator": ("docker/Dockerfile", "evaluator"),
    "exporter": ("docker/Dockerfile", "exporter"),
    "server-cpu": ("docker/Dockerfile", "server-cpu"),
    "dashboards": ("docker/Dockerfile", "dashboards"),
    "trainer": ("docker/Dockerfile.gpu", "trainer"),
    "server": ("docker/Dockerfile.gpu", "server"),
}
GPU_IMAGES = {"trainer", "server"}


def version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        return "unknown"


def labels(name: str, rev: str) -> dict:
    return {
        "org.opencontainers.image.title": f"maze-grpo-{name}",
        "org.opencontainers.image.version": version(),
        "org.opencontainers.image.revision": rev,
        "org.opencontainers.image.created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "org.opencontainers.image.source": "maze-grpo",
        "org.opencontainers.image.description": f"maze-grpo {name} service",
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python docker/build.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated image names (default: all CPU images)")
    parser.add_argument("--gpu", action="store_true", help="also build the GPU images (trainer, server)")
    parser.add_argument("--registry", default="", help="prefix for the image names, e.g. 123.dkr.ecr.us-west-2.amazonaws.com/")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or [n for n in IMAGES if args.gpu or n not in GPU_IMAGES]
    unknown = [n for n in names if n not in IMAGES]
    if unknown:
        sys.exit(f"unknown image {unknown[0]!r}: choose from {', '.join(IMAGES)}")
    try:
        import docker

        client = docker.from_env()
        client.ping()
    except Exception as exc:
        sys.exit(f"no Docker engine reachable ({type(exc).__name__}: {exc}). Start Docker (or set DOCKER_HOST) "
                 "and run `make images` again; CI builds the images with .github/workflows/images.yml.")
    rev = commit()
    for name in names:
        dockerfile, target = IMAGES[name]
        repo = f"{args.registry}maze-grpo/{name}"
        print(f"building {repo}:{version()} ({dockerfile}, target {target})", flush=True)
        image, logs = client.images.build(path=str(ROOT), dockerfile=dockerfile, target=target,
                                          tag=f"{repo}:{version()}", labels=labels(name, rev), rm=True)
        for chunk in logs:
            if "stream" in chunk:
                sys.stdout.write(chunk["stream"])
        for tag in (rev, "latest"):
            image.tag(repo, tag)
        print(f"built {repo}:{version()} {repo}:{rev} {repo}:latest")


if __name__ == "__main__":
    main()
