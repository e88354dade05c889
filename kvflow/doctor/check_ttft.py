"""Step 2: is TTFT high? Queueing against prefill, and when requests queue, the setting they queue
behind: the running cap (max_num_seqs), a full KV pool, or a step token budget full of other
prompts' chunks, read from the gauges sampled during the run and the server's settings."""

from __future__ import annotations

import math
from typing import Any

from kvflow.doctor.check_input import REPEAT_SHARE_WORTH_CACHING
from kvflow.doctor.diagnosis import Diagnosis
from kvflow.doctor.finding import TTFT, Cause, Finding, WhatIf
from kvflow.doctor.offload_tier import offload_tier_what_if
from kvflow.doctor.what_ifs import (
    budget_what_ifs,
    kv_blocks_what_if,
    max_num_seqs_what_if,
    prefix_caching_what_if,
)

QUEUE_DOMINANT_SHARE = 0.5  # queueing is the larger part of TTFT
# Structured output: a grammar wait of this share of TTFT is worth a finding (a cached grammar costs
# microseconds, so a large wait means schemas that keep changing, or very large ones).
GRAMMAR_COMPILE_SHARE = 0.1
KV_FULL = 0.9  # KV usage at which admission waits for blocks


def _ttft_evidence(d: Diagnosis) -> dict[str, Any]:
    run = d.run
    roof_slope = d.roofline_prefill_ms_per_token()
    slope, source = d.prefill_slope
    return {
        "ttft_p50_ms": run.ttft_p50_ms,
        "ttft_p95_ms": run.ttft_p95_ms,
        "queue_ms_mean": "not exported by the server"
        if d.measured and run.not_exported("queue_time")
        else run.queue_ms,
        "prefill_ms_mean": run.prefill_ms,
        "prefill_ms_per_token_measured": slope,
        "prefill_ms_per_token_source": source,
        "prefill_ms_per_token_roofline": roof_slope,
        "prefill_roofline_ratio": (slope / roof_slope) if slope is not None and roof_slope else None,
        "running_max": run.gauge("running"),
        "waiting_max": run.gauge("waiting"),
        "kv_usage_max": run.gauge("kv_usage"),
        "max_num_seqs": d.settings.max_num_seqs,
        "max_num_batched_tokens": d.settings.max_num_batched_tokens,
        "grammar_compile_ms_mean": run.grammar_compile_ms,
        "ttft_ms_by_priority": {
            str(p): {"p50": p50, "p99": p99} for p, (p50, p99) in run.ttft_by_priority.items()
        }
        or None,
    }


def _priority_note(d: Diagnosis) -> str:
    """How the queue falls on the priority classes (kvflow bench --priority-mix), or ""."""
    classes = d.run.ttft_by_priority
    if len(classes) < 2:
        return ""
    parts = ", ".join(
        f"priority {p}: p50 {p50:,.1f} ms" for p, (p50, _) in classes.items() if p50 is not None
    )
    first, last = classes[min(classes)][0], classes[max(classes)][0]
    if first and last and last >= 2 * first:
        return f"; by priority class, {parts}: the later-served class waits {last / first:.1f}x as long"
    return f"; by priority class, {parts}"


def _binding_limit(d: Diagnosis) -> str:
    """What waiting requests wait for: max_num_seqs, kv_pool, token_budget, or capacity (none of
    these: the server is simply busy)."""
    run, s = d.run, d.settings
    running, kv = run.gauge("running"), run.gauge("kv_usage")
    if s.max_num_seqs is not None and (
        (running is not None and running >= s.max_num_seqs)
        or (running is None and run.concurrency > s.max_num_seqs)
    ):
        return "max_num_seqs"
    if (kv is not None and kv >= KV_FULL) or (run.preemptions or 0) > 0:
        return "kv_pool"
    if s.max_num_batched_tokens is not None and run.prompt_p95 + run.concurrency > s.max_num_batched_tokens:
        return "token_budget"
    return "capacity"


def _queueing_finding(
    d: Diagnosis, queue: float, evidence: dict[str, Any], what_ifs: list[WhatIf]
) -> Finding:
    run, s = d.run, d.settings
    ttft = run.ttft_p50_ms or queue
    limit = _binding_limit(d)
    share = f"queueing is {queue / ttft:.0%} of TTFT ({queue:,.1f} of {ttft:,.1f} ms){_priority_note(d)}"
    if limit == "max_num_seqs":
        fix = max_num_seqs_what_if(d)
        cause = Cause(
            "max_num_seqs",
            queue,
            f"{share}: requests wait for one of max_num_seqs={s.max_num_seqs} running slots "
            f"({run.concurrency:,.0f} clients; running max {run.gauge('running') or s.max_num_seqs:,.0f})",
            "max_num_seqs",
        )
    elif limit == "kv_pool":
        fix = kv_blocks_what_if(d)
        cause = Cause(
            "kv_pool_full",
            queue,
            f"{share}: requests wait for KV blocks (usage max {run.gauge('kv_usage') or 0:.0%}, "
            f"{run.preemptions or 0:,.0f} preemptions)",
            "num_kv_blocks",
        )
    elif limit == "token_budget":
        fixes = [w for w in what_ifs if w.setting and "max_num_batched_tokens" in w.setting]
        fix = None if fixes else next(iter(budget_what_ifs(d, (2.0,))), None)
        cause = Cause(
            "token_budget",
            queue,
            f"{share}: new prompts wait while the step budget (max_num_batched_tokens="
            f"{s.max_num_batched_tokens}) is full of other prompts' chunks",
            "max_num_batched_tokens",
        )
    else:
        fix = WhatIf(
            "fewer concurrent requests (lower concurrency, or more capacity behind a load balancer)",
            f"p50 TTFT {ttft:,.1f} -> about {max(ttft - queue, 0.0):,.1f} ms without the queueing",
            {"ttft_p50_ms": max(ttft - queue, 0.0)},
            method="TTFT minus the measured queue time",
        )
        cause = Cause("capacity", queue, f"{share}: the server is busy, no setting caps it", None)
    return TTFT.answer(
        "warning",
        cause.summary,
        f"requests queue behind {cause.setting or 'a busy server'}",
        evidence,
        [w for w in (fix, *what_ifs) if w is not None],
        [cause],
    )


