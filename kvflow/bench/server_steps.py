"""A kvflow server's own record of its engine steps during the measured run: each step's duration,
prompt tokens and decode rows, read from the dashboard's window (the first frame of
/dashboard/events; kvflow/server/dashboard/schema.py). The doctor fits its step costs to these
steps (kvflow/doctor/calibrate.py) rather than to the per-kind means of /metrics alone.

The window keeps the last 30 s of steps (at most 5,000 in one frame): a longer run leaves a sample
of its last steps, which is what a fit needs. Other servers have no such endpoint: None.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

READ_TIMEOUT_S = 10.0
STEP_KEYS = ("dur_ms", "prefill_tokens", "decode_tokens", "attention")  # what each recorded step keeps


def dashboard_steps(server_root: str, headers: dict[str, str] | None) -> list[dict[str, float]] | None:
    """The window's steps ({"t", "dur_ms", "prefill_tokens", "decode_tokens", "attention"}, oldest
    first), or None when the server has no kvflow dashboard (or one too old to record attention)."""
    try:
        with httpx.stream(
            "GET", server_root + "/dashboard/events", headers=headers, timeout=READ_TIMEOUT_S
        ) as response:
            if response.status_code != 200:
                return None
            for line in response.iter_lines():
                if line.startswith("data: "):
                    return _steps(json.loads(line.removeprefix("data: ")))
    except (httpx.HTTPError, ValueError):
        return None
    return None


def _steps(hello: dict[str, Any]) -> list[dict[str, float]] | None:
    fields = (hello.get("fields") or {}).get("step")
    if not fields or "t" not in fields or any(k not in fields for k in STEP_KEYS):
        return None
    index = {name: i for i, name in enumerate(fields)}
    return [{k: float(row[index[k]]) for k in ("t", *STEP_KEYS)} for row in hello.get("steps") or []]


def steps_after(
    steps: list[dict[str, float]] | None, before: list[dict[str, float]] | None
) -> list[list[float]]:
    """The steps of `steps` that ran after the last one of `before` (the measured part), as
    [dur_ms, prefill_tokens, decode_tokens, attention] rows."""
    if not steps:
        return []
    last = max((s["t"] for s in before or ()), default=float("-inf"))
    return [[s[k] for k in STEP_KEYS] for s in steps if s["t"] > last]
