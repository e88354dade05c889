"""Metrics from raw request events (kvflow/bench/events.py). Definitions, also in docs/metrics.md:

    TTFT              first content-bearing chunk - send (a role-only first chunk does not count)
    ttft_first_chunk  first chunk of any kind - send (vLLM bench's definition)
    ITL per token     a content chunk carrying n tokens after a gap g contributes n gaps of g/n
    ITL per chunk     gap between consecutive content chunks, whatever they carry
    TPOT              (E2E - TTFT) / (N_out - 1), one value per request (needs N_out >= 2)
    E2E               last content chunk (or stream end if none) - send
    goodput           requests per second of the run that met every SLO given
Summaries: mean, p50, p90, p95, p99 (linear interpolation between order statistics) and max.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvflow.bench.events import RequestRecord
from kvflow.stats import percentile  # the one percentile (bench and doctor import it from here)

PERCENTILES = (50, 90, 95, 99)
# SLO keys users may give (`--slo ttft_ms=500,tpot_ms=50`) -> the per-request metric each bounds.
SLO_METRICS = ("ttft_ms", "tpot_ms", "itl_p99_ms", "e2e_ms")


@dataclass(frozen=True)
class RequestMetrics:
    ttft_ms: float | None
    ttft_first_chunk_ms: float | None
    e2e_ms: float | None
    tpot_ms: float | None
    itl_ms: list[float]  # per token
    itl_chunk_ms: list[float]  # per chunk

    @property
    def itl_p99_ms(self) -> float | None:
        return percentile(self.itl_ms, 99) if self.itl_ms else None


def request_metrics(record: RequestRecord) -> RequestMetrics:
    first_any = record.chunks[0].time if record.chunks else None
    content = record.content_chunks
    with_tokens = [c for c in content if c.num_tokens > 0]
    ttft = (with_tokens[0].time - record.send_time) if with_tokens else None
    last = with_tokens[-1].time if with_tokens else record.end_time
    e2e = (last - record.send_time) if last is not None and record.succeeded else None
    itl_token: list[float] = []
    itl_chunk: list[float] = []
    for prev, cur in itertools.pairwise(with_tokens):
        gap = (cur.time - prev.time) * 1e3
        itl_chunk.append(gap)
        itl_token.extend([gap / cur.num_tokens] * cur.num_tokens)
    n_out = record.output_tokens
    tpot = None
    if ttft is not None and e2e is not None and n_out >= 2:
        tpot = (e2e - ttft) * 1e3 / (n_out - 1)
    return RequestMetrics(
        ttft_ms=None if ttft is None else ttft * 1e3,
        ttft_first_chunk_ms=None if first_any is None else (first_any - record.send_time) * 1e3,
        e2e_ms=None if e2e is None else e2e * 1e3,
        tpot_ms=tpot,
        itl_ms=itl_token,
        itl_chunk_ms=itl_chunk,
    )


def summarize(values: Iterable[float | None]) -> dict[str, float | None]:
    """mean, p50, p90, p95, p99, max of the non-None values (all None when there are none)."""
    present = [v for v in values if v is not None]
    keys = ["mean", *(f"p{p}" for p in PERCENTILES), "max"]
    if not present:
        return dict.fromkeys(keys)
    result: dict[str, float | None] = {"mean": sum(present) / len(present)}
    for p in PERCENTILES:
        result[f"p{p}"] = percentile(present, p)
    result["max"] = max(present)
    return result


def parse_slo(text: str | None) -> dict[str, float]:
    """`ttft_ms=500,tpot_ms=50` -> {"ttft_ms": 500.0, "tpot_ms": 50.0}; unknown keys are errors."""
    if not text:
        return {}
    slo: dict[str, float] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in SLO_METRICS:
            raise ValueError(f"bad SLO {part!r}: expected KEY=MS with KEY in {', '.join(SLO_METRICS)}")
        slo[key] = float(value)
    return slo


def meets_slo(metrics: RequestMetrics, slo: Mapping[str, float]) -> bool:
    """Every bound holds; a metric that cannot be computed (e.g. TPOT of a 1-token answer) passes."""
    for key, bound in slo.items():
        value = getattr(metrics, key)
        if value is not None and value > bound:
            return False
    return True


def aggregate(
    records: Sequence[RequestRecord], duration_s: float, slo: Mapping[str, float]
) -> dict[str, object]:
    """The headline numbers of a run (warm-up requests must already be excluded)."""
    ok = [r for r in records if r.succeeded]
    per_request = [request_metrics(r) for r in ok]
    output_tokens = sum(r.output_tokens for r in ok)
    input_tokens = sum(r.prompt_tokens for r in ok)
    good = sum(meets_slo(m, slo) for m in per_request) if slo else None
    duration = max(duration_s, 1e-9)
    return {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "goodput": None if good is None else good / duration,
        "slo_attainment_pct": None if good is None else 100.0 * good / max(len(records), 1),
        "ttft_ms": summarize(m.ttft_ms for m in per_request),
        "ttft_first_chunk_ms": summarize(m.ttft_first_chunk_ms for m in per_request),
        "tpot_ms": summarize(m.tpot_ms for m in per_request),
        "itl_ms": summarize(v for m in per_request for v in m.itl_ms),
        "itl_chunk_ms": summarize(v for m in per_request for v in m.itl_chunk_ms),
        "e2e_ms": summarize(m.e2e_ms for m in per_request),
    }
