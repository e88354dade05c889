"""The dashboard's doctor view: the live window becomes a bench result and the doctor's findings."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from fixtures.dashboard_load import MAX_TOKENS, send_load
from fixtures.live_server import LiveServer

from kvflow.doctor.live import LiveDiagnosis, window_result
from kvflow.server.dashboard.hub import DashboardHub

NUM_REQUESTS = 4
# How long the window may lag the engine going idle (a few event-loop turns; generous for a busy CI).
WINDOW_CATCH_UP_S = 10.0


def window_of(server: LiveServer) -> Any:
    dashboard = server.ctx.dashboard
    assert dashboard is not None
    hub: DashboardHub = dashboard.hub
    assert hub.loop is not None

    async def gather() -> Any:
        return hub.doctor_window(str(server.ctx.model_dir))

    return asyncio.run_coroutine_threadsafe(gather(), hub.loop).result(10)


def test_the_live_window_is_diagnosed(start_server: Callable[..., LiveServer]) -> None:
    server = start_server(served_model_name="doctor-view")
    with pytest.raises(ValueError, match="no request finished"):
        window_result(window_of(server))
    send_load(server, NUM_REQUESTS, prefix="doctor ")
    server.wait_until_idle()
    # The engine thread publishes a step's finished requests after the step, onto the event loop:
    # the window can lag "idle" by a moment (seen once on a loaded machine), so wait for it.
    deadline = time.monotonic() + WINDOW_CATCH_UP_S
    window = window_of(server)
    while len(window.requests) < NUM_REQUESTS and time.monotonic() < deadline:
        time.sleep(0.02)
        window = window_of(server)
    result = window_result(window)
    assert result["completed"] == NUM_REQUESTS
    assert all(r["output_tokens"] == MAX_TOKENS and r["ttft_ms"] > 0 for r in result["requests"])
    assert result["ttft_ms"]["p50"] > 0 and result["itl_ms"]["p50"] > 0
    assert len(window.itl_ms) == NUM_REQUESTS * (MAX_TOKENS - 1)
    # The server's own /metrics over the window: kvflow's names, the load's tokens.
    assert result["server"]["server"] == "kvflow"
    assert result["server"]["generation_tokens"] == NUM_REQUESTS * MAX_TOKENS
    # A datasheet's hardware: no probe of this machine in a test.
    page = LiveDiagnosis(hardware="h100")(window)
    assert "kvflow</span> doctor" in page and "live window" in page and f"{NUM_REQUESTS} finished" in page


def test_doctor_view_without_a_doctor_says_so(server: LiveServer) -> None:
    # The in-process test server is built without the CLI's doctor (kvflow serve passes one).
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        response = client.get("/dashboard/doctor")
    assert response.status_code == 501 and "kvflow serve" in response.text