def check_ttft(d: Diagnosis) -> Finding:
    run = d.run
    evidence = _ttft_evidence(d)
    cache = prefix_caching_what_if(d)
    what_ifs = [w for w in (cache, offload_tier_what_if(d)) if w is not None]
    if run.prompt_p95 > (d.settings.max_num_batched_tokens or math.inf):  # prompts take several chunks
        what_ifs += budget_what_ifs(d, (2.0,))
    grammar = run.grammar_compile_ms
    if grammar and run.ttft_p50_ms and grammar >= GRAMMAR_COMPILE_SHARE * run.ttft_p50_ms:
        return _grammar_finding(d, grammar, evidence, what_ifs)
    queue = run.queue_ms
    # Waiting for the step in progress to end is queue time too, but no queue: long steps cause it.
    in_progress = d.step_in_progress_ms()
    evidence["queue_ms_step_in_progress"] = in_progress if queue is not None else None
    if (
        queue is not None
        and run.ttft_p50_ms
        and queue - in_progress >= QUEUE_DOMINANT_SHARE * run.ttft_p50_ms
    ):
        return _queueing_finding(d, queue, evidence, what_ifs)
    if cache is not None and (run.shared_prefix_share or 0.0) >= REPEAT_SHARE_WORTH_CACHING:
        saved = (run.ttft_p50_ms or 0.0) - cache.predicted.get("ttft_p50_ms", run.ttft_p50_ms or 0.0)
        cause = Cause(
            "uncached_prefix",
            saved,
            f"prefill of repeated tokens dominates TTFT: {cache.effect}",
            "enable_prefix_caching",
        )
        return TTFT.answer(
            "warning",
            cause.summary,
            "prefix caching is off or not hitting, so the shared prefix is prefilled again",
            evidence,
            what_ifs,
            [cause],
        )
    if run.ttft_p50_ms is None:
        ttft = 1e3 * d.roofline.prefill(max(1, round(run.prompt_p50))).seconds
        summary = f"roofline prefill of a {run.prompt_p50:,.0f}-token prompt: {ttft:,.1f} ms"
        return TTFT.answer("info", summary, "calculator mode: no measurement", evidence, what_ifs)
    return _prefill_finding(d, evidence, what_ifs)


def _grammar_finding(
    d: Diagnosis, grammar: float, evidence: dict[str, Any], what_ifs: list[WhatIf]
) -> Finding:
    """Structured-output requests wait for their grammar to compile (kvflow/structured/): compiled
    grammars are cached by their text, so the wait is new or changing schemas (or very large ones)."""
    ttft = d.run.ttft_p50_ms or grammar
    cause = Cause(
        "grammar_compile",
        grammar,
        f"grammar compilation is {grammar / ttft:.0%} of TTFT ({grammar:,.1f} ms mean wait of "
        f"structured-output requests, p50 TTFT {ttft:,.1f} ms)",
        None,
    )
    fix = WhatIf(
        "reuse JSON schemas / tool sets across requests (compiled grammars are cached by their text) "
        "and keep them small",
        f"p50 TTFT {ttft:,.1f} -> about {max(ttft - grammar, 0.0):,.1f} ms with cached grammars",
        {"ttft_p50_ms": max(ttft - grammar, 0.0)},
        method="TTFT minus the measured grammar wait (a cached grammar costs microseconds)",
    )
    return TTFT.answer(
        "warning",
        cause.summary,
        "structured-output requests wait for their grammar to compile",
        evidence,
        [fix, *what_ifs],
        [cause],
    )


def _prefill_finding(d: Diagnosis, evidence: dict[str, Any], what_ifs: list[WhatIf]) -> Finding:
    run = d.run
    ratio = evidence["prefill_roofline_ratio"]
    note = f"; prefill runs at {ratio:.1f}x the roofline's ms/token" if ratio else ""
    if run.not_exported("queue_time"):
        waiting = run.gauge("waiting")
        queueing = "queueing unknown (the server exports no queue time"
        queueing += f"; requests waiting, sampled: max {waiting:,.0f})" if waiting is not None else ")"
    else:
        queueing = f"queueing {run.queue_ms or 0:,.1f} ms"
    return TTFT.answer(
        "ok" if not ratio or ratio < 10 else "info",
        f"TTFT p50 {run.ttft_p50_ms:,.1f} ms; {queueing}{note}",
        "TTFT is mostly the prefill work itself",
        evidence,
        what_ifs,
    )
