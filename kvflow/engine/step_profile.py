"""The engine's step time as a function of what a step computes, measured (`kvflow profile-steps`):
the doctor's simulator reads these curves instead of extrapolating two step means linearly
(kvflow/doctor/step_profile.py), as Vidur profiles each operator over token counts before it
simulates.

    prefill curve   one request's prompt of n tokens in one step (n = 8 .. the token budget,
                    doubling): the step's duration, median of `repeats`
    decode curve    b requests decoding together (b = 1 .. max_num_seqs, doubling), short contexts:
                    the median duration of the steps that decode exactly b rows, median of
                    `repeats`
    decode at a     b = 1 and CONTEXT_PROBE_ROWS requests decoding after long prompts: a query row
    long context    re-reads its context (kvflow/query_rows.py), and these against the short ones
                    price a key (the cost of a short prompt suffix after a cached prefix)
    prefill at a    a chunk of n prompt tokens after a cached prefix of C (a prompt the prefix
    context         cache serves C of): its queries attend n x C keys beyond what a fresh prompt of
                    n attends, and these against the prefill curve price a key (what a prompt's
                    later chunk pays for attending its earlier ones); with prefix caching only

Each repeat of the prefill and decode curves is one pass over every size of both (profile_steps).

Durations are the engine's own (StepStats.duration: schedule, forward, sampling, outputs). Prompts
are random token ids, distinct per probe, so no prefix-cache hit shortens one.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Iterator
from typing import Any

from kvflow.engine.engine import LLMEngine
from kvflow.query_rows import MAX_QUERY_ROWS_PER_CHUNK
from kvflow.sampling_params import SamplingParams

# The prefill curve starts above the chunks the engine attends as query rows (kvflow/query_rows.py):
# those cost what as many decode rows do.
MIN_PREFILL_TOKENS = 2 * MAX_QUERY_ROWS_PER_CHUNK
# The long-context decode probe: prompts of up to this many tokens (or what the context allows), and
# this many requests at once besides one alone (a short suffix after a cached prefix is 8 rows).
CONTEXT_PROBE_TOKENS = 512
CONTEXT_PROBE_ROWS = MAX_QUERY_ROWS_PER_CHUNK
# The prefill-at-a-context probes: a chunk of each share of CONTEXT_CHUNK_TOKENS (or of what the
# context allows; within the budget) after a cached prefix of the rest: two points for a slope
# through zero. A long span, for many keys beyond: the context adds a few ms to a 30-100 ms step, and
# on the planted prefill_chunks model (2-core Zen 4, five runs each) chunks of 128 after 384 and of
# 256 after 256 read 0.7-1.7e-4 ms per key, of 256 after 752 and of 512 after 496 0.5-0.8e-4.
CONTEXT_CHUNK_TOKENS = 1024
CONTEXT_CHUNK_SHARES = (0.25, 0.5)
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


def _run(engine: LLMEngine) -> list[tuple[int, int, float, float]]:
    """Step until idle: (prefill tokens, decode rows, duration ms, keys the query rows read) of every
    step."""
    steps = []
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.last_step_stats
        if stats is not None:
            ms = 1e3 * stats.duration
            steps.append((stats.num_prefill_tokens, stats.num_decode_tokens, ms, stats.row_attention_work))
    return steps


def profile_steps(engine: LLMEngine, repeats: int = 3) -> dict[str, Any]:
    """{"prefill_ms": {n: ms}, "decode_ms": {b: ms}, "decode_context_ms": {b: ms},
    "decode_context_keys": {b: keys per row}, "prefill_context_ms": {n: ms}, "prefill_context_keys":
    {n: keys beyond a fresh prompt of n}} for this engine's model and settings (the last two with
    prefix caching only)."""
    sched = engine.config.scheduler_config
    max_len = engine.config.model_config.max_model_len or sched.max_num_batched_tokens + 1
    prompts = _Prompts(engine.tokenizer.vocab_size)
    once = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    engine.add_request("warmup", prompts(WARMUP_TOKENS), SamplingParams(max_tokens=4, ignore_eos=True))
    _run(engine)
    budget = min(sched.max_num_batched_tokens, max_len - 1)
    # Each repeat is a pass over every size, so a slow stretch of the machine (a VM's, lasting a
    # probe or two) lands in one pass of a few sizes, where back-to-back repeats of one size all
    # fell in it. One profile's 4-row decode probe (one run of 12 steps) ran at 15.6 ms beside 13.5
    # at 8 rows (11.9-12.1 when measured again): the run's fit then put its servers' excess over a
    # 4-row step at 1 ms where ~4 were its own, and a disaggregated decode instance priced from the
    # split curve plus that excess came out 20-30% fast (ITL p50 12.0-13.8 ms predicted on four
    # diagnoses, 16.3-17.9 measured on the pair; 14.9-17.2 from a profile measured in passes,
    # session 33).
    prefill_times: dict[int, list[float]] = {}
    decode_times: dict[int, list[float]] = {}
    chunk_times: dict[int, list[float]] = {}
    chunks = _context_chunks(engine, budget, max_len)
    params = SamplingParams(temperature=0.0, max_tokens=DECODE_OUTPUT_TOKENS, ignore_eos=True)
    for r in range(repeats):
        for n in _doubling(MIN_PREFILL_TOKENS, budget):
            engine.add_request(f"prefill-{n}-{r}", prompts(n), once)
            ms = [ms for tokens, rows, ms, _ in _run(engine) if tokens == n and rows == 0]
            prefill_times.setdefault(n, []).extend(ms)
        for n, cached in chunks:
            prefix = prompts(cached)
            engine.add_request(f"prefix-{n}-{r}", prefix, once)  # its blocks stay cached
            _run(engine)
            engine.add_request(f"chunk-{n}-{r}", prefix + prompts(n), once)
            chunk_times.setdefault(n, []).extend(
                ms for tokens, rows, ms, _ in _run(engine) if tokens == n and rows == 0
            )
        for b in _doubling(1, sched.max_num_seqs):
            for i in range(b):
                engine.add_request(f"decode-{b}-{r}-{i}", prompts(DECODE_PROMPT_TOKENS), params)
            # A pass's b-row steps: their median (a few of its steps take in the prompts).
            steps = [ms for tokens, rows, ms, _ in _run(engine) if tokens == 0 and rows == b]
            if steps:
                decode_times.setdefault(b, []).append(statistics.median(steps))
    prefill = {n: statistics.median(times) for n, times in prefill_times.items() if times}
    decode = {b: statistics.median(times) for b, times in decode_times.items()}
    out = {"prefill_ms": prefill, "decode_ms": decode, **_decode_at_context(engine, prompts, max_len)}
    measured = [(n, cached) for n, cached in chunks if chunk_times.get(n)]
    if measured:
        out["prefill_context_ms"] = {n: statistics.median(chunk_times[n]) for n, _ in measured}
        out["prefill_context_keys"] = {n: float(n * cached) for n, cached in measured}
    return out


def _context_chunks(engine: LLMEngine, budget: int, max_len: int) -> list[tuple[int, int]]:
    """The prefill-at-a-context probes, (chunk tokens n, cached prefix C): n a share of the span
    (CONTEXT_CHUNK_TOKENS, or what the context allows) within the budget, at least a prefill chunk's
    MIN_PREFILL_TOKENS, C the rest in whole blocks (a prefix-cache hit is whole blocks); none
    without prefix caching (the prefix would be computed again in the chunk's step)."""
    cache = engine.config.cache_config
    if not cache.enable_prefix_caching:
        return []
    span = min(CONTEXT_CHUNK_TOKENS, max_len - 1)
    chunks = []
    for share in CONTEXT_CHUNK_SHARES:
        n = min(round(span * share), budget)
        cached = (span - n) // cache.block_size * cache.block_size
        if n >= MIN_PREFILL_TOKENS and cached > 0:
            chunks.append((n, cached))
    return chunks


def _decode_at_context(engine: LLMEngine, prompts: _Prompts, max_len: int) -> dict[str, Any]:
    """Decode steps of 1 and CONTEXT_PROBE_ROWS rows after prompts of CONTEXT_PROBE_TOKENS (or what
    the context allows): {"decode_context_ms": {b: median ms}, "decode_context_keys": {b: median
    keys a row read}}; empty when the context is too short to differ from the short probes. The
    requests decode until the last one's prompt is in (a small budget prefills them one after
    another), then DECODE_OUTPUT_TOKENS steps together."""
    sched = engine.config.scheduler_config
    prompt_len = min(CONTEXT_PROBE_TOKENS, (max_len - 1) // 2)  # room for the outputs below
    if prompt_len <= 2 * DECODE_PROMPT_TOKENS:
        return {}
    at_context: dict[int, float] = {}
    keys: dict[int, float] = {}
    for b in sorted({1, min(CONTEXT_PROBE_ROWS, sched.max_num_seqs)}):
        # Steps until the last prompt is in: the prompts' chunks, and one more per request at most.
        prefill_steps = -(-b * prompt_len // sched.max_num_batched_tokens) + b
        outputs = min(DECODE_OUTPUT_TOKENS + prefill_steps, max_len - 1 - prompt_len)
        params = SamplingParams(temperature=0.0, max_tokens=outputs, ignore_eos=True)
        for i in range(b):
            engine.add_request(f"context-{b}-{i}", prompts(prompt_len), params)
        steps = [(ms, row_keys) for tokens, rows, ms, row_keys in _run(engine) if tokens == 0 and rows == b]
        if steps:
            at_context[b] = statistics.median(ms for ms, _ in steps)
            keys[b] = statistics.median(row_keys / b for _, row_keys in steps)
    return {"decode_context_ms": at_context, "decode_context_keys": keys}
