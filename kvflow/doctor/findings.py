"""The six steps of the diagnosis, in the troubleshooting order; each returns one Finding with its
evidence, the cause, and what-ifs with predicted effects (docs/doctor.md has every formula).

Severity: `ok` (fine, and why), `info` (headroom worth knowing), `warning` (a cause of latency
with an actionable fix). Distance from the roofline alone is `info`: small models on CPUs are
dominated by per-step overhead, and that is not something a setting fixes.
"""

from __future__ import annotations

import math
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


@dataclass
class WhatIf:
    change: str
    effect: str  # the prediction as a sentence with numbers
    predicted: dict[str, float] = field(default_factory=dict)
    setting: dict[str, Any] | None = None  # a kvflow serve engine argument `--verify` can apply


@dataclass
class Finding:
    step: int
    title: str
    severity: Severity
    summary: str
    cause: str
    evidence: dict[str, Any] = field(default_factory=dict)
    what_ifs: list[WhatIf] = field(default_factory=list)


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
        steps = self.run.server.get("step_time_ms") or {}
        decode_step = (steps.get("decode_only") or {}).get("mean")
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
        decode_step = (steps.get("decode_only") or {}).get("mean")
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


# ---------------------------------------------------------------------------------- the steps


def step_input(d: Diagnosis) -> Finding:
    run = d.run
    evidence: dict[str, Any] = {
        "prompt_tokens_p50": run.prompt_p50,
        "prompt_tokens_p95": run.prompt_p95,
        "output_tokens_p50": run.output_p50,
        "repeated_prefix_share": run.shared_prefix_share,
        "repeated_prefix_tokens_p50": run.shared_prefix_p50,
    }
    what_ifs = []
    cache = d.prefix_caching_what_if()
    if cache is not None:
        what_ifs.append(cache)
    slope = d.measured_prefill_ms_per_token() or d.roofline_prefill_ms_per_token()
    cut = round(run.prompt_p50 / 4)
    if cut > 0 and run.ttft_p50_ms is not None:
        predicted = max(run.ttft_p50_ms - slope * cut, 0.0)
        what_ifs.append(
            WhatIf(
                f"cut {cut:,} tokens (a quarter) from the median prompt",
                f"p50 TTFT {run.ttft_p50_ms:,.1f} ms -> {predicted:,.1f} ms, and {cut:,} fewer KV tokens "
                "per request",
                {"ttft_p50_ms": predicted},
            )
        )
    english = run.languages.get("en", {}).get("tokens_per_char")
    costly = {
        lang: row["tokens_per_char"] / english
        for lang, row in run.languages.items()
        if english and row["tokens_per_char"] / english >= NON_ENGLISH_TOKEN_RATIO
    }
    if costly:
        evidence["tokens_per_char_vs_english"] = costly
    share = run.shared_prefix_share or 0.0
    if share >= REPEAT_SHARE_WORTH_CACHING and not d.prefix_cache_effective():
        return Finding(
            1,
            "Is the input too long?",
            "warning",
            f"{share:.0%} of prompt tokens repeat an earlier request's prefix and are computed again",
            "a shared system prompt or context is re-prefilled for every request",
            evidence,
            what_ifs,
        )
    summary = f"prompts p50 {run.prompt_p50:,.0f} / p95 {run.prompt_p95:,.0f} tokens"
    if costly:
        langs = ", ".join(f"{k} {v:.1f}x" for k, v in sorted(costly.items(), key=lambda kv: -kv[1]))
        return Finding(
            1, "Is the input too long?", "info", summary + f"; non-English text costs more tokens: {langs}",
            "the tokenizer spends more tokens per character on these scripts (longer prefill, more KV)",
            evidence, what_ifs,
        )  # fmt: skip
    return Finding(
        1, "Is the input too long?", "ok", summary + "; no large repeated prefix left uncached",
        "input lengths are what the workload needs", evidence, what_ifs,
    )  # fmt: skip


