"""Writes a venv's lock: every installed distribution at its exact version (`make lock` runs this).

    python envs/freeze.py VENV LOCK_FILE
    python envs/freeze.py --prune VENV LOCK_FILE   # uninstall what the venv holds and the lock does not

The project itself (installed editable) and flash-attn (built from its sources by the Makefile at its own pin) are
left out; the file starts with a header saying how it was made. The Makefile installs each venv from its lock with
`uv pip install --no-deps -r` (envs/uv_pip.py), so a fresh machine builds exactly the versions the commit was tested with, and
tests/test_locks.py (tests/skyrl_checks/test_skyrl_lock.py for .venv-skyrl) checks that the venvs match their locks.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SEPARATE = {"maze-grpo", "flash-attn"}  # installed by the Makefile on their own, never from a lock


def name(line: str) -> str:
    """Returns the distribution name of a `name==version` line, in the one spelling pip and the locks may differ on."""
    return line.split("==")[0].strip().lower().replace("_", "-")


def pinned(text: str) -> list[str]:
    """Returns the `name==version` lines of a pip freeze output or a lock file (comments left out)."""
    return [line.strip() for line in text.splitlines() if "==" in line and not line.startswith("#")]


def frozen(venv: Path) -> list[str]:
    """Returns `name==version` for every distribution in `venv` but those in SEPARATE, sorted by name."""
    out = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "freeze", "--exclude-editable", "--all"],
                         check=True, capture_output=True, text=True).stdout
    return sorted((line for line in pinned(out) if name(line) not in SEPARATE), key=str.lower)


def prune(venv: Path, lock: Path) -> None:
    """Uninstalls every distribution `venv` holds that `lock` does not list (by name): after a lock drops a
    dependency, `make setup` on an existing venv leaves it equal to its lock, as a fresh one would be."""
    listed = {name(line) for line in pinned(lock.read_text())}
    extra = [line.split("==")[0] for line in frozen(venv) if name(line) not in listed]
    if extra:
        print(f"removing what {lock} no longer lists: {' '.join(extra)}")
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "uninstall", "-y", "-q", *extra], check=True)


def main(argv: list[str]) -> None:
    pruning = argv[:1] == ["--prune"]
    argv = argv[1:] if pruning else argv
    if len(argv) != 2:
        raise SystemExit("usage: python envs/freeze.py [--prune] VENV LOCK_FILE")
    venv, lock = Path(argv[0]), Path(argv[1])
    if not (venv / "bin" / "python").exists():
        raise SystemExit(f"error: {venv} is not a venv (no bin/python)")
    if pruning:
        return prune(venv, lock)
    header = (f"# The exact versions of {lock.stem}'s venv, written by `make lock` (envs/freeze.py) from a fresh,\n"
              "# unconstrained install of pyproject.toml; the Makefile installs exactly these (uv pip install --no-deps -r).\n"
              "# Edit pyproject.toml, then run `make lock`, never this file.\n")
    lock.parent.mkdir(parents=True, exist_ok=True)
    lines = frozen(venv)
    lock.write_text(header + "".join(line + "\n" for line in lines))
    print(f"wrote {lock}: {len(lines)} distributions")


if __name__ == "__main__":
    main(sys.argv[1:])
