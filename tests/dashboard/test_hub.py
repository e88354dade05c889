"""DashboardHub alone: however fast deltas come, frames go out at most once per interval and carry
every step; the window stays bounded; a client's queue never grows past its bound."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from kvflow.server.dashboard.hub import DashboardHub
from kvflow.server.dashboard.recorder import Delta
from kvflow.server.dashboard.schema import STEP_FIELDS
from kvflow.server.dashboard.window import WindowLimits

INTERVAL_S = 0.1


def step(t: float) -> list[Any]:
    row: list[Any] = [0] * len(STEP_FIELDS)
    row[STEP_FIELDS.index("t")] = t
    row[STEP_FIELDS.index("dur_ms")] = 1.0
    row[STEP_FIELDS.index("decode_tokens")] = 1
    row[STEP_FIELDS.index("output_tokens")] = 1
    return row


def decode(message: bytes) -> dict[str, Any]:
    assert message.startswith(b"data: ") and message.endswith(b"\n\n")
    return dict(json.loads(message[len(b"data: ") : -2]))


def test_deltas_are_coalesced_into_at_most_one_frame_per_interval() -> None:
    async def run() -> tuple[list[dict[str, Any]], float]:
        loop = asyncio.get_running_loop()
        hub = DashboardHub({"model": "m"}, lambda: b"", INTERVAL_S, queue_frames=1000, clock=loop.time)
        hub.start()
        sub = hub.subscribe()
        start = loop.time()
        for i in range(500):  # 500 steps in about 0.5 s: 1000 steps a second
            hub.apply(Delta(now=start + i * 1e-3, steps=[step(start + i * 1e-3)], running=["a"]))
            await asyncio.sleep(1e-3)
        await asyncio.sleep(2 * INTERVAL_S)  # the last pending update goes out
        elapsed = loop.time() - start
        hub.stop()
        frames = []
        while not sub.queue.empty():
            frames.append(decode(sub.queue.get_nowait()))
        return frames, elapsed

    frames, elapsed = asyncio.run(run())
    hello, updates = frames[0], frames[1:]
    assert hello["type"] == "hello" and all(f["type"] == "update" for f in updates)
    assert len(updates) <= elapsed / INTERVAL_S + 1  # coalesced, not one frame per step
    assert sum(len(f["steps"]) for f in updates) == 500  # and nothing lost
    assert updates[-1]["totals"]["steps"] == 500


def test_a_full_queue_drops_its_client_and_only_that_client() -> None:
    async def run() -> tuple[DashboardHub, bool, bool, int]:
        loop = asyncio.get_running_loop()
        hub = DashboardHub({"model": "m"}, lambda: b"", 0.0, queue_frames=3, clock=loop.time)
        hub.start()
        stalled, reading = hub.subscribe(), hub.subscribe()
        for i in range(10):
            hub.apply(Delta(now=float(i), steps=[step(float(i))]))
            await asyncio.sleep(0.01)  # the send of an interval of 0 runs on the next loop turn
            while not reading.queue.empty():
                reading.queue.get_nowait()
        return hub, stalled.dropped.is_set(), reading.dropped.is_set(), stalled.queue.qsize()

    hub, stalled_dropped, reading_dropped, backlog = asyncio.run(run())
    assert stalled_dropped and not reading_dropped and backlog <= 3
    assert hub.num_dropped == 1 and len(hub.subscribers) == 1


def test_the_window_is_bounded() -> None:
    limits = WindowLimits(window_s=5.0, step_history_s=2.0, max_steps=50, max_itl=30, max_requests=4)
    hub = DashboardHub({"model": "m"}, lambda: b"", 0.1, limits)
    for i in range(100):  # 100 s of one step, one gap and one finished request a second
        request = {"id": f"r{i}", "state": "finished", "reason": "stop", "finished": float(i)}
        delta = Delta(now=float(i), steps=[step(float(i))], requests=[request], itl=[[float(i), 5.0]])
        hub.window.apply(delta)
    window = hub.window
    assert [row[0] for row in window.steps] == [97.0, 98.0, 99.0]  # the last 2 s of steps
    assert len(window.itl) == 6 and len(window.seconds) <= 7  # the last 5 s
    assert list(window.requests) == ["r95", "r96", "r97", "r98", "r99"][-4:]
    assert window.totals.steps == 100 and window.totals.finished == {"stop": 100}
