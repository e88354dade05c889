"""The last N minutes, kept on the event loop for clients that connect later and for the doctor.

Bounded whatever the load: steps for `step_history_s` (the step chart's span) and at most
`max_steps`; per-second aggregates, ITL gaps and finished requests for `window_s`, at most
`max_itl` gaps and `max_requests` requests (the oldest finished ones go first).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kvflow.server.dashboard.recorder import Delta
from kvflow.server.dashboard.schema import SECOND_FIELDS, STEP_FIELDS

# A new client's first frame: about 0.5 MB at most (measured: ~25 ms to encode on a loaded 2-core box).
HELLO_MAX_ITL = 10_000
HELLO_MAX_STEPS = 5_000
_S = {name: i for i, name in enumerate(STEP_FIELDS)}
_SEC = {name: i for i, name in enumerate(SECOND_FIELDS)}
# Second-row fields summed over the second's steps, and those that keep the second's maximum.
_SUMMED = (
    ("busy_ms", "dur_ms"),
    ("prefill_tokens", "prefill_tokens"),
    ("decode_tokens", "decode_tokens"),
    ("output_tokens", "output_tokens"),
    ("preemptions", "preemptions"),
    ("spec_draft_tokens", "spec_draft_tokens"),
    ("spec_accepted_tokens", "spec_accepted_tokens"),
)
_MAXED = (("kv_usage_max", "kv_usage"), ("running_max", "running"), ("waiting_max", "waiting"))


@dataclass(frozen=True)
class WindowLimits:
    window_s: float = 300.0  # histograms, usage over time, the doctor's view: the last 5 minutes
    step_history_s: float = 30.0  # the step chart shows each step of the last 30 s
    max_steps: int = 20_000  # 30 s of 1.5 ms steps
    max_itl: int = 200_000  # 5 minutes of ~650 tokens/s
    max_requests: int = 2_000


@dataclass
class Totals:
    """Running totals since the server started."""

    steps: int = 0
    output_tokens: int = 0
    prefill_tokens: int = 0
    preemptions: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # finish reason -> requests

    def as_json(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "output_tokens": self.output_tokens,
            "prefill_tokens": self.prefill_tokens,
            "preemptions": self.preemptions,
            "finished": dict(self.finished),
        }


class Window:
    def __init__(self, limits: WindowLimits) -> None:
        self.limits = limits
        self.now = 0.0
        self.steps: deque[list[Any]] = deque(maxlen=limits.max_steps)
        self.seconds: dict[int, list[Any]] = {}  # whole second -> SECOND_FIELDS row (insertion order = time)
        self.itl: deque[list[float]] = deque(maxlen=limits.max_itl)
        self.requests: dict[str, dict[str, Any]] = {}
        self.running: list[str] = []
        self.waiting: list[str] = []
        self.kv: dict[str, Any] | None = None
        self.totals = Totals()

    def apply(self, delta: Delta) -> set[int]:
        """Merge one delta; returns the seconds whose rows changed."""
        self.now = max(self.now, delta.now)
        changed = {self._add_step(row) for row in delta.steps}
        self.steps.extend(delta.steps)
        self.itl.extend(delta.itl)
        for obj in delta.requests:
            previous = self.requests.pop(obj["id"], None)  # re-inserted last: dict order = last update
            if obj["state"] == "finished" and (previous is None or previous["state"] != "finished"):
                reason = obj["reason"] or "abort"
                self.totals.finished[reason] = self.totals.finished.get(reason, 0) + 1
            self.requests[obj["id"]] = obj
        self.running, self.waiting = delta.running, delta.waiting
        if delta.kv is not None:
            self.kv = delta.kv
        self._prune()
        return changed

    def _add_step(self, row: list[Any]) -> int:
        second = math.floor(row[_S["t"]])
        agg = self.seconds.get(second)
        if agg is None:
            agg = self.seconds[second] = [second] + [0] * (len(SECOND_FIELDS) - 1)
        agg[_SEC["steps"]] += 1
        for target, source in _SUMMED:
            agg[_SEC[target]] += row[_S[source]]
        for target, source in _MAXED:
            agg[_SEC[target]] = max(agg[_SEC[target]], row[_S[source]])
        agg[_SEC["busy_ms"]] = round(agg[_SEC["busy_ms"]], 3)
        t = self.totals
        t.steps += 1
        t.output_tokens += row[_S["output_tokens"]]
        t.prefill_tokens += row[_S["prefill_tokens"]]
        t.preemptions += row[_S["preemptions"]]
        return second

    def _prune(self) -> None:
        lim = self.limits
        while self.steps and self.steps[0][_S["t"]] < self.now - lim.step_history_s:
            self.steps.popleft()
        while self.itl and self.itl[0][0] < self.now - lim.window_s:
            self.itl.popleft()
        oldest = math.floor(self.now - lim.window_s)
        for second in [s for s in self.seconds if s < oldest]:
            del self.seconds[second]
        active = set(self.running) | set(self.waiting)
        for obj in self.requests.values():
            if obj["state"] != "finished" and obj["id"] not in active:  # left without a final output
                obj.update(state="finished", reason="abort", finished=self.now)
        finished = list(self.requests)  # every kept request not active is finished; oldest update first
        finished = [rid for rid in finished if rid not in active]
        expired = {rid for rid in finished if self.requests[rid]["finished"] < self.now - lim.window_s}
        kept = [rid for rid in finished if rid not in expired]
        excess = max(0, len(self.requests) - len(expired) - lim.max_requests)
        for rid in [*expired, *kept[:excess]]:
            del self.requests[rid]

    def hello(self) -> dict[str, Any]:
        """Everything kept, in the frame layout of schema.py (config and fields added by the hub), but
        at most the newest HELLO_MAX_ITL gaps and HELLO_MAX_STEPS steps: the hello is encoded on the
        event loop, and a frame of megabytes would stall every stream for its encoding."""
        return {
            "now": self.now,
            "steps": list(self.steps)[-HELLO_MAX_STEPS:],
            "seconds": list(self.seconds.values()),
            "requests": list(self.requests.values()),
            "itl": list(self.itl)[-HELLO_MAX_ITL:],
            "running": self.running,
            "waiting": self.waiting,
            "kv": self.kv,
            "totals": self.totals.as_json(),
        }
