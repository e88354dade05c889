"""A kvflow server's own record of the measured run, read from the dashboard's window (the first
frame of /dashboard/events; kvflow/server/dashboard/schema.py):

- its engine steps: each step's duration, prompt tokens, decode rows and attention work (and which
  of them were single-token query rows, kvflow/query_rows.py). The doctor
  fits its step costs to these steps (kvflow/doctor/calibrate.py) rather than to the per-kind means
  of /metrics alone;
- the run's window: the request rows (each carries the x-request-id kvflow bench sent) and the full
  step rows, so that `kvflow doctor --request N --bench RESULT` tells one request's story once the
  server is gone (kvflow/doctor/bench_request.py).

The window keeps the last 30 s of steps (at most 5,000 in one frame): a longer run leaves a sample
of its last steps, which is what a fit needs, and the stories of its last requests. Other servers
have no such endpoint: None.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

READ_TIMEOUT_S = 10.0
STEP_KEYS = ("dur_ms", "prefill_tokens", "decode_tokens", "attention")  # what each recorded step keeps
# Kept too when the server records them (kvflow servers from session 25 on): which prompt tokens were
# attended as query rows, and the rows' keys (kvflow/query_rows.py). 0 from an older server.
ROW_STEP_KEYS = ("row_prefill_tokens", "row_attention")


def dashboard_hello(server_root: str, headers: dict[str, str] | None) -> dict[str, Any] | None:
    """The dashboard window's first frame, or None when the server has no kvflow dashboard."""
    try:
        with httpx.stream(
            "GET", server_root + "/dashboard/events", headers=headers, timeout=READ_TIMEOUT_S
        ) as response:
            if response.status_code != 200:
                return None
            for line in response.iter_lines():
                if line.startswith("data: "):
                    hello = json.loads(line.removeprefix("data: "))
                    return hello if isinstance(hello, dict) else None
    except (httpx.HTTPError, ValueError):
        return None
    return None


def recorded_steps(hello: dict[str, Any] | None) -> list[dict[str, float]] | None:
    """The window's steps ({"t", "dur_ms", "prefill_tokens", "decode_tokens", "attention",
    "row_prefill_tokens", "row_attention"}, oldest first), or None without a window (or one too old
    to record attention)."""
    fields = ((hello or {}).get("fields") or {}).get("step")
    if not hello or not fields or "t" not in fields or any(k not in fields for k in STEP_KEYS):
        return None
    index = {name: i for i, name in enumerate(fields)}
    return [
        {k: float(row[index[k]]) if k in index else 0.0 for k in ("t", *STEP_KEYS, *ROW_STEP_KEYS)}
        for row in hello.get("steps") or []
    ]


def last_step_time(steps: list[dict[str, float]] | None) -> float:
    """When the last of `steps` started (-inf without any): what ran after it is the measured run."""
    return max((s["t"] for s in steps or ()), default=float("-inf"))


def steps_after(steps: list[dict[str, float]] | None, start: float) -> list[list[float]]:
    """The steps of `steps` that started after `start`, as [dur_ms, prefill_tokens, decode_tokens,
    attention, row_prefill_tokens, row_attention] rows."""
    return [[s[k] for k in (*STEP_KEYS, *ROW_STEP_KEYS)] for s in steps or () if s["t"] > start]


def run_window(hello: dict[str, Any] | None, start: float) -> dict[str, Any] | None:
    """The window's part after `start`: {"step_fields", "steps" (full rows), "requests" (rows of the
    requests that arrived after it: the run's, and any other client's that shared its steps),
    "max_num_seqs", "max_num_batched_tokens"}; None without a window."""
    fields = ((hello or {}).get("fields") or {}).get("step")
    if not hello or not fields or "t" not in fields:
        return None
    t = fields.index("t")
    config = hello.get("config") or {}
    return {
        "step_fields": list(fields),
        "steps": [row for row in hello.get("steps") or [] if row[t] > start],
        "requests": [r for r in hello.get("requests") or [] if (r.get("arrival") or 0.0) > start],
        "max_num_seqs": config.get("max_num_seqs"),
        "max_num_batched_tokens": config.get("max_num_batched_tokens"),
    }
