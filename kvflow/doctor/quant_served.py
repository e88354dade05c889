"""What each weight format's decode costs when served: `kvflow serve --quantization FORMAT` on this
machine, one streaming client (kvflow bench), the client's TPOT p50 per format.

Why not kvflow quant-eval's speeds alone (kvflow/doctor/quant_speed.py): quant-eval times the forward
in one process, and a served step is not that forward plus a constant. On a 2-core Zen 2 the bundled
model's served TPOT was 3.98 ms in bf16, 2.51 in int8 and 2.10 in int4, where the engine alone took
2.25, 1.31 and 0.95 and quant-eval 2.00, 1.41 and 0.84 (session 31). The served step is the engine's
stretched (about 1.4x here: the API thread and the client share the cores its threads run on) plus
a constant, so quant-eval's saving (1.16 ms for int4) carried as a difference under-predicted the
served one (1.88), and as a ratio over-predicted it; the int4 what-if missed by 15-29%.

    served_tpot_ms[dtype]   the reference's (unquantized) TPOT, the median over every round
    served_tpot_ms[format]  that times the median over QUANT_SERVED_ROUNDS rounds of the format's
                            TPOT over the reference's in the round: the reference's server stays
                            up, each format's is started beside it in turn, and each round runs
                            the probe on one, then the other, a second or so apart

Why paired rounds: this VM's speed moves in stretches of a second or so, and a format served a
few seconds after the reference (each in its own server, started in turn) read int4's served TPOT
at 0.72-1.15x bf16's over six runs, and a median of three at 1.05x (int8 1.06x) put the int4
what-if's decode step 31% high in one verify run, where its changed runs measured 0.74-0.96x
(session 42). Eight rounds beside the reference read int4 at 0.76-0.90x, median 0.81, int8 0.87.
It needs the reference and one format in memory at once (MEMORY_HEADROOM); a machine that cannot
hold both measures nothing here and the what-if falls back to quant-eval's speeds.

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

# Rounds per format (module docstring): eight read int4's ratio at 0.76-0.90, one round about 3 s
# on the bundled tiny model. Odd: the median is a round's.
QUANT_SERVED_ROUNDS = 7
# The reference and a format both up: the weight files' bytes twice (a quantized copy is smaller,
# and loading holds the file's tensors), times this for the activations, the KV pool and the rest.
MEMORY_HEADROOM = 1.5
UNQUANTIZED = "none"  # kvflow serve's --quantization for the reference weights


PROBE = "served"  # its cache file's name beside quant-eval's (quant_speed.cache_file)
WEIGHT_FILES = ("*.safetensors", "*.gguf", "*.bin")


def load_served_tpot(model_dir: str | Path, dtype: str) -> dict[str, float]:
    """{format: served TPOT p50 ms} measured earlier for this model, machine and unquantized dtype
    (the reference weights under `dtype`); empty when never measured."""
    return load_by_format(cache_file(model_dir, dtype, PROBE), "served_tpot_ms")


def _probe_tpot(base: str, seed: int) -> float | None:
    """One client streaming the served probe's requests to the server at `base` (other prompts each
    seed: no prefix-cache hits): the client's TPOT p50, None without one."""
    result = run_benchmark(probe_config(base, 1, MIN_PROBE_REQUESTS, seed, seed))
    tpot = (result.get("tpot_ms") or {}).get("p50")
    return float(tpot) if tpot else None


def _weight_bytes(model: str | Path) -> int:
    """The checkpoint's weight files' bytes (safetensors, a GGUF file, PyTorch bins); a model given
    as one file (a GGUF file) is that file's."""
    path = Path(model)
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for pattern in WEIGHT_FILES for f in path.glob(pattern))


def available_memory_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """MemAvailable (what can be allocated without swapping), None where the kernel does not say."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def fits_beside(model_dir: str | Path, available: int | None) -> bool:
    """Whether the reference and one format can both be up: twice the weight files' bytes, with
    MEMORY_HEADROOM, within `available` (None: unknown, tried)."""
    return available is None or 2 * MEMORY_HEADROOM * _weight_bytes(model_dir) <= available


def _rounds_beside(
    reference: str, model_dir: str | Path, flags: list[str], first_seed: int
) -> list[tuple[float, float]]:
    """The format served by `flags` started beside the reference at `reference`: QUANT_SERVED_ROUNDS
    rounds of (the reference's TPOT, the format's), each round the probe on one, then the other."""
    process, base = spawn_server(model_dir, flags)
    pairs: list[tuple[float, float]] = []
    try:
        for round_index in range(QUANT_SERVED_ROUNDS):
            seed = first_seed + round_index
            ref, got = _probe_tpot(reference, seed), _probe_tpot(base, seed)
            if ref and got:
                pairs.append((ref, got))
    finally:
        stop_server(process)
    return pairs


def measure_served_tpot(model_dir: str | Path, dtype: str, formats: Sequence[str]) -> dict[str, float]:
    """Serve the model under `dtype` unquantized and, beside it, each of `formats` in turn, one
    client each, and cache {dtype: its TPOT p50 ms, format: TPOT p50 ms} (module docstring; formats
    whose probe produced a TPOT: a format the server cannot load is left out with a warning, and its
    what-if falls back to quant-eval's). Nothing where the unquantized server cannot start or the
    machine cannot hold two of them (fits_beside)."""
    if not fits_beside(model_dir, available_memory_bytes()):
        logger.warning("%s twice does not fit this machine's memory: no served TPOT per format", model_dir)
        return {}
    errors = (OSError, RuntimeError, ValueError, httpx.HTTPError)
    try:
        reference, base = spawn_server(model_dir, ["--dtype", dtype, "--quantization", UNQUANTIZED])
    except errors as exc:
        logger.warning("serving %s unquantized failed (%s): no served TPOT per format", model_dir, exc)
        return {}
    pairs: dict[str, list[tuple[float, float]]] = {}
    try:
        for index, fmt in enumerate(formats):
            flags = ["--dtype", dtype, "--quantization", fmt]
            try:
                pairs[fmt] = _rounds_beside(base, model_dir, flags, index * QUANT_SERVED_ROUNDS)
            except errors as exc:  # the others stand
                logger.warning("serving %s with %s failed (%s): no served TPOT for it", model_dir, flags, exc)
    finally:
        stop_server(reference)
    references = [ref for rounds in pairs.values() for ref, _ in rounds]
    result = {dtype: statistics.median(references)} if references else {}
    for fmt, rounds in pairs.items():
        if rounds:
            result[fmt] = result[dtype] * statistics.median(got / ref for ref, got in rounds)
    target = cache_file(model_dir, dtype, PROBE)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps({"served_tpot_ms": result, "machine": machine_key(), "dtype": dtype}))
    return result
