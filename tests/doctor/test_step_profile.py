"""The simulator's step cost from measured step shapes (kvflow/doctor/step_profile.py, step_cost.py,
calibrate.py), torch-free:

- the curves interpolate the measured points and extend the last slope (never down);
- a profiled step: decode-only steps add the fitted constant, prompt steps scale by the fitted factor;
- calibration recovers a what-if: runs simulated under a known "server" cost (the profile's shapes,
  a per-step constant on decodes, a factor on prompt steps) give the step means a server would
  report; calibrated on a one-slot run, the profiled simulator predicts the eight-slot run's TTFT
  where the two-coefficient line through the two step means overshoots it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvflow.bench.server_steps import ROW_STEP_KEYS, STEP_KEYS
from kvflow.doctor import step_profile
from kvflow.doctor.calibrate import SIM_METRICS, _least_squares, _prompt_fit, _record_fit, calibrate
from kvflow.doctor.cli import diagnosis_step_profile
from kvflow.doctor.evidence import RequestSample, RunEvidence, calculator_evidence
from kvflow.doctor.model_spec import ModelSpec
from kvflow.doctor.server_settings import EngineSettings
from kvflow.doctor.simulate import SimSettings, simulate
from kvflow.doctor.step_cost import StepCost, StepShape
from kvflow.doctor.step_profile import DECODE_PROBE_CONTEXT, Curve, StepProfile

# Measured on the planted runs' tiny model (kvflow profile-steps, ms): flat for small shapes, then
# growing, as a real engine's steps are.
PROFILE_JSON = {
    "prefill_ms": {"8": 0.62, "16": 0.62, "32": 0.63, "64": 0.79, "128": 1.05, "256": 1.48, "512": 3.0},
    "decode_ms": {"1": 0.51, "2": 0.55, "4": 0.62, "8": 0.74, "16": 0.93, "32": 1.41},
}
PROFILE = StepProfile.from_json(PROFILE_JSON)
assert PROFILE is not None
DECODE_EXTRA_MS, PROMPT_FACTOR = 1.3, 6.8
# The same engine served (kvflow/doctor/served_decode.py): the steps' excess over the curve grows with
# the rows they deliver (0.2 ms at 1 row, 1.5 at 8), as do the clients' gaps after a step and their
# TTFT beyond the server's. Shaped on the planted runs' tiny model on a 2-core Zen 2 (session 26).
SERVED = {
    "served_decode_ms": {"1": 0.71, "2": 0.9, "4": 1.35, "8": 2.24, "16": 2.9, "32": 3.6},
    "served_tpot_ms": {"1": 0.8, "2": 1.0, "4": 1.5, "8": 2.5, "16": 3.3, "32": 4.2},
    "served_ttft_gap_ms": {"1": 3.0, "2": 3.8, "4": 5.3, "8": 8.4, "16": 15.0, "32": 28.0},
}
SERVED_PROFILE = StepProfile.from_json({**PROFILE_JSON, **SERVED})
assert SERVED_PROFILE is not None
CONFIGS = Path(__file__).parent / "configs"


def test_curves_interpolate_and_extend_the_last_slope() -> None:
    curve = Curve((8, 16, 32), (1.0, 1.0, 3.0))
    assert curve(8) == 1.0 and curve(4) == 1.0 and curve(32) == 3.0
    assert curve(24) == pytest.approx(2.0)  # halfway from 16 to 32
    assert curve(64) == pytest.approx(3.0 + 32 * (2.0 / 16))  # the last slope, continued
    assert Curve((1, 2), (2.0, 1.0))(10) == 1.0  # a falling last segment does not fall further
    assert curve.slope(20) == pytest.approx(2.0 / 16)


def test_a_profiled_step_adds_on_decodes_and_scales_prompts() -> None:
    cost = StepCost(0.0, 0.0, 0.0, overhead_ms=0.1, profile=PROFILE, kind_extra_ms=(1.3, 6.8, 0.5))
    assert cost.step_ms(StepShape(decode_rows=8)) == pytest.approx(0.74 + 1.3 + 0.1)
    assert cost.step_ms(StepShape(prefill_tokens=256)) == pytest.approx(1.48 * 6.8 + 0.5 + 0.1)
    mixed = StepShape(decode_rows=4, prefill_tokens=124)
    assert cost.step_ms(mixed) == pytest.approx(PROFILE.prefill(128) * 6.8 + 0.5 + 0.1)


def test_a_short_suffix_after_a_cached_prefix_costs_rows_reading_their_context() -> None:
    """The engine attends a chunk of at most 8 tokens as query rows (kvflow/query_rows.py), each
    re-reading its context: the profile prices a row's key from decodes at a long context, and an
    8-token suffix after 768 cached tokens costs 8 decode rows plus their keys, not a prompt chunk."""
    data = {
        "prefill_ms": {"16": 0.62, "32": 0.63, "64": 0.79},
        "decode_ms": {"1": 0.51, "8": 0.74},
        "decode_context_ms": {"1": 0.51 + 0.002 * (500 - DECODE_PROBE_CONTEXT), "8": 0.74 + 0.016 * 478},
        "decode_context_keys": {"1": 500, "8": 500},
    }
    profile = StepProfile.from_json(data)
    assert profile is not None and profile.row_ms_per_key == pytest.approx(0.002)
    suffix = StepShape().plus_chunk(8, 776)
    assert (suffix.rows, suffix.prefill_tokens, suffix.prompt_tokens) == (8, 0, 8)
    assert StepShape().plus_chunk(9, 777).prefill_tokens == 9  # longer chunks are prefill
    cost = StepCost(0.0, 0.0, 0.0, profile=profile, kind_extra_ms=(1.3, 2.0, 0.5))
    keys_beyond = suffix.row_attention - 8 * DECODE_PROBE_CONTEXT
    # The decode path's step (the decode kind's extra), not the prompt kind's factor and constant.
    assert cost.step_ms(suffix) == pytest.approx(0.74 + 0.002 * keys_beyond + 1.3)
    # Without the probe (an older profile) the rows' keys go to the price the fit gives prefill keys.
    older = replace(cost, profile=replace(profile, row_ms_per_key=None), attention_ms_per_key=0.001)
    assert older.step_ms(suffix) == pytest.approx(0.74 + 1.3 + 0.001 * keys_beyond)
    # With a prefill chunk in the step it is the prompt path's: the rows are tokens of its forward.
    with_chunk = suffix.plus_chunk(16, 16)
    assert cost.server_ms(with_chunk) == pytest.approx(
        (profile.prefill(24) + 0.002 * keys_beyond) * 2.0 + 0.5
    )


def test_serving_adds_its_growth_by_the_rows_a_step_runs_not_the_tokens_it_delivers() -> None:
    """The served probe's b-row steps cost more than the engine's beyond the 1-row excess; a cached
    prefix's 8-token suffix runs 8 rows and delivers one token, and pays the 8-row growth: its
    measured steps took 1.18x the profiled step where a served 8-row decode step is 1.17x (session 43)."""
    served = {"served_decode_ms": {"1": 0.51 + 0.2, "8": 0.74 + 1.4}}
    profile = StepProfile.from_json(
        {"prefill_ms": {"16": 0.62, "32": 0.63}, "decode_ms": {"1": 0.51, "8": 0.74}, **served}
    )
    assert profile is not None and profile.served_growth(8) == pytest.approx(1.2)
    cost = StepCost(0.0, 0.0, 0.0, profile=profile, kind_extra_ms=(0.2, 1.0, 0.0))
    suffix = StepShape().plus_chunk(8, 24)  # within the short probe's keys: no keys beyond
    assert suffix.decode_rows == 0 and suffix.rows == 8
    assert cost.server_ms(suffix) == pytest.approx(
        cost.server_ms(StepShape(decode_rows=8, row_attention=suffix.row_attention))
    )
    assert cost.server_ms(suffix) == pytest.approx(0.74 + 0.2 + 1.2)


# The served suffix probe on the planted prefix_caching_off model (2-core Xeon with AMX, session 44):
# one request's 8-token suffix after a cached prefix, and the 1-row decode step at that context.
SUFFIX_PROBE = {
    "served_suffix_ms": {"240": 10.3, "752": 14.5},
    "served_suffix_decode_ms": {"240": 6.6, "752": 7.5},
}


def test_a_suffix_alone_is_priced_off_the_decode_step_at_its_context() -> None:
    """A cached prefix's 8-token suffix, nothing decoding, served: 14.0-15.9 ms where a 1-row decode
    at its context took 7.4-8.0 (the decode steps' served excess is the API thread streaming the
    previous token; a request that just arrived follows none). Priced as the calibrated 1-row decode
    step at its context x the probe's suffix step over its decode step: the run's speed and the
    decode kind's excess come from the run, the ratio from the probe."""
    data = {
        "prefill_ms": {"16": 6.4, "32": 7.6, "512": 63.2},
        "decode_ms": {"1": 2.62, "8": 4.80},
        "decode_context_ms": {"1": 3.20, "8": 8.26},
        "decode_context_keys": {"1": 518.0, "8": 523.25},
        "served_decode_ms": {"1": 5.69, "8": 9.57},
    }
    # The run's decode steps ran 1.276x the profile's served ones (profile_speed), and the decode
    # kind's extra was fitted to them: 7.9 ms at 772 keys, as measured.
    speed = 1.276
    probed = StepProfile.from_json({**data, **SUFFIX_PROBE})
    older = StepProfile.from_json(data)
    assert probed is not None and older is not None and older.suffix_ratio is None
    probed, older = probed.scaled(speed), older.scaled(speed)
    assert probed.suffix_ratio is not None  # a ratio: the same at any speed
    cost = StepCost(0.0, 0.0, 0.0, profile=probed, kind_extra_ms=(3.73, 1.02, 0.0))
    suffix = StepShape().plus_chunk(8, 776)
    assert suffix.suffix_only and not StepShape(decode_rows=1).suffix_only
    keys = suffix.row_attention / 8  # 772.5 keys a row
    at_240, at_752 = 10.3 / 6.6, 14.5 / 7.5
    ratio = at_752 + (at_752 - at_240) / (752 - 240) * (keys - 752)  # the last slope, continued
    decode = cost.server_ms(StepShape(decode_rows=1, row_attention=keys))
    assert decode == pytest.approx(7.9, abs=0.1)
    assert cost.server_ms(suffix) == pytest.approx(decode * ratio)
    assert 14.0 < cost.server_ms(suffix) < 15.9  # the measured steps' range
    assert replace(cost, profile=older).server_ms(suffix) > 18.0  # the decode path's price: 18.6
    # Fewer rows: along the line from one row (a decode step's work) to the probe's eight.
    four = StepShape().plus_chunk(4, 772)
    four_keys = four.row_attention / 4
    four_ratio = 1 + ((probed.suffix_over_decode(8, four_keys) or 0.0) - 1) * 3 / 7
    four_decode = cost.server_ms(StepShape(decode_rows=1, row_attention=four_keys))
    assert cost.server_ms(four) == pytest.approx(four_decode * four_ratio)
    # The run's decode steps move its price: 1 ms more on the decode kind, ratio x 1 ms on the suffix.
    slower = replace(cost, kind_extra_ms=(4.73, 1.02, 0.0))
    assert slower.server_ms(suffix) - cost.server_ms(suffix) == pytest.approx(ratio)
    # A decode row in the step, or a profile without the probe: the decode path's price, as before.
    with_decode = suffix.plus_chunk(1, 40, decode=True)
    old_price = replace(cost, profile=older)
    assert cost.server_ms(with_decode) == pytest.approx(old_price.server_ms(with_decode))
    assert old_price.server_ms(suffix) == pytest.approx(
        old_price.server_ms(StepShape(decode_rows=8, row_attention=suffix.row_attention))
    )


