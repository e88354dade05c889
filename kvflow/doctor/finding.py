"""What a check returns: a Finding with its evidence, the causes it names, and what-ifs.

Severity: `ok` (fine, and why), `info` (headroom worth knowing), `warning` (a cause of latency with
an actionable fix). A warning names its causes: each with a stable id, the setting (or workload
change) that would remove it, and the latency it explains per request, so the report can rank the
causes of different checks against each other by the time they explain.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

Severity = Literal["ok", "info", "warning"]


@dataclass
class WhatIf:
    change: str
    effect: str  # the prediction as a sentence with numbers
    predicted: dict[str, float] = field(default_factory=dict)  # metric -> predicted value
    setting: dict[str, Any] | None = None  # kvflow serve engine arguments `--verify` can apply
    workload: dict[str, Any] | None = None  # benchmark dataset changes `--verify` can apply
    method: str = ""  # how the prediction was made (e.g. "simulated", "measured per-format speed")
    # metric -> [low, high]: the predicted value with the run's own noise (kvflow/doctor/noise.py)
    interval: dict[str, list[float]] = field(default_factory=dict)
    # metric -> the measured metric its prediction moves with, where not the metric itself (a tail
    # without the baseline's preemption stalls moves with the plain gaps: Calibration.carried_by);
    # `--verify` carries the prediction to its fresh baseline by that metric's ratio.
    carried_by: dict[str, str] = field(default_factory=dict)
    # metric -> [low, high] factors of the prediction: where one run of the change lands, from the
    # simulator's replays (Calibration.replay_range); the interval holds it (kvflow/doctor/noise.py).
    sampling_range: dict[str, list[float]] = field(default_factory=dict)
    # metric -> the prediction made again from each other run of the same server and benchmark
    # (kvflow doctor --bench-repeat, kvflow/doctor/repeated_runs.py); empty without them.
    repeated: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class Cause:
    """One cause of latency a warning names (ids are stable: tools select causes by them)."""

    id: str  # e.g. "max_num_seqs", "prefill_chunks", "preemption", "long_prompt", "uncached_prefix"
    explained_ms: float  # latency per request it accounts for (queueing, prefill, stalls)
    summary: str
    setting: str | None = None  # the server setting (or workload knob) it points at


@dataclass
class Finding:
    step: int  # the place in the troubleshooting order (1-6), as the text report numbers it
    id: str  # stable name of the check, e.g. "ttft": what tests and tools select a finding by
    title: str
    severity: Severity
    summary: str
    cause: str
    evidence: dict[str, Any] = field(default_factory=dict)
    what_ifs: list[WhatIf] = field(default_factory=list)
    causes: list[Cause] = field(default_factory=list)


@dataclass(frozen=True)
class Question:
    """One check: its place in the order, its id, and the question its finding answers."""

    step: int
    id: str
    title: str

    def answer(
        self,
        severity: Severity,
        summary: str,
        cause: str,
        evidence: dict[str, Any],
        what_ifs: Sequence[WhatIf] = (),
        causes: Sequence[Cause] = (),
    ) -> Finding:
        return Finding(
            self.step, self.id, self.title, severity, summary, cause, evidence, list(what_ifs), list(causes)
        )


INPUT_LENGTH = Question(1, "input_length", "Is the input too long?")
TTFT = Question(2, "ttft", "Is TTFT high?")
ITL = Question(3, "itl", "Is ITL high?")
KV_MEMORY = Question(4, "kv_memory", "Does the KV cache take too much memory?")
QUANTIZATION = Question(5, "quantization", "Is there quantization headroom?")
SERVING_FEATURES = Question(6, "serving_features", "Is the serving framework doing its part?")
