"""Measured step-time curves (`kvflow profile-steps`, kvflow/engine/step_profile.py) for the
simulator's step cost: what a step of n prompt tokens, or of b decode rows, costs on this machine.

Why: the two-coefficient cost (kvflow/doctor/step_cost.py) is fitted to the server's step means by
kind, so it extrapolates from the step shapes the run had. A run with one running slot has 1-row
decodes and one-prompt prefills; a what-if that lets 8 run prefills 8 prompts in one step, and the
straight line through two small shapes put that step at twice its measured time (the max_num_seqs
what-if's TTFT was off by 69%: benchmarks/NOTES.md, session 23). The curves are measured over the
shapes instead (doubling sizes), and interpolated:

    shape(rows, tokens) = P(tokens + rows) for a step with prompt tokens (a decode row is one more
                          token in the same forward), D(rows) for a decode-only step
    P, D                  piecewise linear through the measured points; beyond the last point the
                          last segment's slope (never negative)
    row_ms_per_key        decode steps at a long context against D: what a query row pays per key
                          it re-reads (kvflow/query_rows.py), the cost of a short chunk after a
                          cached prefix
The profile runs in one process with no server around it; the server's steps cost more (its
thread, the HTTP side, outputs). That difference is added per step kind, fitted to the server's
measured means (kvflow/doctor/calibrate.py). Attention beyond the probes' own short contexts is not
in the curves: a query row's is row_ms_per_key, a prefill chunk's is fitted to the server's steps.

Measured once per model, machine, dtype and quantization, cached in ~/.cache/kvflow/doctor/
step-profile/ (`kvflow doctor --profile-steps` measures; later runs read the cache).
"""

from __future__ import annotations

import hashlib
import json
import statistics
import subprocess
import sys
from bisect import bisect_left
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvflow.doctor.quant_speed import cache_dir as quant_cache_dir
from kvflow.doctor.quant_speed import machine_key, model_key

PROFILE_TIMEOUT_S = 900.0
# The shapes probed: decode batches up to this many rows, prompts up to this many tokens (or the
# model's context): what-ifs reach past the server's own settings.
PROFILE_MAX_NUM_SEQS = 32
PROFILE_MAX_TOKENS = 1024
# The context of the decode probes (kvflow/engine/step_profile.py: a 16-token prompt, 12 outputs): the
# keys a probed decode row attends, on average.
DECODE_PROBE_CONTEXT = 16 + 12 / 2
# What the profile measures (in the cache key, so that a doctor whose profile gained a probe measures
# again rather than reading an older profile without it): 2 added the decode steps at a long context.
PROFILE_FORMAT = 2


@dataclass(frozen=True)
class Curve:
    """Piecewise-linear ms over sizes (sorted); the last slope beyond the last point."""

    sizes: tuple[int, ...]
    ms: tuple[float, ...]

    def __call__(self, n: float) -> float:
        xs, ys = self.sizes, self.ms
        if len(xs) == 1:
            return ys[0]
        if n <= xs[0]:
            return ys[0]
        if n > xs[-1]:  # beyond the last point: its segment's slope, never falling
            return ys[-1] + max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0) * (n - xs[-1])
        i = bisect_left(xs, n)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) / (x1 - x0) * (n - x0)

    def slope(self, n: float) -> float:
        """ms per unit of size around n (for what a share of a step's tokens cost)."""
        if len(self.sizes) == 1:
            return 0.0
        i = max(1, min(bisect_left(self.sizes, n), len(self.sizes) - 1))
        dx = self.sizes[i] - self.sizes[i - 1]
        return max((self.ms[i] - self.ms[i - 1]) / dx, 0.0)


