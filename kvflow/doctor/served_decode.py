"""What a decode step costs when its rows are served: `kvflow serve` on this machine with b clients
streaming at once (kvflow bench, b = 1 .. max rows, doubling), the server's own record of each
decode-only step of exactly b rows (kvflow/bench/server_steps.py), median per b.

Why: the step profile (kvflow/engine/step_profile.py) runs the engine alone in one process. Served,
every token a step delivers also costs the API thread (its JSON chunk and SSE frame, holding the
GIL the engine thread's Python needs) and a client on the same machine (parsing it): CPU the step
waits for, and it grows with the tokens a step delivers. On a 2-core Zen 2 the tiny planted model's
decode step took 1.0 ms alone and 1.3-1.5 served at 1 row, 1.4 ms alone and 2.9 served at 8 rows.
The calibration's per-kind constant, fitted at the rows the diagnosed run had, absorbs the 1-row
part; the growth with rows it cannot see on a run with one running slot, and the max_num_seqs
what-if had predicted 69 ms of e2e where 130 were measured (benchmarks/NOTES.md, session 26).

    served_decode_ms[b]   the median served b-row decode step; the simulator adds its excess over
                          the profile's b-row step, less the 1-row excess, to every step by its
                          decode rows (kvflow/doctor/step_profile.py: StepProfile.served_growth)
    served_tpot_ms[b]     the clients' TPOT p50: beyond the step, what passes between steps
    served_ttft_gap_ms[b] the clients' TTFT beyond the server's, b first tokens in one step

Measured with the profile, once per model, machine, dtype and quantization (the same cache).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from kvflow.bench.arrivals import LoadSpec
from kvflow.bench.datasets import DatasetSpec
from kvflow.bench.runner import BenchConfig, run_benchmark
from kvflow.server.spawn import spawn_server, stop_server

# Each probe: b clients, each sending requests of this many prompt tokens that stream this many
# outputs, at least MIN_PROBE_REQUESTS requests in all, so that a few rows get as many steps for
# their median as many rows do (at 24 outputs, one wave, the 1-row median moved by 0.3 ms).
SERVED_PROMPT_TOKENS = 16
SERVED_OUTPUT_TOKENS = 64
MIN_PROBE_REQUESTS = 4
# Sweeps over every b, one after another, each b's value the median over them: one sweep's 4-row
# step read 3.41 ms where the sweep before had read 2.34 (a VM slowing for a second or two), and
# every later prediction of that profile carried it (the kv_pool what-if's ITL p99 63% high; a
# 2 -> 4 row step grew 1.2 ms simulated, 0.5 measured: session 27).
SERVED_SWEEPS = 3
SERVED_KEYS = ("served_decode_ms", "served_tpot_ms", "served_ttft_gap_ms")  # the profile's keys
SERVED_PROBE_CONTEXT = SERVED_PROMPT_TOKENS + SERVED_OUTPUT_TOKENS / 2  # keys a probed row reads, on average


def decode_step_ms(result: dict[str, Any], rows: int) -> float | None:
    """The median of the run's recorded decode-only steps of exactly `rows` rows; None without."""
    recorded = (result.get("server") or {}).get("steps") or {}
    fields = list(recorded.get("fields") or [])
    if "dur_ms" not in fields or "prefill_tokens" not in fields or "decode_tokens" not in fields:
        return None
    dur, prompt, decode = (fields.index(k) for k in ("dur_ms", "prefill_tokens", "decode_tokens"))
    times = [row[dur] for row in recorded.get("rows") or [] if row[prompt] == 0 and row[decode] == rows]
    return statistics.median(times) if times else None


def measure_served_decode(
    model_dir: str, serve_flags: Sequence[str], rows: Sequence[int]
) -> dict[str, dict[int, float]]:
    """{"served_decode_ms": {b: the median recorded b-row decode step}, "served_tpot_ms": {b: the
    clients' TPOT p50 (the step and what passes between steps)}, "served_ttft_gap_ms": {b: the
    clients' TTFT beyond the server's (b first tokens come in one step)}} for each b of `rows` that
    produced such steps, each the median over SERVED_SWEEPS sweeps, from one `kvflow serve MODEL
    serve_flags` (which must allow max(rows) running requests)."""
    process, base = spawn_server(model_dir, list(serve_flags))
    seen: dict[str, dict[int, list[float]]] = {key: {} for key in SERVED_KEYS}
    try:
        for sweep in range(SERVED_SWEEPS):
            for b in rows:
                config = BenchConfig(
                    base_url=base + "/v1",
                    dataset=DatasetSpec(
                        "random",
                        max(b, MIN_PROBE_REQUESTS),
                        input_len=SERVED_PROMPT_TOKENS,
                        output_len=SERVED_OUTPUT_TOKENS,
                        seed=b,
                    ),
                    load=LoadSpec(concurrency=b, seed=sweep),  # other prompts each sweep: no cache hits
                    warmup=1,
                    progress=False,
                )
                result = run_benchmark(config)
                step = decode_step_ms(result, b)
                tpot = (result.get("tpot_ms") or {}).get("p50")
                gap = (result.get("server") or {}).get("client_minus_server_ttft_ms")
                if step is not None and tpot:
                    seen["served_decode_ms"].setdefault(b, []).append(step)
                    seen["served_tpot_ms"].setdefault(b, []).append(float(tpot))
                    if gap is not None:
                        seen["served_ttft_gap_ms"].setdefault(b, []).append(float(gap))
    finally:
        stop_server(process)
    return {key: {b: statistics.median(v) for b, v in by_rows.items()} for key, by_rows in seen.items()}
