"""`kvflow serve` as a user runs it: a subprocess that prints its URL and KV pool, serves, and on
SIGINT lets the in-flight stream finish before exiting with status 0."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from kvflow.server.spawn import spawn_server

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_serve_prints_its_url_serves_and_drains_on_sigint(server_model_dir: Path) -> None:
    flags = ["--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "256"]
    process, base = spawn_server(server_model_dir, flags, cwd=REPO_ROOT, stderr=subprocess.PIPE)
    try:
        body = {"model": "tiny", "prompt": "x = ", "max_tokens": 150, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            process.send_signal(signal.SIGINT)  # mid-stream
            rest = [line for line in lines if line.startswith("data: ")]
        assert json.loads(first[len("data: ") :])["choices"][0]["text"] is not None
        final = json.loads(rest[-2][len("data: ") :])
        assert final["choices"][0]["finish_reason"] == "length" and rest[-1] == "data: [DONE]"
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, stderr
    assert f"tiny at {base}/v1" in stderr
    assert "KV cache pool:" in stderr and "[kvflow serve] stopped" in stderr


def test_serve_with_a_wrong_model_path_exits_with_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    result = subprocess.run(
        [sys.executable, "-m", "kvflow.cli", "serve", str(missing)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 2
    assert "kvflow: error:" in result.stderr and str(missing) in result.stderr
