"""One bad request must never hurt another: poisoned requests sent into a running batch end alone
(at the door with a 400, or inside the step with a 500), and the streams running beside them keep
their tokens and their pace."""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from fixtures.live_server import LiveServer

from kvflow.request import Request

# Streams that run beside the poisoned requests: greedy and seeded, so their text is reproducible.
HEALTHY = (
    {"prompt": [5, 6, 7], "max_tokens": 40, "ignore_eos": True, "temperature": 0},
    {"prompt": [8, 9], "max_tokens": 40, "ignore_eos": True, "temperature": 1.0, "seed": 11},
)
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
# Each: (endpoint, raw JSON body, the parameter the 400 must name). Raw JSON, so that what Python's
# json module would refuse to write (NaN, lone surrogates) can be sent as clients send it.
POISON_AT_THE_DOOR = (
    ("/v1/completions", '{"prompt": "x", "seed": 18446744073709551616}', "seed"),
    ("/v1/completions", '{"prompt": "x", "seed": -9223372036854775809}', "seed"),
    ("/v1/completions", '{"prompt": "x", "temperature": NaN}', "temperature"),
    ("/v1/completions", '{"prompt": "x", "repetition_penalty": Infinity}', "repetition_penalty"),
    ("/v1/completions", '{"prompt": "\\ud800"}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "bad \\udfff"]}', "prompt.1"),
    ("/v1/completions", '{"prompt": "x", "stop": ["\\ud800"]}', "stop.0"),
    ("/v1/completions", '{"prompt": [5, -1]}', "prompt.1"),
    ("/v1/completions", '{"prompt": "x", "stop_token_ids": [-3]}', "stop_token_ids.0"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages.0.content"),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"messages": 1}}',
        "chat_template_kwargs.messages",
    ),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}',
        "messages.0.content.0.type",
    ),
)


def sse_events(response: httpx.Response) -> Iterator[dict[str, Any]]:
    for line in response.iter_lines():
        if line.startswith("data: {"):
            yield json.loads(line[len("data: ") :])


def completion_text(http: httpx.Client, body: dict[str, Any]) -> str:
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


class HealthyStream:
    """One streamed completion read in a thread: its text, its chunk arrival times, its end."""

    def __init__(self, http: httpx.Client, body: dict[str, Any]) -> None:
        self.chunk_times: list[float] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.errors: list[dict[str, Any]] = []
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(http, body))
        self._thread.start()
        assert self._started.wait(60), "the healthy stream never started"

    def _read(self, http: httpx.Client, body: dict[str, Any]) -> None:
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            for event in sse_events(response):
                self.chunk_times.append(time.monotonic())
                self._started.set()
                if "error" in event:
                    self.errors.append(event)
                    continue
                choice = event["choices"][0]
                self.text += choice["text"]
                self.finish_reason = choice.get("finish_reason") or self.finish_reason

    def join(self) -> None:
        self._thread.join(120)

    def max_gap(self, start: float, end: float) -> float:
        """The longest pause between chunks that overlaps [start, end]."""
        times = self.chunk_times
        gaps = [b - a for a, b in itertools.pairwise(times) if b >= start and a <= end]
        return max(gaps, default=0.0)


def slow_down_steps(server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """~10 ms per engine step: the tiny model would otherwise finish a stream before the test acts."""
    runner = server.ctx.engine.engine.model_runner
    execute = runner.execute_model

    def slow_execute(*args: Any) -> Any:
        time.sleep(0.01)
        return execute(*args)

    monkeypatch.setattr(runner, "execute_model", slow_execute)


@pytest.fixture
def slow_steps(server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    slow_down_steps(server, monkeypatch)


def test_requests_poisoned_at_the_door_get_400_and_the_batch_runs_on(
    server: LiveServer, slow_steps: None
) -> None:
    with server.client() as http:
        expected = [completion_text(http, body) for body in HEALTHY]
        streams = [HealthyStream(http, body) for body in HEALTHY]
        for path, raw, param in POISON_AT_THE_DOOR:
            response = http.post(path, content=raw.encode(), headers={"content-type": "application/json"})
            assert response.status_code == 400, (raw, response.text)
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error" and error["param"] == param, (raw, error)
        for stream in streams:
            stream.join()
    assert [s.text for s in streams] == expected
    assert all(s.finish_reason == "length" and not s.errors for s in streams)
    server.wait_until_idle()
    assert server.ctx.engine.engine.scheduler.kv_cache_usage == 0.0


def test_a_request_failing_inside_the_step_fails_alone(
    server: LiveServer, slow_steps: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request that passes the door and then fails in the batched sampler (the seed of 2**64 that
    used to), injected where the server builds engine requests: it gets a 500 or an error event,
    the streams in its batch finish with exactly their usual text."""
    engine = server.ctx.engine.engine
    make_request = engine.make_request
    poison_prompt = [3, 3, 3]

    def make_poisoned(*args: Any, **kwargs: Any) -> Request:
        request = make_request(*args, **kwargs)
        if request.prompt_token_ids == poison_prompt:
            request.sampling_params.seed = 2**64
        return request

    monkeypatch.setattr(engine, "make_request", make_poisoned)
    poisoned = {"prompt": poison_prompt, "max_tokens": 5, "temperature": 1.0}
    with server.client() as http:
        expected = [completion_text(http, body) for body in HEALTHY]
        streams = [HealthyStream(http, body) for body in HEALTHY]
        failed = http.post("/v1/completions", json=poisoned)
        assert failed.status_code == 500 and "Overflow" in failed.json()["error"]["message"]
        with http.stream("POST", "/v1/completions", json={**poisoned, "stream": True}) as response:
            events = list(sse_events(response))
        assert "Overflow" in events[-1]["error"]["message"]
        for stream in streams:
            stream.join()
    assert [s.text for s in streams] == expected
    assert all(s.finish_reason == "length" and not s.errors for s in streams)
    server.wait_until_idle()
    assert server.ctx.engine.is_running and engine.scheduler.kv_cache_usage == 0.0


def test_a_huge_body_gets_413_and_a_large_prompt_does_not_stall_the_others(
    start_server: Callable[..., LiveServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A body over the limit is refused before it is parsed; one under it is tokenized off the event
    loop, so a running stream keeps its pace and /health answers meanwhile (the pauses are compared
    with how long the large request took: an event loop blocked by it would pause for all of it)."""
    server = start_server(max_request_body_bytes=4 * 1024**2)
    slow_down_steps(server, monkeypatch)
    large_prompt = "the quick brown fox jumps over the lazy dog " * 80_000  # 3.5 MB, ~0.8M tokens
    with server.client() as http:
        stream = HealthyStream(http, {**HEALTHY[0], "max_tokens": 240})
        too_large = http.post("/v1/completions", json={"prompt": large_prompt * 2})
        assert too_large.status_code == 413, too_large.text
        assert "4194304 bytes" in too_large.json()["error"]["message"]

        refused: list[httpx.Response] = []
        large = threading.Thread(
            target=lambda: refused.append(http.post("/v1/completions", json={"prompt": large_prompt}))
        )
        started = time.monotonic()
        large.start()
        health = []
        while large.is_alive():
            health.append(httpx.get(server.base_url + "/health", timeout=60).status_code)
            time.sleep(0.05)
        large.join()
        took = time.monotonic() - started
        assert refused[0].status_code == 400, refused[0].text
        assert "maximum context length" in refused[0].json()["error"]["message"]
        stream.join()
    assert stream.finish_reason == "length" and not stream.errors
    assert health and set(health) == {200}
    assert stream.max_gap(started, started + took) < took / 2, (stream.max_gap(started, started + took), took)
