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
    served_turnover_ms    the turnover probe: b in TURNOVER_CLIENTS clients whose outputs end at
                          staggered lengths, so that one finishes, and sends its next request, while
                          the others decode; each decode-only step after such a finish less the
                          median of the run's other decode steps of as many rows, pooled over b and
                          sweeps (the simulator draws them where the diagnosed run recorded too few
                          steps after a finish: kvflow/doctor/calibrate.py, step_residuals)

Why the turnover probe: the step after a finish runs while the server's HTTP side completes that
response and the client's next request arrives, is parsed and handed off, all on the cores the
forward's threads need. On the planted tiny model (2-core Zen 2) those steps took 3-8 ms against
1.7-2.1 for the others, and they made the ITL p99 of a run whose clients turn around while others
decode; a run whose steps after a finish admit a waiting prompt (a starved KV pool) records none of
them, and its what-if to a larger pool had predicted ITL p99 22-39% low (session 31).

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
# 2 -> 4 row step grew 1.2 ms simulated, 0.5 measured: session 27). Five: six single sweeps in a row
# read the 4-row step at 2.15-3.26 ms, and a median of three at 2.80 against 2.28-2.48 in the
# profiles before and after it put the kv_pool what-if's ITL p99 67% high (session 31).
SERVED_SWEEPS = 5
SERVED_KEYS = ("served_decode_ms", "served_tpot_ms", "served_ttft_gap_ms")  # the profile's keys
# The turnover probe: this many clients (those the server allows), each sending this many requests
# whose outputs are uniform in SERVED_OUTPUT_TOKENS x (1 -+ the ratio): 6-7 steps after a finish at 2
# clients, 14 at 4, per sweep (the stall grows with what else is decoding: a median 1.3-2.8 ms at 4,
# 1.7-3.9 at 2 on the planted tiny model).
TURNOVER_CLIENTS = (2, 4)
TURNOVER_REQUESTS_PER_CLIENT = 4
TURNOVER_RANGE_RATIO = 0.5
TURNOVER_KEY = "served_turnover_ms"
SERVED_PROBE_CONTEXT = SERVED_PROMPT_TOKENS + SERVED_OUTPUT_TOKENS / 2  # keys a probed row reads, on average


def probe_config(
    base: str, clients: int, requests: int, dataset_seed: int, load_seed: int, range_ratio: float = 0.0
) -> BenchConfig:
    """A probe's benchmark: `clients` clients streaming `requests` requests of the probe's shape
    (SERVED_PROMPT_TOKENS in, SERVED_OUTPUT_TOKENS out, lengths x (1 -+ range_ratio)) to `base`."""
    dataset = DatasetSpec(
        "random",
        requests,
        input_len=SERVED_PROMPT_TOKENS,
        output_len=SERVED_OUTPUT_TOKENS,
        range_ratio=range_ratio,
        seed=dataset_seed,
    )
    load = LoadSpec(concurrency=clients, seed=load_seed)
    return BenchConfig(base_url=base + "/v1", dataset=dataset, load=load, warmup=1, progress=False)


def _recorded_steps(result: dict[str, Any]) -> list[tuple[float, bool, int]]:
    """The server's recorded steps in the order they ran, (dur_ms, had prompt tokens, decode rows);
    none from a result without them."""
    recorded = (result.get("server") or {}).get("steps") or {}
    fields = list(recorded.get("fields") or [])
    if "dur_ms" not in fields or "prefill_tokens" not in fields or "decode_tokens" not in fields:
        return []
    dur, prompt, decode = (fields.index(k) for k in ("dur_ms", "prefill_tokens", "decode_tokens"))
    return [(row[dur], bool(row[prompt]), int(row[decode])) for row in recorded.get("rows") or []]


def decode_step_ms(result: dict[str, Any], rows: int) -> float | None:
    """The median of the run's recorded decode-only steps of exactly `rows` rows; None without."""
    times = [dur for dur, prompt, decode in _recorded_steps(result) if not prompt and decode == rows]
    return statistics.median(times) if times else None


def turnover_excess_ms(result: dict[str, Any]) -> list[float]:
    """Each recorded decode-only step that follows a drop in decode rows (a request finished at the
    end of the step before: kvflow/doctor/step_cost.py, follows_a_drop), less the median of the
    run's other decode-only steps of as many rows; none without records."""
    clear: dict[int, list[float]] = {}
    after_drop: list[tuple[int, float]] = []
    previous_rows = 0
    for dur, prompt, rows in _recorded_steps(result):
        if not prompt:
            if rows < previous_rows:
                after_drop.append((rows, dur))
            else:
                clear.setdefault(rows, []).append(dur)
        previous_rows = rows
    return [ms - statistics.median(clear[rows]) for rows, ms in after_drop if rows in clear]


def _turnover_probe(base: str, clients: int, sweep: int) -> list[float]:
    """`clients` clients of staggered output lengths (other prompts each sweep): turnover_excess_ms."""
    requests = TURNOVER_REQUESTS_PER_CLIENT * clients
    config = probe_config(base, clients, requests, sweep, sweep, TURNOVER_RANGE_RATIO)
    return turnover_excess_ms(run_benchmark(config))


def measure_served_decode(model_dir: str, serve_flags: Sequence[str], rows: Sequence[int]) -> dict[str, Any]:
    """{"served_decode_ms": {b: the median recorded b-row decode step}, "served_tpot_ms": {b: the
    clients' TPOT p50 (the step and what passes between steps)}, "served_ttft_gap_ms": {b: the
    clients' TTFT beyond the server's (b first tokens come in one step)}} for each b of `rows` that
    produced such steps, each the median over SERVED_SWEEPS sweeps, and "served_turnover_ms": [the
    turnover probe's excesses, ms] (TURNOVER_CLIENTS up to max(rows)), from one `kvflow serve MODEL
    serve_flags` (which must allow max(rows) running requests)."""
    process, base = spawn_server(model_dir, list(serve_flags))
    seen: dict[str, dict[int, list[float]]] = {key: {} for key in SERVED_KEYS}
    turnover: list[float] = []
    try:
        for sweep in range(SERVED_SWEEPS):
            for b in rows:
                # Other prompts each sweep (the load's seed): no prefix-cache hits.
                result = run_benchmark(probe_config(base, b, max(b, MIN_PROBE_REQUESTS), b, sweep))
                step = decode_step_ms(result, b)
                tpot = (result.get("tpot_ms") or {}).get("p50")
                gap = (result.get("server") or {}).get("client_minus_server_ttft_ms")
                if step is not None and tpot:
                    seen["served_decode_ms"].setdefault(b, []).append(step)
                    seen["served_tpot_ms"].setdefault(b, []).append(float(tpot))
                    if gap is not None:
                        seen["served_ttft_gap_ms"].setdefault(b, []).append(float(gap))
            for clients in (c for c in TURNOVER_CLIENTS if c <= max(rows, default=0)):
                turnover += _turnover_probe(base, clients, sweep)
    finally:
        stop_server(process)
    medians = {key: {b: statistics.median(v) for b, v in by_rows.items()} for key, by_rows in seen.items()}
    return {**medians, TURNOVER_KEY: turnover}
