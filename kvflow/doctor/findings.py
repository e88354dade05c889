"""The six checks of the diagnosis (the "steps" of docs/doctor.md), in the troubleshooting order; each
`check_<id>` returns one Finding with its evidence, the cause, and what-ifs with predicted effects
(docs/doctor.md has every formula). They are checks, not "steps", in the code: kvflow's engine has
steps too (`step()`, step times), and a `step_ttft` would read as one of them.

Severity: `ok` (fine, and why), `info` (headroom worth knowing), `warning` (a cause of latency
with an actionable fix). Distance from the roofline alone is `info`: small models on CPUs are
dominated by per-step overhead, and that is not something a setting fixes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kvflow.doctor.evidence import EngineSettings, RunEvidence
from kvflow.doctor.model_spec import ModelSpec
from kvflow.doctor.roofline import Roofline

Severity = Literal["ok", "info", "warning"]
# A fifth of the prompt tokens repeated: caching them removes at least a fifth of prefill compute.
REPEAT_SHARE_WORTH_CACHING = 0.2
# Prefix caching counts as effective when it serves at least half of the repeated tokens.
EFFECTIVE_CACHE_FRACTION = 0.5
QUEUE_DOMINANT_SHARE = 0.5  # queueing is the larger part of TTFT
ITL_TAIL_RATIO = 3.0  # p99/p50 of ITL: beyond this the tail is a stall, not noise
STALL_RATIO = 2.0  # mixed (prefill chunk + decodes) steps this much slower than decode-only steps
NON_ENGLISH_TOKEN_RATIO = 1.5  # tokens per character relative to English worth mentioning
KV_DTYPES = ("fp8", "int8", "int4")
WEIGHT_DTYPES = ("int8", "int4")
SLIDING_WINDOW_WHAT_IF = 4096  # the window of the what-if for long contexts (Mistral-7B's)


@dataclass
class WhatIf:
    change: str
    effect: str  # the prediction as a sentence with numbers
    predicted: dict[str, float] = field(default_factory=dict)
    setting: dict[str, Any] | None = None  # a kvflow serve engine argument `--verify` can apply


@dataclass
class Finding:
    step: int  # the place in the troubleshooting order (1-6), as the text report numbers it
    id: str  # stable name of the check, e.g. "ttft": what tests and tools select a finding by
    title: str
    severity: Severity
    summary: str
    cause: str
    evidence: dict[str, Any] = field(default_factory=dict)
    what_ifs: list[WhatIf] = field(default_factory=list)


@dataclass(frozen=True)
class Question:
    """One check: its place in the order, its id, and the question its finding answers."""

    step: int
    id: str
    title: str

    def answer(
        self,
        severity: Severity,
        summary: str,
        cause: str,
        evidence: dict[str, Any],
        what_ifs: Sequence[WhatIf] = (),
    ) -> Finding:
        return Finding(self.step, self.id, self.title, severity, summary, cause, evidence, list(what_ifs))


INPUT_LENGTH = Question(1, "input_length", "Is the input too long?")
TTFT = Question(2, "ttft", "Is TTFT high?")
ITL = Question(3, "itl", "Is ITL high?")
KV_MEMORY = Question(4, "kv_memory", "Does the KV cache take too much memory?")
QUANTIZATION = Question(5, "quantization", "Is there quantization headroom?")
SERVING_FEATURES = Question(6, "serving_features", "Is the serving framework doing its part?")


@dataclass(frozen=True)
class Diagnosis:
    model: ModelSpec
    roofline: Roofline
    run: RunEvidence
    settings: EngineSettings
    measured: bool  # False in calculator mode (no benchmark)

    # ------------------------------------------------------------------------ derived quantities

    @property
    def decode_batch(self) -> int:
        batch = max(1, round(self.run.concurrency))
        if self.settings.max_num_seqs is not None:
            batch = min(batch, self.settings.max_num_seqs)
        return batch

    def roofline_prefill_ms_per_token(self) -> float:
        n = max(1, round(self.run.prompt_p50))
        return 1e3 * self.roofline.prefill(n).seconds / n

    def roofline_decode_ms(self, weight_dtype: str | None = None, kv_dtype: str | None = None) -> float:
        roof = self.roofline
        if weight_dtype or kv_dtype:
            roof = Roofline(
                self.model, roof.hardware, weight_dtype or roof.weight_dtype, kv_dtype or roof.kv_dtype
            )
        return 1e3 * roof.decode_step(self.decode_batch, round(self.run.decode_context)).seconds

    def step_fixed_cost_ms(self) -> float:
        """The cost of a step that computes almost nothing: the server's decode-only step time when
        it exports one (kvflow), else the client's TPOT (which adds HTTP delivery per token)."""
        decode_step = self.run.step_time_ms("decode_only")
        return float(decode_step if decode_step is not None else self.run.tpot_p50_ms or 0.0)

    def measured_prefill_ms_per_token(self) -> float | None:
        """The marginal cost of a prompt token, which is what caching or cutting tokens saves.

        Preferred (kvflow servers): from the server's step times by kind over the run,
            (prefill_only steps' time + mixed steps' time beyond a decode-only step) / prefill tokens,
        with prefill tokens = prompt tokens - prefix-cache hits; this holds under concurrency, where
        one request's prefill spans steps shared with others. Otherwise per request:
            (prefill time - one step's fixed cost) / uncached prompt tokens,
        with the server's prefill time (no queueing) or TTFT - queue time."""
        from_steps = self._prefill_ms_per_token_from_steps()
        if from_steps is not None:
            return from_steps
        run = self.run
        prefill = run.prefill_ms
        if prefill is None and run.ttft_p50_ms is not None:
            prefill = run.ttft_p50_ms - (run.queue_ms or 0.0)
        if prefill is None:
            return None
        uncached = run.prompt_p50 * (1.0 - (run.prefix_hit_rate or 0.0))
        return max(prefill - self.step_fixed_cost_ms(), 0.0) / max(uncached, 1.0)

    def _prefill_ms_per_token_from_steps(self) -> float | None:
        server = self.run.server
        steps = server.get("step_time_ms") or {}
        prompt, hits = server.get("prompt_tokens"), server.get("prefix_cache_hits") or 0.0
        prefill_tokens = (prompt or 0.0) - hits
        decode_step = self.run.step_time_ms("decode_only")
        if not steps or prefill_tokens <= 0 or ("mixed" in steps and decode_step is None):
            return None
        total = 0.0
        for kind, base in (("prefill_only", 0.0), ("mixed", decode_step or 0.0)):
            s = steps.get(kind) or {}
            if s.get("count"):
                total += s["count"] * max(s["mean"] - base, 0.0)
        return total / prefill_tokens if total > 0 else None

    def kv_pool_bytes(self) -> float:
        tokens = self.settings.kv_pool_tokens
        if tokens is not None:
            return tokens * self.model.kv_bytes_per_token(self.roofline.kv_dtype)
        return self.roofline.default_kv_pool_bytes()

    def prefix_cache_effective(self) -> bool:
        share, hit = self.run.shared_prefix_share, self.run.prefix_hit_rate
        if self.settings.enable_prefix_caching is False:
            return False
        if share and hit is not None:
            return hit >= EFFECTIVE_CACHE_FRACTION * share
        return bool(self.settings.enable_prefix_caching)

    def uncached_repeat_tokens(self) -> float:
        """Repeated prompt tokens per request the server still computes."""
        run = self.run
        if not run.shared_prefix_p50 or self.prefix_cache_effective():
            return 0.0
        return run.shared_prefix_p50

    def prefix_caching_what_if(self) -> WhatIf | None:
        repeat = self.uncached_repeat_tokens()
        slope = self.measured_prefill_ms_per_token()
        run = self.run
        if repeat <= 0 or slope is None or run.ttft_p50_ms is None:
            return None
        # Caching whole blocks: what the cache can actually serve.
        block = self.settings.block_size or 16
        cached = block * math.floor(repeat / block)
        saved = slope * cached
        predicted = max(run.ttft_p50_ms - saved, 0.0)
        setting = {"enable_prefix_caching": True} if self.settings.server == "kvflow" else None
        return WhatIf(
            f"cache the {cached:,.0f}-token repeated prefix (prefix caching"
            + (" on)" if self.settings.enable_prefix_caching is False else " effective)"),
            f"p50 TTFT {run.ttft_p50_ms:,.1f} ms -> {predicted:,.1f} ms ({saved:,.1f} ms of prefill at "
            f"{slope:.3f} ms/token measured)",
            {"ttft_p50_ms": predicted},
            setting,
        )


