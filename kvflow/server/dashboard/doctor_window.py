"""What the doctor is handed when the dashboard asks for the live window's findings.

The server layer cannot import the doctor (it sits above: docs/ARCHITECTURE.md, "Layers"), so the
diagnosis is passed in as a callable (`LiveDoctor`) by whoever starts the server (`kvflow serve`:
kvflow/doctor/live.py), with the window's raw material gathered by the hub (`DashboardHub.doctor_window`).
Plain data: the doctor imports this module, and it must stay torch-free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DoctorWindow:
    """The last `window_s` seconds, as the server saw them (schema.py's layouts)."""

    model_dir: str
    started: float  # monotonic time the window starts at
    now: float
    requests: list[dict[str, Any]]  # finished requests (request objects of schema.py)
    itl_ms: list[float]  # every inter-token gap of the window
    seconds: list[list[Any]]  # per-second rows (SECOND_FIELDS)
    metrics_before: bytes  # /metrics at (or just before) `started`
    metrics_after: bytes  # /metrics now
    metrics_samples: list[bytes]  # /metrics sampled during the window (the gauges)
    max_concurrency: int  # max_num_seqs


# Window -> the doctor's HTML page. Called in a worker thread (it may measure the hardware once).
LiveDoctor = Callable[[DoctorWindow], str]
