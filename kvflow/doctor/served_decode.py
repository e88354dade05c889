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
                          query rows (kvflow/doctor/step_profile.py: StepProfile.served_growth)
    served_tpot_ms[b]     the clients' TPOT p50: beyond the step, what passes between steps
    served_ttft_gap_ms[b] the clients' TTFT beyond the server's, b first tokens in one step
    served_suffix_ms[C]   the suffix probe: one client sending prompts of a C-token prefix the server
                          has cached and MAX_QUERY_ROWS_PER_CHUNK tokens of their own: the median
                          step that took in such a suffix alone (query rows, kvflow/query_rows.py)
    served_suffix_decode_ms[C]  the same runs' median 1-row decode step (a context of about C):
                          over it, what a suffix step costs against the decode step the run
                          calibrates (StepProfile.suffix_ratio)
    served_arrival_stall_ms   the arrival probe: b in ARRIVAL_CLIENTS clients whose outputs end at
                          staggered lengths, so that one finishes, and sends its next request, while
                          the others decode; each decode-only step during which a request arrived
                          (kvflow/doctor/arrival_stalls.py) less the median of the run's decode
                          steps of as many rows during which none did, pooled over b and sweeps
                          (the simulator's stall of an arrival where the diagnosed run recorded too
                          few of its own: kvflow/doctor/calibrate.py, step_residuals)

Why the arrival probe: a client sending its next request and the server receiving it take the
cores the forward's threads use, and the step in flight makes no progress until the request has
arrived. On the planted tiny model (2-core Zen 2) decode steps during which a request arrived took
about 3 ms (median) more than the others, up to 8, and they made the ITL p99 of a run whose clients
come back while others decode; a run whose next requests arrive while its engine is idle (clients
turning around together) or into a starved KV pool records few or none (session 32; sessions 30-31
drew a stall for every step after a finish instead, and predicted the kv_pool what-if's ITL p99
19-67% high where its clients turned around together).