@dataclass(frozen=True)
class StepProfile:
    prefill: Curve  # ms of a step of n prompt tokens
    decode: Curve  # ms of a step of b decode rows
    # ms per key a query row reads beyond the decode probes' context, from decode steps at a long
    # context (a row re-reads its context: kvflow/query_rows.py); None: a profile without that probe.
    row_ms_per_key: float | None = None

    def shape_ms(self, rows: int, tokens: int) -> float:
        """A step of `rows` query rows and `tokens` prefill-chunk tokens: the prefill curve at the
        total when there is a prefill chunk (a row is one more token in the same forward), else the
        decode curve."""
        return self.prefill(tokens + rows) if tokens else self.decode(rows)

    @staticmethod
    def row_probe_attention(rows: int) -> float:
        """Keys `rows` probed decode rows read: DECODE_PROBE_CONTEXT each."""
        return rows * DECODE_PROBE_CONTEXT

    @staticmethod
    def prefill_probe_attention(tokens: int) -> float:
        """Keys a probed prompt of `tokens` tokens attended alone, T (T + 1) / 2: a chunk after a
        context attends more."""
        return tokens * (tokens + 1) / 2

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StepProfile | None:
        curves = []
        for key in ("prefill_ms", "decode_ms"):
            points = sorted((int(k), float(v)) for k, v in (data.get(key) or {}).items())
            if not points:
                return None
            curves.append(Curve(tuple(p[0] for p in points), tuple(p[1] for p in points)))
        return cls(curves[0], curves[1], _row_ms_per_key(data, curves[1]))


def _row_ms_per_key(data: dict[str, Any], decode: Curve) -> float | None:
    """The decode steps at a long context against the short-context curve: ms per key per row
    (median over the probed batch sizes, never negative); None without the probe."""
    at_context = {int(b): float(ms) for b, ms in (data.get("decode_context_ms") or {}).items()}
    keys = {int(b): float(k) for b, k in (data.get("decode_context_keys") or {}).items()}
    per_key = [
        (ms - decode(b)) / (b * (keys[b] - DECODE_PROBE_CONTEXT))
        for b, ms in at_context.items()
        if b > 0 and keys.get(b, 0.0) > 2 * DECODE_PROBE_CONTEXT  # far enough to measure a slope
    ]
    return max(statistics.median(per_key), 0.0) if per_key else None


def profile_file(model_dir: str | Path, dtype: str, quantization: str | None) -> Path:
    """Where the profile of this model, machine, dtype and quantization is cached."""
    key = f"{model_key(model_dir)}|{machine_key()}|{dtype}|{quantization}|{PROFILE_FORMAT}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return quant_cache_dir().parent / "step-profile" / f"{Path(model_dir).name}-{digest}.json"


def load_profile(model_dir: str | Path, dtype: str, quantization: str | None) -> StepProfile | None:
    """The profile measured earlier for this model, machine, dtype and quantization, or None."""
    try:
        return StepProfile.from_json(json.loads(profile_file(model_dir, dtype, quantization).read_text()))
    except (OSError, ValueError, KeyError):
        return None


def measure_profile(
    model_dir: str | Path, dtype: str, quantization: str | None, max_model_len: int | None
) -> StepProfile | None:
    """Run `kvflow profile-steps` (a subprocess: the doctor imports no torch) and cache it."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    longest = int(config.get("max_position_embeddings") or PROFILE_MAX_TOKENS + 1)
    context = min(max_model_len or longest, longest, PROFILE_MAX_TOKENS + 1)
    command = [
        sys.executable, "-m", "kvflow.cli", "profile-steps", str(model_dir), "--dtype", dtype,
        "--max-model-len", str(context), "--max-num-seqs", str(PROFILE_MAX_NUM_SEQS),
        "--max-num-batched-tokens", str(max(context - 1, PROFILE_MAX_NUM_SEQS)),
    ]  # fmt: skip
    if quantization and quantization != "none":
        command += ["--quantization", quantization]
    out = subprocess.run(command, capture_output=True, text=True, timeout=PROFILE_TIMEOUT_S, check=True)
    data = json.loads(out.stdout.strip().splitlines()[-1])
    target = profile_file(model_dir, dtype, quantization)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps({**data, "machine": machine_key(), "dtype": dtype}))
    return StepProfile.from_json(data)
