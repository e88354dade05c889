"""The engine's step time as a function of what a step computes, measured (`kvflow profile-steps`):
the doctor's simulator reads these curves instead of extrapolating two step means linearly
(kvflow/doctor/step_profile.py), as Vidur profiles each operator over token counts before it
simulates.

    prefill curve   one request's prompt of n tokens in one step (n = 8 .. the token budget,
                    doubling): the step's duration, median of `repeats`
    decode curve    b requests decoding together (b = 1 .. max_num_seqs, doubling), short contexts:
                    the median duration of the steps that decode exactly b rows

Durations are the engine's own (StepStats.duration: schedule, forward, sampling, outputs). Prompts
are random token ids, distinct per probe, so no prefix-cache hit shortens one.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Iterator
from typing import Any

from kvflow.engine.engine import LLMEngine
from kvflow.sampling_params import SamplingParams

MIN_PREFILL_TOKENS = 8
DECODE_PROMPT_TOKENS = 16
DECODE_OUTPUT_TOKENS = 12  # steps per decode probe: enough for a median
WARMUP_TOKENS = 32
SEED = 0


def _doubling(start: int, limit: int) -> Iterator[int]:
    n = start
    while n <= limit:
        yield n
        n *= 2


class _Prompts:
    """Random prompts of token ids, never repeated (no prefix-cache hits)."""

    def __init__(self, vocab_size: int) -> None:
        self.rng = random.Random(SEED)
        # Skip the lowest ids: tokenizers put their special tokens there.
        self.low, self.high = min(16, vocab_size // 4), vocab_size - 1

    def __call__(self, n: int) -> list[int]:
        return [self.rng.randint(self.low, self.high) for _ in range(n)]


def _run(engine: LLMEngine) -> list[tuple[int, int, float]]:
    """Step until idle: (prefill tokens, decode rows, duration ms) of every step."""
    steps = []
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.last_step_stats
        if stats is not None:
            steps.append((stats.num_prefill_tokens, stats.num_decode_tokens, 1e3 * stats.duration))
    return steps


def profile_steps(engine: LLMEngine, repeats: int = 3) -> dict[str, Any]:
    """{"prefill_ms": {n: ms}, "decode_ms": {b: ms}} for this engine's model and settings."""
    sched = engine.config.scheduler_config
    max_len = engine.config.model_config.max_model_len or sched.max_num_batched_tokens + 1
    prompts = _Prompts(engine.tokenizer.vocab_size)
    once = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    engine.add_request("warmup", prompts(WARMUP_TOKENS), SamplingParams(max_tokens=4, ignore_eos=True))
    _run(engine)
    budget = min(sched.max_num_batched_tokens, max_len - 1)
    prefill: dict[int, float] = {}
    for n in _doubling(MIN_PREFILL_TOKENS, budget):
        times = []
        for r in range(repeats):
            engine.add_request(f"prefill-{n}-{r}", prompts(n), once)
            times += [ms for tokens, rows, ms in _run(engine) if tokens == n and rows == 0]
        if times:
            prefill[n] = statistics.median(times)
    decode: dict[int, float] = {}
    params = SamplingParams(temperature=0.0, max_tokens=DECODE_OUTPUT_TOKENS, ignore_eos=True)
    for b in _doubling(1, sched.max_num_seqs):
        for i in range(b):
            engine.add_request(f"decode-{b}-{i}", prompts(DECODE_PROMPT_TOKENS), params)
        times = [ms for tokens, rows, ms in _run(engine) if tokens == 0 and rows == b]
        if times:
            decode[b] = statistics.median(times)
    return {"prefill_ms": prefill, "decode_ms": decode}