# ---------------------------------------------------------------------------------- the checks


def check_input_length(d: Diagnosis) -> Finding:
    run = d.run
    evidence: dict[str, Any] = {
        "prompt_tokens_p50": run.prompt_p50,
        "prompt_tokens_p95": run.prompt_p95,
        "output_tokens_p50": run.output_p50,
        "repeated_prefix_share": run.shared_prefix_share,
        "repeated_prefix_tokens_p50": run.shared_prefix_p50,
    }
    what_ifs = [w for w in (d.prefix_caching_what_if(), _cut_prompt_what_if(d)) if w is not None]
    costly = _costly_languages(run)
    if costly:
        evidence["tokens_per_char_vs_english"] = costly
    share = run.shared_prefix_share or 0.0
    if share >= REPEAT_SHARE_WORTH_CACHING and not d.prefix_cache_effective():
        return INPUT_LENGTH.answer(
            "warning",
            f"{share:.0%} of prompt tokens repeat an earlier request's prefix and are computed again",
            "a shared system prompt or context is re-prefilled for every request",
            evidence,
            what_ifs,
        )
    summary = f"prompts p50 {run.prompt_p50:,.0f} / p95 {run.prompt_p95:,.0f} tokens"
    if costly:
        langs = ", ".join(f"{k} {v:.1f}x" for k, v in sorted(costly.items(), key=lambda kv: -kv[1]))
        return INPUT_LENGTH.answer(
            "info", summary + f"; non-English text costs more tokens: {langs}",
            "the tokenizer spends more tokens per character on these scripts (longer prefill, more KV)",
            evidence, what_ifs,
        )  # fmt: skip
    return INPUT_LENGTH.answer(
        "ok", summary + "; no large repeated prefix left uncached",
        "input lengths are what the workload needs", evidence, what_ifs,
    )  # fmt: skip


