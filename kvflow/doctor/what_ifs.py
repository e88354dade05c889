"""What-ifs more than one check offers: each predicted by the simulator calibrated on the run
(kvflow/doctor/calibrate.py) when there is one, else by the per-token formula of docs/doctor.md,
and carrying the setting or workload change `--verify` applies."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvflow.doctor.diagnosis import Diagnosis
from kvflow.doctor.finding import WhatIf
from kvflow.doctor.model_spec import ModelSpec

SIMULATED = "simulated: the run's requests replayed under the change, step costs fitted to its step times"
# Enough KV blocks for the p95 request of every client, with this much slack.
KV_HEADROOM = 1.25
PROMPT_WORTH_CUTTING = 0.2  # the prompt's prefill is at least this share of TTFT


@dataclass(frozen=True)
class Simulated:
    """Each metric's measured value moved by the simulated effect of a change, and the measured
    metric each moves with (Calibration.carried_by: `--verify` carries it to a fresh baseline by
    that metric's ratio, as the prediction was carried from the run)."""

    values: dict[str, float]
    carried_by: dict[str, str]
    sampling_range: dict[str, list[float]]

    def __getitem__(self, metric: str) -> float:
        return self.values[metric]

    def what_if(
        self,
        change: str,
        effect: str,
        setting: dict[str, Any] | None = None,
        workload: dict[str, Any] | None = None,
    ) -> WhatIf:
        return WhatIf(
            change,
            effect,
            dict(self.values),
            setting,
            workload,
            SIMULATED,
            carried_by=dict(self.carried_by),
            sampling_range={m: list(r) for m, r in self.sampling_range.items()},
        )


def simulated(d: Diagnosis, metrics: tuple[str, ...], **change: Any) -> Simulated | None:
    """Each metric's measured value moved by the simulated effect of `change`; None without a
    calibrated simulator."""
    cal = d.calibration
    if cal is None:
        return None
    changed = cal.run(**change)
    if changed.num_requests < d.run.num_requests:  # the change would cap requests: no like-for-like
        return None
    values, carried_by, ranges = {}, {}, {}
    for metric in metrics:
        value = d.run.metric(metric)
        if value is not None:
            values[metric] = cal.predict(metric, value, changed)
            if (by := cal.carried_by(metric, changed)) != metric:
                carried_by[metric] = by
            if (spread := cal.replay_range(metric, changed)) is not None:
                ranges[metric] = list(spread)
    return Simulated(values, carried_by, ranges)


def _kvflow(d: Diagnosis, setting: dict[str, Any]) -> dict[str, Any] | None:
    return setting if d.settings.server == "kvflow" else None


def prefix_caching_what_if(d: Diagnosis) -> WhatIf | None:
    cached = d.cacheable_tokens()
    run = d.run
    if cached <= 0 or run.ttft_p50_ms is None:
        return None
    change = "cache the {:,.0f}-token repeated prefix (prefix caching{})".format(
        cached, " on" if d.settings.enable_prefix_caching is False else " effective"
    )
    setting = _kvflow(d, {"enable_prefix_caching": True})
    sim = simulated(d, ("ttft_p50_ms",), enable_prefix_caching=True)
    if sim is not None:
        return sim.what_if(
            change, f"p50 TTFT {run.ttft_p50_ms:,.1f} -> {sim['ttft_p50_ms']:,.1f} ms", setting
        )
    slope = d.measured_prefill_ms_per_token()
    if slope is None:
        return None
    saved = slope * cached
    predicted = max(run.ttft_p50_ms - saved, 0.0)
    return WhatIf(
        change,
        f"p50 TTFT {run.ttft_p50_ms:,.1f} ms -> {predicted:,.1f} ms ({saved:,.1f} ms of prefill at "
        f"{slope:.3f} ms/token measured)",
        {"ttft_p50_ms": predicted},
        setting,
        method="prefill ms/token x cached tokens",
    )


def cut_prompt_what_if(d: Diagnosis, scale: float = 0.75) -> WhatIf | None:
    """Cut a quarter of every prompt: TTFT falls by the prefill of the tokens cut (and the queueing
    that prefill caused, which the simulator sees). Offered where the prompt's prefill is a
    noticeable part of TTFT: elsewhere the change is lost in the noise."""
    run = d.run
    cut = round(run.prompt_p50 * (1 - scale))
    slope = d.measured_prefill_ms_per_token()
    if cut <= 0 or run.ttft_p50_ms is None or slope is None:
        return None
    if slope * d.uncached_prompt_tokens() < PROMPT_WORTH_CUTTING * run.ttft_p50_ms:
        return None
    change = f"cut {cut:,} tokens ({1 - scale:.0%}) from every prompt"
    workload = {"input_len_scale": scale}
    sim = simulated(d, ("ttft_p50_ms", "e2e_p50_ms"), prompt_scale=scale)
    if sim is not None:
        return sim.what_if(
            change,
            f"p50 TTFT {run.ttft_p50_ms:,.1f} -> {sim['ttft_p50_ms']:,.1f} ms, and {cut:,} fewer KV tokens "
            "per request",
            workload=workload,
        )
    predicted = max(run.ttft_p50_ms - slope * cut, 0.0)
    return WhatIf(
        change,
        f"p50 TTFT {run.ttft_p50_ms:,.1f} ms -> {predicted:,.1f} ms ({slope:.3f} ms/token), and {cut:,} "
        "fewer KV tokens per request",
        {"ttft_p50_ms": predicted},
        workload=workload,
        method="prefill ms/token x tokens cut",
    )


def budget_what_ifs(d: Diagnosis, factors: tuple[float, ...]) -> list[WhatIf]:
    """The token budget (the prefill chunk) scaled by each factor: a smaller chunk stalls the decodes
    sharing its step for less but takes more steps to prefill (and queues new prompts longer)."""
    budget = d.settings.max_num_batched_tokens
    if budget is None or d.calibration is None:
        return []
    what_ifs = []
    for factor in factors:
        new = max(d.block_size, int(budget * factor))
        if new == budget:
            continue
        sim = simulated(d, ("itl_p99_ms", "ttft_p50_ms"), max_num_batched_tokens=new)
        if sim is None:
            continue
        what_ifs.append(
            sim.what_if(
                f"max_num_batched_tokens {budget} -> {new}",
                f"ITL p99 {d.run.itl_p99_ms or 0:,.1f} -> {sim['itl_p99_ms']:,.1f} ms, p50 TTFT "
                f"{d.run.ttft_p50_ms or 0:,.1f} -> {sim['ttft_p50_ms']:,.1f} ms",
                _kvflow(d, {"max_num_batched_tokens": new}),
            )
        )
    return what_ifs


def blocks_for(d: Diagnosis, num_requests: int) -> int:
    """KV blocks for `num_requests` requests of p95 length, with slack: a request's blocks in every
    cache group (a sliding window's and a state's flat in its length). Usable blocks, as kvflow's
    num_kv_blocks counts them (the engine adds its null block on top)."""
    per_request = d.kv_config.num_blocks_held(max(1, math.ceil(d.run.request_len_p95)))
    return math.ceil(KV_HEADROOM * num_requests * per_request)


def max_num_seqs_what_if(d: Diagnosis) -> WhatIf | None:
    """Let every client's request run: max_num_seqs up to the concurrency, with the KV blocks they
    need when the pool holds fewer (a kvflow pool sized by default follows max_num_seqs, a pool
    set by hand does not: the what-if sets both, so that it means the same on either)."""
    now = d.settings.max_num_seqs
    if now is None:
        return None
    target = math.ceil(d.run.concurrency)
    if target <= now:
        return None
    setting: dict[str, Any] = {"max_num_seqs": target}
    change = f"max_num_seqs {now} -> {target}"
    blocks = d.settings.num_kv_blocks
    if blocks is not None and blocks < blocks_for(d, target):
        setting["num_kv_blocks"] = blocks_for(d, target)
        change += f" (and num_kv_blocks {blocks} -> {setting['num_kv_blocks']}, so that they fit)"
    sim = simulated(d, ("ttft_p50_ms", "e2e_p50_ms"), **setting)
    if sim is not None:
        effect = (
            f"p50 TTFT {d.run.ttft_p50_ms or 0:,.1f} -> {sim['ttft_p50_ms']:,.1f} ms (steps batch more rows)"
        )
        return sim.what_if(change, effect, _kvflow(d, setting))
    queue, ttft = d.run.queue_ms, d.run.ttft_p50_ms
    if queue is None or ttft is None:
        effect = "TTFT falls by the queueing; not quantified (the server exports no queue time)"
        return WhatIf(change, effect, setting=_kvflow(d, setting))
    predicted = max(ttft - queue, 0.0)
    effect = f"p50 TTFT {ttft:,.1f} -> about {predicted:,.1f} ms without the queueing"
    return WhatIf(
        change,
        effect,
        {"ttft_p50_ms": predicted},
        _kvflow(d, setting),
        method="TTFT minus the measured queue time",
    )


def kv_blocks_what_if(d: Diagnosis) -> WhatIf | None:
    """A pool that holds every client's p95 request: no preemption, no wait for blocks."""
    blocks = d.settings.num_kv_blocks
    if blocks is None:
        return None
    target = blocks_for(d, d.running_capacity)
    if target <= blocks:
        return None
    change = f"num_kv_blocks {blocks} -> {target} (the p95 request of every client, 25% spare)"
    setting = _kvflow(d, {"num_kv_blocks": target})
    sim = simulated(d, ("itl_p99_ms", "ttft_p50_ms"), num_kv_blocks=target)
    if sim is None:
        return WhatIf(change, "no preemption and no wait for blocks; not quantified", setting=setting)
    effect = (
        f"ITL p99 {d.run.itl_p99_ms or 0:,.1f} -> {sim['itl_p99_ms']:,.1f} ms, p50 TTFT "
        f"{d.run.ttft_p50_ms or 0:,.1f} -> {sim['ttft_p50_ms']:,.1f} ms"
    )
    return sim.what_if(change, effect, setting)


# The batch the mixture-of-experts what-if compares against (the "batch 8 reads N of E").
MOE_WHAT_IF_BATCH = 8


def moe_batch_what_if(model: ModelSpec, weight_dtype: str, batch: int) -> WhatIf | None:
    """For a MoE model: the experts and weight bytes a decode step reads at batch 8 against `batch`
    (or against 1 when the batch is 8): B tokens touch E x (1 - (1 - k/E)^B) experts per layer
    (kvflow/doctor/moe_spec.py), so the bytes per token fall with the batch far less than for a
    dense model."""
    moe = model.moe_layer
    if moe is None:
        return None
    other = batch if batch != MOE_WHAT_IF_BATCH else 1
    read = model.experts_read_per_layer(MOE_WHAT_IF_BATCH)
    bytes_8 = model.decode_weight_bytes(weight_dtype, MOE_WHAT_IF_BATCH)
    bytes_other = model.decode_weight_bytes(weight_dtype, other)
    return WhatIf(
        change=f"decode batch {MOE_WHAT_IF_BATCH} instead of {other}",
        effect=(
            f"batch {MOE_WHAT_IF_BATCH} reads {read:.1f} of {moe.num_experts} experts per layer "
            f"(batch {other}: {model.experts_read_per_layer(other):.1f}): {bytes_8 / 1e9:,.2f} GB of weights "
            f"per step instead of {bytes_other / 1e9:,.2f} GB, {bytes_8 / bytes_other:.2f}x the bytes for "
            f"{MOE_WHAT_IF_BATCH / other:.2f}x the tokens"
        ),
        predicted={
            "moe_experts_read_per_layer": read,
            "decode_weight_bytes": bytes_8,
        },
        method="expected distinct experts of top-k routing, uniform over experts",
    )
