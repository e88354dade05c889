"""The ITL check's disaggregation what-if: move prefill to its own instance (kv_role prefill / decode
behind vllm-router --vllm-pd-disaggregation, kvflow/kv_transfer/), so no prompt chunk shares a step
with decodes. Offered when prompt chunks explain the ITL tail; it says when colocated chunked
prefill stays better.

The prediction, for the same machine split in two instances (each half the cores):
    ITL p99   the run's ITL p50 (its decode steps) x DECODE_SPLIT_SLOWDOWN (a decode step on half
              the cores) x DECODE_ONLY_TAIL (p99 / p50 of gaps when no chunk ever joins a step)
    TTFT p50  a request's path through the pair, each part from the calibrated simulator
              (kvflow/doctor/calibrate.py) when the run is a kvflow server's:
                the prefill instance   the same requests replayed with one output token each, on
                                       half the cores (the step profile's curves measured there,
                                       kvflow/doctor/step_profile.py; without them every step x
                                       PREFILL_SPLIT_SLOWDOWN), each client sending its next
                                       request after that request's decode (its outputs x the
                                       split ITL; clients fall out of step as on the pair): this
                                       instance's queueing and prefill, carried onto the measured
                                       TTFT as every simulated change is
                the KV transfer        the p50 prompt's KV at TRANSFER_BYTES_PER_S
                the decode instance    the rest of the step in flight there (the other clients'
                                       decode rows, by the share of their round they spend
                                       decoding), then its own step: the prompt's last block
                                       recomputed (one token is always computed, so a prompt's
                                       trailing tokens after its last full block, at least one)
                                       beside those rows; on half the cores as above (without
                                       split curves, x DECODE_SPLIT_SLOWDOWN)
                the router             HOP_LEGS more HTTP legs, each what the run's client added
                                       to the server's TTFT
              otherwise the run's TTFT p50 x PREFILL_SPLIT_SLOWDOWN + the transfer.
Measured with benchmarks/pd_disaggregation.py and benchmarks/kv_transfer.py (2-core Xeon VM, Qwen2.5-0.5B
shape, 4 streams, 1536-token prompts every 6 s, colocated 2 threads against 1 + 1); on other
machines these ratios move with how prefill and decode scale with cores: the step profile measures
its curves on half the cores too (on a 2-core Zen 2 the planted tiny model prefilled 1.7-2.0x slower
on one core, not 1.43x), and `--verify` measures the pair (kvflow/doctor/verify_pd.py: half the
cores each, behind vllm-router).
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
        cal.cost.on_half_cores(PREFILL_SPLIT_SLOWDOWN),
        cal.concurrency,
        cal.client_gap_ms + hop_ms + transfer_ms,
        after_ms=decode_phase_ms,
        gap_jitter_ms=cal.evidence.client_gap_jitter_ms,
    )
    if not prefill.ttft_ms:
        return None
    # The decode instance: the requests in flight besides this one (closed-loop clients, or Little's
    # law's estimate), by the share of their time they spend decoding there (of a round: prefill,
    # decode and the client's gap), whose rows run its steps.
    round_ms = sum(decode_phase_ms) + sum(prefill.ttft_ms) + len(samples) * (cal.client_gap_ms + hop_ms)
    in_flight = max(cal.evidence.concurrency - 1.0, 0.0)
    others = round(in_flight * sum(decode_phase_ms) / round_ms) if round_ms > 0 else 0
    decode_side = decode_instance_ttft_ms(cal, max(1, round(run.prompt_p50)), others)
    return cal.predict("ttft_p50_ms", run.ttft_p50_ms, prefill) + transfer_ms + decode_side + hop_ms


def decode_instance_ttft_ms(cal: Calibration, prompt: int, others: int) -> float:
    """A request's time on the decode instance before its first token, which `others` decoding
    requests keep busy: the rest of the step in flight when it arrives (half a step of their rows,
    on average, an arrival being as likely at any point of a step), then its own step, the tokens
    after the prompt's last full block (at least one: one token is always computed) sharing it
    with their rows. On half the cores. At 4 clients of ~384-token prompts (Zen 2): measured 57.6
    ms mean (queue 24.7, its step 32.9), and predicted 25.5 for its step alone, as one on an idle
    instance."""
    cost = cal.cost.on_half_cores(DECODE_SPLIT_SLOWDOWN)
    block = cal.settings.block_size
    last = prompt - block * ((prompt - 1) // block)
    busy = StepShape()
    for _ in range(others):  # each at the median request's mean decode context
        busy = busy.plus_chunk(1, round(cal.evidence.decode_context), decode=True)
    in_flight = cost.step_ms(busy) / 2 if others else 0.0
    return in_flight + cost.step_ms(busy.plus_chunk(last, prompt))


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
