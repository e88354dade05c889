"""Is speculation paying off? Measured per step, and (with auto-disable) acted on.

A decode step emits one token per request; a speculative step emits (accepted + 1) per request
but costs the proposal plus a verification step that computes k + 1 tokens per request. From
recent measurements:
    tokens_ratio = tokens emitted per request in speculative steps (mean accepted length), the
                   mean over the last TOKENS_WINDOW speculative steps: the payoff is the mean,
                   and rejections come in bursts (where an output stops copying its prompt, a
                   few steps in a row) that a short window would mistake for a trend;
    time_ratio   = (propose time + speculative step time) / plain step time   (same batch size),
                   medians of the last few steps: robust to a cold first step or a GC pause,
                   which a moving average would carry for many steps
    speedup      = tokens_ratio / time_ratio
Auto-disable rule, per batch-size bucket (verification cost grows with the batch and proposal
cost does not shrink with it, so a large batch is where speculation stops paying):
- baseline: MIN_PLAIN_SAMPLES plain steps first (a bucket's first step is often cold: one sample
  measured the bundled target's batch-1 step at 1.66 ms against 0.85 steady, doubling the estimate;
  without auto-disable one plain step, since the baseline then only feeds the reported estimate);
- explore: speculate until MIN_SPEC_SAMPLES speculative steps are measured;
- then speculate while the speedup estimate is >= 1, else turn speculation off;
- while off, one probe step speculates after `probe_interval` plain steps. A probe judged alone
  (its tokens x plain median / its time) >= 1 turns speculation back on with fresh estimates (the
  workload changed: the old ones are stale); otherwise the interval doubles, from
  PROBE_INTERVAL_MIN to PROBE_INTERVAL_MAX, so that a workload speculation never helps pays for a
  probe ever more rarely (a draft model's probe costs k forward passes of the draft).
Plain steps keep the plain-step estimate fresh; while speculation is on, one step in
PLAIN_REFRESH_INTERVAL runs plain for that (a plain step's time grows with the context).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

PLAIN_WINDOW = 8  # recent plain steps in the plain-step median
MIN_PLAIN_SAMPLES = 3  # plain steps measured before a bucket speculates: the median outvotes one cold step
PLAIN_REFRESH_INTERVAL = 32  # speculative steps between two plain ones (auto-disable on)
SPEC_WINDOW = 4  # recent speculative steps in the speculative-step median
TOKENS_WINDOW = 16  # recent speculative steps in the mean tokens per request
MIN_SPEC_SAMPLES = 3  # speculative steps measured before the rule may turn speculation off
PROBE_INTERVAL_MIN = 8  # plain steps before the first probe after turning off
PROBE_INTERVAL_MAX = 128  # the interval doubles after each failed probe, up to this
# Batch sizes 1, 2-3, 4-7, 8-15, ...: one estimate per power-of-two bucket.
MAX_BUCKET = 8


def _bucket(batch_size: int) -> int:
    return min(max(batch_size, 1).bit_length() - 1, MAX_BUCKET)


@dataclass
class _Bucket:
    plain_step_s: deque[float] = field(default_factory=lambda: deque(maxlen=PLAIN_WINDOW))
    spec_step_s: deque[float] = field(default_factory=lambda: deque(maxlen=SPEC_WINDOW))  # proposal + step
    tokens_per_request: deque[float] = field(default_factory=lambda: deque(maxlen=TOKENS_WINDOW))
    disabled: bool = False
    probe_interval: int = PROBE_INTERVAL_MIN
    steps_since_probe: int = 0
    probing: bool = False  # the next speculative step is a probe
    spec_steps_since_plain: int = 0

    def speedup(self) -> float | None:
        if not self.plain_step_s or not self.spec_step_s:
            return None
        plain, spec = statistics.median(self.plain_step_s), statistics.median(self.spec_step_s)
        return statistics.fmean(self.tokens_per_request) * plain / spec


@dataclass
class SpecController:
    auto_disable: bool
    buckets: dict[int, _Bucket] = field(default_factory=dict)
    num_disabled_steps: int = 0

    def should_propose(self, batch_size: int) -> bool:
        b = self.buckets.get(_bucket(batch_size))
        if b is None or not b.plain_step_s:  # measure a plain step first: the baseline
            return False
        if not self.auto_disable:  # the baseline only feeds the reported estimate: speculate at once
            return True
        if len(b.plain_step_s) < MIN_PLAIN_SAMPLES:  # decisions rest on it: outvote a cold first step
            return False
        if not b.disabled:
            b.spec_steps_since_plain += 1
            if b.spec_steps_since_plain > PLAIN_REFRESH_INTERVAL:  # refresh the baseline
                b.spec_steps_since_plain = 0
                return False
            return True
        b.steps_since_probe += 1
        if b.steps_since_probe >= b.probe_interval:
            b.steps_since_probe, b.probing = 0, True
            return True
        self.num_disabled_steps += 1
        return False

    def record(self, batch_size: int, seconds: float, speculative: bool, tokens_emitted: int) -> None:
        """One decode step of `batch_size` requests (`seconds` includes the proposal if any)."""
        if batch_size <= 0:
            return
        b = self.buckets.setdefault(_bucket(batch_size), _Bucket())
        if not speculative:
            b.plain_step_s.append(seconds)
            return
        tokens = tokens_emitted / batch_size
        if b.probing:
            b.probing = False
            if b.plain_step_s and tokens * statistics.median(b.plain_step_s) / seconds >= 1.0:
                b.spec_step_s.clear()
                b.tokens_per_request.clear()
                b.disabled, b.probe_interval = False, PROBE_INTERVAL_MIN
            else:
                b.probe_interval = min(2 * b.probe_interval, PROBE_INTERVAL_MAX)
        b.spec_step_s.append(seconds)
        b.tokens_per_request.append(tokens)
        speedup = b.speedup()
        if (
            self.auto_disable
            and not b.disabled
            and len(b.spec_step_s) >= MIN_SPEC_SAMPLES
            and speedup is not None
            and speedup < 1.0
        ):
            b.disabled, b.steps_since_probe = True, 0

    def speedup(self, batch_size: int) -> float | None:
        """Estimated decode speedup of speculating at this batch size (None until both measured)."""
        b = self.buckets.get(_bucket(batch_size))
        return None if b is None else b.speedup()
