"""The auto-disable rule: speculate while the measured speedup estimate is >= 1; below it, run
plain steps with a speculative probe every PROBE_INTERVAL steps (pure Python, no model)."""

from __future__ import annotations

import pytest

from kvflow.spec_decode.controller import PROBE_INTERVAL, SpecController


def test_measures_a_plain_step_first_then_speculates_when_it_pays() -> None:
    c = SpecController(auto_disable=True)
    assert not c.should_propose(1)  # no baseline yet
    c.record(1, 0.010, speculative=False, tokens_emitted=1)
    assert c.should_propose(1)  # baseline known, speculation unmeasured: try it
    c.record(1, 0.012, speculative=True, tokens_emitted=3)  # 3 tokens for 1.2x the time
    assert c.speedup(1) == pytest.approx(3 * 0.010 / 0.012)
    assert all(c.should_propose(1) for _ in range(50))


def test_disables_when_it_costs_time_and_probes_periodically() -> None:
    c = SpecController(auto_disable=True)
    c.record(8, 0.020, speculative=False, tokens_emitted=8)
    c.record(8, 0.050, speculative=True, tokens_emitted=9)  # 1.125 tokens per request for 2.5x the time
    speedup = c.speedup(8)
    assert speedup is not None and speedup < 1
    decisions = [c.should_propose(8) for _ in range(3 * PROBE_INTERVAL)]
    assert decisions.count(True) == 3 and c.num_disabled_steps == 3 * (PROBE_INTERVAL - 1)
    # Batch sizes are estimated apart: batch 1 knows nothing yet, so it measures plain first.
    assert not c.should_propose(1)


def test_without_auto_disable_speculation_stays_on() -> None:
    c = SpecController(auto_disable=False)
    c.record(2, 0.010, speculative=False, tokens_emitted=2)
    c.record(2, 0.100, speculative=True, tokens_emitted=2)
    assert c.should_propose(2) and c.speedup(2) == pytest.approx(0.1)