def _cut_prompt_what_if(d: Diagnosis) -> WhatIf | None:
    """Cut a quarter of the median prompt: TTFT falls by the prefill of the tokens cut."""
    run = d.run
    slope = d.measured_prefill_ms_per_token() or d.roofline_prefill_ms_per_token()
    cut = round(run.prompt_p50 / 4)
    if cut <= 0 or run.ttft_p50_ms is None:
        return None
    predicted = max(run.ttft_p50_ms - slope * cut, 0.0)
    return WhatIf(
        f"cut {cut:,} tokens (a quarter) from the median prompt",
        f"p50 TTFT {run.ttft_p50_ms:,.1f} ms -> {predicted:,.1f} ms, and {cut:,} fewer KV tokens per request",
        {"ttft_p50_ms": predicted},
    )


def _costly_languages(run: RunEvidence) -> dict[str, float]:
    """Languages whose tokens per character are at least NON_ENGLISH_TOKEN_RATIO x English's."""
    english = run.languages.get("en", {}).get("tokens_per_char")
    if not english:
        return {}
    ratios = {lang: row["tokens_per_char"] / english for lang, row in run.languages.items()}
    return {lang: ratio for lang, ratio in ratios.items() if ratio >= NON_ENGLISH_TOKEN_RATIO}


