"""What-ifs predicted again from other runs of the same server and benchmark.

A diagnosis fits the simulator to one run, and one run is one draw of what it is fitted to: the
planted budget-128 what-if's ITL p99 is a tail of the change's 128-token chunks, drawn from the 12
prompt steps one run records, and came out 40-60 ms from eleven runs of one server whose changed
runs measured 43-67 (benchmarks/NOTES.md, session 41). Each other run is diagnosed as the first was
(the same model, settings, step profile and measured quantization speeds; that run's evidence), and
each what-if that applies a setting or a workload change is predicted again from it: the median over
the runs is the prediction they state together, their range how far one run's can land.
`kvflow doctor --bench-repeat PATH` (repeatable) takes them from the user; `--verify` takes every
fresh baseline it measures (kvflow/doctor/verify.py).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

from kvflow.doctor.diagnosis import Diagnosis
from kvflow.doctor.evidence import evidence_from_bench
from kvflow.doctor.finding import Finding, WhatIf
from kvflow.doctor.findings import diagnose
from kvflow.doctor.server_settings import settings_from_result

# A benchmark result of the diagnosed server's settings -> the doctor's findings on it.
Rediagnose = Callable[[dict[str, Any]], list[Finding]]
# The bench result's config keys that make two runs the same benchmark (the seeds aside: another
# seed draws other prompts of the same lengths, kvflow/bench/datasets.py).
BENCHMARK_KEYS = (
    "endpoint",
    "dataset_name",
    "num_requests",
    "input_len",
    "output_len",
    "range_ratio",
    "prefix_len",
    "num_turns",
    "concurrency",
    "request_rate",
    "burstiness",
    "max_concurrency",
)
# The server settings that make two runs the same server.
SERVER_KEYS = (
    "server",
    "enable_prefix_caching",
    "max_num_batched_tokens",
    "max_num_seqs",
    "num_kv_blocks",
    "block_size",
    "kv_cache_dtype",
    "dtype",
    "quantization",
)


def change_key(what_if: WhatIf) -> str:
    """What a what-if applies (its setting and workload change), as one comparable string."""
    return json.dumps([what_if.setting, what_if.workload], sort_keys=True)


def rediagnosis(diagnosis: Diagnosis) -> Rediagnose:
    """The doctor's findings on another benchmark result of the diagnosed server: the same model,
    settings, step profile and measured quantization speeds, that run's evidence."""

    def findings_on(result: dict[str, Any]) -> list[Finding]:
        return diagnose(replace(diagnosis, run=evidence_from_bench(result)))

    return findings_on


def predicted_again(findings: list[Finding], what_if: WhatIf) -> dict[str, float]:
    """`what_if`'s predictions made again in `findings` (the doctor's on another run, rediagnosis):
    the what-if applying the same change; empty when that run's diagnosis did not offer it (its
    effect there within the noise, say)."""
    key = change_key(what_if)
    for finding in findings:
        for again in finding.what_ifs:
            if change_key(again) == key:
                return dict(again.predicted)
    return {}


def mismatch(result: dict[str, Any], other: dict[str, Any]) -> str | None:
    """How `other` differs from `result` as a run of the same benchmark against the same server
    (one difference, named), or None when it is a repeat."""
    mine, theirs = result.get("config") or {}, other.get("config") or {}
    for key in BENCHMARK_KEYS:
        if mine.get(key) != theirs.get(key):
            return f"its benchmark's {key} is {theirs.get(key)!r}, the diagnosed run's {mine.get(key)!r}"
    server, their_server = settings_from_result(result), settings_from_result(other)
    for key in SERVER_KEYS:
        mine_value, their_value = getattr(server, key), getattr(their_server, key)
        if mine_value != their_value:
            return f"its server's {key} is {their_value!r}, the diagnosed run's {mine_value!r}"
    return None


def predict_over_runs(
    findings: list[Finding], rediagnose: Rediagnose, runs: Iterable[dict[str, Any]]
) -> None:
    """Each what-if of `findings` that applies a change, predicted again from each of `runs`
    (WhatIf.repeated: metric -> one value per run whose diagnosis offered it)."""
    what_ifs = [w for f in findings for w in f.what_ifs if w.setting or w.workload]
    for run in runs:
        on_run = rediagnose(run)  # one diagnosis per run, every what-if read off it
        for what_if in what_ifs:
            for metric, value in predicted_again(on_run, what_if).items():
                if metric in what_if.predicted:
                    what_if.repeated.setdefault(metric, []).append(value)


def over_runs(what_if: dict[str, Any]) -> dict[str, tuple[float, float, float, int]]:
    """A what-if's (JSON) predictions over the runs, with its own: metric -> (median, lowest,
    highest, runs); empty without other runs."""
    out = {}
    for metric, values in (what_if.get("repeated") or {}).items():
        own = what_if["predicted"].get(metric)
        every = [*values, *([own] if own is not None else [])]
        out[metric] = (statistics.median(every), min(every), max(every), len(every))
    return out
