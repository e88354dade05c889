"""A new user's first `kvflow demo`: the kernel cache is empty, so the demo builds the native kernels
(one progress line per unit) and then runs on them. Its time is measured in benchmarks/first_run.py
(a fresh venv with the README's install command), not here."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvflow.kernels import _SOURCES, simd_target
from kvflow.kernels.build_cache import CACHE_ENV

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    simd_target() is None or shutil.which("c++") is None or os.environ.get("KVFLOW_DISABLE_KERNELS") == "1",
    reason="this machine does not build the native kernels",
)


def test_first_demo_builds_the_kernels_then_runs(tmp_path: Path) -> None:
    env = {**os.environ, CACHE_ENV: str(tmp_path / "empty-kernel-cache")}
    result = subprocess.run(
        [sys.executable, "-m", "kvflow.cli", "demo", "--max-tokens", "4"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stderr.splitlines()
    compiled = sorted(line.split()[2] for line in lines if line.startswith("[kvflow] compiled "))
    assert compiled == sorted(_SOURCES)  # one line per unit, each unit once
    assert any(line.startswith("[kvflow] built kvflow's native CPU kernels in ") for line in lines)
    assert "TTFT" in result.stderr and "continuous batching" in result.stderr
    built = list((tmp_path / "empty-kernel-cache").glob("*/kvflow_cpu_kernels.so"))
    assert len(built) == 1
