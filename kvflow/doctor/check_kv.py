"""Step 4: does the KV cache take too much memory? The pool (the server's, when it says; otherwise
an estimate, and said to be one), whole requests of p95 length it holds, preemptions, and in
calculator mode whether the requested concurrency fits the card at all. A request's KV is what
its blocks take in every cache group (kvflow/doctor/kv_kinds.py): for a model mixing kinds the
summary says how much of it is in the layers that grow with the request (kvflow/doctor/kv_by_kind.py)."""

from __future__ import annotations

import math
from typing import Any

from kvflow.doctor.diagnosis import Diagnosis
from kvflow.doctor.finding import KV_MEMORY, Cause, Finding, WhatIf
from kvflow.doctor.kv_by_kind import has_flat_kinds, split_phrase, state_note
from kvflow.doctor.what_ifs import kv_blocks_what_if

KV_DTYPES = ("fp8", "int8", "int4")
GB = 1e9


def _kv_dtype_what_ifs(d: Diagnosis, fits: int, length: int) -> list[WhatIf]:
    """Smaller KV dtypes hold proportionally more requests in the same bytes (a pool sized in
    bytes; a pool fixed in blocks holds the same tokens whatever their dtype): the ratio of what a
    request of p95 length holds in every cache group, so a linear-attention state, float32 whatever
    the KV dtype, does not shrink."""
    m, now = d.model, d.kv_bytes_per_request(length)
    what_ifs = []
    for dtype in KV_DTYPES:
        ratio = now / m.kv_bytes_per_request(length, dtype, d.block_size)
        if ratio > 1:
            more = math.floor(fits * ratio)
            what_ifs.append(
                WhatIf(
                    f"{dtype} KV cache",
                    f"{ratio:.1f}x the requests of p95 length in the same memory ({fits:,} -> {more:,})"
                    + state_note(d, dtype, length),
                    {"max_concurrency_at_p95": float(more)},
                    method="bytes per request, summed over the cache groups",
                )
            )
    return what_ifs


def check_kv_memory(d: Diagnosis) -> Finding:
    run, m = d.run, d.model
    kv_dtype = d.roofline.kv_dtype
    pool = d.kv_pool_bytes()
    length = max(1, round(run.request_len_p95))
    fits = d.max_concurrency()
    per_request = d.kv_bytes_per_request(length)
    pool_source = (
        "the server's"
        if d.kv_pool_known
        else "an estimate (the server does not say): "
        + (
            "90% of the card minus the weights"
            if "NVIDIA" in d.roofline.hardware.name or "AMD" in d.roofline.hardware.name
            else "half this machine's memory minus the weights"
        )
    )
    evidence: dict[str, Any] = {
        "kv_bytes_per_token": m.kv_bytes_per_token(kv_dtype),
        "kv_pool_bytes": pool,
        "kv_pool_tokens": d.settings.kv_pool_tokens,
        "kv_pool_source": pool_source,
        "request_len_p95": length,
        "kv_bytes_per_request": per_request,
        "kv_bytes_per_request_by_kind": d.kv_config.bytes_held_by_kind(length) if has_flat_kinds(d) else None,
        "max_concurrency_at_p95": fits,
        "observed_concurrency": run.concurrency,
        "preemptions": run.preemptions,
        "kv_usage_max": run.gauge("kv_usage"),
        "sliding_window": m.arch.sliding_window,
    }
    what_ifs = [w for w in (kv_blocks_what_if(d),) if w is not None] + _kv_dtype_what_ifs(d, fits, length)
    preempted = (run.preemptions or 0) > 0
    wanted = d.running_capacity  # what runs at once: the clients, capped by max_num_seqs
    if preempted or fits < wanted:
        return _short_pool(d, evidence, what_ifs, fits, per_request, pool)
    pool_note = "" if d.kv_pool_known else " (estimated pool)"
    split = split_phrase(d, length)
    held = split + "; " if split else f"{m.kv_bytes_per_token(kv_dtype):,.0f} bytes/token; "
    return KV_MEMORY.answer(
        "ok",
        f"{held}the pool{pool_note} holds {fits:,} requests of p95 length ({length:,} tokens), above "
        f"the {wanted:,} in flight",
        "KV memory is not the limit for this load",
        evidence,
        what_ifs,
    )


def _short_pool(
    d: Diagnosis, evidence: dict[str, Any], what_ifs: list[WhatIf], fits: int, per_request: float, pool: float
) -> Finding:
    run = d.run
    wanted = d.running_capacity
    length = evidence["request_len_p95"]
    if not d.measured:
        need = wanted * per_request
        card = d.roofline.hardware.memory_bytes
        split = split_phrase(d, length)
        summary = (
            f"KV for {wanted:,} requests of {length:,} tokens is {need / GB:,.1f} GB"
            + (f": {split}" if split else "")
            + f"; the pool has {pool / GB:,.1f} GB ({card / GB:,.0f} GB card minus "
            f"{d.model.weight_bytes(d.roofline.weight_dtype) / GB:,.1f} GB of weights): {fits:,} fit"
        )
        plan = d.deployment
        if plan.min_devices is not None and plan.min_devices > 1:
            # More devices, not a smaller KV dtype: 0 requests fit in any dtype on one device.
            best = plan.layouts[0]
            summary += f"; it needs {plan.min_devices} devices at least ({best.name}: see deployment)"
            if fits == 0:
                what_ifs = [w for w in what_ifs if "max_concurrency_at_p95" not in w.predicted]
        cause = Cause("kv_does_not_fit", 0.0, summary, "concurrency")
        return KV_MEMORY.answer(
            "warning",
            summary,
            "the requested concurrency does not fit in memory",
            evidence,
            what_ifs,
            [cause],
        )
    why = (
        f"{run.preemptions:,.0f} preemptions"
        if (run.preemptions or 0) > 0
        else "the pool holds fewer requests"
    )
    split = split_phrase(d, length)
    summary = (
        f"{why}: the pool holds {fits:,} requests of p95 length ({length:,} tokens) at concurrency {wanted:,}"
        + (f" ({split})" if split else "")
    )
    cause = Cause("kv_pool", 0.0, summary, "num_kv_blocks")  # its time is counted by steps 2 and 3
    return KV_MEMORY.answer(
        "warning",
        summary,
        "KV blocks run out, so requests are preempted and recomputed (or queue)",
        evidence,
        what_ifs,
        [cause],
    )
