"""The ITL check's disaggregation what-if: move prefill to its own instance (kv_role prefill / decode
behind vllm-router --vllm-pd-disaggregation, kvflow/kv_transfer/), so no prompt chunk shares a step
with decodes. Offered when prompt chunks explain the ITL tail; it says when colocated chunked
prefill stays better.

The prediction, for the same machine split in two instances (each half the cores):
    ITL p99   the run's ITL p50 (its decode steps) x DECODE_SPLIT_SLOWDOWN (a decode step on half
              the cores) x DECODE_ONLY_TAIL (p99 / p50 of gaps when no chunk ever joins a step)
    TTFT p50  a request's path through the pair, each part from the calibrated simulator
              (kvflow/doctor/calibrate.py) when the run is a kvflow server's:
                the prefill instance   the same requests replayed with one output token each, every
                                       step x PREFILL_SPLIT_SLOWDOWN, each client sending its next
                                       request after that request's decode (its outputs x the
                                       split ITL; clients fall out of step as on the pair): this
                                       instance's queueing and prefill, carried onto the measured
                                       TTFT as every simulated change is
                the KV transfer        the p50 prompt's KV at TRANSFER_BYTES_PER_S
                the decode instance    the prompt's last block recomputed there (one token is
                                       always computed, so a prompt's trailing tokens after its
                                       last full block, at least one), a step on half the cores
                the router             HOP_LEGS more HTTP legs, each what the run's client added
                                       to the server's TTFT
              otherwise the run's TTFT p50 x PREFILL_SPLIT_SLOWDOWN + the transfer.
Measured with benchmarks/pd_disaggregation.py and benchmarks/kv_transfer.py (2-core Xeon VM, Qwen2.5-0.5B
shape, 4 streams, 1536-token prompts every 6 s, colocated 2 threads against 1 + 1); on other
machines these ratios move with how prefill and decode scale with cores, which `--verify` measures
(kvflow/doctor/verify_pd.py: the pair on half the cores each, behind vllm-router).
On the planted run's 400-token prompts at one client (session 24): prefill instance 76 ms, decode
instance 16.5 ms (2.2 ms fetching the KV, the rest its 16-token last block), 118 ms at the client:
the other 26 ms are the router's hops on a machine whose two cores also run both servers.
"""

from __future__ import annotations

from dataclasses import replace

from kvflow.doctor.calibrate import Calibration
from kvflow.doctor.diagnosis import Diagnosis
from kvflow.doctor.finding import WhatIf
from kvflow.doctor.simulate import simulate
from kvflow.doctor.step_cost import StepShape
from kvflow.doctor.verify_pd import DISAGGREGATE

DECODE_SPLIT_SLOWDOWN = 1.21  # PD ITL p50 / colocated ITL p50 (82 / 68 ms, medians of 2 rounds)
DECODE_ONLY_TAIL = 1.54  # PD ITL p99 / p50 (126 / 82 ms)
PREFILL_SPLIT_SLOWDOWN = 1.43  # PD / colocated TTFT of the long prompts less the transfer (4025 / 2809 ms)
# A fetch between instances on one machine, through a shared-memory segment: 18 MiB in 6.8 ms
# (benchmarks/kv_transfer.py; over loopback TCP, as between machines, 21.3 ms in the same run).
TRANSFER_BYTES_PER_S = 2.78e9
# The router's extra HTTP legs: the prefill request's round trip, then relaying the decode stream.
HOP_LEGS = 2
METHOD = (
    "decode and prefill step ratios measured on a 2-core CPU split 1 + 1 (kvflow/doctor/disaggregation.py), "
    "applied to this run's ITL p50 and TTFT p50"
)
SIMULATED_METHOD = (
    "the prefill instance simulated (one output per request, steps x the measured half-cores ratio), "
    "plus the KV transfer, the decode instance's last block and the router's hops "
    "(kvflow/doctor/disaggregation.py)"
)


def pd_ttft_ms(d: Diagnosis, cal: Calibration, itl_pd_ms: float, transfer_ms: float) -> float | None:
    """The TTFT p50 through the pair (module docstring), None without a measured TTFT p50."""
    run = d.run
    if run.ttft_p50_ms is None:
        return None
    # The prefill instance: each request prefilled and its one token sampled on half the cores; its
    # client comes back after that request's own decode on the other instance (its outputs at the
    # split ITL: a common output length would keep the clients in step, each round a burst of
    # prompts queueing at the prefill instance, where varied lengths spread them out).
    samples = [replace(s, output_tokens=1) for s in cal.evidence.requests]
    decode_phase_ms = [max(s.output_tokens - 1, 0) * itl_pd_ms for s in cal.evidence.requests]
    hop_ms = HOP_LEGS * cal.client_gap_ms
    prefill = simulate(
        samples,
        cal.settings,
        replace(cal.cost, scale=PREFILL_SPLIT_SLOWDOWN),
        cal.concurrency,
        cal.client_gap_ms + hop_ms + transfer_ms,
        after_ms=decode_phase_ms,
        gap_jitter_ms=cal.evidence.client_gap_jitter_ms,
    )
    if not prefill.ttft_ms:
        return None
    # The decode instance: the tokens after the prompt's last full block (at least one) attend to the
    # prompt, in a step on half the cores.
    prompt = max(1, round(run.prompt_p50))
    block = cal.settings.block_size
    last = prompt - block * ((prompt - 1) // block)
    decode_side = cal.cost.step_ms(StepShape().plus_chunk(last, prompt)) * DECODE_SPLIT_SLOWDOWN
    return cal.predict("ttft_p50_ms", run.ttft_p50_ms, prefill) + transfer_ms + decode_side + hop_ms


def disaggregate_what_if(d: Diagnosis) -> WhatIf | None:
    run = d.run
    if run.itl_p50_ms is None or run.itl_p99_ms is None or run.ttft_p50_ms is None:
        return None
    itl_p50 = run.itl_p50_ms * DECODE_SPLIT_SLOWDOWN
    itl_p99 = itl_p50 * DECODE_ONLY_TAIL
    kv_bytes = run.prompt_p50 * d.model.kv_bytes_per_token(d.roofline.kv_dtype)
    transfer_ms = 1e3 * kv_bytes / TRANSFER_BYTES_PER_S
    cal = d.calibration
    simulated = pd_ttft_ms(d, cal, itl_p50, transfer_ms) if cal is not None else None
    ttft = simulated if simulated is not None else run.ttft_p50_ms * PREFILL_SPLIT_SLOWDOWN + transfer_ms
    effect = (
        f"ITL p99 {run.itl_p99_ms:,.1f} -> {itl_p99:,.1f} ms; "
        f"TTFT p50 {run.ttft_p50_ms:,.1f} -> {ttft:,.1f} ms "
        f"(+{transfer_ms:,.1f} ms moving {kv_bytes / 2**20:,.1f} MiB of KV)"
    )
    if itl_p99 >= run.itl_p99_ms:
        effect += (
            ": colocated chunked prefill is better here (the split costs the decodes more than the chunks do)"
        )
    change = (
        "disaggregate: a prefill and a decode instance (kv_role), half the cores each, behind vllm-router"
    )
    # kvflow servers with prefix caching (the transfer keys blocks by prefix hashes): --verify runs it.
    verifiable = d.settings.server == "kvflow" and d.settings.enable_prefix_caching is not False
    setting = {"kv_role": DISAGGREGATE} if verifiable else None
    method = SIMULATED_METHOD if simulated is not None else METHOD
    return WhatIf(change, effect, {"itl_p99_ms": itl_p99, "ttft_p50_ms": ttft}, setting, method=method)
