"""The server's own view of a run (the result's `server` section): `/metrics` deltas between the
scrapes before and after the measured requests, gauges sampled during them, and the per-request
timings a server streams (llama-server's `timings`), whatever the server's names
(kvflow/bench/metric_names.py maps them). Fields a server does not export are listed in
`not_exported` instead of reading as zero. Histogram quantiles are interpolated from bucket deltas as
Prometheus' `histogram_quantile` does, so they cover exactly the requests of the run.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from kvflow.bench.gauges import GaugeSamples
from kvflow.bench.metric_names import REPORTED_FIELDS, ServerNames, Source, server_names
from kvflow.bench.server_metrics import Snapshot

STEP_KINDS = ("decode_only", "mixed", "prefill_only")


def _total(snapshot: Snapshot, name: str, **labels: str) -> float | None:
    samples = snapshot.get(name)
    if samples is None:
        return None
    want = set(labels.items())
    return sum(v for key, v in samples.items() if want <= set(key))


def _resolve(snapshot: Snapshot, source: Source) -> tuple[str, ...] | None:
    """The first alternative whose every name the server exports."""
    return next((alt for alt in source if all(name in snapshot for name in alt)), None)


def _delta(before: Snapshot, after: Snapshot, names: tuple[str, ...], **labels: str) -> float:
    total = 0.0
    for name in names:
        total += (_total(after, name, **labels) or 0.0) - (_total(before, name, **labels) or 0.0)
    return total


def _buckets(snapshot: Snapshot, name: str) -> list[tuple[float, float]]:
    merged: dict[float, float] = defaultdict(float)
    for key, value in snapshot.get(name + "_bucket", {}).items():
        le = dict(key).get("le")
        if le is not None:
            merged[float(le)] += value
    return sorted(merged.items())


def histogram_quantile(before: Snapshot, after: Snapshot, name: str, q: float) -> float | None:
    """Quantile q in [0, 1] of the observations of histogram `name` (full name) made between the
    two snapshots (linear within a bucket)."""
    after_b, before_b = _buckets(after, name), dict(_buckets(before, name))
    deltas = [(le, count - before_b.get(le, 0.0)) for le, count in after_b]
    if not deltas or deltas[-1][1] <= 0:
        return None
    rank = q * deltas[-1][1]
    prev_le, prev_count = 0.0, 0.0
    for le, count in deltas:
        if count >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_count) / max(count - prev_count, 1e-12)
        prev_le, prev_count = le, count
    return prev_le


class _Reader:
    """Deltas of one server's fields between two snapshots, remembering which fields it lacks."""

    def __init__(self, names: ServerNames, before: Snapshot, after: Snapshot) -> None:
        self.names, self.before, self.after = names, before, after
        self.missing: set[str] = set()

    def counter(self, field: str) -> float | None:
        resolved = _resolve(self.after, self.names.counters.get(field, ()))
        if resolved is None:
            self.missing.add(field)
            return None
        return _delta(self.before, self.after, resolved)

    def histogram(self, field: str) -> dict[str, float | None]:
        bases = [n for alt in self.names.histograms.get(field, ()) for n in alt]
        name = next((n for n in bases if n + "_bucket" in self.after or n + "_count" in self.after), None)
        if name is None:
            self.missing.add(field)
            return {"mean": None, "p50": None, "p99": None}
        count = _delta(self.before, self.after, (name + "_count",))
        total = _delta(self.before, self.after, (name + "_sum",))

        def quantile_ms(q: float) -> float | None:
            value = histogram_quantile(self.before, self.after, name, q)
            return None if value is None else value * 1e3

        return {
            "mean": 1e3 * total / count if count else None,
            "p50": quantile_ms(0.5),
            "p99": quantile_ms(0.99),
        }

    def step_times(self) -> dict[str, dict[str, float]]:
        """kvflow's engine step time by what the step computed (decode_only / mixed / prefill_only)."""
        if not self.names.step_kinds:
            return {}
        base = self.names.prefix + "engine_step_time_seconds"
        result: dict[str, dict[str, float]] = {}
        for kind in STEP_KINDS:
            count = _delta(self.before, self.after, (base + "_count",), step_kind=kind)
            total = _delta(self.before, self.after, (base + "_sum",), step_kind=kind)
            if count:
                result[kind] = {"count": count, "mean": 1e3 * total / count}
        return result


