"""Step 3: is ITL high? The long gaps between tokens, attributed to what the step was doing when they
happened, and the decode step against the roofline.

Attribution: the client's long gaps (beyond ITL_TAIL_RATIO x the median) add up to a stall per
request; the simulator calibrated on the run's step times by kind and preemption count says which
share of such stalls comes from a request's own preemption (its wait and recompute), from other
requests' prompt chunks sharing its step, and from their recomputes. Each cause is ranked by the
time it explains, and each names its setting (num_kv_blocks, max_num_batched_tokens).
"""

from __future__ import annotations

from typing import Any

from kvflow.doctor.diagnosis import Diagnosis
from kvflow.doctor.disaggregation import disaggregate_what_if
from kvflow.doctor.finding import ITL, Cause, Finding
from kvflow.doctor.what_ifs import budget_what_ifs, kv_blocks_what_if, moe_batch_what_if

ITL_TAIL_RATIO = 3.0  # a gap this many times the median is a stall, not noise
# The stalls matter when they add this share to a request's decode time (E2E - TTFT).
STALL_SHARE_OF_DECODE = 0.1
MIN_CAUSE_SHARE = 0.2  # a cause named for at least this share of the stall time
# Neither bandwidth nor compute this close to its peak: per-step overhead is what decode waits for.
OVERHEAD_BOUND_UTILIZATION = 0.3
CHUNK_FACTORS = (0.25, 0.5, 2.0)  # the token budgets the prefill-chunk what-ifs try


def stall_per_request_ms(d: Diagnosis) -> float:
    """Time beyond the median gap in the client's long gaps, per request."""
    run = d.run
    if not run.itl_gaps_ms or not run.itl_p50_ms or not run.num_requests:
        return 0.0
    threshold = ITL_TAIL_RATIO * run.itl_p50_ms
    excess = sum(g - run.itl_p50_ms for g in run.itl_gaps_ms if g > threshold)
    return excess / run.num_requests


def stall_shares(d: Diagnosis) -> dict[str, float] | None:
    """Share of the stall time by cause (preemption, prefill_chunks): from the simulator when
    calibrated, else from the step times by kind and the counters; None when the server says nothing."""
    cal = d.calibration
    if cal is not None:
        explained = cal.baseline.explained_ms
        total = sum(explained.values())
        if total <= 0:
            return {}
        preempt = explained["preemption"] + explained["recompute"]
        return {"preemption": preempt / total, "prefill_chunks": explained["prefill_chunks"] / total}
    run = d.run
    decode, mixed = run.step_time_ms("decode_only"), run.step_time_ms("mixed")
    if decode is None or mixed is None:
        return None
    prompt = (run.counter("prompt_tokens") or 0.0) - (run.counter("prefix_cache_hits") or 0.0)
    computed = d.prefill_tokens_computed() or prompt
    recompute = max(computed - prompt, 0.0) / computed if computed else 0.0
    if run.preemptions == 0:  # the server counts preemptions and saw none: the excess is window edges
        recompute = 0.0
    return {"preemption": recompute, "prefill_chunks": 1.0 - recompute}


def _stall_causes(d: Diagnosis, stall: float, shares: dict[str, float]) -> list[Cause]:
    run, s = d.run, d.settings
    causes = []
    if shares.get("preemption", 0.0) >= MIN_CAUSE_SHARE:
        ms = stall * shares["preemption"]
        causes.append(
            Cause(
                "preemption",
                ms,
                f"{run.preemptions or 0:,.0f} preemptions: their waits and recomputes are "
                f"{shares['preemption']:.0%} of the long gaps ({ms:,.1f} ms per request)",
                "num_kv_blocks",
            )
        )
    if shares.get("prefill_chunks", 0.0) >= MIN_CAUSE_SHARE:
        ms = stall * shares["prefill_chunks"]
        causes.append(
            Cause(
                "prefill_chunks",
                ms,
                f"prompt chunks sharing steps with decodes are {shares['prefill_chunks']:.0%} of the "
                f"long gaps ({ms:,.1f} ms per request; a step with a chunk takes "
                f"{run.step_time_ms('mixed') or 0:,.1f} ms against "
                f"{run.step_time_ms('decode_only') or 0:,.1f} for decodes alone; chunk "
                f"max_num_batched_tokens={s.max_num_batched_tokens})",
                "max_num_batched_tokens",
            )
        )
    return sorted(causes, key=lambda c: -c.explained_ms)


def check_itl(d: Diagnosis) -> Finding:
    run = d.run
    evidence = _decode_evidence(d)
    tail = (run.itl_p99_ms / run.itl_p50_ms) if run.itl_p50_ms and run.itl_p99_ms else None
    stall = stall_per_request_ms(d)
    decode_time = (run.e2e_p50_ms or 0.0) - (run.ttft_p50_ms or 0.0)
    evidence.update({"itl_p99_over_p50": tail, "stall_ms_per_request": stall})
    shares = stall_shares(d)
    if shares is not None:
        evidence["stall_shares"] = shares
    if tail and tail >= ITL_TAIL_RATIO and decode_time > 0 and stall >= STALL_SHARE_OF_DECODE * decode_time:
        causes = _stall_causes(d, stall, shares or {})
        if causes:
            what_ifs = []
            for cause in causes:
                if cause.id == "preemption":
                    what_ifs += [w for w in (kv_blocks_what_if(d),) if w is not None]
                else:
                    what_ifs += budget_what_ifs(d, CHUNK_FACTORS)
                    what_ifs += [w for w in (disaggregate_what_if(d),) if w is not None]
            why = {
                "preemption": "KV blocks run out: requests are preempted, wait, and recompute",
                "prefill_chunks": "prefill chunks share steps with decodes and stall them",
            }[causes[0].id]
            summary = f"ITL p99 is {tail:.1f}x p50: " + "; ".join(c.summary for c in causes)
            return ITL.answer("warning", summary, why, evidence, what_ifs, causes)
    return _decode_finding(d, evidence, tail)