def step_ttft(d: Diagnosis) -> Finding:
    run = d.run
    roof_slope = d.roofline_prefill_ms_per_token()
    slope = d.measured_prefill_ms_per_token()
    evidence: dict[str, Any] = {
        "ttft_p50_ms": run.ttft_p50_ms,
        "ttft_p95_ms": run.ttft_p95_ms,
        "queue_ms_mean": run.queue_ms,
        "prefill_ms_mean": run.prefill_ms,
        "prefill_ms_per_token_measured": slope,
        "prefill_ms_per_token_roofline": roof_slope,
        "prefill_roofline_ratio": (slope / roof_slope) if slope is not None and roof_slope else None,
    }
    what_ifs = []
    cache = d.prefix_caching_what_if()
    if cache is not None:
        what_ifs.append(cache)
    chunk = d.settings.max_num_batched_tokens
    if chunk is not None and run.prompt_p95 > chunk and run.tpot_p50_ms is not None:
        steps_now = math.ceil(run.prompt_p95 / chunk)
        steps_new = math.ceil(run.prompt_p95 / (2 * chunk))
        saved = (steps_now - steps_new) * run.tpot_p50_ms  # each step's fixed cost
        what_ifs.append(
            WhatIf(
                f"double the prefill chunk (max_num_batched_tokens {chunk} -> {2 * chunk})",
                f"p95-length prompts take {steps_new} steps instead of {steps_now}: about {saved:,.1f} ms "
                "less TTFT, but decodes sharing a step with a chunk stall longer (see step 3)",
                {"ttft_p95_ms": max((run.ttft_p95_ms or 0.0) - saved, 0.0)},
                {"max_num_batched_tokens": 2 * chunk} if d.settings.server == "kvflow" else None,
            )
        )
    queue = run.queue_ms
    if queue is not None and run.ttft_p50_ms and queue >= QUEUE_DOMINANT_SHARE * run.ttft_p50_ms:
        predicted = run.ttft_p50_ms - queue
        what_ifs.append(
            WhatIf(
                "fewer concurrent prefills (lower concurrency, or more capacity behind the load balancer)",
                f"p50 TTFT {run.ttft_p50_ms:,.1f} ms -> about {predicted:,.1f} ms without the queueing",
                {"ttft_p50_ms": predicted},
            )
        )
        return Finding(
            2, "Is TTFT high?", "warning",
            f"queueing is {queue / run.ttft_p50_ms:.0%} of TTFT ({queue:,.1f} of {run.ttft_p50_ms:,.1f} ms)",
            "requests wait for a running slot or for the step token budget: the server is at capacity",
            evidence, what_ifs,
        )  # fmt: skip
    if cache is not None and (run.shared_prefix_share or 0.0) >= REPEAT_SHARE_WORTH_CACHING:
        return Finding(
            2, "Is TTFT high?", "warning", f"prefill of repeated tokens dominates TTFT: {cache.effect}",
            "prefix caching is off or not hitting, so the shared prefix is prefilled again",
            evidence, what_ifs,
        )  # fmt: skip
    if run.ttft_p50_ms is None:
        ttft = 1e3 * d.roofline.prefill(max(1, round(run.prompt_p50))).seconds
        summary = f"roofline prefill of a {run.prompt_p50:,.0f}-token prompt: {ttft:,.1f} ms"
        return Finding(
            2, "Is TTFT high?", "info", summary,
            "calculator mode: no measurement", evidence, what_ifs,
        )  # fmt: skip
    ratio = evidence["prefill_roofline_ratio"]
    note = f"; prefill runs at {ratio:.1f}x the roofline's ms/token" if ratio else ""
    return Finding(
        2, "Is TTFT high?", "ok" if not ratio or ratio < 10 else "info",
        f"TTFT p50 {run.ttft_p50_ms:,.1f} ms, mostly prefill, no queueing to speak of{note}",
        "TTFT is the prefill work itself", evidence, what_ifs,
    )  # fmt: skip


