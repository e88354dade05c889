"""The ITL check's disaggregation what-if: move prefill to its own instance (kv_role prefill / decode
behind vllm-router --vllm-pd-disaggregation, kvflow/kv_transfer/), so no prompt chunk shares a step
with decodes. Offered when prompt chunks explain the ITL tail; it says when colocated chunked
prefill stays better.

The prediction, for the same machine split in two instances (each half the cores), from the
calibrated simulator (kvflow/doctor/calibrate.py) when the run is a kvflow server's, every step on
half the cores (the step profile's curves measured there, kvflow/doctor/step_profile.py; without
them every step x PREFILL_SPLIT_SLOWDOWN or DECODE_SPLIT_SLOWDOWN):
    the prefill instance   the same requests replayed with one output token each, each client
                           sending its next request after that request's decode (its outputs at
                           the run's ITL p50 x the split decode ratio; clients fall out of step as
                           on the pair): its queueing and prefill
    the decode instance    the same requests, each client's next one after a trip through the
                           prefill instance (its simulated TTFTs): each prompt's full blocks fetched
                           from the prefill instance at TRANSFER_BYTES_PER_S from when the engine
                           takes it in, beside the step in flight, and the request admitted at the
                           first step boundary after (kvflow/kv_transfer/imports.py), then the
                           tokens after the last full block computed (one token always is) beside
                           the others' decodes: its TTFT there, and its gaps (ITL p50 and p99: the
                           steps that take in a last block are the tail)
    the router             HOP_LEGS more HTTP legs, each what the run's client added to the
                           server's TTFT
    TTFT p50 = the prefill instance's + the decode instance's + the client's gap + the router's.
Both instances' simulated times are carried onto the measurement by the step speed, the run's plain
decode gaps' ratio (measured ITL p50 / simulated), and `--verify` carries the prediction to its
fresh baseline by the same (WhatIf.carried_by): not by the colocated run's ITL p99 or TTFT p50, as
a colocated what-if is. The pair shares neither: the colocated tail was the prompt chunks the
decode instance does not have, and the colocated TTFT p50 is where 12 requests happened to queue
behind each other, which the pair's prefill instance reorders. That p50 is noisy: on four diagnoses
of the planted prefill_chunks settings its measured-over-simulated ratio was 1.07-1.33 where the
step speed's was 1.02 on all four. Carried by it (and under `--verify` by the fresh baseline's TTFT
p50 again) the pair's TTFT came out 14-44% from the measured (session 32). Carried by the step
speed, on a profile measured in passes (kvflow/engine/step_profile.py), it came out 20%, 11%, 19% and
6% low in four runs (session 33): the pair's prefill instance ran its steps 17-22% slower than their price
(the split curve plus the run's fitted prompt constant), which a busy neighbour alone does not
explain (a forward loop on the other core moved the split probes by 0-9%), and its prompts queue
behind those steps.
The fetch's wait for a step boundary is most of the decode instance's TTFT: on the planted
prefill_chunks pair (session 30) requests waited 14.3 ms (median) between the engine taking them in
and their admission, about one decode step, for a 1 ms fetch; arriving with their KV, as the
simulated decode instance had them until then, its TTFT came out 25 ms where 47 were measured.
Otherwise: ITL p99 = the run's ITL p50 x DECODE_SPLIT_SLOWDOWN x DECODE_ONLY_TAIL (p99 / p50 of gaps
when no chunk ever joins a step), TTFT p50 = the run's x PREFILL_SPLIT_SLOWDOWN + the p50 prompt's
transfer.
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

import statistics
from dataclasses import dataclass, replace

from kvflow.doctor.calibrate import SIM_METRICS, Calibration
from kvflow.doctor.diagnosis import Diagnosis
from kvflow.doctor.finding import WhatIf
from kvflow.doctor.step_cost import MIN_STEP_MS
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
    "both instances simulated on half the cores (the prefill instance: one output per request; the "
    "decode instance: each prompt's last block and the decodes), plus the KV transfer and the router's "
    "hops (kvflow/doctor/disaggregation.py)"
)


@dataclass(frozen=True)
class PairPrediction:
    """The pair simulated (module docstring): the TTFT p50 at the client, and the decode instance's
    ITL p50 and p99."""

    ttft_p50_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    # The decode instance's ITL p99 over its replays, as factors (Calibration.replay_range).
    itl_p99_range: tuple[float, float] | None = None


def pd_simulated(cal: Calibration, transfer_ms_per_token: float) -> PairPrediction | None:
    """Both instances simulated on half the cores (module docstring), for the run the calibration
    was fitted to, a prompt token's KV moving between them in `transfer_ms_per_token`; None without
    its TTFT p50 and ITL p50."""
    run = cal.evidence
    if run.ttft_p50_ms is None or run.itl_p50_ms is None:
        return None
    transfer_ms = run.prompt_p50 * transfer_ms_per_token  # the client's round trip holds one
    # The prefill instance: each request prefilled and its one token sampled on half the cores; its
    # client comes back after that request's own decode on the other instance (its outputs at the
    # split ITL, first guessed from the run's: a common output length would keep the clients in step,
    # each round a burst of prompts queueing at the prefill instance, where varied lengths spread
    # them out).
    requests = cal.evidence.requests
    guess_ms = run.itl_p50_ms * decode_split_ratio(cal)
    decode_phase_ms = [max(s.output_tokens - 1, 0) * guess_ms for s in requests]
    hop_ms = HOP_LEGS * cal.client_gap_ms
    # Pooled over replays as every prediction: one replay of a 12-request run put the planted
    # prefill_chunks pair's prefill-instance TTFT p50 anywhere from 198 to 340 ms by its seed alone
    # (which of a returning burst's prompts queued behind the others), 251-428 carried (session 30).
    prefill = cal.replays(
        [replace(s, output_tokens=1) for s in requests],
        cal.settings,
        cal.cost.on_half_cores(PREFILL_SPLIT_SLOWDOWN),
        cal.client_gap_ms + hop_ms + transfer_ms,
        decode_phase_ms,
    )
    if not prefill.ttft_ms:
        return None
    # The decode instance: every prompt's full blocks fetched (one token is always computed), each
    # client's next request after its trip through the prefill instance (that request's median
    # simulated TTFT there); its steps are the others' decodes and the last blocks, on half the
    # cores, pooled over replays as every prediction (a tail of few gaps is otherwise one residual
    # draw).
    trips: dict[int, list[float]] = {}
    for index, ttft_ms in zip(prefill.ttft_request, prefill.ttft_ms, strict=True):
        trips.setdefault(index, []).append(ttft_ms)
    typical = statistics.median(prefill.ttft_ms)  # a request the pool capped on every replay
    waits = [statistics.median(trips[i]) if i in trips else typical for i in range(len(requests))]
    fetching = replace(cal.settings, enable_prefix_caching=True, fetch_ms_per_token=transfer_ms_per_token)
    on_decode = cal.replays(
        [replace(s, shared_prefix_tokens=s.prompt_tokens) for s in requests],
        fetching,
        cal.cost.on_half_cores(DECODE_SPLIT_SLOWDOWN),
        cal.client_gap_ms + hop_ms,
        waits,
    )
    if not on_decode.itl_ms or not on_decode.ttft_ms:
        return None
    # Both instances carried onto the measurement by the step speed, the plain decode gaps' ratio
    # (module docstring).
    p50 = SIM_METRICS["itl_p50_ms"]
    ratio = run.itl_p50_ms / max(p50(cal.pooled_baseline), MIN_STEP_MS)
    server_ttft = (statistics.median(prefill.ttft_ms) + statistics.median(on_decode.ttft_ms)) * ratio
    ttft = server_ttft + cal.client_gap_ms + hop_ms
    return PairPrediction(
        ttft,
        p50(on_decode) * ratio,
        SIM_METRICS["itl_p99_ms"](on_decode) * ratio,
        cal.replay_range("itl_p99_ms", on_decode),
    )


def decode_split_ratio(cal: Calibration) -> float:
    """A decode step on half the cores over one on all of them at the run's concurrency: the
    profile's split curves where measured, else DECODE_SPLIT_SLOWDOWN."""
    profile = cal.cost.profile
    if profile is None or profile.split is None:
        return DECODE_SPLIT_SLOWDOWN
    rows = max(1, round(cal.evidence.concurrency))
    return profile.split[1](rows) / max(profile.decode(rows), MIN_STEP_MS)


