"""Start `kvflow serve` as a subprocess on a free port and wait until it is healthy (doctor
--verify, the benchmarks, the tests); stop it the way a user would, with SIGINT."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
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
    deadline = time.monotonic() + startup_timeout_s
    while True:
        if process.poll() is not None:
            detail = process.communicate()[1] if stderr is subprocess.PIPE else "(run it by hand to see why)"
            raise RuntimeError(f"kvflow serve {' '.join(flags)} exited during start-up: {detail}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return process, base
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise TimeoutError(f"kvflow serve did not become healthy within {startup_timeout_s:.0f} s")
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
