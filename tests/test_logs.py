"""Logging: every command takes --log-level (or $LOG_LEVEL); info is the bare line on stdout, warnings go to stderr
with their level, a log file carries times; a bad level is one line."""

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shared.config import command_line
from shared.logs import log_to_file, stop_logging_to

REPO = Path(__file__).resolve().parent.parent
log = logging.getLogger("services.test_logs")


def test_levels_streams_and_the_file(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("LOG_LEVEL", raising=False)
    command_line("python -m example", config=False).parse_args([])
    log.debug("not shown")
    log.info("step 3: reward 0.5")
    log.warning("the disk is nearly full")
    out, err = capsys.readouterr()
    assert out == "step 3: reward 0.5\n" and err == "warning: the disk is nearly full\n"

    command_line("python -m example", config=False).parse_args(["--log-level", "warning"])
    log.info("quiet now")
    log.error("stopped")
    out, err = capsys.readouterr()
    assert out == "" and err == "error: stopped\n"

    monkeypatch.setenv("LOG_LEVEL", "debug")
    command_line("python -m example", config=False).parse_args([])
    handler = log_to_file(tmp_path / "train.log")
    log.debug("details")
    stop_logging_to(handler)
    log.info("after the file closed")
    assert capsys.readouterr().out == "details\nafter the file closed\n"
    lines = (tmp_path / "train.log").read_text().splitlines()
    assert len(lines) == 1 and re.match(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} DEBUG   services.test_logs: details$", lines[0])


@pytest.mark.parametrize("args, env", [(["--log-level", "loud"], {}), ([], {"LOG_LEVEL": "loud"})])
def test_a_bad_level_is_one_line(args, env):
    proc = subprocess.run([sys.executable, "-m", "shared.maze", "ceiling", "--seeds", "0-3", *args], cwd=REPO, capture_output=True,
                          text=True, env={"PATH": "/usr/bin:/bin", **env}, timeout=120)
    assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "loud" in proc.stderr and "Traceback" not in proc.stderr


def test_a_command_run_as_a_module_says_its_lines(tmp_path):
    """`python -m services.<name>` logs from its `__main__.py` under the name "__main__": its info lines reach stdout,
    and --log-level quiets them."""
    def dashboards(*extra):
        return subprocess.run([sys.executable, "-m", "services.dashboards", "--out", str(tmp_path), *extra], cwd=REPO,
                              capture_output=True, text=True, timeout=120)

    said = dashboards()
    assert said.returncode == 0 and said.stdout.count(f"wrote {tmp_path}") == 5, said.stdout + said.stderr
    quiet = dashboards("--log-level", "warning")
    assert quiet.returncode == 0 and quiet.stdout == "", quiet.stdout
