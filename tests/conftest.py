"""Session-wide fixtures: tiny checkpoints built once per distinct arguments (see fixtures/checkpoints.py)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

# Tests never reach the network: transformers must not consult the Hub (set before it is imported).
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from fixtures.checkpoints import build_checkpoint, train_tokenizer


@pytest.fixture(scope="session", autouse=True)
def isolated_doctor_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The doctor's caches (quantization speeds, step profiles) start empty in every test session:
    a profile measured by a benchmark on this machine must not change what a test predicts."""
    previous = os.environ.get("KVFLOW_CACHE_DIR")
    os.environ["KVFLOW_CACHE_DIR"] = str(tmp_path_factory.mktemp("kvflow-cache"))
    yield
    if previous is None:
        os.environ.pop("KVFLOW_CACHE_DIR", None)
    else:
        os.environ["KVFLOW_CACHE_DIR"] = previous


if TYPE_CHECKING:
    from fixtures.live_server import LiveServer


@pytest.fixture(scope="session")
def tiny_checkpoint_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`factory(arch, **build_checkpoint_kwargs) -> Path`, cached for the whole session."""
    cache: dict[str, Path] = {}

    def factory(arch: str, **kwargs: Any) -> Path:
        # repr() keys: kwargs may hold unhashable values (a rope dict, a torch.dtype is fine either way).
        key = repr((arch, sorted(kwargs.items())))
        if key not in cache:
            out_dir = tmp_path_factory.mktemp(f"tiny-{arch}")
            cache[key] = build_checkpoint(out_dir, arch, **kwargs)
        return cache[key]

    return factory


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with only the fixture tokenizer's files (no weights)."""
    out_dir = tmp_path_factory.mktemp("tiny-tokenizer")
    train_tokenizer(out_dir)
    return out_dir


@pytest.fixture
def prefill_through_dequantized_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Quantized prefill chunks through the dequantize-and-GEMM blocks (bf16 activations), as on CPUs
    with a bf16 GEMM, rather than the int8-activation GEMV that takes them on AVX2
    (kvflow/quant/linear.py): for tests that check quantized weights against their dequantization
    with tolerances a random model's amplified activation rounding would exceed. The GEMV's own
    error is bounded in tests/quant/test_weight_quant.py. Set in the environment, which
    tensor-parallel workers inherit."""
    from kvflow.quant.linear import QUANTIZED_PREFILL_ENV

    monkeypatch.setenv(QUANTIZED_PREFILL_ENV, "dequantize")


@pytest.fixture(autouse=True, scope="session")
def _one_served_probe_sweep() -> Iterator[None]:
    """The doctor's served probe sweeps its client counts five times and its profile runs seven
    passes on each core count, keeping medians (against a VM's moments of slowness,
    kvflow/doctor/served_decode.py, kvflow/doctor/step_profile.py); the tests that measure a profile
    need one sweep's and one pass's numbers, not their noise (the medians have their own tests): a
    profile of the tiny model took 74 s with seven passes."""
    from kvflow.doctor import served_decode, step_profile

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(served_decode, "SERVED_SWEEPS", 1)
        patch.setattr(step_profile, "PROFILE_PASSES", 1)
        yield


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread() -> None:
    """Tiny models: one thread is faster (no OpenMP hand-off) and immune to the 1000x slowdown two
    spinning OpenMP threads suffer when another process holds one of this machine's two cores."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def server_model_dir(tiny_checkpoint_factory: Callable[..., Path]) -> Path:
    return tiny_checkpoint_factory("llama")


@pytest.fixture(scope="session")
def start_server(server_model_dir: Path) -> Iterator[Callable[..., LiveServer]]:
    """`start_server(server_config_kwargs..., engine=dict)` -> a running LiveServer, stopped at the end."""
    servers: list[LiveServer] = []

    from fixtures.live_server import ENGINE_KWARGS, LiveServer

    from kvflow.server.launcher import ServerConfig

    def start(engine: dict[str, Any] | None = None, **config: Any) -> LiveServer:
        config.setdefault("served_model_name", "tiny-llama")
        server = LiveServer(server_model_dir, ServerConfig(**config), {**ENGINE_KWARGS, **(engine or {})})
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def server(start_server: Callable[..., LiveServer]) -> LiveServer:
    """The shared default server (no API key, no queue limit)."""
    return start_server()
