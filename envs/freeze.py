"""Writes a venv's lock: every installed distribution at its exact version (`make lock` runs this).

    python envs/freeze.py VENV LOCK_FILE

The project itself (installed editable) is left out; the file starts with a header saying how it was made. The
Makefile installs each venv with its lock as pip constraints (`-c`), so a fresh machine builds the versions the
commit was tested with, and tests/test_locks.py checks that the venvs `make test` built match their locks.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PROJECT = "maze-grpo"


def frozen(venv: Path) -> list[str]:
    """Returns `name==version` for every distribution in `venv` but the project, sorted by name."""
    out = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "freeze", "--exclude-editable", "--all"],
                         check=True, capture_output=True, text=True).stdout
    lines = [line.strip() for line in out.splitlines() if "==" in line and not line.startswith("#")]
    return sorted((line for line in lines if line.split("==")[0].lower() != PROJECT), key=str.lower)


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        raise SystemExit("usage: python envs/freeze.py VENV LOCK_FILE")
    venv, lock = Path(argv[0]), Path(argv[1])
    if not (venv / "bin" / "python").exists():
        raise SystemExit(f"error: {venv} is not a venv (no bin/python)")
    header = (f"# The exact versions of {lock.stem}'s venv, written by `make lock` (envs/freeze.py) from a fresh,\n"
              "# unconstrained install of pyproject.toml; the Makefile installs with it as constraints. Edit pyproject.toml,\n"
              "# then run `make lock`, never this file.\n")
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.write_text(header + "".join(line + "\n" for line in frozen(venv)))
    print(f"wrote {lock}: {len(frozen(venv))} distributions")


if __name__ == "__main__":
    main(sys.argv[1:])
