"""The ITL check's disaggregation what-if: move prefill to its own instance (kv_role prefill / decode
behind vllm-router --vllm-pd-disaggregation, kvflow/kv_transfer/), so no prompt chunk shares a step
with decodes. Offered when prompt chunks explain the ITL tail; it says when colocated chunked
prefill stays better.

The prediction, for the same machine split in two instances (each half the cores):
    ITL p99   the run's ITL p50 (its decode steps) x DECODE_SPLIT_SLOWDOWN (a decode step on half
              the cores) x DECODE_ONLY_TAIL (p99 / p50 of gaps when no chunk ever joins a step)
    TTFT p50  the run's TTFT p50 x PREFILL_SPLIT_SLOWDOWN (a prefill on half the cores, no longer
              sharing steps) + the transfer of the p50 prompt's KV at TRANSFER_BYTES_PER_S
Measured with benchmarks/pd_disaggregation.py and benchmarks/kv_transfer.py (2-core Xeon VM, Qwen2.5-0.5B
shape, 4 streams, 1536-token prompts every 6 s, colocated 2 threads against 1 + 1); on other
machines these ratios move with how prefill and decode scale with cores, which `--verify` measures
(kvflow/doctor/verify_pd.py: the pair on half the cores each, behind vllm-router).
"""

from __future__ import annotations

from kvflow.doctor.diagnosis import Diagnosis
from kvflow.doctor.finding import WhatIf
from kvflow.doctor.verify_pd import DISAGGREGATE

DECODE_SPLIT_SLOWDOWN = 1.21  # PD ITL p50 / colocated ITL p50 (82 / 68 ms, medians of 2 rounds)
DECODE_ONLY_TAIL = 1.54  # PD ITL p99 / p50 (126 / 82 ms)
PREFILL_SPLIT_SLOWDOWN = 1.43  # PD / colocated TTFT of the long prompts less the transfer (4025 / 2809 ms)
# A fetch between instances on one machine, through a shared-memory segment: 18 MiB in 6.8 ms
# (benchmarks/kv_transfer.py; over loopback TCP, as between machines, 21.3 ms in the same run).
TRANSFER_BYTES_PER_S = 2.78e9
METHOD = (
    "decode and prefill step ratios measured on a 2-core CPU split 1 + 1 (kvflow/doctor/disaggregation.py), "
    "applied to this run's ITL p50 and TTFT p50"
)


def disaggregate_what_if(d: Diagnosis) -> WhatIf | None:
    run = d.run
    if run.itl_p50_ms is None or run.itl_p99_ms is None or run.ttft_p50_ms is None:
        return None
    itl_p99 = run.itl_p50_ms * DECODE_SPLIT_SLOWDOWN * DECODE_ONLY_TAIL
    kv_bytes = run.prompt_p50 * d.model.kv_bytes_per_token(d.roofline.kv_dtype)
    transfer_ms = 1e3 * kv_bytes / TRANSFER_BYTES_PER_S
    ttft = run.ttft_p50_ms * PREFILL_SPLIT_SLOWDOWN + transfer_ms
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
    return WhatIf(change, effect, {"itl_p99_ms": itl_p99, "ttft_p50_ms": ttft}, setting, method=METHOD)
