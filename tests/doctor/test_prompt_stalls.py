"""A prompt step's arrival stall (kvflow/doctor/prompt_stalls.py): what the calibration takes off the
recorded prompt steps that held an arrival, and the simulator puts back on the replayed ones that
hold one. Torch-free."""

from __future__ import annotations

import gzip
import json
import statistics
from dataclasses import replace
from pathlib import Path

import pytest

from kvflow.doctor.calibrate import MIN_STEP_RECORDS, _step_records, calibrate
from kvflow.doctor.evidence import RequestSample, evidence_from_bench
from kvflow.doctor.model_spec import ModelSpec
from kvflow.doctor.prompt_stalls import (
    MIN_PROMPT_STEPS_EACH,
    destalled_ms,
    prompt_arrival_stall,
    typical_arrival_stall,
)
from kvflow.doctor.server_settings import settings_from_result
from kvflow.doctor.simulate import SimSettings, simulate
from kvflow.doctor.step_cost import StepCost, StepResiduals, StepShape, profiled_step
from kvflow.doctor.step_profile import StepProfile

RECORDED = Path(__file__).parent / "recorded_runs"


def _profile(arrival_probe: tuple[float, ...] = ()) -> StepProfile:
    measured = json.loads((RECORDED / "step_profile.json").read_text())
    profile = StepProfile.from_json({**measured, "served_arrival_stall_ms": list(arrival_probe)})
    assert profile is not None
    return profile


def _prompt_steps(profile: StepProfile, excess_ms: float, count: int) -> list[tuple[float, StepShape]]:
    """`count` one-prompt steps of 48 tokens beside one decoding row, each `excess_ms` over what the
    profile says it serves in."""
    shape = StepShape(decode_rows=1, prefill_tokens=48)
    served = profiled_step(profile, shape)[0] + profile.served_growth(1)
    return [(served + excess_ms, shape)] * count


def test_the_prompt_steps_state_their_own_stall_where_they_have_both_kinds() -> None:
    """The planted kv_pool run of session 36: its prompt steps that held an arrival took ~2.9 ms more
    than those that did not, the decode steps' (the arrival probe's) stall was 3.4; taking 3.4 off
    priced the what-if's TTFT 14-16% low. The prompt steps' own difference is what comes off."""
    profile = _profile(arrival_probe=(3.4,) * MIN_STEP_RECORDS)
    each = MIN_PROMPT_STEPS_EACH
    steps = _prompt_steps(profile, 2.0, each) + _prompt_steps(profile, 4.9, each + 2)
    flags = [False] * each + [True] * (each + 2)
    assert prompt_arrival_stall(steps, flags, profile) == pytest.approx(2.9)
    # Too few steps that held none: the decode steps' stall (here the probe's) stands.
    cut = steps[1:], flags[1:]
    assert prompt_arrival_stall(*cut, profile) == pytest.approx(3.4)
    # Without a profile the shapes cannot be taken out of the times: the decode steps' stall.
    assert prompt_arrival_stall(steps, flags, None) == typical_arrival_stall(steps, flags, None) == 0.0
    # Flagged steps no slower than the others: nothing comes off.
    calm = _prompt_steps(profile, 2.0, 2 * each)
    assert prompt_arrival_stall(calm, [False] * each + [True] * each, profile) == 0.0


def test_the_decode_steps_stall_is_the_runs_own_else_the_probes() -> None:
    decode = [(1.0, StepShape(decode_rows=2))] * 4 + [(4.0, StepShape(decode_rows=2))] * MIN_STEP_RECORDS
    flags = [False] * 4 + [True] * MIN_STEP_RECORDS
    assert typical_arrival_stall(decode, flags, None) == pytest.approx(3.0)
    few = decode[: 4 + MIN_STEP_RECORDS - 1], flags[: 4 + MIN_STEP_RECORDS - 1]
    assert typical_arrival_stall(*few, _profile((2.5,) * MIN_STEP_RECORDS)) == pytest.approx(2.5)
    assert typical_arrival_stall(*few, None) == 0.0


def test_a_destalled_step_keeps_its_own_work() -> None:
    assert destalled_ms(6.0, 3.0, 1.0) == pytest.approx(3.0)
    assert destalled_ms(2.0, 3.0, 1.0) == pytest.approx(1.0)  # a short stall: the profiled work stays
    assert destalled_ms(0.5, 3.0, 1.0) == pytest.approx(0.5)  # never above what it took


