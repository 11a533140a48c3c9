"""Runs `uv pip install` with the package sources this machine's pip is configured with.

    python envs/uv_pip.py UV_BINARY --python VENV/bin/python [uv pip install arguments]

The Makefile installs every venv from its lock with uv (a third of pip's CPU, a fifth of its time: docs/experiments.md),
but uv reads no pip configuration, and a machine's pip.conf or PIP_* variables may be where its packages come from:
a local index or wheel folder, a constraint, a proxy's CA certificate. This reads them from `pip config list` and
passes them on (index-url, extra-index-url, find-links, constraint, cert, client-cert, trusted-host, timeout,
proxy, no-index), with pip's rule for several indexes (every index searched, the best version taken). Standard
library only.
"""

from __future__ import annotations

import ast
import os
import shlex
import subprocess
import sys

# What a pip setting becomes for uv: a flag given once per value, or an environment variable (a proxy only where
# the environment names none).
FLAGS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "--constraint", "trusted-host": "--allow-insecure-host"}
ENV = {"cert": "SSL_CERT_FILE", "client-cert": "SSL_CLIENT_CERT"}  # timeout: UV_HTTP_TIMEOUT, whole seconds
PROXY = ("HTTPS_PROXY", "HTTP_PROXY")
ALIASES = {"default-timeout": "timeout"}  # one pip option, two spellings
# pip's precedence, lowest first: a file's [global] section, its [install] section, then PIP_* variables. Other
# sections ([download], [wheel], ...) are other commands' settings.
SCOPES = ("global", "install", ":env:")


def parse_config_list(text: str) -> dict[str, str]:
    """Returns pip's effective install settings (key -> value) from `pip config list` output (`section.key='value'`,
    the value as Python writes a string: a setting over several lines comes with its newlines escaped)."""
    ranked = []
    for line in text.splitlines():
        scoped, sep, value = line.partition("=")
        section, dot, key = scoped.rpartition(".")
        if not (sep and dot) or section not in SCOPES:
            continue
        try:
            value = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            value = value.strip().strip("'\"")
        ranked.append((SCOPES.index(section), ALIASES.get(key, key), str(value)))
    return {key: value for _, key, value in sorted(ranked, key=lambda item: item[0])}


def pip_settings(python: str = sys.executable) -> dict[str, str]:
    """Returns pip's effective install settings; exits with pip's own words when pip cannot read its configuration
    (installing without them would take packages from elsewhere, silently)."""
    proc = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True,
                          env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    if proc.returncode != 0:
        said = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        sys.exit(f"error: `{python} -m pip config list` failed ({said}): uv gets this machine's package sources from it")
    return parse_config_list(proc.stdout)


def uv_arguments(settings: dict[str, str], environ=os.environ) -> tuple[list[str], dict[str, str]]:
    """Returns (uv flags, environment variables) carrying pip's settings."""
    flags, env = ["--index-strategy", "unsafe-best-match"], {}
    for key, value in settings.items():
        if key in FLAGS:
            flags += [arg for item in value.split() for arg in (FLAGS[key], item)]
        elif key == "timeout":
            env["UV_HTTP_TIMEOUT"] = str(max(1, round(float(value))))
        elif key in ENV:
            env[ENV[key]] = value
        elif key == "proxy" and not any(environ.get(name) or environ.get(name.lower()) for name in PROXY):
            env.update(dict.fromkeys(PROXY, value))
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
