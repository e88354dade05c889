"""Measured decode speed per weight format, for one model on one machine.

Whether int8 or int4 weights decode faster than bf16 depends on the kernels and the machine, not
on bytes alone: far below the bandwidth roofline, fewer bytes buy nothing (on one CPU int8 and int4
were slower than bf16; after new GEMV kernels int4 became the fastest). So the quantization what-if
uses speeds measured by `kvflow quant-eval` (single-stream decode tokens/s of each path), cached per
model and machine in ~/.cache/kvflow/doctor/quant-speed/, or says the gain is unknown.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

QUANT_FORMATS = ("int8", "int4")
# quant-eval scores a short text only: the speed probe is what the doctor needs.
QUANT_EVAL_ARGS = ("--max-tokens", "128", "--window", "64", "--json")
QUANT_EVAL_TIMEOUT_S = 900.0
# quant-eval's decode probe is one short generation per path: the median of a few runs per format.
QUANT_EVAL_RUNS = 3


def cache_dir() -> Path:
    return (
        Path(os.environ.get("KVFLOW_CACHE_DIR", Path.home() / ".cache" / "kvflow")) / "doctor" / "quant-speed"
    )


# The /proc/cpuinfo fields that tell one CPU from another: under a hypervisor the model name is
# often just the vendor's ("AMD EPYC" on a Zen 2 and on a Zen 4 VM alike), and family, model and
# the instruction set (flags: AVX-512, VNNI, AMX pick different kernels) are what set the speeds.
# An Arm kernel names them CPU implementer / CPU part / Features instead.
CPU_ID_FIELDS = (
    "model name",
    "cpu family",
    "model",
    "stepping",
    "flags",
    "CPU implementer",
    "CPU part",
    "Features",
)
# Long fields kept as a short digest in the key.
DIGESTED_FIELDS = ("flags", "Features")


def cpu_identity(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The first processor's CPU_ID_FIELDS from `cpuinfo` (DIGESTED_FIELDS as short digests), or
    the platform's processor string where there is none of them."""
    fields: dict[str, str] = {}
    try:
        for line in cpuinfo.read_text().splitlines():
            if not line.strip():
                break  # the first processor's block ends: every processor of a VM is alike
            key, _, value = line.partition(":")
            key = key.strip()
            if key in CPU_ID_FIELDS:
                fields[key] = value.strip()
    except OSError:
        pass
    if not fields:
        return platform.processor()
    for name in DIGESTED_FIELDS:
        if name in fields:
            fields[name] = hashlib.sha256(fields[name].encode()).hexdigest()[:12]
    return "/".join(fields[name] for name in CPU_ID_FIELDS if name in fields)


def _torch_version() -> str:
    """The installed torch's version, read without importing it (the doctor imports no torch):
    its CPU kernels set the step times as much as the machine does."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "no torch"


def machine_key(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """What a measured speed belongs to besides the model: the CPU (cpu_identity), its core count,
    the architecture and torch. A cache measured on another CPU with the same name must not be
    read here: this project's VMs were a Zen 2 and a Zen 4 under the one name "AMD EPYC", whose
    tiny-model steps and int8/int4 speeds differ (benchmarks/NOTES.md, session 34)."""
    return f"{cpu_identity(cpuinfo)}|{os.cpu_count()}|{platform.machine()}|torch {_torch_version()}"


def model_key(model_dir: str | Path) -> str:
    """config.json and the weight files' names and sizes: a different checkpoint, a different key."""
    path = Path(model_dir)
    parts = [(path / "config.json").read_text()]
    parts += [f"{f.name}:{f.stat().st_size}" for f in sorted(path.glob("*.safetensors"))]
    return "\n".join(parts)


def cache_file(model_dir: str | Path, dtype: str, probe: str = "") -> Path:
    """Where a per-format measurement of this model, machine and unquantized dtype is cached:
    quant-eval's speeds (probe ""), or another probe's (its name in the key and the file's name)."""
    suffix = f"|{probe}" if probe else ""
    key = hashlib.sha256(f"{model_key(model_dir)}|{machine_key()}|{dtype}{suffix}".encode()).hexdigest()[:20]
    return cache_dir() / f"{Path(model_dir).name}-{probe + '-' if probe else ''}{key}.json"


def load_by_format(path: Path, field: str) -> dict[str, float]:
    """{format: value} of the cached measurement's `field`; empty when never measured."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: float(v) for k, v in data.get(field, {}).items()}


def load_speeds(model_dir: str | Path, dtype: str) -> dict[str, float]:
    """{format: decode tokens/s} measured earlier for this model, machine and unquantized dtype
    (the unquantized path under `dtype`); empty when never measured."""
    return load_by_format(cache_file(model_dir, dtype), "decode_tokens_per_s")


def measure_speeds(model_dir: str | Path, dtype: str) -> dict[str, float]:
    """Run `kvflow quant-eval` for each format (a subprocess: the doctor imports no torch) and cache
    the decode speeds; returns {dtype: reference tokens/s, format: tokens/s}."""
    speeds: dict[str, list[float]] = {}
    for fmt in [f for f in QUANT_FORMATS for _ in range(QUANT_EVAL_RUNS)]:
        command = [
            sys.executable,
            "-m",
            "kvflow.cli",
            "quant-eval",
            str(model_dir),
            "--quantization",
            fmt,
            "--dtype",
            dtype,
            *QUANT_EVAL_ARGS,
        ]
        out = subprocess.run(
            command, capture_output=True, text=True, timeout=QUANT_EVAL_TIMEOUT_S, check=True
        )
        report = json.loads(out.stdout)
        for path in report["paths"]:
            label = dtype if path["label"] == "reference" else fmt
            speeds.setdefault(label, []).append(float(path["decode_tokens_per_s"]))
    # Medians over the runs (the reference runs once per format run: its median is the steadiest).
    result = {label: sorted(v)[len(v) // 2] for label, v in speeds.items()}
    target = cache_file(model_dir, dtype)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps({"decode_tokens_per_s": result, "machine": machine_key(), "dtype": dtype}))
    return result
