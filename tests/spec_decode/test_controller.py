"""The auto-disable rule (kvflow/spec_decode/controller.py): explore, speculate while the measured
speedup estimate is >= 1, below it run plain steps with probes at doubling intervals, and turn
back on when a probe pays (pure Python, no model)."""

from __future__ import annotations

import pytest

from kvflow.spec_decode.controller import (
    MIN_PLAIN_SAMPLES,
    MIN_SPEC_SAMPLES,
    PLAIN_REFRESH_INTERVAL,
    PROBE_INTERVAL_MAX,
    PROBE_INTERVAL_MIN,
    SpecController,
)


def _baseline(c: SpecController, batch_size: int, seconds: float) -> None:
    """The plain steps a bucket measures before it speculates."""
    for _ in range(MIN_PLAIN_SAMPLES):
        assert not c.should_propose(batch_size)
        c.record(batch_size, seconds, speculative=False, tokens_emitted=batch_size)


def test_measures_a_plain_step_first_then_speculates_when_it_pays() -> None:
    c = SpecController(auto_disable=True)
    _baseline(c, 1, 0.010)
    assert c.should_propose(1)  # baseline known, speculation unmeasured: try it
    c.record(1, 0.012, speculative=True, tokens_emitted=3)  # 3 tokens for 1.2x the time
    assert c.speedup(1) == pytest.approx(3 * 0.010 / 0.012)
    assert all(c.should_propose(1) for _ in range(PLAIN_REFRESH_INTERVAL - 1))


def test_a_cold_first_step_does_not_turn_speculation_off() -> None:
    """Medians, not a moving average: one slow step (first use of a shape, a GC pause) among
    good ones neither disables speculation nor lingers in the estimate."""
    c = SpecController(auto_disable=True)
    _baseline(c, 1, 0.010)
    c.record(1, 0.200, speculative=True, tokens_emitted=3)  # cold: 20x a plain step
    assert c.should_propose(1)  # still exploring
    for _ in range(MIN_SPEC_SAMPLES):
        c.record(1, 0.012, speculative=True, tokens_emitted=3)
    assert c.speedup(1) == pytest.approx(3 * 0.010 / 0.012)
    assert all(c.should_propose(1) for _ in range(20)) and c.num_disabled_steps == 0


def test_disables_when_it_costs_time_and_probes_at_doubling_intervals() -> None:
    c = SpecController(auto_disable=True)
    _baseline(c, 8, 0.020)
    for _ in range(MIN_SPEC_SAMPLES):  # 1.125 tokens per request for 2.5x the time
        c.record(8, 0.050, speculative=True, tokens_emitted=9)
    speedup = c.speedup(8)
    assert speedup is not None and speedup < 1
    gaps = []
    for _ in range(4):  # each probe fails: the gap before the next one doubles
        steps = 1
        while not c.should_propose(8):
            steps += 1
        gaps.append(steps)
        c.record(8, 0.050, speculative=True, tokens_emitted=9)
    assert gaps == [PROBE_INTERVAL_MIN * 2**i for i in range(4)]
    assert all(g <= PROBE_INTERVAL_MAX for g in gaps)
    assert c.num_disabled_steps == sum(g - 1 for g in gaps)
    # Batch sizes are estimated apart: batch 1 knows nothing yet, so it measures plain first.
    assert not c.should_propose(1)


def test_a_probe_that_pays_turns_speculation_back_on() -> None:
    c = SpecController(auto_disable=True)
    _baseline(c, 1, 0.010)
    for _ in range(MIN_SPEC_SAMPLES):
        c.record(1, 0.015, speculative=True, tokens_emitted=1)  # nothing accepted
    assert not c.should_propose(1)
    while not c.should_propose(1):
        pass
    c.record(1, 0.013, speculative=True, tokens_emitted=4)  # the workload turned repetitive
    assert c.speedup(1) == pytest.approx(4 * 0.010 / 0.013)  # fresh estimates: old ones dropped
    assert all(c.should_propose(1) for _ in range(20))


def test_without_auto_disable_speculation_stays_on() -> None:
    """One plain step for the reported estimate, then speculation whatever it measures."""
    c = SpecController(auto_disable=False)
    assert not c.should_propose(2)
    c.record(2, 0.010, speculative=False, tokens_emitted=2)
    assert c.should_propose(2)
    for _ in range(MIN_SPEC_SAMPLES):
        c.record(2, 0.100, speculative=True, tokens_emitted=2)
    assert c.should_propose(2) and c.speedup(2) == pytest.approx(0.1)


def test_a_burst_of_rejections_among_good_steps_keeps_speculation_on() -> None:
    """Where an output stops copying its prompt, a few drafts in a row are rejected; the payoff is
    the mean over recent steps, so a short burst does not turn speculation off."""
    c = SpecController(auto_disable=True)
    _baseline(c, 1, 0.010)
    for tokens in [4, 4, 4, 4, 4, 1, 1, 1, 4, 4]:
        c.record(1, 0.011, speculative=True, tokens_emitted=tokens)
        assert c.should_propose(1)
    assert c.num_disabled_steps == 0


def test_a_cold_first_plain_step_does_not_inflate_the_baseline() -> None:
    """The plain baseline is the median of several steps: one cold first step (measured: 1.66 ms
    against 0.85 steady on the bundled target) would have doubled the speedup estimate."""
    c = SpecController(auto_disable=True)
    for seconds in (0.0166, 0.0085, 0.0086):
        assert not c.should_propose(1)
        c.record(1, seconds, speculative=False, tokens_emitted=1)
    assert c.should_propose(1)
    for _ in range(MIN_SPEC_SAMPLES):
        c.record(1, 0.020, speculative=True, tokens_emitted=2)  # 2 tokens for 2.3x the time: a loss
    assert c.speedup(1) == pytest.approx(2 * 0.0086 / 0.020)
    assert not c.should_propose(1)


def test_while_speculating_a_plain_step_refreshes_the_baseline_now_and_then() -> None:
    """A plain step's time grows with the context: one step in PLAIN_REFRESH_INTERVAL + 1 runs
    plain while speculation is on, and its time replaces the stale start-of-request ones."""
    c = SpecController(auto_disable=True)
    _baseline(c, 1, 0.010)
    decisions = []
    for _ in range(2 * (PLAIN_REFRESH_INTERVAL + 1)):
        speculate = c.should_propose(1)
        decisions.append(speculate)
        c.record(
            1, 0.012 if speculate else 0.014, speculative=speculate, tokens_emitted=3 if speculate else 1
        )
    assert decisions.count(False) == 2 and decisions.index(False) == PLAIN_REFRESH_INTERVAL
    assert c.speedup(1) == pytest.approx(3 * 0.010 / 0.012)  # median of 0.010 x 3, 0.014 x 2
    assert c.num_disabled_steps == 0
    # Without auto-disable nothing is measured for it: every step after the first plain one speculates.
    c = SpecController(auto_disable=False)
    c.record(1, 0.010, speculative=False, tokens_emitted=1)
    assert all(c.should_propose(1) for _ in range(3 * PLAIN_REFRESH_INTERVAL))
