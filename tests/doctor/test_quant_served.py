"""Served TPOT per weight format (kvflow/doctor/quant_served.py): a real `kvflow serve` of the tiny
model in each format, one streaming client, cached per model and machine; each format served beside
the unquantized reference, rounds alternating between them, the rounds' ratios kept."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import pytest

from kvflow.bench.runner import BenchConfig
from kvflow.doctor import quant_served
from kvflow.doctor.quant_served import (
    QUANT_SERVED_ROUNDS,
    available_memory_bytes,
    fits_beside,
    load_served_tpot,
    measure_served_tpot,
)
from kvflow.doctor.quant_speed import machine_key


def test_each_format_is_served_and_its_tpot_cached(
    server_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(quant_served, "QUANT_SERVED_ROUNDS", 1)  # one round's numbers, not their noise
    assert load_served_tpot(server_model_dir, "float32") == {}
    served = measure_served_tpot(server_model_dir, "float32", ["int8"])
    assert set(served) == {"float32", "int8"} and all(ms > 0 for ms in served.values())
    assert load_served_tpot(server_model_dir, "float32") == served
    assert load_served_tpot(server_model_dir, "bfloat16") == {}  # another dtype: not measured


class FakeServers:
    """spawn_server / stop_server / run_benchmark stand-ins: each server a port, its TPOT its
    format's times the moment's slowness (the round: the bench's seed), the order recorded."""

    def __init__(self, tpot: dict[str, float], slow: dict[int, float], fail: tuple[str, ...] = ()) -> None:
        self.tpot, self.slow, self.fail = tpot, slow, fail
        self.ports: dict[str, str] = {}
        self.up: list[str] = []
        self.events: list[tuple[str, ...]] = []

    def spawn(self, model: Any, flags: list[str]) -> tuple[str, str]:
        quantization = flags[flags.index("--quantization") + 1]
        if quantization in self.fail:
            raise RuntimeError("kvflow serve exited during start-up")
        self.ports[f"http://127.0.0.1:{len(self.ports) + 1}"] = quantization
        self.up.append(quantization)
        self.events.append(("up", quantization))
        return quantization, f"http://127.0.0.1:{len(self.ports)}"

    def stop(self, process: str) -> None:
        self.up.remove(process)
        self.events.append(("down", process))

    def bench(self, config: BenchConfig) -> dict[str, Any]:
        quantization = self.ports[config.base_url.removesuffix("/v1")]
        assert quantization in self.up
        seed = config.load.seed
        self.events.append(("bench", quantization, str(seed)))
        return {"tpot_ms": {"p50": self.tpot[quantization] * self.slow.get(seed, 1.0)}}

    def patch(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(quant_served, "spawn_server", self.spawn)
        monkeypatch.setattr(quant_served, "stop_server", self.stop)
        monkeypatch.setattr(quant_served, "run_benchmark", self.bench)


def model_dir(tmp_path: Path, weight_bytes: int = 1000) -> Path:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "m" / "model.safetensors").write_bytes(b"\0" * weight_bytes)
    return tmp_path / "m"


def test_each_format_runs_beside_the_reference_and_keeps_the_rounds_ratio(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The VM slowing for a second slows the round's reference and format alike: the ratio of each
    round cancels it, where medians of runs seconds apart had read int4 at 0.72-1.15x bf16."""
    model = model_dir(tmp_path)
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(quant_served, "available_memory_bytes", lambda: None)
    # Every other round (each its own prompts: its own seed) on a slow moment, up to 2x.
    slow = {seed: 1.0 + (seed % 2) * (0.5 + 0.1 * seed) for seed in range(2 * QUANT_SERVED_ROUNDS)}
    servers = FakeServers({"none": 4.0, "int8": 3.2, "int4": 3.0}, slow)
    servers.patch(monkeypatch)
    served = measure_served_tpot(model, "bfloat16", ["int8", "int4"])
    references = sorted(4.0 * slow[seed] for seed in range(2 * QUANT_SERVED_ROUNDS))
    assert served["bfloat16"] == pytest.approx(statistics.median(references))
    assert served["int8"] == pytest.approx(served["bfloat16"] * 0.8)
    assert served["int4"] == pytest.approx(served["bfloat16"] * 0.75)
    assert load_served_tpot(model, "bfloat16") == served
    # The reference up first and throughout; each format up beside it in turn, its rounds
    # alternating reference then format on the same prompts, then down before the next.
    rounds = QUANT_SERVED_ROUNDS
    int8 = [e for r in range(rounds) for e in (("bench", "none", str(r)), ("bench", "int8", str(r)))]
    int4 = [
        e for r in range(rounds, 2 * rounds) for e in (("bench", "none", str(r)), ("bench", "int4", str(r)))
    ]
    expected = [("up", "none"), ("up", "int8"), *int8, ("down", "int8"), ("up", "int4"), *int4]
    assert servers.events == [*expected, ("down", "int4"), ("down", "none")]


def test_a_format_the_server_cannot_load_is_left_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = model_dir(tmp_path)
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(quant_served, "available_memory_bytes", lambda: None)
    FakeServers({"none": 3.0, "int8": 3.0}, {}, fail=("int4",)).patch(monkeypatch)
    assert measure_served_tpot(model, "bfloat16", ["int8", "int4"]) == {"bfloat16": 3.0, "int8": 3.0}
    # No reference, no ratio: nothing.
    FakeServers({}, {}, fail=("none",)).patch(monkeypatch)
    assert measure_served_tpot(model, "bfloat16", ["int8"]) == {}


def test_a_machine_that_cannot_hold_two_servers_measures_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reference and a format both up: twice the weights with headroom. Where that does not fit,
    no server is started (the what-if falls back to quant-eval's speeds)."""
    model = model_dir(tmp_path, weight_bytes=1000)
    assert fits_beside(model, 3000) and not fits_beside(model, 2999) and fits_beside(model, None)
    gguf = tmp_path / "tiny.gguf"  # a model given as one file
    gguf.write_bytes(b"\0" * 1000)
    assert fits_beside(gguf, 3000) and not fits_beside(gguf, 2999)
    monkeypatch.setattr(quant_served, "available_memory_bytes", lambda: 2999)
    servers = FakeServers({"none": 3.0, "int8": 2.0}, {})
    servers.patch(monkeypatch)
    assert measure_served_tpot(model, "bfloat16", ["int8"]) == {}
    assert servers.events == []
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(
        "MemTotal:       24000000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n"
    )
    assert available_memory_bytes(meminfo) == 20000000 * 1024
    meminfo.write_text("MemTotal:       24000000 kB\n")
    assert available_memory_bytes(meminfo) is None
    assert available_memory_bytes(tmp_path / "absent") is None


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
