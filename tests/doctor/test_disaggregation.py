"""The disaggregation what-if's decode instance (kvflow/doctor/disaggregation.py): a request arriving
there waits for the step in flight and then shares its own step with the rows already decoding, on
half the cores."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvflow.doctor.calibrate import Calibration
from kvflow.doctor.disaggregation import DECODE_SPLIT_SLOWDOWN, decode_instance_ttft_ms
from kvflow.doctor.evidence import calculator_evidence
from kvflow.doctor.simulate import SimSettings, simulate
from kvflow.doctor.step_cost import StepCost, StepShape

COST = StepCost(fixed_ms=2.0, per_token_ms=0.1, attention_ratio=0.0)  # a step: 2 ms + 0.1 ms a token


def test_the_decode_instance_waits_for_the_step_in_flight_and_shares_its_own() -> None:
    """At 4 clients of ~384-token prompts (2-core Zen 2) the decode instance took 57.6 ms to a first
    token (24.7 queued behind the step in flight, 32.9 its step beside the others' decodes), where
    its step alone on an idle instance had been the whole prediction (25.5)."""
    evidence = replace(calculator_evidence(392, 4, 48), concurrency=4.0)  # 392 = 24 blocks + 8
    settings = SimSettings(4, 512, None, 16, False)
    cal = Calibration(COST, settings, simulate(evidence.requests, settings, COST, 4), 4, evidence, 0.0)
    half = COST.on_half_cores(DECODE_SPLIT_SLOWDOWN)  # no profile: every step x the measured ratio
    alone = half.step_ms(StepShape(prefill_tokens=8))  # the 8 tokens after the last full block
    assert decode_instance_ttft_ms(cal, 392, 0) == pytest.approx(alone)
    two_rows = half.step_ms(StepShape(decode_rows=2))
    beside = half.step_ms(StepShape(decode_rows=2, prefill_tokens=8))
    assert decode_instance_ttft_ms(cal, 392, 2) == pytest.approx(two_rows / 2 + beside)
    assert decode_instance_ttft_ms(cal, 384, 0) == pytest.approx(half.step_ms(StepShape(prefill_tokens=16)))
