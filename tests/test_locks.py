"""Locked installs: the venv `make setup` built holds exactly the versions of its lock (envs/locks/main.txt), so a
fresh machine next month builds what this commit was tested with. A dependency added to pyproject.toml without
`make lock` shows up here as a package the lock does not pin."""

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
