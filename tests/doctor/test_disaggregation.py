"""The disaggregation what-if's pair (kvflow/doctor/disaggregation.py) simulated: the decode instance
takes each prompt's last block beside the others' decodes, and those steps are its tail; a request
arriving there waits for the step in flight."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvflow.doctor.calibrate import SIM_METRICS, Calibration
from kvflow.doctor.disaggregation import DECODE_SPLIT_SLOWDOWN, PREFILL_SPLIT_SLOWDOWN, pd_simulated
from kvflow.doctor.evidence import RequestSample, calculator_evidence
from kvflow.doctor.simulate import SimSettings, simulate
from kvflow.doctor.step_cost import StepCost, StepShape

COST = StepCost(fixed_ms=2.0, per_token_ms=0.1, attention_ratio=0.0)  # a step: 2 ms + 0.1 ms a token


def test_the_decode_instances_tail_is_the_steps_that_take_in_a_last_block() -> None:
    """Four clients of 392-token prompts (24 blocks + 8 tokens) and 48 outputs, colocated with a
    512-token budget: the tail is the decodes stalled by prompt chunks. On the pair the decode
    instance computes only each prompt's last 8 tokens, beside the other clients' decodes: its ITL
    p99 is such a step, its p50 a plain decode, and a request's first token there waits for the step
    in flight before its own (the constant-ratio estimate had priced its step on an idle instance,
    25.5 ms where 57.6 were measured on a Zen 2)."""
    samples = [RequestSample(392, 48, 0, 0.0, None, None) for _ in range(16)]
    settings = SimSettings(4, 512, None, 16, True)
    colocated = simulate(samples, settings, COST, 4)
    p50 = SIM_METRICS["itl_p50_ms"]
    evidence = replace(
        calculator_evidence(392, 4, 48),
        requests=samples,
        concurrency=4.0,
        itl_p50_ms=p50(colocated),  # the run's plain gaps as simulated: the carry's ratio is 1
        ttft_p50_ms=SIM_METRICS["ttft_p50_ms"](colocated),
    )
    cal = Calibration(COST, settings, colocated, 4, evidence, 0.0)
    pair = pd_simulated(cal, transfer_ms_per_token=1.0 / 392)  # 1 ms for the prompt
    assert pair is not None
    half = DECODE_SPLIT_SLOWDOWN  # no profile: every decode-instance step x the measured ratio
    last_block_beside = half * (COST.fixed_ms + COST.per_token_ms * (8 + 3))
    assert pair.itl_p99_ms == pytest.approx(last_block_beside, rel=0.05)
    assert pair.itl_p99_ms < SIM_METRICS["itl_p99_ms"](colocated)  # no 512-token chunk stalls a decode
    assert pair.itl_p50_ms <= half * COST.step_ms(StepShape(decode_rows=4)) + 1e-9
    # Where one run of the pair's decode instance lands, from its replays (the interval's width).
    assert pair.itl_p99_range is not None and pair.itl_p99_range[0] <= 1.0 <= pair.itl_p99_range[1]
    # TTFT: the prefill instance's (whole prompts on half the cores), then the decode instance's (the
    # fetch, the step in flight, its own): more than its own step on an idle instance.
    alone = half * COST.step_ms(StepShape(prefill_tokens=8))
    prefill_alone = PREFILL_SPLIT_SLOWDOWN * COST.step_ms(StepShape(prefill_tokens=392))
    assert pair.ttft_p50_ms > prefill_alone + 1.0 + alone


def test_the_pair_is_carried_by_the_step_speed_not_the_colocated_ttft() -> None:
    """The colocated run's TTFT p50 is where its few requests happened to queue behind each other,
    which the pair's prefill instance reorders: two runs of the same step speed whose TTFT p50 differ
    by a third predict the same pair; a run whose steps are all 20% slower predicts a slower pair."""
    samples = [RequestSample(392, 48, 0, 0.0, None, None) for _ in range(16)]
    settings = SimSettings(4, 512, None, 16, True)
    colocated = simulate(samples, settings, COST, 4)
    p50 = SIM_METRICS["itl_p50_ms"]

    def pair(ttft_p50_ms: float, itl_p50_ms: float) -> float:
        evidence = replace(
            calculator_evidence(392, 4, 48),
            requests=samples,
            concurrency=4.0,
            itl_p50_ms=itl_p50_ms,
            ttft_p50_ms=ttft_p50_ms,
        )
        predicted = pd_simulated(Calibration(COST, settings, colocated, 4, evidence, 0.0), 1.0 / 392)
        assert predicted is not None
        return predicted.ttft_p50_ms

    ttft, itl = SIM_METRICS["ttft_p50_ms"](colocated), p50(colocated)
    assert pair(ttft * 1.33, itl) == pytest.approx(pair(ttft, itl))
    # Slower steps: each instance's steps 20% slower, less queueing at the prefill instance (each
    # client's decode phase is longer too, so fewer prompts arrive together).
    assert pair(ttft, itl) < pair(ttft, itl * 1.2) <= pair(ttft, itl) * 1.2