def disaggregate_what_if(d: Diagnosis) -> WhatIf | None:
    run = d.run
    if run.itl_p50_ms is None or run.itl_p99_ms is None or run.ttft_p50_ms is None:
        return None
    bytes_per_token = d.model.kv_bytes_per_token(d.roofline.kv_dtype)
    kv_bytes = run.prompt_p50 * bytes_per_token
    per_token_ms = 1e3 * bytes_per_token / TRANSFER_BYTES_PER_S
    transfer_ms = run.prompt_p50 * per_token_ms
    cal = d.calibration
    simulated = pd_simulated(cal, per_token_ms) if cal is not None else None
    if simulated is not None:
        ttft, itl_p99 = simulated.ttft_p50_ms, simulated.itl_p99_ms
    else:
        ttft = run.ttft_p50_ms * PREFILL_SPLIT_SLOWDOWN + transfer_ms
        itl_p99 = run.itl_p50_ms * DECODE_SPLIT_SLOWDOWN * DECODE_ONLY_TAIL
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
    # The simulated pair moves with the plain decode gaps (it was carried by their ratio: module
    # docstring); the constants' tail with the run's ITL p50 it multiplies, their TTFT with the
    # run's TTFT p50.
    carried = {"itl_p99_ms": "itl_p50_ms"}
    if simulated is not None:
        carried["ttft_p50_ms"] = "itl_p50_ms"
    predicted = {"itl_p99_ms": itl_p99, "ttft_p50_ms": ttft}
    ranges = {}
    if simulated is not None and simulated.itl_p99_range is not None:
        ranges["itl_p99_ms"] = list(simulated.itl_p99_range)
    return WhatIf(
        change, effect, predicted, setting, method=method, carried_by=carried, sampling_range=ranges
    )
