"""Start `kvflow serve` as a subprocess on a free port and wait until it is healthy (doctor
--verify, the benchmarks, the tests); stop it the way a user would, with SIGINT. Also vllm-router
in front of kvflow replicas (the replica and disaggregation tests and benchmarks)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import httpx

# The first start on a machine builds the native kernels (about a minute) before serving.
STARTUP_TIMEOUT_S = 600.0
POLL_INTERVAL_S = 0.2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_server(
    model: str | Path,
    flags: Sequence[str] = (),
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    stderr: int | IO[Any] | None = subprocess.DEVNULL,
    startup_timeout_s: float = STARTUP_TIMEOUT_S,
) -> tuple[subprocess.Popen[Any], str]:
    """(the process, its base URL http://127.0.0.1:PORT) once /health answers 200."""
    port = free_port()
    command = [sys.executable, "-m", "kvflow.cli", "serve", str(model), "--port", str(port), *flags]
    process = subprocess.Popen(command, cwd=cwd, env=env, stderr=stderr, text=stderr is subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"

    def detail() -> str:
        return process.communicate()[1] if stderr is subprocess.PIPE else "(run it by hand to see why)"

    _wait_healthy(process, base, f"kvflow serve {' '.join(flags)}", startup_timeout_s, detail)
    return process, base


def spawn_vllm_router(
    args: Sequence[str], startup_timeout_s: float = 120.0
) -> tuple[subprocess.Popen[Any], str]:
    """vllm-router (installed from PyPI) on free ports, with `args` (policy, workers, PD mode...),
    once its /health answers 200; (the process, its base URL). Stop it with stop_router."""
    port = free_port()
    command = ["vllm-router", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    # Its Prometheus exporter takes a fixed port by default: two routers (or a stale one) collide.
    command += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), *args]
    # Its log goes to a file, read only if it fails to start (a pipe nobody reads could fill and
    # stall it during a long run).
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile(mode="w+") as log:  # the child keeps its own descriptor
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, text=True)
        _wait_healthy(process, base, " ".join(command), startup_timeout_s, lambda: _read(log))
    return process, base


def _read(log: IO[str]) -> str:
    log.seek(0)
    return log.read()[-2000:]


def stop_router(process: subprocess.Popen[Any]) -> None:
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()


def _wait_healthy(
    process: subprocess.Popen[Any], base: str, what: str, timeout_s: float, detail: Callable[[], str]
) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited during start-up: {detail()}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise TimeoutError(f"{what} did not become healthy within {timeout_s:.0f} s")
        time.sleep(POLL_INTERVAL_S)


def stop_server(process: subprocess.Popen[Any], timeout_s: float = 60.0) -> None:
    """SIGINT (graceful drain), then kill if it does not exit in time."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
