"""A tensor-parallel worker that dies takes the engine down with its rank and reason, never a hang:
the requests in flight fail with that error, later steps refuse, and `kvflow serve` ends its
streams with an error event and exits with status 1."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from kvflow import LLM, SamplingParams
from kvflow.errors import RequestFailedError
from kvflow.parallel.errors import WorkerDiedError
from kvflow.server.spawn import spawn_server

# Generous bounds on how long the failure may take to surface (it takes well under a second): they
# only keep a regression from hanging the suite.
SURFACE_TIMEOUT_S = 30.0


def test_killed_worker_fails_the_step_with_rank_and_signal(
    tiny_checkpoint_factory: Callable[..., Path],
) -> None:
    llm = LLM(str(tiny_checkpoint_factory("llama")), tensor_parallel_size=2)
    parallel = llm.llm_engine.parallel
    assert parallel is not None
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        assert len(llm.generate([[5, 6, 7]], greedy)[0].outputs[0].token_ids) == 4
        os.kill(parallel.worker_pids[1], signal.SIGKILL)
        with pytest.raises(
            (WorkerDiedError, RequestFailedError), match=r"rank 1 died: killed by signal 9 \(SIGKILL\)"
        ):
            llm.generate(
                [[5, 6, 7], [8, 9]], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
            )
        with pytest.raises(WorkerDiedError, match="rank 1"):  # and every later step
            llm.generate([[1, 2]], greedy)
        assert llm.llm_engine.fatal_error is not None
    finally:
        parallel.shutdown()


def _worker_pids(server_pid: int) -> list[int]:
    """The server's spawned rank processes (not multiprocessing's resource tracker)."""
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    pids = []
    for pid in map(int, children):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        if "spawn_main" in cmdline and "resource_tracker" not in cmdline:
            pids.append(pid)
    return pids


def test_server_ends_streams_with_an_error_and_exits_nonzero(
    tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path
) -> None:
    log = (tmp_path / "serve.log").open("w")
    process, base = spawn_server(
        tiny_checkpoint_factory("llama"), ["--tensor-parallel-size", "2"], stderr=log
    )
    try:
        workers = _worker_pids(process.pid)
        assert len(workers) == 1
        body = {"model": str(tiny_checkpoint_factory("llama")), "prompt": "Hello", "max_tokens": 900,
                "stream": True, "ignore_eos": True}  # fmt: skip
        events = []
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=SURFACE_TIMEOUT_S) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line.removeprefix("data: "))
                if len(events) == 2:  # the stream is running: kill the worker under it
                    os.kill(workers[0], signal.SIGKILL)
        errors = [json.loads(e)["error"] for e in events if e != "[DONE]" and "error" in json.loads(e)]
        assert errors, events[-3:]
        assert "rank 1 died" in errors[0]["message"]
        assert process.wait(timeout=SURFACE_TIMEOUT_S) == 1
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        log.close()
    assert "rank 1 died: killed by signal 9 (SIGKILL)" in (tmp_path / "serve.log").read_text()