def check_ttft(d: Diagnosis) -> Finding:
    run = d.run
    evidence = _ttft_evidence(d)
    cache = d.prefix_caching_what_if()
    what_ifs = [w for w in (cache, _double_chunk_what_if(d)) if w is not None]
    queue = run.queue_ms
    if queue is not None and run.ttft_p50_ms and queue >= QUEUE_DOMINANT_SHARE * run.ttft_p50_ms:
        return _queueing_finding(run.ttft_p50_ms, queue, evidence, what_ifs)
    if cache is not None and (run.shared_prefix_share or 0.0) >= REPEAT_SHARE_WORTH_CACHING:
        return TTFT.answer(
            "warning", f"prefill of repeated tokens dominates TTFT: {cache.effect}",
            "prefix caching is off or not hitting, so the shared prefix is prefilled again",
            evidence, what_ifs,
        )  # fmt: skip
    if run.ttft_p50_ms is None:
        ttft = 1e3 * d.roofline.prefill(max(1, round(run.prompt_p50))).seconds
        summary = f"roofline prefill of a {run.prompt_p50:,.0f}-token prompt: {ttft:,.1f} ms"
        return TTFT.answer("info", summary, "calculator mode: no measurement", evidence, what_ifs)
    ratio = evidence["prefill_roofline_ratio"]
    note = f"; prefill runs at {ratio:.1f}x the roofline's ms/token" if ratio else ""
    return TTFT.answer(
        "ok" if not ratio or ratio < 10 else "info",
        f"TTFT p50 {run.ttft_p50_ms:,.1f} ms, mostly prefill, no queueing to speak of{note}",
        "TTFT is the prefill work itself", evidence, what_ifs,
    )  # fmt: skip


def _ttft_evidence(d: Diagnosis) -> dict[str, Any]:
    run = d.run
    roof_slope = d.roofline_prefill_ms_per_token()
    slope = d.measured_prefill_ms_per_token()
    return {
        "ttft_p50_ms": run.ttft_p50_ms,
        "ttft_p95_ms": run.ttft_p95_ms,
        "queue_ms_mean": run.queue_ms,
        "prefill_ms_mean": run.prefill_ms,
        "prefill_ms_per_token_measured": slope,
        "prefill_ms_per_token_roofline": roof_slope,
        "prefill_roofline_ratio": (slope / roof_slope) if slope is not None and roof_slope else None,
    }


def _double_chunk_what_if(d: Diagnosis) -> WhatIf | None:
    """When p95 prompts need several chunks: a chunk twice as large saves steps, each a fixed cost."""
    run, chunk = d.run, d.settings.max_num_batched_tokens
    if chunk is None or run.prompt_p95 <= chunk or run.tpot_p50_ms is None:
        return None
    steps_now = math.ceil(run.prompt_p95 / chunk)
    steps_new = math.ceil(run.prompt_p95 / (2 * chunk))
    saved = (steps_now - steps_new) * run.tpot_p50_ms  # each step's fixed cost
    return WhatIf(
        f"double the prefill chunk (max_num_batched_tokens {chunk} -> {2 * chunk})",
        f"p95-length prompts take {steps_new} steps instead of {steps_now}: about {saved:,.1f} ms "
        "less TTFT, but decodes sharing a step with a chunk stall longer (see step 3)",
        {"ttft_p95_ms": max((run.ttft_p95_ms or 0.0) - saved, 0.0)},
        {"max_num_batched_tokens": 2 * chunk} if d.settings.server == "kvflow" else None,
    )


