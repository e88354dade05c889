"""Shutdown: while the server drains, new requests get 503 (not a reset connection); streams still
running after the grace period end with a final chunk (finish_reason "abort") and [DONE]; the log
says how many were cut; the process exits with status 0."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from fixtures.live_server import LiveServer

from kvflow.assets import bundled_model_dir
from kvflow.server.spawn import spawn_server

REPO_ROOT = Path(__file__).resolve().parents[2]
LONG_STREAM = {"prompt": [5, 6, 7], "max_tokens": 240, "ignore_eos": True, "temperature": 0, "stream": True}


def data_lines(lines: list[str]) -> list[str]:
    return [line[len("data: ") :] for line in lines if line.startswith("data: ")]


def final_finish_reason(data: list[str]) -> str | None:
    chunks = [json.loads(d) for d in data if d.startswith("{")]
    assert all("error" not in c for c in chunks), chunks
    finish_reason: str | None = [c for c in chunks if c["choices"]][-1]["choices"][0]["finish_reason"]
    return finish_reason


def test_the_drain_answers_503_then_ends_the_streams_left(
    start_server: Callable[..., LiveServer], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """In-process, so that the engine can be slowed down: the stream outlasts the grace period."""
    caplog.set_level(logging.INFO, logger="kvflow.server.shutdown")
    server = start_server(shutdown_grace_s=0.5)
    runner = server.ctx.engine.engine.model_runner
    execute = runner.execute_model

    def slow_execute(*args: Any) -> Any:  # 240 tokens: ~2.4 s, several times the grace period
        time.sleep(0.01)
        return execute(*args)

    monkeypatch.setattr(runner, "execute_model", slow_execute)
    with server.client() as http, http.stream("POST", "/v1/completions", json=LONG_STREAM) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: {"))
        server.server.handle_exit(signal.SIGTERM, None)  # what uvicorn's signal handler calls
        # Fresh connections during the drain: answered, not reset.
        completion = httpx.post(server.base_url + "/v1/completions", json={"prompt": [5]})
        for refused in (completion, httpx.get(server.base_url + "/health")):
            assert refused.status_code == 503, refused.text
            assert "shutting down" in refused.json()["error"]["message"]
            assert refused.headers["connection"] == "close"
        data = [first[len("data: ") :], *data_lines(list(lines))]
    assert final_finish_reason(data) == "abort" and data[-1] == "[DONE]"
    server.thread.join(30)
    assert not server.thread.is_alive()  # then the server exited
    assert "1 request(s) still running after the 0.5 s grace period were ended" in caplog.text


def test_sigterm_mid_stream_gives_a_final_chunk_and_exits_cleanly() -> None:
    """`kvflow serve` as deployed: a real SIGTERM, no grace period; the stream would need seconds more."""
    env = {**os.environ, "KVFLOW_DISABLE_KERNELS": "1"}  # float32: the native kernels are not needed
    flags = ["--dtype", "float32", "--max-model-len", "1024", "--shutdown-grace-seconds", "0"]
    process, base = spawn_server(bundled_model_dir(), flags, env=env, cwd=REPO_ROOT, stderr=subprocess.PIPE)
    try:
        body = {**LONG_STREAM, "max_tokens": 1000, "prompt": "def main():"}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            process.send_signal(signal.SIGTERM)
            data = [first[len("data: ") :], *data_lines(list(lines))]
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert final_finish_reason(data) == "abort" and data[-1] == "[DONE]"
    assert process.returncode == 0, stderr
    assert "1 request(s) still running after the 0 s grace period were ended" in stderr
    assert "[kvflow serve] stopped" in stderr
