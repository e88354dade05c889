"""Is speculation paying off? Measured per step, and (with auto-disable) acted on.

A decode step emits one token per request; a speculative step emits (accepted + 1) per request
but costs the proposal plus a verification step that computes k + 1 tokens per request. From
exponential moving averages of what was measured:
    tokens_ratio = tokens emitted per request in speculative steps (mean accepted length)
    time_ratio   = (propose time + speculative step time) / plain step time   (same batch size)
    speedup      = tokens_ratio / time_ratio
Auto-disable rule: when the speedup estimate is below 1, steps run without proposals; every
PROBE_INTERVAL steps one speculative step runs anyway, so that a workload turning repetitive (or a
batch shrinking) is noticed. Plain steps keep the plain-step estimate fresh. Both estimates are
kept per batch-size bucket, since verification cost grows with the batch and proposal cost does
not shrink with it (a large batch is where speculation stops paying).
"""

from __future__ import annotations

from dataclasses import dataclass, field

EMA_WEIGHT = 0.2  # weight of the newest observation in every moving average
PROBE_INTERVAL = 16  # steps between speculative probes while disabled
# Batch sizes 1, 2-3, 4-7, 8-15, ...: one estimate per power-of-two bucket.
MAX_BUCKET = 8


def _bucket(batch_size: int) -> int:
    return min(max(batch_size, 1).bit_length() - 1, MAX_BUCKET)


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - EMA_WEIGHT) * old + EMA_WEIGHT * new


@dataclass
class _Estimates:
    plain_step_s: float | None = None
    spec_step_s: float | None = None  # proposal + verification step
    tokens_per_request: float | None = None  # in speculative steps


@dataclass
class SpecController:
    auto_disable: bool
    buckets: dict[int, _Estimates] = field(default_factory=dict)
    steps_since_probe: int = 0
    num_disabled_steps: int = 0

    def should_propose(self, batch_size: int) -> bool:
        e = self.buckets.get(_bucket(batch_size))
        if e is None or e.plain_step_s is None:  # measure a plain step first: the baseline
            return False
        if not self.auto_disable:
            return True
        speedup = self.speedup(batch_size)
        if speedup is None or speedup >= 1.0:
            return True
        self.steps_since_probe += 1
        if self.steps_since_probe >= PROBE_INTERVAL:
            self.steps_since_probe = 0
            return True
        self.num_disabled_steps += 1
        return False

    def record(self, batch_size: int, seconds: float, speculative: bool, tokens_emitted: int) -> None:
        """One decode step of `batch_size` requests (`seconds` includes the proposal if any)."""
        if batch_size <= 0:
            return
        e = self.buckets.setdefault(_bucket(batch_size), _Estimates())
        if speculative:
            e.spec_step_s = _ema(e.spec_step_s, seconds)
            e.tokens_per_request = _ema(e.tokens_per_request, tokens_emitted / batch_size)
        else:
            e.plain_step_s = _ema(e.plain_step_s, seconds)

    def speedup(self, batch_size: int) -> float | None:
        """Estimated decode speedup of speculating at this batch size (None until both measured)."""
        e = self.buckets.get(_bucket(batch_size))
        if e is None or e.plain_step_s is None or e.spec_step_s is None or e.tokens_per_request is None:
            return None
        return e.tokens_per_request * e.plain_step_s / e.spec_step_s