def _queueing_finding(
    ttft_ms: float, queue_ms: float, evidence: dict[str, Any], what_ifs: list[WhatIf]
) -> Finding:
    """Queueing is most of TTFT: the server is at capacity; without the queue TTFT is the rest."""
    predicted = ttft_ms - queue_ms
    fewer_prefills = WhatIf(
        "fewer concurrent prefills (lower concurrency, or more capacity behind the load balancer)",
        f"p50 TTFT {ttft_ms:,.1f} ms -> about {predicted:,.1f} ms without the queueing",
        {"ttft_p50_ms": predicted},
    )
    return TTFT.answer(
        "warning",
        f"queueing is {queue_ms / ttft_ms:.0%} of TTFT ({queue_ms:,.1f} of {ttft_ms:,.1f} ms)",
        "requests wait for a running slot or for the step token budget: the server is at capacity",
        evidence,
        [*what_ifs, fewer_prefills],
    )


def check_itl(d: Diagnosis) -> Finding:
    run = d.run
    roof_ms = d.roofline_decode_ms()
    evidence = _itl_evidence(d, roof_ms)
    decode_step, mixed_step = run.step_time_ms("decode_only"), run.step_time_ms("mixed")
    tail = (run.itl_p99_ms / run.itl_p50_ms) if run.itl_p50_ms and run.itl_p99_ms else None
    if (
        tail
        and tail >= ITL_TAIL_RATIO
        and decode_step
        and mixed_step
        and mixed_step >= STALL_RATIO * decode_step
    ):
        return _prefill_stall_finding(d, tail, decode_step, mixed_step, evidence)
    if run.tpot_p50_ms is None:
        return ITL.answer(
            "info", f"roofline decode step at batch {d.decode_batch}: {roof_ms:,.2f} ms",
            "calculator mode: no measurement", evidence,
        )  # fmt: skip
    ratio = run.tpot_p50_ms / roof_ms if roof_ms else None
    util = evidence.get("bandwidth_utilization") or 0.0
    return ITL.answer(
        "ok" if ratio is None or ratio < 3 else "info",
        f"decode {run.tpot_p50_ms:,.2f} ms/step at batch {d.decode_batch} against {roof_ms:,.2f} ms roofline "
        f"({util:.0%} of peak bandwidth); ITL p99/p50 {tail or 0:.1f}",
        "decode is memory-bound: every step reads the weights and the KV cache", evidence,
    )  # fmt: skip


def _itl_evidence(d: Diagnosis, roof_ms: float) -> dict[str, Any]:
    run = d.run
    evidence: dict[str, Any] = {
        "decode_batch": d.decode_batch,
        "decode_context": run.decode_context,
        "decode_ms_per_step_measured": run.tpot_p50_ms,
        "decode_ms_per_step_roofline": roof_ms,
        "itl_p50_ms": run.itl_p50_ms,
        "itl_p99_ms": run.itl_p99_ms,
    }
    if run.tpot_p50_ms:
        # The bytes the roofline says a step reads, over the measured step time.
        nbytes = d.roofline.decode_bytes(d.decode_batch, round(run.decode_context))
        achieved = nbytes / (run.tpot_p50_ms / 1e3)
        evidence["achieved_bandwidth_gb_s"] = achieved / 1e9
        evidence["bandwidth_utilization"] = achieved / d.roofline.hardware.bandwidth_bytes_s
    evidence["step_ms_decode_only"] = run.step_time_ms("decode_only")
    evidence["step_ms_mixed"] = run.step_time_ms("mixed")
    return evidence


