"""The server's gauges sampled while the load runs: requests running and waiting, KV usage.

Counters and histograms tell what happened over the run from two scrapes (before and after); gauges
only say what holds at one instant, and after the run every queue is empty. So `/metrics` is also
read every `interval_s` during the load, and the doctor sees whether running requests sat at the
server's limit, how many waited, and how full the KV pool was.

Against a kvflow server the samples come from its dashboard window instead (`window_gauges`): every
engine step records the running and waiting requests and the KV usage after it, so the series is
read off the steps at GRID_S after the run, and nothing scrapes the server while it serves. Each
scrape renders ~21 KB of Prometheus text on the server's API thread, holding the GIL its engine
thread needs: the step it lands on took ~9.5 ms instead of 1.5 on the planted tiny model, a stall
the ITL p99 of a short run reads (benchmarks/NOTES.md, sessions 26 and 27).

A sample parses only the gauges' lines (`gauge_lines`): the sampler shares the event loop that
timestamps every streamed token, and parsing a kvflow server's whole /metrics text (~500 samples,
prometheus_client's parser) held it long enough that each scrape stalled every stream: sampling every
0.1 s, the client's ITL p99 read 13.9 ms on the tiny model, 7.6 without sampling and 7.5 with the
lines filtered first (benchmarks/NOTES.md, session 24).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvflow.bench.metric_names import SERVERS, server_names
from kvflow.bench.server_metrics import Snapshot, parse_metrics

# Every server's gauge sample names (the only lines a sample parses).
GAUGE_NAMES = frozenset(
    name
    for names in SERVERS
    for source in names.gauges.values()
    for alternative in source
    for name in alternative
)


@dataclass
class GaugeSamples:
    """Every sampled value of each gauge sample name (full names, summed over label sets)."""

    values: dict[str, list[float]] = field(default_factory=dict)
    num_scrapes: int = 0

    def add(self, snapshot: Snapshot) -> None:
        self.num_scrapes += 1
        names = server_names(snapshot)
        if names is None:
            return
        for source in names.gauges.values():
            for alternative in source:
                for name in alternative:
                    if name in snapshot:
                        self.values.setdefault(name, []).append(sum(snapshot[name].values()))

    def summary(self, name: str) -> dict[str, float] | None:
        """{mean, max, samples} of one gauge, None when it was never seen."""
        seen = self.values.get(name)
        if not seen:
            return None
        return {"mean": sum(seen) / len(seen), "max": max(seen), "samples": float(len(seen))}


# The window's gauges read at this spacing: finer than any scrape interval, coarser than a step of
# the tiny model (each sample is one step's values, so finer would only repeat them).
GRID_S = 0.01
# A kvflow server's window fields and the gauge each stands for (kvflow/server/metrics.py sets the
# gauges from the same StepStats after every step).
WINDOW_GAUGES = {
    "running": "kvflow:num_requests_running",
    "waiting": "kvflow:num_requests_waiting",
    "kv_usage": "kvflow:kv_cache_usage_perc",
}
WINDOW_FIELDS = ("t", "dur_ms", *WINDOW_GAUGES)  # what a step row needs for them


def records_gauges(hello: dict[str, Any] | None) -> bool:
    """Whether a dashboard window's steps (its first frame, kvflow/bench/server_steps.py) record the
    gauges, each step's."""
    fields = ((hello or {}).get("fields") or {}).get("step") or []
    return all(f in fields for f in WINDOW_FIELDS)


def window_gauges(window: dict[str, Any] | None, grid_s: float = GRID_S) -> GaugeSamples | None:
    """The gauges a scrape every `grid_s` would have read over the run, from a kvflow server's window
    of steps (kvflow/bench/server_steps.py: run_window): at each grid time, the values after the
    last step that ended by then. None without a window that records them."""
    fields = (window or {}).get("step_fields") or []
    steps = (window or {}).get("steps") or []
    if not steps or any(f not in fields for f in WINDOW_FIELDS):
        return None
    index = {name: i for i, name in enumerate(fields)}
    ends = sorted((row[index["t"]] + row[index["dur_ms"]] / 1e3, row) for row in steps)
    samples = GaugeSamples()
    first, last = ends[0][0], ends[-1][0]
    i = 0
    for k in range(int((last - first) / grid_s) + 1):
        at = first + k * grid_s
        while i + 1 < len(ends) and ends[i + 1][0] <= at:
            i += 1
        row = ends[i][1]
        samples.num_scrapes += 1
        for field_name, gauge in WINDOW_GAUGES.items():
            samples.values.setdefault(gauge, []).append(float(row[index[field_name]]))
    return samples


async def sample_gauges(
    http: httpx.AsyncClient, metrics_url: str, interval_s: float, samples: GaugeSamples
) -> None:
    """Scrape every `interval_s` until cancelled (the run's end); a failed scrape is skipped."""
    while True:
        await asyncio.sleep(interval_s)  # first sample once the load is under way
        with contextlib.suppress(httpx.HTTPError, ValueError):
            response = await http.get(metrics_url, timeout=10)
            if response.status_code == 200:
                samples.add(parse_metrics(gauge_lines(response.text)))


def gauge_lines(text: str) -> str:
    """The lines of a /metrics text that belong to a sampled gauge: its samples and its # HELP and
    # TYPE lines (parsed as they would be in the whole text)."""
    kept = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(maxsplit=3)
            name = parts[2] if len(parts) > 2 and parts[1] in ("HELP", "TYPE") else ""
        else:
            name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in GAUGE_NAMES:
            kept.append(line)
    return "\n".join(kept) + "\n"