def test_the_decode_fit_leaves_out_suffix_steps_the_probe_prices() -> None:
    """The decode kind's extra is fitted to the decode steps; a suffix step alone is priced off it
    and the probe (above), so its own excess (here 5 ms, against 1.3) must not move it. Without the
    probe it is a decode-path step like any other and fitted with them."""
    probed = StepProfile.from_json({**PROFILE_JSON, **SUFFIX_PROBE})
    assert probed is not None and PROFILE is not None
    steps = [(PROFILE.decode(1) + 1.3, StepShape(decode_rows=1, row_attention=22.0)) for _ in range(10)]
    suffix = StepShape(row_prefill_tokens=8, row_attention=8 * 22.0)
    steps += [(PROFILE.decode(8) + 5.0, suffix) for _ in range(12)]
    assert _record_fit(probed, steps, (), 0.0)[0] == pytest.approx(1.3)
    assert _record_fit(PROFILE, steps, (), 0.0)[0] == pytest.approx(5.0)  # 12 of 22: their median


def test_a_stalled_one_row_context_probe_does_not_price_every_key() -> None:
    """A step's noise is a stall of some ms, about the same at 1 row as at 8; the 8-row probe reads
    8x the keys beyond the short probe, so it states the price of a key 8x as precisely. A profile
    whose 1-row context probe ran 0.4 ms slow (session 32: 1.56 ms against 1.16 at the short context)
    had read 1.9e-3 ms per key (the median of the two probes' slopes) where its 8-row probe said
    1.3e-4, and priced a 4-row step at a 112-token context 0.8 ms above a short one."""
    per_key = 1.3e-4
    keys = 139.0
    data = {
        "prefill_ms": {"16": 0.62, "32": 0.63, "64": 0.79},
        "decode_ms": {"1": 1.16, "8": 1.59},
        "decode_context_ms": {
            "1": 1.16 + per_key * (keys - DECODE_PROBE_CONTEXT) + 0.4,  # a stall
            "8": 1.59 + per_key * 8 * (keys - DECODE_PROBE_CONTEXT),
        },
        "decode_context_keys": {"1": keys, "8": keys},
    }
    profile = StepProfile.from_json(data)
    assert profile is not None and profile.row_ms_per_key is not None
    # The stall spread over all nine rows' keys: within 4e-4 of the true price, not 1.9e-3.
    assert profile.row_ms_per_key == pytest.approx(per_key, abs=4e-4)
    # Without a stall the fit is exact, and a context probe below the short curve prices no key.
    data["decode_context_ms"]["1"] -= 0.4
    exact = StepProfile.from_json(data)
    assert exact is not None and exact.row_ms_per_key == pytest.approx(per_key)
    data["decode_context_ms"] = {"1": 1.0, "8": 1.5}
    cheaper = StepProfile.from_json(data)
    assert cheaper is not None and cheaper.row_ms_per_key == 0.0


