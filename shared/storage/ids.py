"""Run and adapter ids become folder names on the volume and keys in S3: one rule for both."""

from __future__ import annotations

import re

# Matched whole (fullmatch; `$` would let a trailing newline through).
ADAPTER_ID = re.compile(r"[A-Za-z0-9._-]+")


def check_adapter_id(adapter_id: str, what: str = "adapter id") -> str:
    """Returns the id if all of it matches [A-Za-z0-9._-]+ (and it is not '.' or '..'); else ValueError."""
    if not isinstance(adapter_id, str) or not ADAPTER_ID.fullmatch(adapter_id) or adapter_id in {".", ".."}:
        raise ValueError(f"{what} {adapter_id!r} is invalid: use only letters, digits, '.', '_' and '-' "
                         "(and not '.' or '..')")
    return adapter_id


def check_run_id(run_id: str) -> str:
    """Returns the run id if it is a plain folder name under runs/ (same rule as adapter ids); else ValueError."""
    return check_adapter_id(run_id, "run id")
