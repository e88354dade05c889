"""A run's own noise on each latency metric (kvflow/doctor/noise.py): the bootstrap interval narrows
as the run holds more requests, a prediction carries it, and what-ifs whose predicted change is
inside it are held back (listed in the finding's evidence) instead of offered as fixes."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from kvflow.doctor.evidence import RequestSample, calculator_evidence
from kvflow.doctor.finding import TTFT, WhatIf
from kvflow.doctor.noise import METRICS, hold_back_noise, relative_noise


def run_of(n: int, seed: int = 1):  # type: ignore[no-untyped-def]
    rng = random.Random(seed)
    requests = []
    for i in range(n):
        ttft = rng.gauss(100.0, 20.0)
        gaps = tuple(max(rng.gauss(10.0, 3.0), 0.1) for _ in range(15))
        requests.append(RequestSample(32, 16, 0, float(i), ttft, ttft + sum(gaps), gaps, sum(gaps) / 15))
    return replace(calculator_evidence(32, 1, 16), requests=requests)


def test_the_interval_narrows_with_more_requests_and_tails_are_noisier() -> None:
    few, many = relative_noise(run_of(8), "ttft_p50_ms"), relative_noise(run_of(400), "ttft_p50_ms")
    assert few is not None and many is not None and 0 < many < few
    # A p50 over 400 requests of sd 20 around 100: its standard error is ~1.25 ms, the 90% half-width ~2%.
    assert many == pytest.approx(0.02, abs=0.012)
    p99 = relative_noise(run_of(40), "itl_p99_ms")
    p50 = relative_noise(run_of(40), "decode_ms_per_step")
    assert p99 is not None and p50 is not None and p99 > p50
    assert relative_noise(run_of(40), "max_concurrency_at_p95") is None  # not a latency the run measures
    assert relative_noise(run_of(40), "ttft_p50_ms") == relative_noise(run_of(40), "ttft_p50_ms")  # seeded


def test_what_ifs_within_the_noise_are_held_back() -> None:
    run = run_of(16)
    base = METRICS["ttft_p50_ms"](run.requests)
    run = replace(run, ttft_p50_ms=base)  # the run's own figure, as kvflow bench reports it
    h = relative_noise(run, "ttft_p50_ms")
    assert base is not None and h is not None
    small = WhatIf("a smaller chunk", "p50 TTFT barely moves", {"ttft_p50_ms": base * (1 - h / 2)})
    large = WhatIf("more slots", "p50 TTFT halves", {"ttft_p50_ms": base * 0.5})
    mixed = WhatIf("int8 KV", "more requests", {"ttft_p50_ms": base, "max_concurrency_at_p95": 9.0})
    finding = TTFT.answer("warning", "s", "c", {}, [small, large, mixed])
    hold_back_noise(run, [finding])
    assert [w.change for w in finding.what_ifs] == ["more slots", "int8 KV"]
    held = finding.evidence["what_ifs_within_noise"]
    assert [w["change"] for w in held] == ["a smaller chunk"]
    lo, hi = large.interval["ttft_p50_ms"]
    assert lo == pytest.approx(base * 0.5 * (1 - h)) and hi == pytest.approx(base * 0.5 * (1 + h))


def test_a_prediction_carried_by_another_metric_takes_that_metrics_noise_and_stays_positive() -> None:
    """The kv_pool what-if's ITL p99, once the baseline's preemption stalls are gone, is scaled by
    the plain gaps' ratio (WhatIf.carried_by: itl_p50_ms): the noise that entered it is the ITL
    p50's, not the stalled tail's (h = 4.2 on the planted run, an interval of -15 to 25 ms around
    4.7). Whatever h, the interval never goes below zero."""
    run = run_of(12)
    stalled = [
        replace(r, itl_ms=(*r.itl_ms[:-1], 400.0)) if i % 6 == 0 else r for i, r in enumerate(run.requests)
    ]  # a stall in every sixth request: the tail's value hangs on which requests a rerun draws
    run = replace(run, requests=stalled, itl_p99_ms=METRICS["itl_p99_ms"](stalled))
    tail, plain = relative_noise(run, "itl_p99_ms"), relative_noise(run, "itl_p50_ms")
    assert tail is not None and plain is not None and tail > 1.0 > 10 * plain
    carried = WhatIf(
        "num_kv_blocks 12 -> 36", "...", {"itl_p99_ms": 12.0}, carried_by={"itl_p99_ms": "itl_p50_ms"}
    )
    itself = WhatIf("num_kv_blocks 12 -> 24", "...", {"itl_p99_ms": 12.0})
    hold_back_noise(run, [TTFT.answer("warning", "s", "c", {}, [carried, itself])])
    assert carried.interval["itl_p99_ms"] == pytest.approx([12.0 * (1 - plain), 12.0 * (1 + plain)])
    assert itself.interval["itl_p99_ms"] == pytest.approx([0.0, 12.0 * (1 + tail)])


def test_the_interval_holds_where_one_run_of_the_change_lands() -> None:
    """A simulated prediction states where one run of the change lands (WhatIf.sampling_range, the
    central 90% of the simulator's replays): the interval is at least that wide, on each side, so a
    tail on the edge of a step kind (kv_pool's ITL p99: 3.1-5.4 ms over its replays around 3.8) is
    not stated as 3.5-3.6 from the plain gaps' noise alone."""
    run = run_of(12)
    plain = relative_noise(run, "itl_p50_ms")
    assert plain is not None and plain < 0.2
    edge = WhatIf(
        "num_kv_blocks 12 -> 36",
        "...",
        {"itl_p99_ms": 3.6},
        carried_by={"itl_p99_ms": "itl_p50_ms"},
        sampling_range={"itl_p99_ms": [0.8, 1.4]},
    )
    inside = WhatIf(  # a replay range narrower than the carried noise changes nothing
        "num_kv_blocks 12 -> 24",
        "...",
        {"itl_p99_ms": 3.6},
        carried_by={"itl_p99_ms": "itl_p50_ms"},
        sampling_range={"itl_p99_ms": [1 - plain / 2, 1 + plain / 2]},
    )
    hold_back_noise(run, [TTFT.answer("warning", "s", "c", {}, [edge, inside])])
    assert edge.interval["itl_p99_ms"] == pytest.approx([3.6 * 0.8, 3.6 * 1.4])
    assert inside.interval["itl_p99_ms"] == pytest.approx([3.6 * (1 - plain), 3.6 * (1 + plain)])