def _server(  # type: ignore[no-untyped-def]
    settings: SimSettings, samples: list[RequestSample], concurrency: int, profile: StepProfile = PROFILE
):
    truth = StepCost(0.0, 0.0, 0.0, profile=profile, kind_extra_ms=(DECODE_EXTRA_MS, PROMPT_FACTOR, 0.0))
    return simulate(samples, settings, truth, concurrency)


def _one_slot_evidence(  # type: ignore[no-untyped-def]
    samples: list[RequestSample], baseline
) -> tuple[RunEvidence, ModelSpec, EngineSettings]:
    """What the doctor reads of a one-slot server's run `baseline` of `samples`: its step means by
    kind and TPOT, on a Qwen2.5-0.5B's config."""
    steps = {
        k: {"count": float(v.count), "mean": v.time_ms / v.count}
        for k, v in baseline.kinds.items()
        if v.count
    }
    run = replace(
        calculator_evidence(32, 8, 32),
        num_requests=len(samples),
        requests=samples,
        server={"step_time_ms": steps, "client_minus_server_ttft_ms": 0.0},
        tpot_p50_ms=SIM_METRICS["decode_ms_per_step"](baseline),
    )
    model = ModelSpec.from_config(json.loads((CONFIGS / "qwen2.5-0.5b.json").read_text()))
    settings = EngineSettings(server="kvflow", max_num_batched_tokens=2048, max_num_seqs=1, block_size=16)
    return run, model, settings


