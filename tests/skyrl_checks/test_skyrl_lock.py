"""Locked installs: .venv-skyrl holds exactly the versions of envs/locks/skyrl.txt (`make lock` refreshes it)."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "envs"))
from freeze import frozen  # noqa: E402


def test_the_skyrl_venv_is_its_lock():
    locked = {line.strip() for line in (REPO / "envs" / "locks" / "skyrl.txt").read_text().splitlines()
              if line.strip() and not line.startswith("#")}
    installed = set(frozen(Path(sys.prefix)))
    assert installed - locked == set(), "installed but not locked (run make lock)"
    assert locked - installed == set(), "locked but not installed"
