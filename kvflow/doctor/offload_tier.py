"""The TTFT check's KV offload tier what-if: prompts repeat prefixes the prefix cache no longer holds
(evicted by others: the pool is too small for the returning conversations), and kvflow can keep
evicted blocks on disk and read them back (`kv_offload_path`, kvflow/kv_offload/).

Predicted TTFT p50 = TTFT p50 - prefill of the missed repeated tokens (measured ms/token) + their
restore: KV bytes / the tier's own read bandwidth, measured now on blocks it has just written (the
page cache holds recently written blocks: a tier on a cold disk reads slower).
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile

from kvflow.doctor.diagnosis import Diagnosis
from kvflow.doctor.finding import WhatIf
from kvflow.kv_offload.disk_tier import DiskKVTier

# `--verify` gives the changed server a fresh temporary directory for this setting's value.
TEMPORARY_DIR = "<temporary directory>"
PROBE_BYTES = 32 * 2**20
PROBE_CHUNK = 196 * 2**10  # one Qwen2.5-0.5B bf16 block of 16 tokens: the tier reads block by block
PROBE_REPEATS = 3
METHOD = (
    "missed repeated tokens x measured prefill ms/token, against their KV bytes / the tier's read "
    "bandwidth measured now on blocks it just wrote (page cache)"
)


def read_bytes_per_s(directory: str | None = None) -> float:
    """Median bandwidth of the tier's own read path (kvflow/kv_offload/disk_tier.py: one file per
    block, header and checksum checked) on 32 MiB of blocks it has just written."""
    payload = os.urandom(PROBE_CHUNK)
    hashes = [i.to_bytes(32, "big") for i in range(PROBE_BYTES // PROBE_CHUNK)]
    seconds = []
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        tier = DiskKVTier(tmp, 2 * PROBE_BYTES, bytes(32))
        try:
            for block_hash in hashes:
                tier.store(block_hash, payload)
            tier.flush()
            for _ in range(PROBE_REPEATS):
                read = tier.load_async(hashes).result()
                if len(read.payloads) != len(hashes):
                    raise RuntimeError("the read-bandwidth probe could not read back its own blocks")
                seconds.append(read.seconds)
        finally:
            tier.close()
    return len(hashes) * PROBE_CHUNK / statistics.median(seconds)


def missed_repeat_tokens(d: Diagnosis) -> float:
    """Repeated prompt tokens per request (p50 prompt) the prefix cache did not serve, in whole blocks."""
    run = d.run
    share, hit = run.shared_prefix_share, run.prefix_hit_rate
    if share is None or hit is None:
        return 0.0
    missed = max(share - hit, 0.0) * run.prompt_p50
    return d.block_size * math.floor(missed / d.block_size)


def offload_tier_what_if(d: Diagnosis, bytes_per_s: float | None = None) -> WhatIf | None:
    run, s = d.run, d.settings
    if s.server != "kvflow" or not s.enable_prefix_caching or run.ttft_p50_ms is None:
        return None  # the tier is kvflow's, and needs prefix caching (off: the prefix-caching what-if)
    missed = missed_repeat_tokens(d)
    slope = d.measured_prefill_ms_per_token()
    if missed <= 0 or slope is None:
        return None
    bandwidth = bytes_per_s if bytes_per_s is not None else read_bytes_per_s()
    kv_bytes = missed * d.model.kv_bytes_per_token(d.roofline.kv_dtype)
    restore_ms = 1e3 * kv_bytes / bandwidth
    saved_ms = slope * missed
    if restore_ms >= saved_ms:
        return None
    predicted = max(run.ttft_p50_ms - saved_ms + restore_ms, 0.0)
    return WhatIf(
        f"keep evicted prefix blocks on disk (kv_offload_path): {missed:,.0f} repeated tokens per "
        "request missed the pool",
        f"p50 TTFT {run.ttft_p50_ms:,.1f} -> {predicted:,.1f} ms ({saved_ms:,.1f} ms of prefill at "
        f"{slope:.3f} ms/token, against {restore_ms:,.1f} ms reading {kv_bytes / 2**20:,.1f} MiB at "
        f"{bandwidth / 1e9:.2f} GB/s)",
        {"ttft_p50_ms": predicted},
        {"kv_offload_path": TEMPORARY_DIR},
        method=METHOD,
    )