def test_serving_adds_by_the_rows_a_step_delivers_measured_against_one_row() -> None:
    """The served probe's excess over the in-process curve, less its 1-row value: 0 at one row (the
    calibration's constant holds that), growing with rows; a noisy dip pooled with its neighbour."""
    assert SERVED_PROFILE is not None and PROFILE is not None
    assert SERVED_PROFILE.served_growth(1) == 0.0 and SERVED_PROFILE.served_growth(0) == 0.0
    excess_1 = 0.71 - 0.51
    assert SERVED_PROFILE.served_growth(8) == pytest.approx(2.24 - 0.74 - excess_1)
    assert SERVED_PROFILE.between_growth(8) == pytest.approx((2.5 - 2.24) - (0.8 - 0.71))
    assert SERVED_PROFILE.delivery_growth(8) == pytest.approx(8.4 - 3.0)
    assert PROFILE.served_growth(8) == 0.0 and PROFILE.delivery_growth(8) == 0.0  # no served probe
    dip = StepProfile.from_json(
        {**PROFILE_JSON, "served_decode_ms": {"1": 0.7, "2": 1.2, "4": 0.9, "8": 1.9}}
    )
    assert dip is not None
    growth = [dip.served_growth(b) for b in (1, 2, 4, 8)]
    assert growth == sorted(growth)  # never less for more rows
    pooled = ((1.2 - 0.55) + (0.9 - 0.62)) / 2 - (0.7 - 0.51)
    assert growth[1] == pytest.approx(pooled) and growth[2] == pytest.approx(pooled)
    cost = StepCost(0.0, 0.0, 0.0, overhead_ms=0.1, profile=SERVED_PROFILE, kind_extra_ms=(1.3, 6.8, 0.5))
    eight = StepShape(decode_rows=8)
    assert cost.server_ms(eight) == pytest.approx(0.74 + 1.3 + SERVED_PROFILE.served_growth(8))
    assert cost.step_ms(eight) == pytest.approx(
        cost.server_ms(eight) + 0.1 + SERVED_PROFILE.between_growth(8)
    )


def test_a_steps_first_tokens_cost_the_clients_only_beyond_what_the_runs_own_steps_delivered() -> None:
    """The probe's TTFT gap grows from one client (3.0 ms) to eight first tokens in one step (8.4).
    A run whose clients read their first tokens alone gets the whole growth to 8; one whose
    returning requests read theirs from 4-token steps (5.3 in the probe) already paid that much in
    its offset, and gets the growth beyond it: 8.4 - 5.3 at 8 tokens, less than its offset at 1
    (never below the whole offset: a client's gap is not negative)."""
    assert SERVED_PROFILE is not None
    cost = StepCost(0.0, 0.0, 0.0, profile=SERVED_PROFILE, client_gap_ms=6.0)
    assert cost.delivery_ms(8) == pytest.approx(8.4 - 3.0) and cost.delivery_ms(1) == 0.0
    four = replace(cost, gap_delivered=4.0)
    assert four.delivery_ms(8) == pytest.approx(8.4 - 5.3)
    assert four.delivery_ms(4) == 0.0 and four.delivery_ms(1) == pytest.approx(3.0 - 5.3)
    assert replace(four, client_gap_ms=1.0).delivery_ms(1) == -1.0
    assert StepCost(0.0, 0.0, 0.0).delivery_ms(8) == 0.0  # no served probe: nothing known
    # Calibrated on a run, the cost carries the run's offset and the delivery it was read on.
    samples = [RequestSample(32, 32, 0, 0.0, None, None) for _ in range(16)]
    baseline = _server(SimSettings(1, 2048, None, 16, True), samples, 8, SERVED_PROFILE)
    run, model, settings = _one_slot_evidence(samples, baseline)
    run = replace(run, client_return_gap_ms=6.0, client_return_delivered=4.0)
    cal = calibrate(run, settings, model, profile=SERVED_PROFILE)
    assert cal is not None and cal.cost.client_gap_ms == 6.0 and cal.cost.gap_delivered == 4.0
    speed = cal.profile_speed or 1.0
    assert cal.cost.delivery_ms(8) == pytest.approx((8.4 - 5.3) * speed)


def test_calibrated_on_one_slot_a_served_profile_predicts_eight_slots_decode() -> None:
    """A server whose steps cost more the more rows they deliver (SERVED): calibrated on one slot,
    where every decode delivers one token, the profile without the served probe prices the eight-slot
    decode as the one-slot excess allows (the max_num_seqs what-if's 69 ms e2e against 130 measured);
    with it, the growth is measured and the TPOT comes out right."""
    assert SERVED_PROFILE is not None
    samples = [RequestSample(32, 32, 0, 0.0, None, None) for _ in range(16)]
    one_slot = SimSettings(1, 2048, None, 16, True)
    baseline = _server(one_slot, samples, 8, SERVED_PROFILE)
    eight = _server(replace(one_slot, max_num_seqs=8), samples, 8, SERVED_PROFILE)
    run, model, settings = _one_slot_evidence(samples, baseline)
    served, unserved = (calibrate(run, settings, model, profile=p) for p in (SERVED_PROFILE, PROFILE))
    assert served is not None and unserved is not None
    true_tpot = SIM_METRICS["decode_ms_per_step"](eight)
    assert SIM_METRICS["decode_ms_per_step"](served.run(max_num_seqs=8)) == pytest.approx(true_tpot, rel=0.05)
    assert SIM_METRICS["decode_ms_per_step"](unserved.run(max_num_seqs=8)) < 0.8 * true_tpot
    true_ttft = SIM_METRICS["ttft_p50_ms"](eight)
    assert SIM_METRICS["ttft_p50_ms"](served.run(max_num_seqs=8)) == pytest.approx(true_ttft, rel=0.05)


def test_calibrated_on_one_slot_the_profile_predicts_eight() -> None:
    rng = random.Random(0)
    samples = [RequestSample(32, 32, 0, 0.0, None, None) for _ in range(16)]
    rng.shuffle(samples)
    one_slot = SimSettings(1, 2048, None, 16, True)
    baseline = _server(one_slot, samples, 8)
    eight = _server(replace(one_slot, max_num_seqs=8), samples, 8)
    run, model, settings = _one_slot_evidence(samples, baseline)
    profiled = calibrate(run, settings, model, profile=PROFILE)
    line = calibrate(run, settings, model)
    assert profiled is not None and line is not None
    true_ttft = SIM_METRICS["ttft_p50_ms"](eight)
    profiled_ttft = SIM_METRICS["ttft_p50_ms"](profiled.run(max_num_seqs=8))
    line_ttft = SIM_METRICS["ttft_p50_ms"](line.run(max_num_seqs=8))
    assert profiled_ttft == pytest.approx(true_ttft, rel=0.05)
    assert abs(line_ttft - true_ttft) > 3 * abs(profiled_ttft - true_ttft)  # the line overshoots
    assert profiled.cost.kind_extra_ms[0] == pytest.approx(DECODE_EXTRA_MS, rel=0.05)
    assert profiled.cost.kind_extra_ms[1] == pytest.approx(PROMPT_FACTOR, rel=0.05)


