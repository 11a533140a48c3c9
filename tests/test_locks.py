"""Locked installs: the venv `make setup` built holds exactly the versions of its lock (envs/locks/main.txt), so a
fresh machine next month builds what this commit was tested with. The Makefile installs the lock with no resolver,
so a dependency added to pyproject.toml without `make lock` is missing from the venv: `pip check` names it."""

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "envs"))
from freeze import frozen  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def lock_lines(name: str) -> set[str]:
    return {line.strip() for line in (REPO / "envs" / "locks" / f"{name}.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")}


def test_the_main_venv_is_its_lock():
    installed, locked = set(frozen(Path(sys.prefix))), lock_lines("main")
    assert installed - locked == set(), "installed but not locked (run make lock)"
    assert locked - installed == set(), "locked but not installed"


def test_the_lock_holds_what_pyproject_asks_for():
    """The venv is installed from the lock without a resolver: a requirement added to pyproject.toml without `make
    lock` is missing from it, and pip's own check names it."""
    proc = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
