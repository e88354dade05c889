"""Step 5: is there quantization headroom? Per smaller weight format: the weight memory saved, and the
decode step predicted from the formats' TPOT served on this machine (kvflow/doctor/quant_served.py)
when measured (their ratio at one decode row, the probe's shape; their difference with more), else
from their speed in kvflow quant-eval (kvflow/doctor/quant_speed.py: the step minus the difference
of the formats' ms/token); from the bytes a step reads
only where decode runs near the bandwidth roofline (there, and only there, fewer bytes make faster
steps); otherwise the gain is unknown, and said to be."""

from __future__ import annotations

from typing import Any

from kvflow.doctor.diagnosis import Diagnosis
from kvflow.doctor.finding import QUANTIZATION, Finding, WhatIf

WEIGHT_DTYPES = ("int8", "int4")
# Decode at this share of the bandwidth roofline or above: bytes are the bottleneck.
MEMORY_BOUND_UTILIZATION = 0.5


def _bandwidth_utilization(d: Diagnosis) -> float | None:
    measured = d.run.server.get("decode_step_ms") or d.run.tpot_p50_ms
    if not measured:
        return None
    nbytes = d.roofline.decode_bytes(d.runnable_batch, round(d.run.decode_context))
    return nbytes / (float(measured) / 1e3) / d.roofline.hardware.bandwidth_bytes_s


def _predict(d: Diagnosis, dtype: str, base: float, now_ms: float) -> tuple[float | None, str]:
    """(decode ms/step with `dtype` weights, how it was predicted), None when unknown."""
    now = d.roofline.weight_dtype
    served = d.quant_served_tpot_ms
    if served.get(dtype, 0.0) > 0 and served.get(now, 0.0) > 0:
        # Both formats served as the run was (kvflow/doctor/quant_served.py), stretch and all. A run
        # of one decode row is the probe's shape: the ratio carries (and a machine slower while the
        # probe ran slows both formats alike). With more rows the step reads the weights once for
        # all of them: the saving per step carries, as a difference.
        saved = served[now] - served[dtype]
        source = (
            f"measured served: {served[now]:,.2f} -> {served[dtype]:,.2f} ms/token at one client "
            f"(kvflow serve --quantization {dtype})"
        )
        if d.runnable_batch <= 1:
            return base * served[dtype] / served[now], f"{source}, x{served[dtype] / served[now]:.2f}"
        return max(base - saved, 0.0), f"{source}, saves {saved:,.2f} ms/step"
    speeds = d.quant_speeds
    if dtype in speeds and now in speeds and speeds[dtype] > 0 and speeds[now] > 0:
        # The formats differ in the forward's time per token; what a served step adds around it
        # (scheduling, HTTP) stays: the difference of the measured ms/token carries over, not the ratio.
        saved = 1e3 / speeds[now] - 1e3 / speeds[dtype]
        return max(base - saved, 0.0), (
            f"measured per-format speed: {speeds[now]:,.0f} -> {speeds[dtype]:,.0f} tok/s single-stream "
            f"(kvflow quant-eval), {saved:+,.2f} ms/token"
        )
    utilization = _bandwidth_utilization(d)
    if utilization is None or utilization >= MEMORY_BOUND_UTILIZATION:
        ratio = d.roofline_decode_ms(weight_dtype=dtype) / now_ms
        where = (
            "calculator: memory-bound roofline"
            if utilization is None
            else f"{utilization:.0%} of the roofline"
        )
        return base * ratio, f"bytes per step x{ratio:.2f} ({where})"
    return None, (
        f"unknown: decode runs at {utilization:.0%} of the bandwidth roofline, so bytes are not what it "
        "waits for; measure with `kvflow doctor MODEL --measure-quantization` (runs kvflow quant-eval "
        "and serves each format once per model and machine)"
    )


def check_quantization(d: Diagnosis) -> Finding:
    m, run = d.model, d.run
    now = d.roofline.weight_dtype
    now_ms = d.roofline_decode_ms()
    evidence: dict[str, Any] = {
        "weight_dtype": now,
        "weight_bytes": m.weight_bytes(now),
        "bytes_per_param": m.weight_bytes(now) / m.num_params,
        "bandwidth_utilization": _bandwidth_utilization(d),
        "measured_decode_tokens_per_s": d.quant_speeds or None,
        "measured_served_tpot_ms": d.quant_served_tpot_ms or None,
        "quality_cost": "unknown here: measure it with `kvflow quant-eval MODEL_DIR --quantization "
        "int8|int4` (KL divergence, top-1 agreement, perplexity on your text)",
    }
    what_ifs = []
    for dtype in WEIGHT_DTYPES:
        if m.weight_bytes(dtype) >= m.weight_bytes(now):
            continue
        base = run.tpot_p50_ms if run.tpot_p50_ms else now_ms
        predicted, method = _predict(d, dtype, base, now_ms)
        memory = f"weights {m.weight_bytes(now) / 1e9:,.2f} -> {m.weight_bytes(dtype) / 1e9:,.2f} GB"
        if predicted is None:
            what_ifs.append(
                WhatIf(
                    f"{dtype} weights",
                    f"{memory}; decode speed {method}; quality cost unknown",
                    {"weight_bytes": m.weight_bytes(dtype)},
                    method="unknown",
                )
            )
            continue
        setting = {"quantization": dtype} if d.settings.server == "kvflow" else None
        what_ifs.append(
            WhatIf(
                f"{dtype} weights",
                f"decode {base:,.2f} -> {predicted:,.2f} ms/step ({method}); {memory}; quality cost unknown",
                {"decode_ms_per_step": predicted, "weight_bytes": m.weight_bytes(dtype)},
                setting,
                method=method,
            )
        )
    if not what_ifs:
        return QUANTIZATION.answer("ok", f"weights are already {now}", "no smaller format", evidence)
    return QUANTIZATION.answer(
        "info",
        f"weights in {now} ({evidence['bytes_per_param']:.2f} bytes/param): {what_ifs[-1].effect}",
        "smaller weights save memory; they save decode time only where decode waits for bytes",
        evidence,
        what_ifs,
    )