def test_the_servers_step_records_separate_factor_constant_and_attention() -> None:
    """Prompt steps of varied sizes and contexts, each costing 2 x the profile + 3 ms + 1e-4 ms per
    key beyond what the probes of its shape read (its chunk's queries x the context before it, its
    decode rows' keys beyond the decode probe's: this profile has no row probe, so one price), and
    decode steps the profile + 1.3 ms, as are 8-token prompt chunks the decode path ran as query rows
    (a cached prefix's suffix: the server counts them prompt steps): fitted over the recorded steps,
    all four come back (the per-kind means alone give one factor)."""
    rng = random.Random(1)
    steps = []
    row_context = 100  # the keys each decode row reads
    for _ in range(60):
        tokens, rows, context = rng.choice((16, 64, 128, 256)), rng.randint(0, 4), rng.choice((0, 256, 768))
        prefill_keys = tokens * (context + (tokens + 1) / 2)
        beyond = tokens * context + rows * (row_context - DECODE_PROBE_CONTEXT)
        dur = 2.0 * PROFILE.prefill(tokens + rows) + 3.0 + 1e-4 * beyond
        steps.append(
            [dur, float(tokens), float(rows), prefill_keys + rows * row_context, 0.0, rows * row_context]
        )
    for _ in range(40):
        rows = rng.randint(1, 8)
        steps.append([PROFILE.decode(rows) + 1.3, 0.0, float(rows), rows * 22.0, 0.0, rows * 22.0])
    for _ in range(20):  # query rows alone: [dur, prompt tokens, decodes, keys, row prompt tokens, row keys]
        steps.append([PROFILE.decode(8) + 1.3, 8.0, 0.0, 8 * 22.0, 8.0, 8 * 22.0])
    samples = [RequestSample(64, 16, 0, 0.0, None, None) for _ in range(8)]
    run = replace(
        calculator_evidence(64, 4, 16),
        num_requests=len(samples),
        requests=samples,
        server={
            "step_time_ms": {
                "decode_only": {"count": 40.0, "mean": 2.0},
                "mixed": {"count": 60.0, "mean": 9.0},
                "prefill_only": {"count": 20.0, "mean": 2.0},
            },
            "steps": {"fields": [*STEP_KEYS, *ROW_STEP_KEYS], "rows": steps},
        },
    )
    model = ModelSpec.from_config(json.loads((CONFIGS / "qwen2.5-0.5b.json").read_text()))
    settings = EngineSettings(server="kvflow", max_num_batched_tokens=512, max_num_seqs=4, block_size=16)
    cal = calibrate(run, settings, model, profile=PROFILE)
    assert cal is not None
    decode_add, factor, constant = cal.cost.kind_extra_ms
    assert (decode_add, factor, constant) == (pytest.approx(1.3), pytest.approx(2.0), pytest.approx(3.0))
    assert cal.cost.attention_ms_per_key == pytest.approx(1e-4)


def test_two_clusters_of_prompt_steps_do_not_make_up_a_constant() -> None:
    """A run whose prompts all take two chunks (the planted prefix_caching_off run: 776 tokens at a
    512-token budget) records two shapes of prompt step: 512 tokens attending nothing beyond the
    probe, and 264 tokens after them. Two points cannot fix a factor, a constant and a price per key.
    With the columns' scales five orders apart, the elimination had left a rounding-sized pivot and
    returned one of the infinitely many fits (factor 0.87, an 11.6 ms constant), which priced the
    cached what-if's 8-row step at 36 ms where 25-30 were measured. The fit keeps the attention and
    no constant. The steps below are that run's records (ms; the profiled shapes and the keys beyond
    the probe's, session 28)."""
    durations = {
        512: (176.401, 154.75, 156.583, 161.036, 170.384, 169.558),
        264: (105.308, 105.929, 102.142, 100.696, 103.092, 106.268),
    }
    # (profiled ms, keys beyond the probe's), as the run's scaled profile gave them
    shape = {512: (175.38063839403517, 0.0), 264: (91.50186912083531, 135168.0)}
    steps = [(dur, *shape[tokens]) for tokens, durs in durations.items() for dur in durs]
    design = [[s, 1.0, k] for _, s, k in steps]
    assert _least_squares(design, [d for d, _, _ in steps], [1.0] * len(steps)) is None
    factor, constant, per_key = _prompt_fit(steps)
    assert constant == 0.0
    # Through both clusters' means: 164.785 = f x 175.381; 103.906 = f x 91.502 + per_key x 135168.
    assert factor == pytest.approx(164.785 / 175.381, rel=1e-3)
    assert per_key == pytest.approx((103.906 - factor * 91.502) / 135168, rel=1e-2)


