"""Served TPOT per weight format (kvflow/doctor/quant_served.py): a real `kvflow serve` of the tiny
model in each format, one streaming client, cached per model and machine; runs interleave the
formats and keep medians."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvflow.bench.runner import BenchConfig
from kvflow.doctor import quant_served
from kvflow.doctor.quant_served import QUANT_SERVED_RUNS, load_served_tpot, measure_served_tpot
from kvflow.doctor.quant_speed import machine_key


def test_each_format_is_served_and_its_tpot_cached(
    server_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(quant_served, "QUANT_SERVED_RUNS", 1)  # one run's numbers, not their noise
    assert load_served_tpot(server_model_dir, "float32") == {}
    served = measure_served_tpot(server_model_dir, "float32", ["int8"])
    assert set(served) == {"float32", "int8"} and all(ms > 0 for ms in served.values())
    assert load_served_tpot(server_model_dir, "float32") == served
    assert load_served_tpot(server_model_dir, "bfloat16") == {}  # another dtype: not measured


def test_runs_interleave_the_formats_and_keep_each_formats_median(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A VM slowing for a few seconds slows every format of that run, and the median drops it."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "cache"))
    served_order: list[tuple[str, int]] = []
    current: list[str] = []
    slow_run = {0: 1.0, 1: 1.5, 2: 1.1}
    tpot = {"none": 4.0, "int8": 2.5, "int4": 2.0}

    def spawn(model: Any, flags: list[str]) -> tuple[None, str]:
        current[:] = [flags[flags.index("--quantization") + 1]]
        return None, "http://127.0.0.1:1"

    def bench(config: BenchConfig) -> dict[str, Any]:
        run = config.load.seed
        served_order.append((current[0], run))
        return {"tpot_ms": {"p50": tpot[current[0]] * slow_run[run]}}

    monkeypatch.setattr(quant_served, "spawn_server", spawn)
    monkeypatch.setattr(quant_served, "stop_server", lambda process: None)
    monkeypatch.setattr(quant_served, "run_benchmark", bench)
    served = measure_served_tpot(tmp_path / "m", "bfloat16", ["int8", "int4"])
    assert served_order == [(q, r) for r in range(QUANT_SERVED_RUNS) for q in ("none", "int8", "int4")]
    assert served == {"bfloat16": pytest.approx(4.4), "int8": pytest.approx(2.75), "int4": pytest.approx(2.2)}


def test_a_format_the_server_cannot_load_is_left_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "cache"))

    def spawn(model: Any, flags: list[str]) -> tuple[None, str]:
        if "int4" in flags:
            raise RuntimeError("kvflow serve exited during start-up")
        return None, "http://127.0.0.1:1"

    monkeypatch.setattr(quant_served, "spawn_server", spawn)
    monkeypatch.setattr(quant_served, "stop_server", lambda process: None)
    monkeypatch.setattr(quant_served, "run_benchmark", lambda config: {"tpot_ms": {"p50": 3.0}})
    assert measure_served_tpot(tmp_path / "m", "bfloat16", ["int8", "int4"]) == {"bfloat16": 3.0, "int8": 3.0}


def test_two_cpus_under_one_model_name_get_their_own_caches(tmp_path: Path) -> None:
    """A hypervisor shows "AMD EPYC" for a Zen 2 and a Zen 4 alike: the cache key must tell them
    apart by family, model and instruction set, or one machine's speeds are read on the other."""

    def cpuinfo(name: str, family: str, model: str, flags: str) -> Path:
        block = f"processor\t: 0\nmodel name\t: {name}\ncpu family\t: {family}\nmodel\t\t: {model}\n"
        path = tmp_path / f"cpuinfo-{family}-{model}-{len(flags)}"
        path.write_text(block + f"stepping\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\nmodel name\t: other\n")
        return path

    zen2 = machine_key(cpuinfo("AMD EPYC", "23", "49", "fpu sse avx2"))
    zen4 = machine_key(cpuinfo("AMD EPYC", "25", "17", "fpu sse avx2 avx512f avx512_vnni"))
    same_family_other_isa = machine_key(cpuinfo("AMD EPYC", "23", "49", "fpu sse avx2 avx512f"))
    assert len({zen2, zen4, same_family_other_isa}) == 3
    # Stable: the same CPU finds its cache again.
    assert machine_key(cpuinfo("AMD EPYC", "23", "49", "fpu sse avx2")) == zen2
    assert "other" not in zen2  # the first processor's block only
    # An Arm kernel's fields: implementer, part and features tell its CPUs apart.
    arm = tmp_path / "cpuinfo-arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd sve\nCPU implementer\t: 0x41\nCPU part\t: 0xd40\n")
    other_arm = tmp_path / "cpuinfo-arm2"
    other_arm.write_text("processor\t: 0\nFeatures\t: fp asimd\nCPU implementer\t: 0x41\nCPU part\t: 0xd0c\n")
    assert machine_key(arm) != machine_key(other_arm)