Why the suffix probe: a short suffix after a cached prefix is query rows re-reading their context,
one request's rows at once, and on a 2-core Xeon with AMX it did not cost what the decode probes
(rows of as many requests) priced: the engine alone took 12.6-13.8 ms for 8 rows after 768 cached
tokens where the profile's rows priced 10.0, and served the step took 14.7-15.2 ms (medians of four
servers) where a 1-row decode at that context took 7.8-8.0, 4 ms beyond the engine's own where the
suffix step was 1.5-2 beyond (the API thread streams the previous token while a decode step runs;
a suffix step of a request that just arrived follows none). Priced as a decode step (the decode
kind's served excess and the run's speed over the profile's), the prefix-caching what-if's TTFT
came out 22-36% high (benchmarks/NOTES.md, session 44). Over the served 1-row decode step at its
context, measured together, the suffix step is priced against the decode steps the diagnosed run
recorded.

Measured with the profile, once per model, machine, dtype and quantization (the same cache).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from kvflow.bench.arrivals import LoadSpec
from kvflow.bench.datasets import DatasetSpec
from kvflow.bench.runner import BenchConfig, run_benchmark
from kvflow.doctor.arrival_stalls import flagged_records
from kvflow.doctor.evidence import recorded_steps
from kvflow.query_rows import MAX_QUERY_ROWS_PER_CHUNK
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
# profiles before and after it put the kv_pool what-if's ITL p99 67% high (session 31). Eleven:
# the 8-row step over the 1-row, which prices the max_num_seqs what-if's steps from a run with one
# slot, came out 2.07-2.87 in five profiles of five sweeps, and the 2.87 one put that what-if's
# e2e 27% high; over fifteen sweeps on one server it read 2.40, and five of them drawn at random
# 2.17-2.86 (p5-p95), nine 2.31-2.59 (session 42). A sweep takes about 6 s on the tiny model.
SERVED_SWEEPS = 11
SERVED_KEYS = ("served_decode_ms", "served_tpot_ms", "served_ttft_gap_ms")  # the profile's keys
# The arrival probe: this many clients (those the server allows), each sending this many requests
# whose outputs are uniform in SERVED_OUTPUT_TOKENS x (1 -+ the ratio), so that a client's next request
# arrives while the others decode.
ARRIVAL_CLIENTS = (2, 4)
ARRIVAL_REQUESTS_PER_CLIENT = 4
ARRIVAL_RANGE_RATIO = 0.5
ARRIVAL_KEY = "served_arrival_stall_ms"
SERVED_PROBE_CONTEXT = SERVED_PROMPT_TOKENS + SERVED_OUTPUT_TOKENS / 2  # keys a probed row reads, on average
# The suffix probe: cached prefixes of these shares of the context (two points for how the suffix
# step grows with it), whole blocks; each sweep SUFFIX_REQUESTS requests after the one that caches
# the prefix (its warmup), each streaming SUFFIX_OUTPUT_TOKENS (1-row decode steps at about the
# prefix's context).
SUFFIX_CONTEXT_SHARES = (0.25, 0.75)
SUFFIX_BLOCK_TOKENS = 16
SUFFIX_REQUESTS = 6
SUFFIX_OUTPUT_TOKENS = 8
SUFFIX_KEYS = ("served_suffix_ms", "served_suffix_decode_ms")


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


def decode_step_ms(result: dict[str, Any], rows: int) -> float | None:
    """The median of the run's recorded decode-only steps of exactly `rows` rows; None without."""
    steps = recorded_steps(result.get("server") or {})
    times = [dur for dur, prompt, decode in steps if not prompt and decode == rows]
    return statistics.median(times) if times else None


def arrival_stall_ms(result: dict[str, Any]) -> list[float]:
    """Each decode-only step of the server's window during which a request arrived
    (kvflow/doctor/arrival_stalls.py), less the median of the run's decode-only steps of as many
    rows during which none did; none without a window."""
    records = flagged_records(result.get("server") or {})
    clear: dict[int, list[float]] = {}
    stalled: list[tuple[int, float]] = []
    for record, held_an_arrival in records or ():
        dur, prompt, rows = record[0], record[1], int(record[2])
        if prompt or not rows:
            continue
        if held_an_arrival:
            stalled.append((rows, dur))
        else:
            clear.setdefault(rows, []).append(dur)
    return [ms - statistics.median(clear[rows]) for rows, ms in stalled if rows in clear]


def suffix_prefixes(context: int) -> list[int]:
    """The suffix probe's cached prefix lengths for a server of `context` tokens: SUFFIX_CONTEXT_SHARES
    of what leaves room for the suffix and its outputs, in whole blocks, distinct and positive."""
    room = context - MAX_QUERY_ROWS_PER_CHUNK - SUFFIX_OUTPUT_TOKENS - 1
    lengths = {
        int(share * room) // SUFFIX_BLOCK_TOKENS * SUFFIX_BLOCK_TOKENS for share in SUFFIX_CONTEXT_SHARES
    }
    return sorted(n for n in lengths if n > 0)


def suffix_steps(result: dict[str, Any]) -> list[float]:
    """The steps that took in prompt tokens as query rows and nothing else (no decode row, no prefill
    chunk), ms, from the server's records (kvflow/bench/server_steps.py); none from records without
    the query rows split out."""
    recorded = (result.get("server") or {}).get("steps") or {}
    fields = list(recorded.get("fields") or [])
    needed = ("dur_ms", "prefill_tokens", "decode_tokens", "row_prefill_tokens")
    if not all(key in fields for key in needed):
        return []
    dur, prompt, decode, rows = (fields.index(key) for key in needed)
    return [
        float(row[dur])
        for row in recorded.get("rows") or []
        if row[prompt] and row[rows] == row[prompt] and not row[decode]
    ]


def _suffix_probe(base: str, prefix_tokens: int, sweep: int) -> tuple[float, float] | None:
    """One client, SUFFIX_REQUESTS prompts of one `prefix_tokens` prefix (another each sweep: the
    dataset's seed) and MAX_QUERY_ROWS_PER_CHUNK tokens of their own: (the median suffix step, the
    median 1-row decode step); None when the run recorded either none."""
    dataset = DatasetSpec(
        "shared-prefix",
        SUFFIX_REQUESTS,
        input_len=MAX_QUERY_ROWS_PER_CHUNK,
        output_len=SUFFIX_OUTPUT_TOKENS,
        prefix_len=prefix_tokens,
        seed=1_000 + sweep,  # apart from the decode probes' seeds
    )
    load = LoadSpec(concurrency=1, seed=sweep)
    config = BenchConfig(base_url=base + "/v1", dataset=dataset, load=load, warmup=1, progress=False)
    result = run_benchmark(config)
    suffix, single = suffix_steps(result), decode_step_ms(result, 1)
    if not suffix or single is None:
        return None
    return statistics.median(suffix), single


def _arrival_probe(base: str, clients: int, sweep: int) -> list[float]:
    """`clients` clients of staggered output lengths (other prompts each sweep): arrival_stall_ms."""
    requests = ARRIVAL_REQUESTS_PER_CLIENT * clients
    config = probe_config(base, clients, requests, sweep, sweep, ARRIVAL_RANGE_RATIO)
    return arrival_stall_ms(run_benchmark(config))


def measure_served_decode(
    model_dir: str, serve_flags: Sequence[str], rows: Sequence[int], context: int | None = None
) -> dict[str, Any]:
    """{"served_decode_ms": {b: the median recorded b-row decode step}, "served_tpot_ms": {b: the
    clients' TPOT p50 (the step and what passes between steps)}, "served_ttft_gap_ms": {b: the
    clients' TTFT beyond the server's (b first tokens come in one step)}} for each b of `rows` that
    produced such steps, each the median over SERVED_SWEEPS sweeps, and "served_arrival_stall_ms": [the
    arrival probe's stalls, ms] (ARRIVAL_CLIENTS up to max(rows)); with the server's `context`,
    "served_suffix_ms" and "served_suffix_decode_ms": {C: the suffix probe's medians at a cached
    prefix of C} (suffix_prefixes); from one `kvflow serve MODEL serve_flags` (which must allow
    max(rows) running requests, and cache prefixes for the suffix probe)."""
    process, base = spawn_server(model_dir, list(serve_flags))
    seen: dict[str, dict[int, list[float]]] = {key: {} for key in (*SERVED_KEYS, *SUFFIX_KEYS)}
    stalls: list[float] = []
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
            for clients in (c for c in ARRIVAL_CLIENTS if c <= max(rows, default=0)):
                stalls += _arrival_probe(base, clients, sweep)
            for prefix in suffix_prefixes(context) if context else ():
                probed = _suffix_probe(base, prefix, sweep)
                if probed is not None:
                    seen["served_suffix_ms"].setdefault(prefix, []).append(probed[0])
                    seen["served_suffix_decode_ms"].setdefault(prefix, []).append(probed[1])
    finally:
        stop_server(process)
    medians = {key: {b: statistics.median(v) for b, v in by_rows.items()} for key, by_rows in seen.items()}
    for key in SUFFIX_KEYS if not medians["served_suffix_ms"] else ():  # no suffix probe: no keys
        medians.pop(key)
    return {**medians, ARRIVAL_KEY: stalls}
