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
    (StepResiduals.arrival); the engine makes no progress in the s before the request arrives: a
    decode-only step that starts then does its work from the arrival, and one running when it
    begins does the rest of its work from the arrival (paused_ms).
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
    """How much later a step from `start` to `end` (ms, any clock) ends when the engine makes no
    progress during any of `stalls` ((begins, ends): before a request's arrival): a step that starts
    in one does its work from its end, and a step already running when one begins stops there and
    does the rest of its work from its end (stalls that overlap pause it once, to the later end).

    Why the running step pauses too (session 40): the planted kv_pool what-if's 35-block server
    runs its four clients a step apart (one finishes, then three), and the three's last decode
    step (eight in six runs), started 2.8-5.8 ms before the one's next request arrived, took 1.8-5.2
    ms more than the 4-row steps (2.2-3.4 ms) and ended 0.9-2.7 ms after the arrival: it had done
    part of its work, then waited. Left to run as it would (session 32's rule) unless a stall that
    long was drawn, the replay put the change's ITL p99 12-37% below the measured in all five
    session-39 verify runs; the recorded runs' ITL p99 came closer too (docs/doctor.md)."""
    t, remaining = start, end - start  # where the step is, and the work it has left
    for begins, ends in sorted(stalls):
        if ends <= t:
            continue  # over before the step got here
        if begins >= t + remaining:
            break  # the step is done before this one (and every later one) begins
        remaining -= max(begins - t, 0.0)  # the work done before the stall
        t = ends
    return t + remaining - end
