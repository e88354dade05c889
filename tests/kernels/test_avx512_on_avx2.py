"""kvflow/kernels/avx512_on_avx2.h, the AVX-512 intrinsics over AVX2 that the kernels build on for
CPUs without AVX-512, checked lane by lane against scalar definitions of the instructions
(avx512_on_avx2_check.cpp). Built with AVX2 flags whatever this CPU is, so an AVX-512 machine checks
the AVX2 build too; a plain g++ build of one file, no torch headers (a few seconds)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from kvflow.kernels import AVX2, simd_target

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
