"""What each weight format's decode costs when served: `kvflow serve --quantization FORMAT` on this
machine, one streaming client (kvflow bench), the client's TPOT p50 per format.

Why not kvflow quant-eval's speeds alone (kvflow/doctor/quant_speed.py): quant-eval times the forward
in one process, and a served step is not that forward plus a constant. On a 2-core Zen 2 the bundled
model's served TPOT was 3.98 ms in bf16, 2.51 in int8 and 2.10 in int4, where the engine alone took
2.25, 1.31 and 0.95 and quant-eval 2.00, 1.41 and 0.84 (session 31). The served step is the engine's
stretched (about 1.4x here: the API thread and the client share the cores its threads run on) plus
a constant, so quant-eval's saving (1.16 ms for int4) carried as a difference under-predicted the
served one (1.88), and as a ratio over-predicted it; the int4 what-if missed by 15-29%.

    served_tpot_ms[format]  the median over QUANT_SERVED_RUNS runs, each format served in turn
                            within a run (a VM drifting for seconds moves every format alike)

Cached beside quant-eval's speeds, per model, machine and unquantized dtype; measured on
`kvflow doctor MODEL --measure-quantization`.
"""

from __future__ import annotations

import json
import logging
import statistics
from collections.abc import Sequence
from pathlib import Path

import httpx

from kvflow.bench.runner import run_benchmark
from kvflow.doctor.quant_speed import cache_file, load_by_format, machine_key
from kvflow.doctor.served_decode import MIN_PROBE_REQUESTS, probe_config
from kvflow.server.spawn import spawn_server, stop_server

logger = logging.getLogger(__name__)

# Runs over every format: one served TPOT moved 2.43 -> 2.86 ms between two runs of the same int8
# server (session 31), the median of three held within 4% of each other run's.
QUANT_SERVED_RUNS = 3
UNQUANTIZED = "none"  # kvflow serve's --quantization for the reference weights


PROBE = "served"  # its cache file's name beside quant-eval's (quant_speed.cache_file)


def load_served_tpot(model_dir: str | Path, dtype: str) -> dict[str, float]:
    """{format: served TPOT p50 ms} measured earlier for this model, machine and unquantized dtype
    (the reference weights under `dtype`); empty when never measured."""
    return load_by_format(cache_file(model_dir, dtype, PROBE), "served_tpot_ms")


def _served_tpot(model_dir: str | Path, flags: Sequence[str], seed: int) -> float | None:
    """One `kvflow serve MODEL flags`, one client streaming the served probe's requests (other
    prompts each seed: no prefix-cache hits): the client's TPOT p50, None without one."""
    process, base = spawn_server(model_dir, list(flags))
    try:
        result = run_benchmark(probe_config(base, 1, MIN_PROBE_REQUESTS, seed, seed))
    finally:
        stop_server(process)
    tpot = (result.get("tpot_ms") or {}).get("p50")
    return float(tpot) if tpot else None


def measure_served_tpot(model_dir: str | Path, dtype: str, formats: Sequence[str]) -> dict[str, float]:
    """Serve the model under `dtype` unquantized and in each of `formats`, one client each, and cache
    {dtype: its TPOT p50 ms, format: TPOT p50 ms} (formats whose probe produced a TPOT; a format the
    server cannot load is left out with a warning, and its what-if falls back to quant-eval's)."""
    labels = [(dtype, UNQUANTIZED), *((fmt, fmt) for fmt in formats)]
    seen: dict[str, list[float]] = {}
    for run in range(QUANT_SERVED_RUNS):
        for label, quantization in labels:
            flags = ["--dtype", dtype, "--quantization", quantization]
            try:
                tpot = _served_tpot(model_dir, flags, seed=run)
            except (OSError, RuntimeError, ValueError, httpx.HTTPError) as exc:  # the others stand
                logger.warning("serving %s with %s failed (%s): no served TPOT for it", model_dir, flags, exc)
                continue
            if tpot is not None:
                seen.setdefault(label, []).append(tpot)
    result = {label: statistics.median(values) for label, values in seen.items()}
    target = cache_file(model_dir, dtype, PROBE)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps({"served_tpot_ms": result, "machine": machine_key(), "dtype": dtype}))
    return result
