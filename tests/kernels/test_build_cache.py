"""The native kernels' build cache (kvflow/kernels/build_cache.py): a build killed while it holds the
lock never blocks the next start, a live build is waited for with a message and a bound, and the
cache is keyed so that environments do not rebuild each other's kernels.

The lock is tested with a stand-in build (a Python callable in a subprocess), not by compiling the
real kernels: their build takes minutes. `native_build()` goes through the same `locked_build`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvflow.kernels import _LDFLAGS, AVX2, AVX512_BF16, native_build_dir, simd_target
from kvflow.kernels.build_cache import (
    CACHE_ENV,
    BuildLockTimeout,
    build_dir_for,
    locked_build,
    sources_key,
    toolchain_key,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
# A generous bound for "promptly": the subprocess start and a lock poll take well under a second.
PROMPTLY_S = 30.0

# A process that starts a build and never finishes it: it marks that it holds the lock, then sleeps
# until it is killed.
_HANGING_BUILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from kvflow.kernels.build_cache import locked_build

    build_dir, marker = Path(sys.argv[1]), Path(sys.argv[2])

    def build(directory):
        marker.write_text("building")
        time.sleep(3600)

    locked_build(build_dir, build, "stand-in kernels")
    """
)


def _start_hanging_build(build_dir: Path, marker: Path) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(
        [sys.executable, "-c", _HANGING_BUILD, str(build_dir), str(marker)], cwd=REPO_ROOT
    )
    deadline = time.monotonic() + PROMPTLY_S
    while not marker.exists():
        assert process.poll() is None, "the stand-in build exited early"
        assert time.monotonic() < deadline, "the stand-in build never took the lock"
        time.sleep(0.05)
    return process


def test_a_build_killed_mid_way_does_not_block_the_next_start(tmp_path: Path) -> None:
    build_dir = tmp_path / "cache" / "toolchain-sources"
    process = _start_hanging_build(build_dir, tmp_path / "building")
    process.send_signal(signal.SIGKILL)  # Ctrl-C's harsher cousin: no cleanup code runs at all
    process.wait(PROMPTLY_S)

    started = time.monotonic()
    result = locked_build(
        build_dir, lambda d: f"built in {d.name}", "stand-in kernels", wait_timeout_s=PROMPTLY_S
    )
    assert result == "built in toolchain-sources"
    assert time.monotonic() - started < PROMPTLY_S


def test_a_live_build_is_waited_for_with_a_message_and_a_bound(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    build_dir = tmp_path / "cache" / "toolchain-sources"
    process = _start_hanging_build(build_dir, tmp_path / "building")
    try:
        with pytest.raises(BuildLockTimeout, match=f"pid {process.pid}"):
            locked_build(build_dir, lambda d: "never", "stand-in kernels", wait_timeout_s=0.5)
        assert f"waiting for another process (pid {process.pid}) building stand-in kernels" in (
            capsys.readouterr().err
        )
    finally:
        process.kill()
        process.wait()


def test_a_build_says_what_it_does_and_how_long_it_took(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    build_dir = tmp_path / "toolchain-sources"

    def is_built(directory: Path) -> bool:
        return (directory / "module.so").exists()

    def build(directory: Path) -> str:
        (directory / "module.so").write_text("")
        return "module"

    assert locked_build(build_dir, build, "stand-in kernels", is_built=is_built) == "module"
    err = capsys.readouterr().err
    assert f"building stand-in kernels in {build_dir}" in err and "built stand-in kernels in" in err
    assert locked_build(build_dir, build, "stand-in kernels", is_built=is_built) == "module"
    assert capsys.readouterr().err == ""  # loading a finished build is quiet


def test_a_new_key_starts_from_the_same_toolchains_newest_build(tmp_path: Path) -> None:
    """Editing one source recompiles that file only: the objects and ninja's logs are copied with
    their timestamps, so ninja sees the others as up to date."""
    old = tmp_path / "tool-aaaa"
    old.mkdir()
    for name in ("module.so", "a.o", ".ninja_log"):
        (old / name).write_text(name)
    os.utime(old / "a.o", (1_000_000, 1_000_000))
    other_toolchain = tmp_path / "other-bbbb"
    other_toolchain.mkdir()
    (other_toolchain / "module.so").write_text("other")
    locked_build(tmp_path / "tool-cccc", lambda d: None, "stand-in kernels", is_built=lambda d: False)
    new = tmp_path / "tool-cccc"
    assert sorted(p.name for p in new.iterdir()) == [".ninja_log", "a.o", "module.so"]
    assert (new / "a.o").stat().st_mtime == 1_000_000 and (new / "module.so").read_text() == "module.so"


def test_the_cache_is_keyed_by_sources_toolchain_and_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = tmp_path / "a.cpp", tmp_path / "b.h"
    first.write_text("int a;")
    second.write_text("int b;")
    key = sources_key([first, second])
    assert sources_key([second, first]) == key
    second.write_text("int b2;")
    assert sources_key([first, second]) != key
    toolchain = toolchain_key(["-O3"], [])
    assert toolchain_key(["-O2"], []) != toolchain
    monkeypatch.setenv("CXX", sys.executable)  # another compiler is another toolchain
    assert toolchain_key(["-O3"], []) != toolchain
    monkeypatch.delenv("CXX")

    # The real kernels' directory: under KVFLOW_KERNEL_CACHE, named by both keys.
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    # Each instruction set builds apart: an AVX2 build never loads on an AVX-512 CPU, nor the reverse.
    for target in (AVX512_BF16, AVX2):
        real = native_build_dir(target)
        assert real.parent == tmp_path / "cache"
        assert real.name.startswith(toolchain_key(target.cflags, _LDFLAGS) + "-")
        assert real == build_dir_for(tmp_path / "cache", *real.name.split("-"))
    assert native_build_dir(AVX512_BF16) != native_build_dir(AVX2)


def test_simd_target_prefers_avx512_bf16_and_falls_back_to_avx2() -> None:
    zen4 = {"avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"}
    assert simd_target(zen4) == AVX512_BF16
    assert simd_target({"avx2", "fma", "f16c", "bmi2", "avx512f"}) == AVX2  # Skylake-X: no BF16
    assert simd_target({"avx2", "fma", "f16c", "bmi2"}) == AVX2  # Zen 2/3
    assert simd_target({"avx", "sse4_2"}) is None


def test_build_kernels_command_says_why_kernels_are_unavailable() -> None:
    env = {**os.environ, "KVFLOW_DISABLE_KERNELS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "kvflow.cli", "build-kernels"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=120,
    )
    assert result.returncode == 0  # an unsuited machine is not an error: the torch paths serve
    assert "unavailable (disabled by KVFLOW_DISABLE_KERNELS=1)" in result.stderr


def test_a_directory_seeded_from_an_older_build_is_built_not_loaded(tmp_path: Path) -> None:
    """The copy of an older build carries that build's module: the new key's sources must still be
    compiled (ninja brings the copy up to date); only a directory that was finished before is loaded."""
    old = tmp_path / "tool-aaaa"
    old.mkdir()
    (old / "module.so").write_text("old sources")
    new = tmp_path / "tool-bbbb"

    def is_built(directory: Path) -> bool:
        return (directory / "module.so").exists()

    def build(directory: Path) -> str:
        (directory / "module.so").write_text("new sources")
        return "built"

    def load(directory: Path) -> str:
        return "loaded " + (directory / "module.so").read_text()

    assert locked_build(new, build, "stand-in kernels", is_built=is_built, load=load) == "built"
    assert locked_build(new, build, "stand-in kernels", is_built=is_built, load=load) == "loaded new sources"