def _decode_ms(d: Diagnosis) -> float | None:
    """The measured decode step: the server's own (kvflow decode-only steps, llama-server's time per
    token per slot), else the client's TPOT."""
    server = d.run.server.get("decode_step_ms")
    return float(server) if server else d.run.tpot_p50_ms


def _decode_evidence(d: Diagnosis) -> dict[str, Any]:
    run, roof = d.run, d.roofline
    batch, context = d.runnable_batch, round(run.decode_context)
    phase = roof.decode_step(batch, context)
    evidence: dict[str, Any] = {
        "decode_batch": batch,
        "decode_context": run.decode_context,
        "decode_ms_per_step_measured": _decode_ms(d),
        "decode_ms_per_step_roofline": 1e3 * phase.seconds,
        "decode_roofline_bound": phase.bound,
        "itl_p50_ms": run.itl_p50_ms,
        "itl_p99_ms": run.itl_p99_ms,
        "step_ms_decode_only": run.step_time_ms("decode_only"),
        "step_ms_mixed": run.step_time_ms("mixed"),
    }
    if d.model.moe_layer is not None:  # a MoE step reads the experts its batch touches, not all
        evidence["moe_experts_read_per_layer"] = d.model.experts_read_per_layer(batch)
        evidence["moe_num_experts"] = d.model.moe_layer.num_experts
    measured = _decode_ms(d)
    if measured:
        seconds = measured / 1e3
        bandwidth = roof.decode_bytes(batch, context) / seconds / roof.hardware.bandwidth_bytes_s
        compute = roof.decode_flops(batch, context) / seconds / roof.flops_per_s
        evidence["achieved_bandwidth_gb_s"] = roof.decode_bytes(batch, context) / seconds / 1e9
        evidence["bandwidth_utilization"] = bandwidth
        evidence["compute_utilization"] = compute
        evidence["decode_measured_bound"] = _measured_bound(bandwidth, compute, roof.hardware.uncertainty)
    return evidence


def _measured_bound(bandwidth: float, compute: float, uncertainty: float) -> str:
    """Which peak the measured step is closer to; "either" within the hardware figures' spread,
    "overhead" when it is far from both."""
    if max(bandwidth, compute) < OVERHEAD_BOUND_UTILIZATION:
        return "overhead"
    lo, hi = sorted((bandwidth, compute))
    if hi <= lo * (1.0 + 2.0 * uncertainty):
        return "either"
    return "memory" if bandwidth > compute else "compute"


def _decode_finding(d: Diagnosis, evidence: dict[str, Any], tail: float | None) -> Finding:
    roof_ms, batch = evidence["decode_ms_per_step_roofline"], evidence["decode_batch"]
    measured = evidence["decode_ms_per_step_measured"]
    moe = moe_batch_what_if(d.model, d.roofline.weight_dtype, batch)
    what_ifs = [moe] if moe is not None else []
    if measured is None:
        note = ""
        if not d.measured and d.decode_batch > batch:
            note = f" (the requested {d.decode_batch} do not fit in the KV pool: {batch} do)"
        return ITL.answer(
            "info",
            f"roofline decode step at batch {batch}{note}: {roof_ms:,.2f} ms "
            f"({evidence['decode_roofline_bound']}-bound)",
            "calculator mode: no measurement",
            evidence,
            what_ifs,
        )
    bound = evidence["decode_measured_bound"]
    stall = evidence.get("stall_ms_per_request") or 0.0
    unattributed = ""
    if tail and tail >= ITL_TAIL_RATIO and "stall_shares" not in evidence and stall > 0:
        unattributed = (
            f"; long gaps add {stall:,.1f} ms per request, not attributed: the server exports no "
            "step times by kind or preemption count"
        )
    why = {
        "memory": "decode is memory-bound: every step reads the weights and the KV cache",
        "compute": "decode is compute-bound at this batch: the matmuls, not the bytes, set the step time",
        "either": "compute and memory time are within the hardware figures' spread of each other",
        "overhead": "neither bandwidth nor compute is near its peak: per-step overhead sets the step time",
    }[bound]
    return ITL.answer(
        "ok" if measured < 3 * roof_ms else "info",
        f"decode {measured:,.2f} ms/step at batch {batch} against {roof_ms:,.2f} ms roofline "
        f"({evidence['bandwidth_utilization']:.0%} of peak bandwidth, "
        f"{evidence['compute_utilization']:.0%} of peak FLOP/s); ITL p99/p50 {tail or 0:.1f}{unattributed}",
        why,
        evidence,
        what_ifs,
    )
