"""Which of a kvflow server's recorded steps ran while a request arrived, and how an arrival stalls
the engine.

On a machine whose cores the forward's threads already use, a client sending its next request and
the server receiving it take the cores from the engine: the step in flight makes no progress until
the request has arrived. On the planted runs (2-core Zen 2, tiny model, session 32) a decode-only
step that held a request's arrival (the server's `arrival` stamp between the step's start and end)
took 3.1 ms (median; p10 1.3, p90 4.6) more than the other decode steps of its rows, and it had
started about that long before the arrival (its start to the arrival less its excess: median -0.1
ms, p10-p90 -0.8 to 0.5): its own work ran after the arrival. Steps that ended before an arrival
took no more than the others, whatever the gap (0-12 ms before it, 1,200 steps). A run whose clients
turn around together (every client's next request arriving while the engine is idle) has no such
stall: the kv_pool what-if's 36-block server had none in 563 decode steps, and its ITL p99 was
1.6-1.9x its p50, where a stall drawn for every step after a finish (sessions 30-31) predicted 2.1x.

    the simulator (kvflow/doctor/simulate.py): each request draws a stall s from the measured ones
    (StepResiduals.arrival); a decode-only step that starts within s before the request arrives
    does its work from the arrival (paused_ms), and a step that started earlier runs as it would.
    A step with prompt tokens that holds an arrival takes the stall its recorded twins were fitted
    without (kvflow/doctor/prompt_stalls.py).

Pure Python: the window's rows in, flags out (kvflow/bench/server_steps.py writes them).
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

from kvflow.bench.server_steps import ROW_STEP_KEYS, STEP_KEYS

# The recorded step's columns the doctor reads, in the order of the bench's step records.
RECORD_KEYS = (*STEP_KEYS, *ROW_STEP_KEYS)


def arrival_times(window: dict[str, Any]) -> list[float]:
    """Each request's arrival in the window, the server's clock (s), in order."""
    rows = window.get("requests") or []
    return sorted(float(row["arrival"]) for row in rows if row.get("arrival") is not None)


def holds_an_arrival(start_s: float, dur_ms: float, arrivals: list[float]) -> bool:
    """Whether a request arrived during a step from `start_s` lasting `dur_ms` (`arrivals` sorted)."""
    first = bisect_left(arrivals, start_s)
    return first < len(arrivals) and arrivals[first] <= start_s + dur_ms / 1e3


def flagged_records(server: dict[str, Any]) -> list[tuple[list[float], bool]] | None:
    """The window's steps, oldest first, as the bench's step records ([dur_ms, prefill_tokens,
    decode_tokens, attention, row_prefill_tokens, row_attention]) each with whether a request
    arrived during it; None without a window that has the steps' start times and the requests'
    arrivals (another server, or a result whose window kept only its requests)."""
    window = server.get("window") or {}
    fields = list(window.get("step_fields") or [])
    steps = window.get("steps") or []
    arrivals = arrival_times(window)
    if not steps or not arrivals or "t" not in fields or any(k not in fields for k in RECORD_KEYS[:4]):
        return None
    index = {name: i for i, name in enumerate(fields)}
    out = []
    for row in steps:
        record = [float(row[index[k]]) if k in index else 0.0 for k in RECORD_KEYS]
        out.append((record, holds_an_arrival(float(row[index["t"]]), record[0], arrivals)))
    return out


def paused_ms(start: float, end: float, stalls: list[tuple[float, float]]) -> float:
    """How much later a step from `start` to `end` (ms, any clock) ends when the engine cannot run
    a step that starts during one of `stalls` ((begins, ends): before a request's arrival) until that
    stall ends: its work starts then."""
    t = start
    for begins, ends in sorted(stalls):
        if begins <= t < ends:
            t = ends
    return t - start
