"""/dashboard/events without a browser: the frames' schema against a live server under load, a client
that stops reading dropped while the engine serves on, the dashboard's API-key rules, --no-dashboard."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import httpx
import pytest
from fixtures.dashboard_load import MAX_TOKENS, send_load
from fixtures.live_server import LiveServer

from kvflow.server.dashboard.hub import DashboardHub, Subscriber
from kvflow.server.dashboard.schema import (
    ITL_FIELDS,
    REQUEST_STATES,
    SCHEMA_VERSION,
    SECOND_FIELDS,
    STEP_FIELDS,
)

NUM_REQUESTS = 6
REQUEST_KEYS = {
    "id", "state", "reason", "arrival", "handed_off", "added",
    "first_scheduled", "first_token", "last_token", "finished",
    "chunks", "preemptions", "prompt_tokens", "cached_tokens", "output_tokens", "priority", "ttft_ms",
    "itl_p50_ms", "itl_p99_ms", "slowest_gaps", "grammar_ms", "restore_ms", "x_request_id",
}  # fmt: skip
T = TypeVar("T")
UPDATE_KEYS = {
    "type", "v", "now", "steps", "seconds", "requests", "itl", "running", "waiting", "kv", "totals",
}  # fmt: skip


def sse_frames(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    """The JSON frames of an event stream (comments and `retry:` skipped)."""
    for line in lines:
        if line.startswith("data: "):
            yield json.loads(line.removeprefix("data: "))


def check_frame(frame: dict[str, Any], num_blocks: int) -> None:
    assert frame["v"] == SCHEMA_VERSION
    assert set(frame) >= UPDATE_KEYS
    for row in frame["steps"]:
        assert len(row) == len(STEP_FIELDS)
        step = dict(zip(STEP_FIELDS, row, strict=True))
        assert step["dur_ms"] >= 0 and 0.0 <= step["kv_usage"] <= 1.0
        assert step["prefill_tokens"] >= 0 and step["decode_tokens"] >= 0
    for row in frame["seconds"]:
        assert len(row) == len(SECOND_FIELDS) and row[0] == int(row[0])
    for row in frame["itl"]:
        assert len(row) == len(ITL_FIELDS) and row[1] >= 0
    for obj in frame["requests"]:
        assert set(obj) == REQUEST_KEYS
        assert obj["state"] in REQUEST_STATES
        assert (obj["reason"] is not None) == (obj["state"] == "finished")
        assert obj["first_scheduled"] is None or obj["first_scheduled"] >= obj["added"] >= obj["arrival"]
    if frame["kv"] is not None:
        kv = frame["kv"]
        assert len(kv["owner"]) == num_blocks
        assert kv["used"] == sum(1 for code in kv["owner"] if code >= 0)
        assert all(-2 <= code < len(kv["groups"]) for code in kv["owner"])


def on_loop(hub: DashboardHub, fn: Callable[[], Any]) -> Any:
    """Run `fn` on the server's event loop (the hub's state belongs to it) and return its result."""
    assert hub.loop is not None

    async def call() -> Any:
        return fn()

    return asyncio.run_coroutine_threadsafe(call(), hub.loop).result(10)


def frames_during(
    server: LiveServer, load: Callable[[], T], num_requests: int
) -> tuple[list[dict[str, Any]], T]:
    """Every frame of /dashboard/events from its hello until the `num_requests` requests of `load`
    have finished and nothing runs or waits (the frame of the engine going idle), and what `load`
    returned. The stream is read in a thread while the load runs, as a browser would."""
    frames: list[dict[str, Any]] = []
    started = threading.Event()

    def read() -> None:
        finished: set[str] = set()
        with (
            httpx.Client(base_url=server.base_url, timeout=60) as client,
            client.stream("GET", "/dashboard/events") as response,
        ):
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            for frame in sse_frames(response.iter_lines()):
                frames.append(frame)
                started.set()
                if frame["type"] == "update":
                    finished |= {obj["id"] for obj in frame["requests"] if obj["state"] == "finished"}
                    if len(finished) >= num_requests and not frame["running"] + frame["waiting"]:
                        return

    server.wait_until_idle()
    reader = threading.Thread(target=read)
    reader.start()
    assert started.wait(10)  # the hello first: then the load is seen whole
    result = load()
    reader.join(60)
    assert not reader.is_alive()
    return frames, result


def test_event_stream_schema_under_load(server: LiveServer) -> None:
    num_blocks = server.ctx.engine.engine.num_kv_blocks
    frames, bodies = frames_during(server, lambda: send_load(server, NUM_REQUESTS, "schema "), NUM_REQUESTS)

    hello, updates = frames[0], frames[1:]
    assert hello["type"] == "hello"
    fields = {"step": list(STEP_FIELDS), "second": list(SECOND_FIELDS), "itl": list(ITL_FIELDS)}
    assert hello["fields"] == fields
    assert hello["config"]["num_blocks"] == num_blocks and hello["config"]["model"] == server.model
    for frame in frames:
        check_frame(frame, num_blocks)
    assert updates and all(f["type"] == "update" for f in updates)

    # Every request of the load (the server was idle before) appears and finishes with its reason.
    assert len(bodies) == NUM_REQUESTS
    finished = {obj["id"]: obj for f in updates for obj in f["requests"] if obj["state"] == "finished"}
    assert len(finished) == NUM_REQUESTS
    for obj in finished.values():
        assert obj["reason"] == "length" and obj["output_tokens"] == MAX_TOKENS
        assert obj["ttft_ms"] > 0 and obj["chunks"] and obj["itl_p50_ms"] is not None
    # The steps account for every token sent, and the ITL stream for every gap.
    step_tokens = sum(row[STEP_FIELDS.index("output_tokens")] for f in updates for row in f["steps"])
    assert step_tokens == NUM_REQUESTS * MAX_TOKENS
    assert len([g for f in updates for g in f["itl"]]) == NUM_REQUESTS * (MAX_TOKENS - 1)
    # Idle: the last block map holds nothing, as /metrics says.
    last_kv = [f["kv"] for f in updates if f["kv"] is not None][-1]
    assert last_kv["used"] == 0 == server.metric("kv_cache_usage_perc", model_name=server.model)


def test_a_client_that_stops_reading_is_dropped_and_the_engine_serves_on(server: LiveServer) -> None:
    dashboard = server.ctx.dashboard
    assert dashboard is not None
    hub = dashboard.hub
    server.wait_until_idle()
    dropped_before = hub.num_dropped
    hub.queue_frames = 2  # a small bound: the load below overflows it within a second
    frames_seen: list[bytes] = []

    def subscribe_both() -> tuple[Subscriber, Subscriber, asyncio.Task[None]]:
        slow, fast = hub.subscribe(), hub.subscribe()

        async def drain() -> None:  # a reader that keeps up
            while not fast.dropped.is_set():
                frames_seen.append(await fast.queue.get())

        return slow, fast, asyncio.ensure_future(drain())

    try:
        slow, fast, reader = on_loop(hub, subscribe_both)
        deadline = time.monotonic() + 60
        rounds = 0
        while not slow.dropped.is_set() and time.monotonic() < deadline:
            bodies = send_load(server, NUM_REQUESTS, prefix=f"slow {rounds} ")
            rounds += 1
            # The engine did not wait for the slow reader: every request completed in full.
            assert all(b["usage"]["completion_tokens"] == MAX_TOKENS for b in bodies)
        server.wait_until_idle()
        assert slow.dropped.is_set() and hub.num_dropped == dropped_before + 1
        assert not fast.dropped.is_set() and len(frames_seen) > 2
        assert on_loop(hub, lambda: slow not in hub.subscribers and fast in hub.subscribers)
        assert slow.queue.qsize() <= 2  # its memory stayed bounded
    finally:
        hub.queue_frames = 16
        on_loop(hub, lambda: (reader.cancel(), hub.unsubscribe(fast)))


def test_a_dropped_client_connection_is_closed(server: LiveServer) -> None:
    hub = server.ctx.dashboard.hub if server.ctx.dashboard else None
    assert hub is not None
    with (
        httpx.Client(base_url=server.base_url, timeout=30) as client,
        client.stream("GET", "/dashboard/events") as response,
    ):
        lines = response.iter_lines()
        assert next(sse_frames(lines))["type"] == "hello"
        sub = on_loop(hub, lambda: hub.subscribers[-1])
        on_loop(hub, lambda: hub.drop(sub))
        with pytest.raises(httpx.RemoteProtocolError):  # the server cut the stream short
            for _ in lines:
                pass


def test_dashboard_takes_the_api_key_as_query_parameter_or_cookie(
    start_server: Callable[..., LiveServer],
) -> None:
    server = start_server(api_key="sesame")
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        assert client.get("/dashboard").status_code == 401
        assert client.get("/dashboard?api_key=wrong").status_code == 401
        assert client.get("/dashboard/static/dashboard.js").status_code == 401
        page = client.get("/dashboard?api_key=sesame")
        assert page.status_code == 200 and "kvflow" in page.text
        cookie = page.headers["set-cookie"].lower()
        assert "kvflow_dashboard_key=sesame" in cookie
        assert "httponly" in cookie and "samesite=strict" in cookie
        # The cookie now in the client's jar opens the page's own requests, and only under /dashboard.
        assert client.get("/dashboard/static/uPlot.iife.min.js").status_code == 200
        with client.stream("GET", "/dashboard/events") as events:
            assert events.status_code == 200
            assert next(sse_frames(events.iter_lines()))["type"] == "hello"
        assert client.get("/v1/models").status_code == 401  # the API still wants the header
        assert client.get("/v1/models?api_key=sesame").status_code == 401


def test_no_dashboard_flag(start_server: Callable[..., LiveServer]) -> None:
    server = start_server(dashboard=False)
    assert server.ctx.dashboard is None
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        assert client.get("/dashboard").status_code == 404
        assert client.get("/dashboard/events").status_code == 404


def test_preempted_requests_show_when_they_were_preempted_and_resumed(
    start_server: Callable[..., LiveServer],
) -> None:
    # 3 blocks of 16 tokens; each request (a short prompt + 24 tokens) grows to 2 blocks, so any two
    # decoding at once preempt one another, however the 6 requests happen to overlap.
    server = start_server(served_model_name="preempting", engine={"num_kv_blocks": 3})
    frames, _ = frames_during(server, lambda: send_load(server, NUM_REQUESTS, "p "), NUM_REQUESTS)
    finished = [obj for f in frames[1:] for obj in f["requests"] if obj["state"] == "finished"]
    preempted = {obj["id"]: obj for obj in finished if obj["preemptions"]}
    num_preemptions = server.metric("num_preemptions_total", model_name=server.model)
    assert preempted and frames[-1]["totals"]["preemptions"] == num_preemptions
    assert sum(len(obj["preemptions"]) for obj in preempted.values()) == num_preemptions
    for obj in preempted.values():
        for start, resumed in obj["preemptions"]:
            # Resumed by recomputation: a prefill chunk scheduled after the preemption.
            assert resumed is not None and resumed > start
            assert any(t == resumed for t, _ in obj["chunks"])
        assert obj["reason"] == "length" and obj["output_tokens"] == MAX_TOKENS


def test_an_open_dashboard_does_not_hold_the_shutdown(start_server: Callable[..., LiveServer]) -> None:
    # A grace period far longer than the join below: only streams that end by themselves let it pass.
    server = start_server(served_model_name="draining", shutdown_grace_s=120.0)
    ended = threading.Event()

    def watch() -> None:
        url = server.base_url + "/dashboard/events"
        with contextlib.suppress(httpx.HTTPError), httpx.stream("GET", url) as response:
            for _ in response.iter_lines():
                pass
        ended.set()

    watcher = threading.Thread(target=watch)
    watcher.start()
    dashboard = server.ctx.dashboard
    assert dashboard is not None
    wait_until(lambda: bool(on_loop(dashboard.hub, lambda: dashboard.hub.subscribers)))
    server.server.handle_exit(signal.SIGINT, None)  # what SIGINT does: drain, 503 to new requests
    server.thread.join(60)
    assert not server.thread.is_alive() and ended.wait(10)
    watcher.join(10)


def wait_until(check: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_speculative_steps_carry_their_drafts(start_server: Callable[..., LiveServer]) -> None:
    spec = {"speculative_method": "ngram", "num_speculative_tokens": 3, "speculative_auto_disable": False}
    server = start_server(served_model_name="speculating", engine=spec)
    # A repetitive prompt: prompt lookup finds n-grams to draft from.
    prefix = "a b c d a b c d a b c d "
    frames, bodies = frames_during(server, lambda: send_load(server, 2, prefix), 2)
    steps = [dict(zip(STEP_FIELDS, row, strict=True)) for f in frames[1:] for row in f["steps"]]
    drafted = sum(s["spec_draft_tokens"] for s in steps)
    accepted = sum(s["spec_accepted_tokens"] for s in steps)
    assert drafted > 0 and 0 <= accepted <= drafted
    # Accepted drafts are output tokens too: every token of both responses is in some step's row.
    assert sum(s["output_tokens"] for s in steps) == sum(b["usage"]["completion_tokens"] for b in bodies)
    seconds = [row for f in frames[1:] for row in f["seconds"]]
    assert seconds and all(len(row) == len(SECOND_FIELDS) for row in seconds)


def test_rows_carry_the_requests_priority(start_server: Callable[..., LiveServer]) -> None:
    """Under --scheduling-policy priority each row says its request's priority (the page's queue
    time per priority is read from them)."""
    server = start_server(served_model_name="prioritised", engine={"scheduling_policy": "priority"})
    load = lambda: send_load(server, NUM_REQUESTS, "q ", priority=lambda i: i % 2 * 5)  # noqa: E731
    frames, _ = frames_during(server, load, NUM_REQUESTS)
    finished = {obj["id"]: obj for f in frames[1:] for obj in f["requests"] if obj["state"] == "finished"}
    assert sorted(obj["priority"] for obj in finished.values()) == sorted(
        i % 2 * 5 for i in range(NUM_REQUESTS)
    )
