"""A workload's priority classes (`kvflow bench --priority-mix 0:0.2,5:0.8`): each measured request
carries vLLM's `priority` field (lower is served first by a server under
`--scheduling-policy priority`), drawn so that each class gets its share of the requests exactly
(rounded), in a seeded order; the result reports TTFT and end-to-end latency per class."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from kvflow.bench.events import RequestRecord
from kvflow.bench.metrics import request_metrics, summarize


def parse_priority_mix(text: str | None) -> dict[int, float]:
    """ "0:0.2,5:0.8" -> {0: 0.2, 5: 0.8}: integer priorities, positive shares that sum to 1."""
    if not text:
        return {}
    mix: dict[int, float] = {}
    for item in text.split(","):
        priority, sep, share = item.partition(":")
        try:
            if not sep:
                raise ValueError
            mix[int(priority)] = float(share)
        except ValueError:
            raise ValueError(f"--priority-mix: {item!r} is not PRIORITY:SHARE (e.g. 0:0.2,5:0.8)") from None
    if any(s <= 0 for s in mix.values()) or abs(sum(mix.values()) - 1.0) > 1e-6:
        raise ValueError(f"--priority-mix: the shares must be positive and sum to 1, got {text!r}")
    return mix


def assign_priorities(num_requests: int, mix: Mapping[int, float], seed: int) -> list[int | None]:
    """One priority per measured request: round(share * n) of each class (the largest class takes the
    rounding), shuffled by `seed`. No mix: None for every request (the field is not sent)."""
    if not mix:
        return [None] * num_requests
    counts = {p: round(share * num_requests) for p, share in mix.items()}
    largest = max(mix, key=lambda p: mix[p])
    counts[largest] += num_requests - sum(counts.values())
    order: list[int | None] = [p for p, c in sorted(counts.items()) for _ in range(c)]
    random.Random(seed).shuffle(order)
    return order


def per_priority(records: Sequence[RequestRecord]) -> dict[str, dict[str, object]] | None:
    """TTFT and end-to-end latency per priority class, when the run has more than one; keyed by the
    priority as text (JSON keys)."""
    classes = sorted({r.priority for r in records if r.priority is not None})
    if len(classes) < 2:
        return None
    table: dict[str, dict[str, object]] = {}
    for priority in classes:
        ok = [request_metrics(r) for r in records if r.priority == priority and r.succeeded]
        table[str(priority)] = {
            "completed": len(ok),
            "failed": sum(1 for r in records if r.priority == priority and not r.succeeded),
            "ttft_ms": summarize(m.ttft_ms for m in ok),
            "e2e_ms": summarize(m.e2e_ms for m in ok),
        }
    return table
