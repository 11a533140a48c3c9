"""Logging for every command: clean lines on the terminal, timestamps in files, one level setting.

Every module logs through `logging.getLogger(__name__)`; the command line (shared.config.CommandLineParser) calls
`setup_logging` with `--log-level`, or the `LOG_LEVEL` variable, or `info`. On the terminal an info line is the bare
message on stdout and a warning or error goes to stderr as `warning: ...` / `error: ...`, written through tqdm so a
progress bar is never torn; `log_to_file` adds a file (the trainer's `runs/<id>/train.log`) where every line carries
its time, level and module. Libraries' own loggers (Ray, transformers) are left as they are.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from tqdm import tqdm

LEVELS = ("debug", "info", "warning", "error")
ENV_VAR = "LOG_LEVEL"
# The project's loggers, configured here; nothing else is touched. A command run as `python -m services.<name>` logs
# from its `__main__.py` under the name "__main__", not "services.<name>.__main__".
PACKAGES = ("services", "shared", "bench", "__main__")
FILE_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


class _TerminalHandler(logging.Handler):
    """Info and below to stdout as the bare message; warnings and errors to stderr, prefixed with their level."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            if record.exc_info:
                message += "\n" + logging.Formatter().formatException(record.exc_info)
            warning = record.levelno >= logging.WARNING
            if warning:
                message = f"{record.levelname.lower()}: {message}"
            stream = sys.stderr if warning else sys.stdout
            tqdm.write(message, file=stream)
            stream.flush()
        except Exception:  # a closed stream at exit: logging's own policy is to report and go on
            self.handleError(record)


def level_from(value: str | None) -> int:
    """Returns the logging level named by `value` (or by $LOG_LEVEL, else info); a bad name is one line, exit 2."""
    name = (value or os.environ.get(ENV_VAR) or "info").strip().lower()
    if name not in LEVELS:
        raise SystemExit(f"error: log level {name!r} (from --log-level or ${ENV_VAR}) is not one of {', '.join(LEVELS)}")
    return getattr(logging, name.upper())


def setup_logging(level: str | None = None) -> None:
    """Sends the project's loggers to the terminal at `level` (see `level_from`); calling it again resets them."""
    resolved = level_from(level)
    for package in PACKAGES:
        logger = logging.getLogger(package)
        for handler in [h for h in logger.handlers if isinstance(h, _TerminalHandler)]:
            logger.removeHandler(handler)
        logger.addHandler(_TerminalHandler())
        logger.setLevel(resolved)
        logger.propagate = False


def log_to_file(path: Path) -> logging.Handler:
    """Also writes the project's log lines, with their times, to `path` (appended); returns the handler, which the
    caller removes with `stop_logging_to`."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter(FILE_FORMAT))
    handler.setLevel(logging.DEBUG)
    for package in PACKAGES:
        logging.getLogger(package).addHandler(handler)
    return handler


def stop_logging_to(handler: logging.Handler) -> None:
    for package in PACKAGES:
        logging.getLogger(package).removeHandler(handler)
    handler.close()
