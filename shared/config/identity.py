"""Which settings decide what: a training step, an evaluation, the SFT warm start. Checkpoints, evals and warm
starts record these, and a resume or a reuse under other values stops with the keys that differ."""

from __future__ import annotations

from typing import Any

from shared.config.schema import RunConfig

# Keys that never change what a training step computes: where files go, how often they are written and scored, how
# long the run is, and the sections of the other services.
UNTRAINED_KEYS = ("run_id", "storage.", "server.", "dashboards.", "cluster.", "trainer.", "schedule.total_steps",
                  "rollout.max_error_fraction", "rollout.eval_samples",
                  "schedule.eval_interval", "schedule.eval_before_train", "schedule.ckpt_interval",
                  "schedule.max_ckpts_to_keep", "schedule.hf_save_interval", "schedule.resume_mode")
# Keys that change how an evaluation plays (beside which policy it scores).
EVAL_KEYS = ("model.max_images_in_context", "model.max_turns_in_context", "model.dtype", "env.max_turns",
             "env.cell_px", "env.response_format", "env.action_style", "env.prompt_style", "env.eval_env",
             "env.eval_seeds", "env.extended_eval_seeds", "rollout.eval_temperature", "rollout.max_new_tokens")


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
    """Returns the settings that decide what training computes (everything but UNTRAINED_KEYS)."""
    def untrained(key: str) -> bool:
        return any(key.startswith(u) if u.endswith(".") else key == u for u in UNTRAINED_KEYS)

    return {k: v for k, v in flat_settings(cfg).items() if not untrained(k)}


# Keys that decide what the SFT warm start (services/trainer/sft.py) builds.
SFT_KEYS = ("seed", "sft.", "model.tiny_name", "model.max_images_in_context", "model.max_turns_in_context",
            "model.dtype", "env.id", "env.max_turns", "env.cell_px", "env.response_format", "env.action_style",
            "env.prompt_style", "env.sft_seed_start")


def sft_settings(cfg: RunConfig) -> dict[str, Any]:
    """Returns the settings that decide the SFT warm start (SFT_KEYS)."""
    return {k: v for k, v in flat_settings(cfg).items() if any(k.startswith(u) if u.endswith(".") else k == u
                                                               for u in SFT_KEYS)}


def eval_settings(cfg: RunConfig) -> dict[str, Any]:
    """Returns the settings that decide how an evaluation plays (EVAL_KEYS)."""
    flat = flat_settings(cfg)
    return {k: flat[k] for k in EVAL_KEYS}


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
