"""Step 1: is the input too long? Prompt length judged by what it costs: its prefill's share of TTFT
and of the whole request, its share of the context window, its share of the KV pool; and the
prompt tokens repeated from earlier requests that the server computes again."""

from __future__ import annotations

from typing import Any

from kvflow.doctor.diagnosis import Diagnosis
from kvflow.doctor.evidence import RunEvidence
from kvflow.doctor.finding import INPUT_LENGTH, Cause, Finding
from kvflow.doctor.what_ifs import cut_prompt_what_if, prefix_caching_what_if

# A fifth of the prompt tokens repeated: caching them removes at least a fifth of prefill compute.
REPEAT_SHARE_WORTH_CACHING = 0.2
# The prompt's prefill is the larger part of both TTFT and the whole request: the input dominates.
PROMPT_DOMINANT_SHARE = 0.5
# Prompt + output this close to the context window: little room left, the longest requests fail.
CONTEXT_WINDOW_SHARE = 0.9
# One p95 prompt takes this much of the KV pool: the pool holds barely two.
KV_POOL_SHARE = 0.5
NON_ENGLISH_TOKEN_RATIO = 1.5  # tokens per character relative to English worth mentioning


def _costly_languages(run: RunEvidence) -> dict[str, float]:
    """Languages whose tokens per character are at least NON_ENGLISH_TOKEN_RATIO x English's."""
    english = run.languages.get("en", {}).get("tokens_per_char")
    if not english:
        return {}
    ratios = {lang: row["tokens_per_char"] / english for lang, row in run.languages.items()}
    return {lang: ratio for lang, ratio in ratios.items() if ratio >= NON_ENGLISH_TOKEN_RATIO}


def _costs(d: Diagnosis) -> dict[str, Any]:
    """What the prompt costs: its prefill (ms, share of TTFT and of E2E), window and pool shares."""
    run = d.run
    slope, source = d.prefill_slope
    prefill = slope * d.uncached_prompt_tokens() if slope is not None else None
    window = d.max_model_len
    pool = d.settings.kv_pool_tokens
    return {
        "prompt_prefill_ms": prefill,
        "prefill_ms_per_token": slope,
        "prefill_ms_per_token_source": source,
        "prompt_share_of_ttft": prefill / run.ttft_p50_ms
        if prefill is not None and run.ttft_p50_ms
        else None,
        "prompt_share_of_e2e": prefill / run.e2e_p50_ms if prefill is not None and run.e2e_p50_ms else None,
        "context_window": window,
        "context_share": (run.prompt_p95 + run.output_p95) / window,
        "kv_pool_share_per_prompt": run.prompt_p95 / pool if pool else None,
    }


def _long_input_causes(d: Diagnosis, costs: dict[str, Any]) -> list[Cause]:
    run, causes = d.run, []
    prefill = costs["prompt_prefill_ms"] or 0.0
    ttft_share, e2e_share = costs["prompt_share_of_ttft"] or 0.0, costs["prompt_share_of_e2e"] or 0.0
    if ttft_share >= PROMPT_DOMINANT_SHARE and e2e_share >= PROMPT_DOMINANT_SHARE:
        causes.append(
            Cause(
                "long_prompt",
                prefill,
                f"the prompt's prefill is {ttft_share:.0%} of TTFT and {e2e_share:.0%} of the "
                f"request ({prefill:,.1f} ms for {d.uncached_prompt_tokens():,.0f} tokens)",
                "input_len",
            )
        )
    if costs["context_share"] >= CONTEXT_WINDOW_SHARE:
        over = costs["context_share"] > 1.0
        causes.append(
            Cause(
                "context_window",
                prefill,
                f"prompt + output ({run.prompt_p95:,.0f} + {run.output_p95:,.0f} tokens at p95) "
                + ("exceed" if over else "fill " + f"{costs['context_share']:.0%} of")
                + f" the {costs['context_window']:,}-token context window",
                "input_len",
            )
        )
    if (costs["kv_pool_share_per_prompt"] or 0.0) >= KV_POOL_SHARE:
        causes.append(
            Cause(
                "prompt_vs_kv_pool",
                prefill,
                f"one p95 prompt takes {costs['kv_pool_share_per_prompt']:.0%} of the KV pool",
                "input_len",
            )
        )
    return causes


def check_input_length(d: Diagnosis) -> Finding:
    run = d.run
    costs = _costs(d)
    evidence: dict[str, Any] = {
        "prompt_tokens_p50": run.prompt_p50,
        "prompt_tokens_p95": run.prompt_p95,
        "output_tokens_p50": run.output_p50,
        "repeated_prefix_share": run.shared_prefix_share,
        "repeated_prefix_tokens_p50": run.shared_prefix_p50,
        **costs,
    }
    costly = _costly_languages(run)
    if costly:
        evidence["tokens_per_char_vs_english"] = costly
    what_ifs = [w for w in (prefix_caching_what_if(d), cut_prompt_what_if(d)) if w is not None]
    causes = []
    share = run.shared_prefix_share or 0.0
    if share >= REPEAT_SHARE_WORTH_CACHING and not d.prefix_cache_effective():
        slope = d.measured_prefill_ms_per_token() or 0.0
        causes.append(
            Cause(
                "uncached_prefix",
                slope * d.cacheable_tokens(),
                f"{share:.0%} of prompt tokens repeat an earlier request's prefix and are computed again",
                "enable_prefix_caching",
            )
        )
    causes += _long_input_causes(d, costs)
    if causes:
        causes.sort(key=lambda c: -c.explained_ms)
        why = {
            "uncached_prefix": "a shared system prompt or context is re-prefilled for every request",
            "long_prompt": "the prompt's prefill is most of the latency: fewer input tokens, less time",
            "context_window": "the requests do not fit the model's context"
            if costs["context_share"] > 1.0
            else "the requests barely fit the model's context",
            "prompt_vs_kv_pool": "long prompts hold most of the KV pool",
        }[causes[0].id]
        summary = "; ".join(c.summary for c in causes)
        return INPUT_LENGTH.answer("warning", summary, why, evidence, what_ifs, causes)
    summary = f"prompts p50 {run.prompt_p50:,.0f} / p95 {run.prompt_p95:,.0f} tokens"
    if costs["prompt_share_of_ttft"] is not None:
        summary += f", their prefill {costs['prompt_share_of_ttft']:.0%} of TTFT"
    if costly:
        langs = ", ".join(f"{k} {v:.1f}x" for k, v in sorted(costly.items(), key=lambda kv: -kv[1]))
        return INPUT_LENGTH.answer(
            "info",
            summary + f"; non-English text costs more tokens: {langs}",
            "the tokenizer spends more tokens per character on these scripts (longer prefill, more KV)",
            evidence,
            what_ifs,
        )
    cause = "input lengths are not what dominates latency here" if d.measured else "the planned input fits"
    return INPUT_LENGTH.answer("ok", summary, cause, evidence, what_ifs)