def test_two_clusters_above_the_profile_do_not_make_up_a_constant_either() -> None:
    """The same two shapes where the served steps ran above the profile (session 31's run: 512
    tokens 143.6-157.6 ms against 139.3 profiled): a constant (10.8 ms, factor 1) and the factor
    both pass through the two clusters, and the constant, first on the tie, priced the cached
    what-if's 8-row step at 31.2 ms where 23.6-27.6 were measured. Two shapes keep the factor and
    the attention, whichever side of the profile they fall."""
    durations = {512: (153.4, 143.6, 145.7, 157.6, 153.5, 146.8), 264: (92.0, 91.4, 93.3, 91.6, 91.4, 93.2)}
    shape = {512: (139.3, 0.0), 264: (75.65, 135168.0)}
    steps = [(dur, *shape[tokens]) for tokens, durs in durations.items() for dur in durs]
    factor, constant, per_key = _prompt_fit(steps)
    assert constant == 0.0 and factor > 1.0 and per_key > 0.0
    mean = {tokens: sum(durs) / len(durs) for tokens, durs in durations.items()}
    assert factor * 139.3 == pytest.approx(mean[512], rel=1e-3)
    assert factor * 75.65 + per_key * 135168.0 == pytest.approx(mean[264], rel=1e-3)


def test_prompt_steps_of_many_sizes_are_fitted_in_relative_terms() -> None:
    """The planted prefill_chunks run's prompt steps span 22 to 512 tokens (session 29, run 4: ms,
    the scaled profile's shape, keys beyond the probe's). Fitted in absolute terms the big chunks
    decided the line, 0.82 x the profile + 14.5 ms, which put the 22-token step 21% above its
    measured time and a disaggregated decode instance's 1-16-token last blocks 6-12 ms above theirs.
    In relative terms the full fit prices a key at just below zero; of the fits left, the one
    closest to the steps (a factor and a constant) is kept, not the first listed (the factor held at
    1, which put the big chunks 8-15% above their measured times)."""
    steps = [
        (24.9, 18.2, 11198.0),
        (71.1, 62.2, 0.0),
        (77.0, 78.7, 0.0),
        (83.5, 86.7, 0.0),
        (104.9, 96.1, 0.0),
        (113.4, 114.5, 57961.0),
        (109.0, 118.3, 0.0),
        (119.5, 127.4, 0.0),
        (121.9, 133.2, 0.0),
        (137.4, 149.2, 0.0),
        (137.4, 147.6, 0.0),
        (131.0, 147.4, 0.0),
    ]
    factor, constant, per_key = _prompt_fit(steps)
    assert 0.0 < factor < 1.0 and constant > 0.0 and per_key == 0.0
    errors = [abs(factor * s + constant + per_key * k - d) / d for d, s, k in steps]
    assert max(errors) < 0.11
    assert errors[0] < 0.05  # the smallest step, which the absolute fit put 21% high
    absolute = _least_squares([[s, 1.0, k] for _, s, k in steps], [d for d, _, _ in steps], [1.0] * 12)
    assert absolute is not None
    assert (absolute[0] * 18.2 + absolute[1] + absolute[2] * 11198.0) / 24.9 > 1.2


def test_one_shape_of_prompt_step_gets_what_the_server_adds_not_a_factor() -> None:
    """A one-slot run's prompt steps are all one shape (32 tokens), so a factor and a constant cannot
    be told apart. What the server adds to a prompt step is about the same whatever its size (the
    planted tiny model served 32 tokens in 3.2 ms against 1.8 alone, 160-256 tokens in 4.0-6.9
    against 2.6-3.3, session 28), so the fit holds the profile as the compute and adds a constant:
    an 8-prompt step of 256 tokens costs the profile's 256 tokens plus it, where the factor (3.4 on
    the planted run) had priced it at twice the measured time."""
    rng = random.Random(3)
    shape = PROFILE.prefill(32)
    steps = [(shape + 2.5 + rng.uniform(-1.0, 1.0), shape, 0.0) for _ in range(24)]
    factor, constant, per_key = _prompt_fit(steps)
    assert factor == 1.0 and per_key == 0.0
    assert constant == pytest.approx(statistics.mean(d - shape for d, _, _ in steps))
    # Steps faster than the profile (a run on a faster moment than the profile's) get a factor below 1.
    faster = [(0.8 * shape, shape, 0.0) for _ in range(24)]
    assert _prompt_fit(faster) == (pytest.approx(0.8), 0.0, 0.0)


def test_the_profile_is_measured_by_default_only_for_a_server_on_this_machine(
    tiny_checkpoint_factory: Callable[..., Path],
) -> None:
    """kvflow doctor profiles the engine's steps (cached) when the diagnosed kvflow server ran here
    (a loopback URL, or --verify) and MODEL holds the weights; never for a remote server unless
    asked, never when told not to. KVFLOW_CACHE_DIR is a temporary directory (tests/conftest.py)."""
    model = str(tiny_checkpoint_factory("llama"))
    settings = EngineSettings(server="kvflow", max_num_batched_tokens=64, max_num_seqs=4, max_model_len=128)

    def profile(url: str, flag: bool | None = None, verify: bool = False) -> StepProfile | None:
        args = argparse.Namespace(model=model, profile_steps=flag, verify=verify)
        return diagnosis_step_profile(args, settings, "float32", {"config": {"base_url": url}})

    assert profile("http://10.0.0.7:8000/v1") is None  # another machine's steps: not these
    assert profile("http://127.0.0.1:8000/v1", flag=False) is None
    measured = profile("http://localhost:8000/v1")
    assert measured is not None and measured.row_ms_per_key is not None
    if (os.cpu_count() or 1) > 1:  # the same curves on half the cores (the disaggregation what-if's)
        assert measured.split is not None and measured.split[0].sizes == measured.prefill.sizes
    assert profile("http://10.0.0.7:8000/v1", verify=True) == measured  # --verify runs here: cached


