"""Runs `uv pip install` with the package sources this machine's pip is configured with.

    python envs/uv_pip.py UV_BINARY --python VENV/bin/python [uv pip install arguments]

The Makefile installs every venv from its lock with uv (a third of pip's CPU, a fifth of its time: docs/experiments.md),
but uv reads no pip configuration, and a machine's pip.conf or PIP_* variables may be where its packages come from:
a local index or wheel folder, a constraint, a proxy's CA certificate. This reads them from `pip config list` and
passes them on (index-url, extra-index-url, find-links, constraint, cert, trusted-host, timeout, no-index), with
pip's rule for several indexes (every index searched, the best version taken). Standard library only.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

# What a pip setting becomes for uv: a flag given once per value, or an environment variable.
FLAGS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "--constraint", "trusted-host": "--allow-insecure-host"}
ENV = {"cert": "SSL_CERT_FILE", "timeout": "UV_HTTP_TIMEOUT", "default-timeout": "UV_HTTP_TIMEOUT"}
# pip's precedence, lowest first: a file's [global] section, its [install] section, then PIP_* variables.
SCOPES = ("global", "install", ":env:")


def pip_settings(python: str = sys.executable) -> dict[str, str]:
    """Returns pip's effective settings (key without its section -> value) as `pip config list` reports them."""
    proc = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True,
                          env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    ranked = []
    for line in proc.stdout.splitlines():
        scoped, sep, value = line.partition("=")
        section, dot, key = scoped.rpartition(".")
        if not (sep and dot):
            continue
        rank = SCOPES.index(section) if section in SCOPES else 0
        ranked.append((rank, key, value.strip().strip("'\"")))
    return {key: value for _, key, value in sorted(ranked, key=lambda item: item[0])}


def uv_arguments(settings: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """Returns (uv flags, environment variables) carrying pip's settings."""
    flags, env = ["--index-strategy", "unsafe-best-match"], {}
    for key, value in settings.items():
        if key in FLAGS:
            flags += [arg for item in value.split() for arg in (FLAGS[key], item)]
        elif key in ENV:
            env[ENV[key]] = value
        elif key == "no-index" and value.lower() in ("1", "true", "yes", "on"):
            flags.append("--no-index")
    return flags, env


def main(argv: list[str]) -> None:
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__.strip())
        return
    if len(argv) < 2:
        sys.exit("usage: python envs/uv_pip.py UV_BINARY [uv pip install arguments] (--help says more)")
    uv, rest = argv[0], argv[1:]
    if not os.access(uv, os.X_OK):
        sys.exit(f"error: {uv} is not an executable uv binary (`make setup` puts the main lock's pin in .uv/VERSION/bin/uv)")
    flags, env = uv_arguments(pip_settings())
    command = [uv, "pip", "install", *flags, *rest]
    print("+ " + shlex.join(["uv", "pip", "install", *flags, *rest]), flush=True)
    sys.exit(subprocess.run(command, env={**os.environ, **env}).returncode)


if __name__ == "__main__":
    main(sys.argv[1:])