def _prefill_stall_finding(
    d: Diagnosis, tail: float, decode_step: float, mixed_step: float, evidence: dict[str, Any]
) -> Finding:
    """The ITL tail is decodes stalled behind a prefill chunk in their step: halving the chunk halves
    the extra time of such a step."""
    chunk = d.settings.max_num_batched_tokens
    what_ifs = []
    if chunk is not None:
        predicted = decode_step + (mixed_step - decode_step) / 2
        what_ifs.append(
            WhatIf(
                f"halve the prefill chunk (max_num_batched_tokens {chunk} -> {chunk // 2})",
                f"a stalled step ~{mixed_step:,.1f} -> ~{predicted:,.1f} ms (ITL p99 falls toward it), "
                "at the price of more prefill steps (TTFT)",
                {"itl_p99_ms": predicted},
                {"max_num_batched_tokens": chunk // 2} if d.settings.server == "kvflow" else None,
            )
        )
    return ITL.answer(
        "warning",
        f"ITL p99 is {tail:.1f}x p50: steps carrying a prefill chunk take {mixed_step:,.1f} ms against "
        f"{decode_step:,.1f} ms for decode-only steps",
        "prefill chunks share steps with decodes and stall them",
        evidence,
        what_ifs,
    )


def check_kv_memory(d: Diagnosis) -> Finding:
    run, m = d.run, d.model
    kv_dtype = d.roofline.kv_dtype
    pool = d.kv_pool_bytes()
    length = max(1, round(run.request_len_p95))
    limit = d.roofline.max_concurrency(pool, length)
    evidence: dict[str, Any] = {
        "kv_bytes_per_token": m.kv_bytes_per_token(kv_dtype),
        "kv_pool_bytes": pool,
        "kv_pool_tokens": d.settings.kv_pool_tokens,
        "request_len_p95": length,
        "max_concurrency_at_p95": limit,
        "observed_concurrency": run.concurrency,
        "preemptions": run.preemptions,
        "sliding_window": m.arch.sliding_window,
    }
    what_ifs = _kv_what_ifs(d, limit, length)
    preempted = (run.preemptions or 0) > 0
    if preempted or limit < run.concurrency:
        why = f"{run.preemptions:,.0f} preemptions" if preempted else "the pool holds fewer requests than run"
        return KV_MEMORY.answer(
            "warning",
            f"{why}: the pool fits {limit:,.1f} requests of p95 length ({length:,} tokens) at "
            f"concurrency {run.concurrency:,.0f}",
            "KV blocks run out, so requests are preempted and recomputed (or queue)", evidence, what_ifs,
        )  # fmt: skip
    return KV_MEMORY.answer(
        "ok",
        f"{m.kv_bytes_per_token(kv_dtype):,.0f} bytes/token; the pool fits {limit:,.1f} requests of p95 "
        f"length, above the {run.concurrency:,.0f} in flight",
        "KV memory is not the limit for this load", evidence, what_ifs,
    )  # fmt: skip


def _kv_what_ifs(d: Diagnosis, limit: float, length: int) -> list[WhatIf]:
    """Smaller KV dtypes fit proportionally more requests; a sliding window caps long contexts."""
    m, kv_dtype = d.model, d.roofline.kv_dtype
    what_ifs = []
    for dtype in KV_DTYPES:
        ratio = m.kv_bytes_per_token(kv_dtype) / m.kv_bytes_per_token(dtype)
        if ratio > 1:
            what_ifs.append(
                WhatIf(
                    f"{dtype} KV cache",
                    f"{ratio:.1f}x concurrent requests at p95 length ({limit:,.1f} -> {limit * ratio:,.1f})",
                    {"max_concurrency_at_p95": limit * ratio},
                )
            )
    window = SLIDING_WINDOW_WHAT_IF
    if m.arch.sliding_window is None and length > window:
        what_ifs.append(
            WhatIf(
                f"a {window}-token sliding window (a model trained with one)",
                f"KV per request capped at {window} tokens: {length / window:.1f}x concurrency",
                {"max_concurrency_at_p95": limit * length / window},
            )
        )
    return what_ifs


def check_quantization(d: Diagnosis) -> Finding:
    m, run = d.model, d.run
    now = d.roofline.weight_dtype
    now_ms = d.roofline_decode_ms()
    evidence: dict[str, Any] = {
        "weight_dtype": now,
        "weight_bytes": m.weight_bytes(now),
        "bytes_per_param": m.weight_bytes(now) / m.num_params,
        "quality_cost": "unknown here: measure it with `kvflow quant-eval MODEL_DIR --quantization "
        "int8|int4` (KL divergence, top-1 agreement, perplexity on your text)",
    }
    what_ifs = []
    for dtype in WEIGHT_DTYPES:
        if m.weight_bytes(dtype) >= m.weight_bytes(now):
            continue
        new_ms = d.roofline_decode_ms(weight_dtype=dtype)
        base = run.tpot_p50_ms if run.tpot_p50_ms else now_ms
        predicted = base * new_ms / now_ms
        what_ifs.append(
            WhatIf(
                f"{dtype} weights",
                f"decode {base:,.2f} -> {predicted:,.2f} ms/step (bytes per step x{new_ms / now_ms:.2f}); "
                f"weights {m.weight_bytes(now) / 1e9:,.2f} -> {m.weight_bytes(dtype) / 1e9:,.2f} GB; "
                "quality cost unknown",
                {"decode_ms_per_step": predicted, "weight_bytes": m.weight_bytes(dtype)},
            )
        )
    if not what_ifs:
        return QUANTIZATION.answer("ok", f"weights are already {now}", "no smaller format", evidence)
    return QUANTIZATION.answer(
        "info",
        f"weights in {now} ({evidence['bytes_per_param']:.2f} bytes/param): {what_ifs[-1].effect}",
        "decode reads every weight each step: fewer bytes per weight, proportionally faster steps",
        evidence, what_ifs,
    )  # fmt: skip


def check_serving_features(d: Diagnosis) -> Finding:
    s = d.settings
    evidence: dict[str, Any] = {
        "server": s.server,
        "continuous_batching": s.continuous_batching,
        "chunked_prefill": None if s.max_num_batched_tokens is None else True,
        "max_num_batched_tokens": s.max_num_batched_tokens,
        "prefix_caching": s.enable_prefix_caching,
        "speculative_decoding": s.speculative_decoding,
    }
    what_ifs = []
    off = []
    if s.enable_prefix_caching is False:
        off.append("prefix caching")
        cache = d.prefix_caching_what_if()
        if cache is not None:
            what_ifs.append(cache)
        else:
            what_ifs.append(
                WhatIf("prefix caching on", "no repeated prefix was measured: little effect on this workload",
                       {}, {"enable_prefix_caching": True} if s.server == "kvflow" else None)
            )  # fmt: skip
    if s.speculative_decoding is False:
        off.append("speculative decoding")
        what_ifs.append(
            WhatIf(
                "speculative decoding",
                "not predicted: the gain is (1 - a^(k+1)) / (1 - a) tokens per step at acceptance a, which "
                "must be measured on this workload: kvflow serve --speculative-method ngram|draft reports "
                "it (kvflow:spec_decode_*) and --speculative-auto-disable turns it off where it costs time",
            )
        )
    if s.continuous_batching is False:
        off.append("continuous batching")
    severity: Severity = "info" if off else "ok"
    if s.enable_prefix_caching is False and (d.run.shared_prefix_share or 0.0) >= REPEAT_SHARE_WORTH_CACHING:
        severity = "warning"
    known = "; ".join(f"{k} {v}" for k, v in evidence.items() if v is not None and k != "server")
    summary = f"off: {', '.join(off)}" if off else "every feature that matters here is on"
    if s.server == "unknown":
        summary = "the server's settings are unknown (give --metrics-url or --engine-config)"
        severity = "info"
    return SERVING_FEATURES.answer(severity, summary, known or "no settings known", evidence, what_ifs)


CHECKS = (
    check_input_length,
    check_ttft,
    check_itl,
    check_kv_memory,
    check_quantization,
    check_serving_features,
)


def diagnose(d: Diagnosis) -> list[Finding]:
    """Every check's finding, in the troubleshooting order."""
    return [check(d) for check in CHECKS]