def _gauges(names: ServerNames, samples: GaugeSamples | None, missing: set[str]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for field, source in names.gauges.items():
        found = None
        for alternative in source:
            found = samples.summary(alternative[0]) if samples is not None else None
            if found is not None:
                break
        if found is None:
            missing.add(field)
        else:
            result[field] = found
    return result


def stream_timings(timings: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Means of the per-request timings a server streamed (llama-server: prompt_ms covers the
    request's prompt processing, batched with others' when they overlap; predicted_per_token_ms is
    its mean gap between generated tokens)."""
    keys = ("prompt_ms", "prompt_n", "predicted_per_token_ms", "cache_n")
    result: dict[str, float] = {"requests": float(len(timings))}
    for key in keys:
        values = [float(t[key]) for t in timings if isinstance(t.get(key), (int, float))]
        if values:
            result[key + "_mean"] = sum(values) / len(values)
    return result


def server_section(
    before: Snapshot | None,
    after: Snapshot | None,
    client_ttft_mean_ms: float | None,
    gauges: GaugeSamples | None = None,
    timings: Sequence[dict[str, Any]] = (),
    num_requests: int = 0,
) -> dict[str, Any]:
    """The JSON result's `server` object; `num_requests` (completed, client side) turns llama-server's
    summed per-slot prompt seconds into a mean per request."""
    streamed = stream_timings(timings) if timings else None
    names = server_names(after) if after is not None else None
    if before is None or after is None or names is None:
        section: dict[str, Any] = {
            "metrics_prefix": None,
            "server": "unknown",
            "not_exported": list(REPORTED_FIELDS),
            "note": "no Prometheus /metrics from this server, or none in a known naming scheme",
        }
        if streamed and "prompt_ms_mean" in streamed:
            section["stream_timings"] = streamed
            section["prefill_time_ms"] = {"mean": streamed["prompt_ms_mean"]}
            section["not_exported"].remove("prefill_time")
        return section
    return _section(names, _Reader(names, before, after), client_ttft_mean_ms, gauges, streamed, num_requests)


def _section(
    names: ServerNames,
    read: _Reader,
    client_ttft_mean_ms: float | None,
    gauges: GaugeSamples | None,
    streamed: dict[str, float] | None,
    num_requests: int,
) -> dict[str, Any]:
    queries, hits = read.counter("prefix_cache_queries"), read.counter("prefix_cache_hits")
    generation = read.counter("generation_tokens")
    ttft = read.histogram("ttft")
    prefill = read.histogram("prefill_time")
    prompt_seconds, decode_seconds = read.counter("prompt_seconds"), read.counter("decode_seconds")
    if prefill["mean"] is None and streamed and "prompt_ms_mean" in streamed:
        prefill["mean"] = streamed["prompt_ms_mean"]  # the server's own per-request prompt time
        read.missing.discard("prefill_time")
    elif prefill["mean"] is None and prompt_seconds is not None and num_requests:
        prefill["mean"] = 1e3 * prompt_seconds / num_requests  # per slot = per request
        read.missing.discard("prefill_time")
    section: dict[str, Any] = {
        "metrics_prefix": names.prefix,
        "server": names.family,
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": (hits / queries) if queries and hits is not None else None,
        "num_preemptions": read.counter("num_preemptions"),
        "prompt_tokens": read.counter("prompt_tokens"),
        "generation_tokens": generation,
        "requests_finished": read.counter("requests_finished"),
        "computed_tokens": read.counter("computed_tokens"),
        "num_steps": read.counter("num_steps"),
        "ttft_ms": ttft,
        "itl_ms": read.histogram("itl"),
        "e2e_ms": read.histogram("e2e"),
        "queue_time_ms": read.histogram("queue_time"),
        # kvflow: structured-output requests' wait for their grammar (part of their queue time).
        "grammar_compile_ms": read.histogram("grammar_compile"),
        "prefill_time_ms": prefill,
        "step_time_ms": read.step_times(),
        # Each slot's time per generated token, averaged: one decode step of the batch it was in.
        "decode_step_ms": (1e3 * decode_seconds / generation) if decode_seconds and generation else None,
        "client_minus_server_ttft_ms": (
            client_ttft_mean_ms - ttft["mean"]
            if client_ttft_mean_ms is not None and ttft["mean"] is not None
            else None
        ),
    }
    section["gauges"] = _gauges(names, gauges, read.missing)
    if streamed:
        section["stream_timings"] = streamed
    exported = names.exported() | ({"prefill_time"} if prefill["mean"] is not None else set())
    section["not_exported"] = [f for f in REPORTED_FIELDS if f in read.missing or f not in exported]
    if section["decode_step_ms"] is None and "decode_only" in section["step_time_ms"]:
        section["decode_step_ms"] = section["step_time_ms"]["decode_only"]["mean"]
    return section
