"""Which settings decide what: a training step, an evaluation, the SFT warm start. Checkpoints, evals and warm
starts record these, and a resume or a reuse under other values stops with the keys that differ."""

from __future__ import annotations

import functools
from typing import Any

from pydantic import BaseModel

from shared.config.schema import EVAL, SFT, TRAINING, RunConfig, Section


@functools.cache
def deciding_keys(part: str, section: type[BaseModel] = RunConfig, prefix: str = "") -> tuple[str, ...]:
    """Returns the dotted keys whose settings decide `part` (TRAINING, EVAL or SFT), read from the schema: each
    field's `decides` (schema.decides), else its section's."""
    keys: list[str] = []
    for name, info in section.model_fields.items():
        kind = info.annotation
        if isinstance(kind, type) and issubclass(kind, Section):
            keys += deciding_keys(part, kind, f"{prefix}{name}.")
            continue
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        if part in extra.get("decides", getattr(section, "decides", (TRAINING,))):
            keys.append(f"{prefix}{name}")
    return tuple(keys)


def flat_settings(cfg: RunConfig) -> dict[str, Any]:
    """Returns every setting as {dotted key: value} (secrets left out)."""
    flat: dict[str, Any] = {}

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            else:
                flat[f"{prefix}{key}"] = value

    walk(cfg.model_dump(mode="json"), "")
    return flat


def training_settings(cfg: RunConfig) -> dict[str, Any]:
    """Returns the settings that decide what training computes."""
    return _settings(cfg, TRAINING)


def sft_settings(cfg: RunConfig) -> dict[str, Any]:
    """Returns the settings that decide the SFT warm start (services/trainer/sft.py)."""
    return _settings(cfg, SFT)


def eval_settings(cfg: RunConfig) -> dict[str, Any]:
    """Returns the settings that decide how an evaluation plays (beside which policy it scores)."""
    return _settings(cfg, EVAL)


def _settings(cfg: RunConfig, part: str) -> dict[str, Any]:
    flat = flat_settings(cfg)  # secrets are left out of it, and so out of every record
    return {key: flat[key] for key in deciding_keys(part) if key in flat}


def settings_hash(settings: dict[str, Any]) -> str:
    """Returns a short, stable digest of a settings dict."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def changed_settings(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Returns 'key (old -> new)' for every key whose value differs between two settings dicts. A key the record
    predates counts as its schema default (a setting added later, left at its default, changes nothing)."""
    recorded = {**{k: v for k, v in flat_settings(RunConfig()).items() if k in current}, **recorded}
    keys = sorted(set(recorded) | set(current))
    missing = object()
    return [f"{k} ({recorded.get(k, 'unset')!r} -> {current.get(k, 'unset')!r})" for k in keys
            if recorded.get(k, missing) != current.get(k, missing)]