def _prompt_ms(prompt_arrival: float, client_gap_ms: float) -> float:
    """One running slot, two clients of two requests each (16 prompt tokens, 4 outputs), every step
    1 ms: each prompt step after the first admits the waiting request when the other finishes, and
    the finished client's next request arrives `client_gap_ms` later. The simulated prompt steps'
    total time."""
    samples = [RequestSample(16, 4, 0, 0.0, None, None) for _ in range(4)]
    cost = StepCost(1.0, 0.0, 0.0, residuals=StepResiduals(prompt_arrival=prompt_arrival))
    one_slot = SimSettings(1, 512, None, 16, False)
    run = simulate(samples, one_slot, cost, concurrency=2, client_gap_ms=client_gap_ms)
    return run.kinds["prefill_only"].time_ms


def test_a_replayed_prompt_step_that_holds_an_arrival_takes_the_stall() -> None:
    """The two admitting steps that follow a finish while the other client still has a request to
    send hold that request's arrival (or the stall before it) and take the stall; the first prompt
    step and the last admission (nothing left to arrive) do not. An arrival whose stall begins
    after the step ended leaves it alone, and a run calibrated without the stall replays as
    before."""
    assert _prompt_ms(0.0, 0.5) == pytest.approx(4.0)
    assert _prompt_ms(3.0, 0.5) == pytest.approx(4.0 + 2 * 3.0)
    # The arrival 2 ms after the finish, after the 1 ms step: its 3 ms stall began within the step.
    assert _prompt_ms(3.0, 2.0) == pytest.approx(4.0 + 2 * 3.0)
    # 5 ms after: the stall begins 1 ms after the step ended.
    assert _prompt_ms(3.0, 5.0) == pytest.approx(4.0)


def test_decode_steps_keep_their_own_stalls() -> None:
    """The prompt stall is for steps with prompt tokens: decode-only steps still pause for the
    arrivals' drawn stalls (StepResiduals.arrival), not for it."""
    samples = [RequestSample(16, 8, 0, 0.0, None, None), RequestSample(16, 12, 0, 0.0, None, None)] * 2
    settings = SimSettings(4, 512, None, 16, False)
    cost = StepCost(1.0, 0.0, 0.0)
    with_prompt_stall = replace(cost, residuals=StepResiduals(prompt_arrival=3.0))
    plain = simulate(samples, settings, cost, concurrency=2, client_gap_ms=2.0)
    stalled = simulate(samples, settings, with_prompt_stall, concurrency=2, client_gap_ms=2.0)
    assert stalled.kinds["decode_only"].time_ms == pytest.approx(plain.kinds["decode_only"].time_ms)


def test_the_recorded_runs_prompt_steps_are_priced_at_what_they_took() -> None:
    """Calibrated on each recorded run (the step profile recorded beside them), a prompt step that held
    no arrival is priced at what such steps took, and one that held an arrival at that plus the stall
    (medians of measured / priced over each group of MIN_PROMPT_STEPS_EACH or more). Fitted with the
    stalls in (session 35's code), the 8-client runs on 20 blocks, whose admitting prompt steps mostly
    held an arrival (47 of 59, 53 of 130), priced their clear prompt steps at 1.5-1.7x what they took."""
    profile = StepProfile.from_json(json.loads((RECORDED / "step_profile.json").read_text()))
    for path in sorted(RECORDED.glob("*.json.gz")):
        result = json.loads(gzip.decompress(path.read_bytes()))
        settings = settings_from_result(result)
        evidence = evidence_from_bench(result)
        calibration = calibrate(
            evidence, settings, ModelSpec.from_dir(str(RECORDED)), settings.kv_cache_dtype, profile
        )
        assert calibration is not None
        cost = calibration.cost
        steps, flags = _step_records(evidence)
        for held in (False, True):
            stall = cost.residuals.prompt_arrival if held else 0.0
            ratios = [
                dur / (cost.server_ms(shape) + stall)
                for (dur, shape), flagged in zip(steps, flags, strict=True)
                if shape.prompt_tokens and flagged == held
            ]
            if len(ratios) >= MIN_PROMPT_STEPS_EACH:
                assert statistics.median(ratios) == pytest.approx(1.0, abs=0.05), (path.name, held)