def test_the_whole_machine_and_half_of_it_are_measured_in_turn(
    tiny_checkpoint_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The half-core curves are read against the whole machine's, and a VM's speed moves by a fifth
    over minutes: one pass on all the cores, one on half, in turn, each point the median over the
    passes (two profiles measured all-then-half read the 8-row decode on half the cores 1.53x and
    1.06x the whole machine's, session 38)."""
    monkeypatch.setattr(step_profile, "PROFILE_PASSES", 3)  # the tests' session runs one (conftest.py)
    calls: list[int | None] = []
    slow = iter([1.0, 1.0, 1.5, 1.5, 1.0, 1.0])  # the VM slows by half for the second pass of both

    def one_pass(command: list[str], threads: int | None) -> dict[str, Any]:
        assert command[-2:] == ["--repeats", "1"]
        calls.append(threads)
        factor = next(slow) * (2.0 if threads else 1.0)
        return {
            "prefill_ms": {"16": 1.0 * factor, "32": 2.0 * factor},
            "decode_ms": {"1": 0.5 * factor},
            "decode_context_ms": {"1": (0.5 + 0.002 * 478) * factor},
            "decode_context_keys": {"1": 478 + DECODE_PROBE_CONTEXT},  # keys: not the machine's speed
        }

    monkeypatch.setattr(step_profile, "_profile_steps", one_pass)
    monkeypatch.setattr(step_profile, "measure_served_decode", lambda *a: {})
    monkeypatch.setattr(step_profile.os, "cpu_count", lambda: 2)
    profile = step_profile.measure_profile(tiny_checkpoint_factory("llama"), "float32", None, 128)
    assert calls == [None, 1] * step_profile.PROFILE_PASSES
    assert profile is not None and profile.split is not None
    assert profile.prefill(32) == 2.0 and profile.split[0](32) == 4.0  # the medians: 2x, not 2x +- the drift
    # The half passes' decode steps at a context price a row's key there (twice the whole machine's).
    assert profile.row_ms_per_key == pytest.approx(0.002)
    assert profile.split_row_ms_per_key == pytest.approx(0.004)
    assert step_profile.median_passes([{"a": {"1": 1.0}}, {"a": {"1": 3.0, "2": 5.0}}]) == {
        "a": {"1": 2.0, "2": 5.0}
    }


def test_a_prompts_later_chunk_pays_the_profiles_price_for_its_context() -> None:
    """A chunk of n tokens after C of its prompt attends n x C keys a fresh prompt of n does not:
    the profile prices them from chunks after a cached prefix (kvflow/engine/step_profile.py), the
    slope through zero weighted by the keys (0.5-1.7e-4 ms per key on the planted prefill_chunks
    model, session 38). Priced as a fresh prompt, the later chunks of a 256-token budget ran 8-27%
    above their price and the budget what-if's ITL p99 came out 11% low."""
    per_key = 1e-4
    keys = {"128": 128.0 * 384, "256": 256.0 * 256}
    data = {
        **PROFILE_JSON,
        "prefill_context_ms": {
            "128": PROFILE_JSON["prefill_ms"]["128"] + per_key * keys["128"] + 0.3,  # a stall
            "256": PROFILE_JSON["prefill_ms"]["256"] + per_key * keys["256"],
        },
        "prefill_context_keys": keys,
    }
    profile = StepProfile.from_json(data)
    assert profile is not None and PROFILE.chunk_ms_per_key is None
    assert profile.chunk_ms_per_key == pytest.approx(per_key, abs=4e-6)
    # A chunk of 253 tokens after 253 of its prompt: the context's keys at the profile's price.
    later = StepShape().plus_chunk(253, 506)
    fresh = StepShape().plus_chunk(253, 253)
    assert later.prefill_attention - fresh.prefill_attention == 253 * 253
    cost = StepCost(0.0, 0.0, 0.0, profile=profile, kind_extra_ms=(0.0, 2.0, 0.5))
    extra = cost.server_ms(later) - cost.server_ms(fresh)
    assert extra == pytest.approx(2.0 * profile.chunk_ms_per_key * 253 * 253)  # the factor scales it
    # The fit's own price per key comes on top (a run whose steps say more).
    assert replace(cost, attention_ms_per_key=1e-5).server_ms(later) - cost.server_ms(later) == pytest.approx(
        1e-5 * 253 * 253
    )
    # Scaled with the rest of the profile, and on half the cores the price measured there.
    assert profile.scaled(1.5).chunk_ms_per_key == pytest.approx(1.5 * profile.chunk_ms_per_key)
    split = {
        "split_prefill_ms": {"64": 1.6, "256": 3.4, "512": 6.0},
        "split_decode_ms": {"1": 0.6, "8": 1.0},
        "split_prefill_context_ms": {"256": 3.4 + 3 * per_key * keys["256"]},
        "split_prefill_context_keys": {"256": keys["256"]},
    }
    halves = StepProfile.from_json({**data, **split})
    assert halves is not None
    half = halves.on_half_cores()
    assert half is not None and half.chunk_ms_per_key == pytest.approx(3 * per_key)
    # Without the probe (an older profile) the context's keys go to the fitted price alone.
    older = replace(cost, profile=PROFILE)
    assert older.server_ms(later) == pytest.approx(older.server_ms(fresh))


def test_an_instance_on_half_the_cores_costs_the_curves_measured_there() -> None:
    """The disaggregation what-if runs a prefill and a decode instance on half the cores each. With
    the profile's curves measured there (OMP_NUM_THREADS), a step costs what they say; without
    them, every step x the ratio measured on another machine."""
    split = {"split_prefill_ms": {"64": 1.6, "512": 6.0}, "split_decode_ms": {"1": 0.6, "8": 1.0}}
    profile = StepProfile.from_json({**PROFILE_JSON, **split})
    assert profile is not None and profile.split is not None and PROFILE.split is None
    half = profile.on_half_cores()
    assert half is not None and half.prefill(512) == 6.0 and half.decode(8) == 1.0
    assert half.row_ms_per_key == profile.row_ms_per_key  # the rest kept
    cost = StepCost(0.0, 0.0, 0.0, profile=profile)
    chunk = StepShape(prefill_tokens=512)
    assert cost.on_half_cores(1.43).server_ms(chunk) == pytest.approx(6.0)
    whole = StepCost(0.0, 0.0, 0.0, profile=PROFILE)
    assert whole.on_half_cores(1.43).server_ms(chunk) == pytest.approx(1.43 * whole.server_ms(chunk))


def test_on_half_the_cores_a_query_row_reads_its_keys_at_the_price_measured_there() -> None:
    """One thread reads keys slower than two: the decode steps at a context measured on half the
    cores price the query rows of an instance there (a short prompt suffix after a fetched prefix is
    that many rows re-reading it: the disaggregated pair's decode instance). Without that probe (a
    profile of format 10) the whole machine's price stands; scaled with the rest."""
    context = {"decode_context_ms": {"1": 0.51 + 0.002 * 478, "8": 0.74 + 0.016 * 478}}
    split = {
        "split_prefill_ms": {"64": 1.6, "512": 6.0},
        "split_decode_ms": {"1": 0.6, "8": 1.0},
        "split_decode_context_ms": {"1": 0.6 + 0.005 * 478, "8": 1.0 + 0.04 * 478},
        "split_decode_context_keys": {"1": 478 + DECODE_PROBE_CONTEXT, "8": 478 + DECODE_PROBE_CONTEXT},
    }
    keys = {"decode_context_keys": {"1": 478 + DECODE_PROBE_CONTEXT, "8": 478 + DECODE_PROBE_CONTEXT}}
    profile = StepProfile.from_json({**PROFILE_JSON, **context, **keys, **split})
    assert profile is not None and profile.row_ms_per_key == pytest.approx(0.002)
    assert profile.split_row_ms_per_key == pytest.approx(0.005)
    half = profile.on_half_cores()
    assert half is not None and half.row_ms_per_key == pytest.approx(0.005)
    assert half.split_row_ms_per_key is None  # what is half of half: not measured
    suffix = StepShape().plus_chunk(6, 406)  # 6 rows re-reading 400 fetched tokens
    whole_cost = StepCost(0.0, 0.0, 0.0, profile=profile)
    half_cost = whole_cost.on_half_cores(1.43)
    beyond = suffix.row_attention - 6 * DECODE_PROBE_CONTEXT
    assert half_cost.server_ms(suffix) == pytest.approx(half.decode(6) + 0.005 * beyond)
    assert profile.scaled(2.0).split_row_ms_per_key == pytest.approx(0.010)
    older = StepProfile.from_json({**PROFILE_JSON, **context, **keys, **split, "split_decode_context_ms": {}})
    assert older is not None and older.split_row_ms_per_key is None
    older_half = older.on_half_cores()
    assert older_half is not None and older_half.row_ms_per_key == pytest.approx(0.002)


def test_a_profile_measured_on_a_faster_moment_is_scaled_to_the_run() -> None:
    """The profile is cached; the VM's speed moves by a third over minutes. A one-slot run whose
    every step ran 1.3x slower than the served profile says: the recorded decode steps give the
    ratio, the whole profile is scaled by it, and the eight-slot decode (whose growth with rows the
    run never showed) comes out right. Unscaled, the fitted constant absorbs the 1-row slowdown
    but the growth stays at the profile's speed (under by ~10%)."""
    assert SERVED_PROFILE is not None and SERVED_PROFILE.served_base_excess == pytest.approx(0.71 - 0.51)
    slow = SERVED_PROFILE.scaled(1.3)
    assert slow.decode(8) == pytest.approx(1.3 * 0.74) and slow.served_growth(8) == pytest.approx(
        1.3 * SERVED_PROFILE.served_growth(8)
    )
    samples = [RequestSample(32, 32, 0, 0.0, None, None) for _ in range(16)]
    one_slot = SimSettings(1, 2048, None, 16, True)
    extras = (1.3 * SERVED_PROFILE.served_base_excess, PROMPT_FACTOR, 0.0)
    truth = StepCost(0.0, 0.0, 0.0, profile=slow, kind_extra_ms=extras)
    baseline = simulate(samples, one_slot, truth, 8)
    eight = simulate(samples, replace(one_slot, max_num_seqs=8), truth, 8)
    run, model, settings = _one_slot_evidence(samples, baseline)
    one_row = StepShape(decode_rows=1, row_attention=DECODE_PROBE_CONTEXT)
    records = [[truth.server_ms(one_row), 0, 1, DECODE_PROBE_CONTEXT, 0, DECODE_PROBE_CONTEXT]] * 20
    run.server["steps"] = {"fields": [*STEP_KEYS, *ROW_STEP_KEYS], "rows": records}
    scaled = calibrate(run, settings, model, profile=SERVED_PROFILE)
    unscaled = calibrate(run, settings, model, profile=replace(SERVED_PROFILE, served_base_excess=None))
    assert scaled is not None and unscaled is not None
    assert scaled.profile_speed == pytest.approx(1.3) and unscaled.profile_speed is None
    true_tpot = SIM_METRICS["decode_ms_per_step"](eight)
    assert SIM_METRICS["decode_ms_per_step"](scaled.run(max_num_seqs=8)) == pytest.approx(true_tpot, rel=0.03)
    assert SIM_METRICS["decode_ms_per_step"](unscaled.run(max_num_seqs=8)) < 0.95 * true_tpot
