"""Replicas behind a router, one report: which replica is the bottleneck, and each one's prefix hit rate.

Input: each replica's server section (kvflow/bench/server_view.py), from `kvflow bench
--replica-metrics` (deltas over the run) or scraped now by `kvflow doctor --replica-metrics`
(cumulative since each replica started). The bottleneck is the replica whose requests waited longest
for their first token (mean TTFT): that is where the router's choices cost the users. The reasons
looked for, in the order a router operator would act on them:
    load        it served more than its share of the requests (the policy does not balance)
    queueing    its requests queued before prefill (it is saturated: more replicas, or balance)
    cache       its prefix hit rate is below the others' (prompts it could have hit were sent elsewhere:
                a cache-aware policy keeps a prefix on one replica)
    KV pool     its pool filled (preemptions recompute prompts)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

# A replica is "over its share" when it served this much more than 1/N of the requests.
IMBALANCE_RATIO = 1.25
# Its hit rate is "below the others'" by at least this many points (a fraction of prompt tokens).
HIT_RATE_GAP = 0.15
# Queueing explains the gap when its mean queue time is at least this share of its mean TTFT.
QUEUE_SHARE = 0.3
# A pool this full at its peak turns new requests into preemptions.
KV_FULL = 0.95


@dataclass(frozen=True)
class ReplicaView:
    metrics_url: str
    server: str
    requests: float | None
    prompt_tokens: float | None
    prefix_hit_rate: float | None
    ttft_mean_ms: float | None
    ttft_p99_ms: float | None
    queue_mean_ms: float | None
    itl_mean_ms: float | None
    kv_usage_max: float | None
    num_preemptions: float | None


def replica_view(section: Mapping[str, Any]) -> ReplicaView:
    kv = section.get("gauges", {}).get("kv_usage")
    return ReplicaView(
        metrics_url=str(section.get("metrics_url", "")),
        server=str(section.get("server", "unknown")),
        requests=section.get("requests_finished"),
        prompt_tokens=section.get("prompt_tokens"),
        prefix_hit_rate=section.get("prefix_cache_hit_rate"),
        ttft_mean_ms=section.get("ttft_ms", {}).get("mean"),
        ttft_p99_ms=section.get("ttft_ms", {}).get("p99"),
        queue_mean_ms=section.get("queue_time_ms", {}).get("mean"),
        itl_mean_ms=section.get("itl_ms", {}).get("mean"),
        kv_usage_max=kv.get("max") if isinstance(kv, Mapping) else None,
        num_preemptions=section.get("num_preemptions"),
    )


def _bottleneck_reasons(
    worst: ReplicaView, others: Sequence[ReplicaView], total_requests: float
) -> list[str]:
    reasons = []
    n = len(others) + 1
    if worst.requests is not None and total_requests > 0:
        share = worst.requests / total_requests
        if share > IMBALANCE_RATIO / n:
            reasons.append(
                f"load: it served {share:.0%} of the requests, against a fair share of {1 / n:.0%}"
            )
    if (
        worst.queue_mean_ms is not None
        and worst.ttft_mean_ms
        and worst.queue_mean_ms >= QUEUE_SHARE * worst.ttft_mean_ms
    ):
        reasons.append(
            f"queueing: its requests waited {worst.queue_mean_ms:.0f} ms before prefill, "
            f"{worst.queue_mean_ms / worst.ttft_mean_ms:.0%} of its mean TTFT"
        )
    rates = [o.prefix_hit_rate for o in others if o.prefix_hit_rate is not None]
    if worst.prefix_hit_rate is not None and rates and max(rates) - worst.prefix_hit_rate >= HIT_RATE_GAP:
        reasons.append(
            f"cache: its prefix hit rate is {worst.prefix_hit_rate:.0%}, against {max(rates):.0%} on "
            "another replica (more of its prompts were computed from scratch)"
        )
    if worst.kv_usage_max is not None and worst.kv_usage_max >= KV_FULL:
        preempted = f", {worst.num_preemptions:.0f} preemptions" if worst.num_preemptions else ""
        reasons.append(f"KV pool: it filled to {worst.kv_usage_max:.0%}{preempted}")
    return reasons


def replicas_report(sections: Sequence[Mapping[str, Any]], cumulative: bool) -> dict[str, Any]:
    """The doctor JSON's `replicas` object (docs/doctor.md)."""
    views = [replica_view(s) for s in sections]
    total_requests = sum(v.requests or 0.0 for v in views)
    queries = sum((v.prompt_tokens or 0.0) for v in views if v.prefix_hit_rate is not None)
    hits = sum((v.prompt_tokens or 0.0) * (v.prefix_hit_rate or 0.0) for v in views)
    report: dict[str, Any] = {
        "window": "since each replica started" if cumulative else "the benchmark run",
        "replicas": [asdict(v) for v in views],
        "prefix_hit_rate": hits / queries if queries else None,
        "bottleneck": None,
        "advice": [],
    }
    timed = [v for v in views if v.ttft_mean_ms is not None and v.requests]
    if len(timed) < 2:
        report["advice"].append(
            "fewer than two replicas served requests with a TTFT histogram: nothing to compare"
        )
        return report
    worst = max(timed, key=lambda v: v.ttft_mean_ms or 0.0)
    best = min(timed, key=lambda v: v.ttft_mean_ms or 0.0)
    others = [v for v in views if v is not worst]
    reasons = _bottleneck_reasons(worst, others, total_requests)
    report["bottleneck"] = {
        "metrics_url": worst.metrics_url,
        "ttft_mean_ms": worst.ttft_mean_ms,
        "best_ttft_mean_ms": best.ttft_mean_ms,
        "reasons": reasons,
    }
    if any(r.startswith(("load", "queueing")) for r in reasons):
        report["advice"].append(
            "balance the load: a policy that counts requests in flight (vllm-router power_of_two, or "
            "kv_aware, which weighs prefix hits against load), or one more replica"
        )
    if any(r.startswith("cache") for r in reasons):
        report["advice"].append(
            "keep each prefix on one replica: vllm-router --policy kv_aware with every kvflow replica "
            "publishing --kv-events-config (README, 'Replicas behind a KV-aware router')"
        )
    return report


def replicas_text(report: Mapping[str, Any]) -> str:
    lines = [f"Replicas ({report['window']}):"]
    lines.append(
        "  replica                                  requests  prefix hits  TTFT mean  TTFT p99  queue  KV max"
    )
    for r in report["replicas"]:
        lines.append(
            f"  {r['metrics_url'][:40]:<40} {_num(r['requests'], '.0f'):>8}"
            f"  {_num(r['prefix_hit_rate'], '.0%'):>11}"
            f"  {_num(r['ttft_mean_ms'], '.0f'):>9}  {_num(r['ttft_p99_ms'], '.0f'):>8}"
            f"  {_num(r['queue_mean_ms'], '.0f'):>5}  {_num(r['kv_usage_max'], '.0%'):>6}"
        )
    if report["prefix_hit_rate"] is not None:
        lines.append(f"  all replicas: {report['prefix_hit_rate']:.0%} of prompt tokens hit a prefix cache")
    bottleneck = report["bottleneck"]
    if bottleneck is not None:
        lines.append(
            f"  bottleneck: {bottleneck['metrics_url']} (mean TTFT {bottleneck['ttft_mean_ms']:.0f} ms, "
            f"the best replica's {bottleneck['best_ttft_mean_ms']:.0f} ms)"
        )
        lines += [f"    - {reason}" for reason in bottleneck["reasons"] or ["no single reason stands out"]]
    lines += [f"  advice: {a}" for a in report["advice"]]
    return "\n".join(lines)


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)
