"""kvflow/kernels/avx512_on_avx2.h, the AVX-512 intrinsics over AVX2 that the kernels build on for
CPUs without AVX-512, checked lane by lane against scalar definitions of the instructions
(avx512_on_avx2_check.cpp). Built with AVX2 flags whatever this CPU is, so an AVX-512 machine checks
the AVX2 build too; a plain g++ build of one file, no torch headers (a few seconds).

And every kernel unit compiled for the AVX2 target: a kernel that calls an intrinsic the stand-ins
lack builds on AVX-512 machines and fails on AVX2 ones, where kvflow then falls back to its torch
paths without a failing test (session 26 found gemv_ggml.cpp's NVFP4 scales so, on a Zen 2)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from kvflow.kernels import _HERE, _SOURCES, AVX2, simd_target
from kvflow.kernels.ninja_build import compile_flags, write_build_file

HERE = Path(__file__).parent
KERNELS = HERE.parents[1] / "kvflow" / "kernels"


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ on this machine")
@pytest.mark.skipif(simd_target() is None, reason="this CPU runs neither kernel target (no AVX2)")
def test_avx2_stand_ins_match_the_avx512_instructions(tmp_path: Path) -> None:
    binary = tmp_path / "check"
    flags = [f for f in AVX2.cflags if f != "-fopenmp"]
    source = HERE / "avx512_on_avx2_check.cpp"
    build = subprocess.run(
        ["g++", "-std=c++17", *flags, f"-I{KERNELS}", str(source), "-o", str(binary)],
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 failed checks" in run.stdout


@pytest.mark.skipif(shutil.which("ninja") is None, reason="no ninja on this machine")
@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler on this machine")
def test_every_kernel_unit_compiles_for_avx2(tmp_path: Path) -> None:
    """The units on simd.h, compiled (not linked) with the AVX2 target's flags at -O0 (the build's
    own ninja file and precompiled header; about 11 s on 2 cores against 30 s at -O3). -O0 also
    checks the stand-ins where GCC's immediate-operand intrinsics are macros: no "redefined"."""
    units = [_HERE / s for s in _SOURCES if '#include "simd.h"' in (_HERE / s).read_text()]
    assert units, "no kernel unit includes simd.h"
    cflags = ["-O0" if f == "-O3" else f for f in AVX2.cflags]
    write_build_file(
        tmp_path, units, "avx2_check", compile_flags("avx2_check", cflags), [], _HERE / "aten_lite.h"
    )
    build = subprocess.run(
        ["ninja", "-C", str(tmp_path), *(f"{u.stem}.o" for u in units)], capture_output=True, text=True
    )
    assert build.returncode == 0, build.stdout[-6000:]
    assert "redefined" not in build.stdout, build.stdout[-6000:]
