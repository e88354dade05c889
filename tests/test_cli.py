"""`kvflow generate` end to end in a subprocess, as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path


def _kvflow(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvflow.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[1],
    )


def test_generate_streams_text_and_prints_timing(tiny_checkpoint_factory: Callable[..., Path]) -> None:
    path = tiny_checkpoint_factory("qwen2")
    result = _kvflow(
        "generate",
        str(path),
        "--prompt",
        "hello",
        "--chat",
        "--max-tokens",
        "8",
        "--ignore-eos",
        "--dtype",
        "float32",
        "--max-num-seqs",
        "4",
    )
    assert result.returncode == 0, result.stderr
    assert "KV cache pool:" in result.stderr
    assert "TTFT" in result.stderr and "ITL" in result.stderr and "tokens/s" in result.stderr
    assert "finish length" in result.stderr


def test_generate_reports_a_missing_model_clearly(tmp_path: Path) -> None:
    result = _kvflow("generate", str(tmp_path / "missing"), "--prompt", "x")
    assert result.returncode == 2
    assert "does not exist" in result.stderr and "Traceback" not in result.stderr


def test_demo_generates_with_timing(tiny_checkpoint_factory: Callable[..., Path]) -> None:
    path = tiny_checkpoint_factory("llama")
    result = _kvflow("demo", "--model", str(path), "--max-tokens", "4", "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("--- completion ---") == 4
    assert "TTFT" in result.stderr and "continuous batching" in result.stderr
