"""Where a config comes from: a YAML profile, then environment variables, then `key.path=value` overrides; a bad
key or value is one line naming it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from shared.config.rules import check_consistent
from shared.config.schema import DEFAULT_CONFIG, ConfigError, RunConfig

# Every environment variable the services read, and the config key it sets (over the profile, under CLI overrides).
ENV_OVERRIDES = {
    "SHARED_DIR": "storage.shared_dir",
    "S3_URI": "storage.s3_uri",
    "AWS_ENDPOINT_URL": "storage.aws_endpoint_url",
    "RAY_ADDRESS": "cluster.ray_address",
    "SAGEMAKER_ENDPOINT_URL": "cluster.sagemaker_endpoint_url",
    "SERVER_URL": "server.url",
    "SERVER_API_KEY": "server.api_key",
    "GRAFANA_URL": "dashboards.grafana_url",
    "GRAFANA_TOKEN": "dashboards.grafana_token",
    "PROMETHEUS_URL": "dashboards.prometheus_url",
    "RAY_METRICS_EXPORT_PORT": "cluster.metrics_export_port",
}
# Variables that fill a key only where the profile leaves it unset: a shell's usual AWS_REGION must not move a
# profile's cluster to another region.
ENV_FALLBACKS = {"AWS_REGION": "cluster.region"}
SECRET_KEYS = {"server.api_key", "dashboards.grafana_token"}


def from_environment(key: str, environ: dict | None = None) -> str | None:
    """Returns the environment's value for a config key (through ENV_OVERRIDES), for code that runs without a
    config: a Ray Serve replica built from a deploy file, which must not hold the API key."""
    environ = os.environ if environ is None else environ
    variable = next(name for name, dotted in {**ENV_OVERRIDES, **ENV_FALLBACKS}.items() if dotted == key)
    return environ.get(variable) or None


def _set_path(tree: dict, dotted: str, value: Any) -> None:
    node = tree
    *parents, leaf = dotted.split(".")
    for key in parents:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config key {dotted}: {key} is a value, not a section")
        node = child
    node[leaf] = value


def _describe(error: dict) -> str:
    key = ".".join(str(part) for part in error["loc"])
    if error["type"] == "extra_forbidden":
        section = RunConfig
        for part in error["loc"][:-1]:
            field = section.model_fields.get(str(part))
            section = field.annotation if field is not None else section
        allowed = ", ".join(sorted(section.model_fields)) if isinstance(section, type) else "see configs/"
        return f"config error: unknown key {key!r}; allowed keys here: {allowed}"
    value = "(hidden)" if key in SECRET_KEYS else _shortened(repr(error.get("input")))
    return f"config error: {key} = {value} is invalid: {_shortened(error['msg'])}"


def _shortened(text: str, limit: int = 160) -> str:
    """Returns text cut to a readable length: an echoed value can be megabytes (a YAML alias expands)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def parse_config(tree: dict) -> RunConfig:
    """Returns a validated RunConfig from a plain dict; ConfigError names the first bad key."""
    try:
        cfg = RunConfig.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_describe(exc.errors()[0])) from None
    check_consistent(cfg)
    return cfg


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, environ: dict | None = None
) -> RunConfig:
    """Returns the run config: YAML profile, then environment variables, then `key.path=value` overrides."""
    path = Path(path) if path else DEFAULT_CONFIG
    if not path.exists():
        raise ConfigError(f"config error: no config file at {path}; profiles live in configs/ (e.g. configs/tiny-cpu.yaml)")
    if path.is_dir():
        raise ConfigError(f"config error: {path} is a folder; --config names a YAML file (e.g. configs/tiny-cpu.yaml)")
    try:
        tree = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError:
        raise ConfigError(f"config error: {path} is not UTF-8 text; save it as UTF-8 YAML") from None
    except OSError as exc:
        raise ConfigError(f"config error: cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config error: {path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"config error: {path} must hold a mapping of sections, got {type(tree).__name__}")
    environ = os.environ if environ is None else environ
    for variable, dotted in ENV_OVERRIDES.items():
        if environ.get(variable):
            _set_path(tree, dotted, environ[variable])
    for variable, dotted in ENV_FALLBACKS.items():
        section, field = dotted.split(".")
        node = tree.get(section)
        if environ.get(variable) and not (isinstance(node, dict) and node.get(field) is not None):
            _set_path(tree, dotted, environ[variable])
    for item in overrides or []:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"config error: override {item!r} is not key.path=value (e.g. rollout.temperature=0.5)")
        try:
            value = raw if key.strip() in SECRET_KEYS else yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError:
            value = raw
        _set_path(tree, key.strip(), value)
    return parse_config(tree)


def dump_config(cfg: RunConfig) -> str:
    """Returns the resolved config as YAML (what `runs/<id>/run.yaml` holds)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