def step_itl(d: Diagnosis) -> Finding:
    run = d.run
    roof_ms = d.roofline_decode_ms()
    nbytes = d.roofline.decode_bytes(d.decode_batch, round(run.decode_context))
    evidence: dict[str, Any] = {
        "decode_batch": d.decode_batch,
        "decode_context": run.decode_context,
        "decode_ms_per_step_measured": run.tpot_p50_ms,
        "decode_ms_per_step_roofline": roof_ms,
        "itl_p50_ms": run.itl_p50_ms,
        "itl_p99_ms": run.itl_p99_ms,
    }
    if run.tpot_p50_ms:
        achieved = nbytes / (run.tpot_p50_ms / 1e3)
        evidence["achieved_bandwidth_gb_s"] = achieved / 1e9
        evidence["bandwidth_utilization"] = achieved / d.roofline.hardware.bandwidth_bytes_s
    steps = run.server.get("step_time_ms") or {}
    decode_step = (steps.get("decode_only") or {}).get("mean")
    mixed_step = (steps.get("mixed") or {}).get("mean")
    evidence["step_ms_decode_only"], evidence["step_ms_mixed"] = decode_step, mixed_step
    tail = (run.itl_p99_ms / run.itl_p50_ms) if run.itl_p50_ms and run.itl_p99_ms else None
    chunk = d.settings.max_num_batched_tokens
    if (
        tail
        and tail >= ITL_TAIL_RATIO
        and decode_step
        and mixed_step
        and mixed_step >= STALL_RATIO * decode_step
    ):
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
        return Finding(
            3, "Is ITL high?", "warning",
            f"ITL p99 is {tail:.1f}x p50: steps carrying a prefill chunk take {mixed_step:,.1f} ms against "
            f"{decode_step:,.1f} ms for decode-only steps",
            "prefill chunks share steps with decodes and stall them", evidence, what_ifs,
        )  # fmt: skip
    if run.tpot_p50_ms is None:
        return Finding(
            3, "Is ITL high?", "info", f"roofline decode step at batch {d.decode_batch}: {roof_ms:,.2f} ms",
            "calculator mode: no measurement", evidence,
        )  # fmt: skip
    ratio = run.tpot_p50_ms / roof_ms if roof_ms else None
    util = evidence.get("bandwidth_utilization") or 0.0
    return Finding(
        3, "Is ITL high?", "ok" if ratio is None or ratio < 3 else "info",
        f"decode {run.tpot_p50_ms:,.2f} ms/step at batch {d.decode_batch} against {roof_ms:,.2f} ms roofline "
        f"({util:.0%} of peak bandwidth); ITL p99/p50 {tail or 0:.1f}",
        "decode is memory-bound: every step reads the weights and the KV cache", evidence,
    )  # fmt: skip


def step_kv(d: Diagnosis) -> Finding:
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
    if m.arch.sliding_window is None and length > 4096:
        window = 4096
        what_ifs.append(
            WhatIf(
                f"a {window}-token sliding window (a model trained with one)",
                f"KV per request capped at {window} tokens: {length / window:.1f}x concurrency",
                {"max_concurrency_at_p95": limit * length / window},
            )
        )
    preempted = (run.preemptions or 0) > 0
    if preempted or limit < run.concurrency:
        why = f"{run.preemptions:,.0f} preemptions" if preempted else "the pool holds fewer requests than run"
        return Finding(
            4, "Does the KV cache take too much memory?", "warning",
            f"{why}: the pool fits {limit:,.1f} requests of p95 length ({length:,} tokens) at "
            f"concurrency {run.concurrency:,.0f}",
            "KV blocks run out, so requests are preempted and recomputed (or queue)", evidence, what_ifs,
        )  # fmt: skip
    return Finding(
        4, "Does the KV cache take too much memory?", "ok",
        f"{m.kv_bytes_per_token(kv_dtype):,.0f} bytes/token; the pool fits {limit:,.1f} requests of p95 "
        f"length, above the {run.concurrency:,.0f} in flight",
        "KV memory is not the limit for this load", evidence, what_ifs,
    )  # fmt: skip


def step_quantization(d: Diagnosis) -> Finding:
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
        return Finding(
            5, "Is there quantization headroom?", "ok", f"weights are already {now}", "no smaller format",
            evidence,
        )  # fmt: skip
    return Finding(
        5, "Is there quantization headroom?", "info",
        f"weights in {now} ({evidence['bytes_per_param']:.2f} bytes/param): {what_ifs[-1].effect}",
        "decode reads every weight each step: fewer bytes per weight, proportionally faster steps",
        evidence, what_ifs,
    )  # fmt: skip


def step_framework(d: Diagnosis) -> Finding:
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
    return Finding(
        6, "Is the serving framework doing its part?", severity, summary, known or "no settings known",
        evidence, what_ifs,
    )  # fmt: skip


STEPS = (step_input, step_ttft, step_itl, step_kv, step_quantization, step_framework)


def diagnose(d: Diagnosis) -> list[Finding]:
    return [step(d) for step in STEPS]
