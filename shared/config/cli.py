"""The command line every service shares: one-line argument errors, --log-level, --config and overrides."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable

from pydantic import SecretStr

from shared.config.loading import load_config
from shared.config.schema import ConfigError, RunConfig


class CommandLineParser(argparse.ArgumentParser):
    """argparse that reports a bad argument in one line (no usage block), exit status 2, and takes --log-level (or
    $LOG_LEVEL): parsing sets up the project's logging (shared.logs)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # SUPPRESS: a subcommand's parser (argparse builds it with this class) leaves the main parser's value be
        self.add_argument("--log-level", default=argparse.SUPPRESS, choices=["debug", "info", "warning", "error"],
                          help="how much the command says (default: $LOG_LEVEL, else info)")

    def parse_known_args(self, args=None, namespace=None):
        parsed, rest = super().parse_known_args(args, namespace)
        from shared.logs import setup_logging

        setup_logging(getattr(parsed, "log_level", None))
        return parsed, rest

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def subcommand(argv: list[str] | None, commands: Iterable[str], default: str) -> tuple[str, list[str]]:
    """Returns (the command, the arguments after it) for `python -m services.<name> [COMMAND] [ARGS...]`: a command
    is only ever the first word; without one the command is `default` and every argument is its own."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] and argv[0] in commands:
        return argv[0], argv[1:]
    return default, argv


def command_line(prog: str, description: str | None = None, config: bool = True) -> CommandLineParser:
    """Returns the parser every command starts from: a bad argument is one line and exit status 2, the module's
    docstring is its --help, and (with `config`) it takes --config plus key.path=value overrides."""
    parser = CommandLineParser(prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    if config:
        add_config_arguments(parser)
    return parser


def add_config_arguments(parser) -> None:
    """Adds `--config` and the `key.path=value` overrides every command takes."""
    parser.add_argument("--config", default=None, help="run profile (default: configs/tiny-cpu.yaml)")
    parser.add_argument("overrides", nargs="*", help="key.path=value config overrides, e.g. rollout.temperature=0.5")


def reveal(secret: SecretStr | None) -> str | None:
    """Returns a secret's value (an API key, a token), or None when it is unset."""
    return secret.get_secret_value() if secret is not None else None


def config_from_args(args, extra: list[str] | None = None) -> RunConfig:
    """Returns the config named by --config plus overrides; exits with the one-line error when it is bad."""
    try:
        return load_config(args.config, list(getattr(args, "overrides", [])) + list(extra or []))
    except ConfigError as exc:
        raise SystemExit(str(exc)) from None
