"""Bad input and overload: OpenAI-style error bodies with the right status, and the server keeps serving."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from fixtures.live_server import LiveServer

from kvflow.engine.scheduler import RequestUpdate

BODY = {"prompt": "def main():", "max_tokens": 4, "temperature": 0}


def assert_error(response: httpx.Response, status: int, *fragments: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for fragment in fragments:
        assert fragment in error["message"], error["message"]
    assert response.headers.get("x-request-id")
    return error  # type: ignore[no-any-return]


def test_malformed_json_and_wrong_types_name_the_field(server: LiveServer) -> None:
    with server.client() as http:
        bad_json = http.post(
            "/v1/completions", content=b'{"prompt": "x",', headers={"content-type": "application/json"}
        )
        assert_error(bad_json, 400, "malformed JSON")
        wrong_type = http.post("/v1/completions", json={**BODY, "temperature": "hot"})
        assert assert_error(wrong_type, 400, "temperature")["param"] == "temperature"
        out_of_range = http.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "n": 0}
        )
        assert assert_error(out_of_range, 400, "n")["param"] == "n"
        missing = http.post("/v1/chat/completions", json={"max_tokens": 3})
        assert assert_error(missing, 400, "messages")["param"] == "messages"
        bad_role = http.post("/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]})
        assert_error(bad_role, 400, "Unknown role")
        assert_error(http.post("/v1/completions", json={**BODY, "logit_bias": {"1": 500}}), 400, "logit_bias")
        assert_error(http.post("/v1/completions", json={**BODY, "prompt": [999999]}), 400, "token ids")
        assert_error(http.get("/v1/nope"), 404, "/v1/nope")


def test_unknown_model_is_404(server: LiveServer) -> None:
    with server.client() as http:
        error = assert_error(http.post("/v1/completions", json={**BODY, "model": "gpt-17"}), 404, "gpt-17")
        assert error["code"] == "model_not_found" and error["param"] == "model"


def test_context_overflow_states_both_numbers(server: LiveServer) -> None:
    prompt_ids = [5] * 250
    with server.client() as http:
        r = http.post("/v1/completions", json={"prompt": prompt_ids, "max_tokens": 10})
        assert_error(r, 400, "256", "260", "250 in the prompt", "10 for max_tokens")
        too_long = http.post("/v1/completions", json={"prompt": [5] * 300, "max_tokens": 1})
        assert_error(too_long, 400, "300")
        # Without max_tokens, chat gets the rest of the context.
        chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 200


def test_api_key_is_required_when_set(start_server: Callable[..., LiveServer]) -> None:
    server = start_server(api_key="sekret")
    with server.client() as http:
        assert_error(http.post("/v1/completions", json=BODY), 401, "missing API key")
        wrong = http.post("/v1/completions", json=BODY, headers={"authorization": "Bearer nope"})
        assert_error(wrong, 401, "invalid API key")
        ok = http.post("/v1/completions", json=BODY, headers={"authorization": "Bearer sekret"})
        assert ok.status_code == 200
        assert http.get("/health").status_code == 200 and http.get("/metrics").status_code == 200


def stream_events(response: httpx.Response) -> Iterator[dict[str, Any]]:
    for line in response.iter_lines():
        if line.startswith("data: {"):
            yield json.loads(line[len("data: ") :])


def test_queue_limit_gives_429_and_drops_nothing_admitted(start_server: Callable[..., LiveServer]) -> None:
    server = start_server(max_waiting=2, engine={"max_num_seqs": 1})
    body = {**BODY, "max_tokens": 30, "ignore_eos": True, "stream": True}
    # The running request must still run when the third one arrives: as long as the test model's
    # 256-token context allows, so that a busy machine does not let it finish first.
    long_body = {**body, "max_tokens": 240}
    with server.client() as http, contextlib.ExitStack() as stack:
        running = stack.enter_context(http.stream("POST", "/v1/completions", json=long_body))
        events = [stream_events(running)]
        next(events[0])  # the first request is running (max_num_seqs=1)
        for _ in range(2):  # two more wait
            waiting = stack.enter_context(http.stream("POST", "/v1/completions", json=body))
            assert waiting.status_code == 200
            events.append(stream_events(waiting))
        rejected = http.post("/v1/completions", json=BODY)
        assert_error(rejected, 429, "max_waiting is 2")
        assert rejected.headers["retry-after"] == "1"
        for stream in events:
            chunks = list(stream)
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    server.wait_until_idle()
    with server.client() as http:
        assert http.post("/v1/completions", json=BODY).status_code == 200


def test_client_disconnect_aborts_and_frees_kv_blocks(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = server.ctx.engine.engine
    scheduler, pool = engine.scheduler, engine.scheduler.kv_cache_manager.block_pool
    runner_execute = engine.model_runner.execute_model

    def slow_execute(*args: Any) -> Any:  # ~10 ms steps: the tiny model would finish before we hang up
        time.sleep(0.01)
        return runner_execute(*args)

    monkeypatch.setattr(engine.model_runner, "execute_model", slow_execute)
    aborted_before = server.metric("request_success_total", finished_reason="abort")
    body = {**BODY, "max_tokens": 200, "ignore_eos": True}
    with server.client() as http:
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            events = stream_events(response)
            next(events), next(events)
            assert scheduler.num_running == 1 and pool.usage > 0
        # Leaving the block closed the connection mid-stream. Now a non-streamed request, abandoned:
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json=body, timeout=0.3)
    server.wait_until_idle()
    assert server.metric("request_success_total", finished_reason="abort") == aborted_before + 2
    assert pool.usage == 0.0 and pool.get_num_free_blocks() == pool.num_usable_blocks
    scheduler.check_integrity()


def test_a_failing_request_gets_500_and_the_others_are_served(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault injection: output processing raises for one prompt only."""
    processor = server.ctx.engine.engine.output_processor
    original = processor.process

    def process(update: RequestUpdate, logprobs: Any) -> Any:
        if update.request.prompt_token_ids[-2:] == [7, 7]:
            raise RuntimeError("injected fault")
        return original(update, logprobs)

    monkeypatch.setattr(processor, "process", process)
    healthy = {**BODY, "max_tokens": 40, "ignore_eos": True, "stream": True}
    with server.client() as http, http.stream("POST", "/v1/completions", json=healthy) as ok_stream:
        events = stream_events(ok_stream)
        next(events)
        failed = http.post("/v1/completions", json={**BODY, "prompt": [5, 6, 7, 7]})
        assert_error(failed, 500, "injected fault")
        with http.stream("POST", "/v1/completions", json={**BODY, "prompt": [5, 7, 7], "stream": True}) as r:
            error_events = list(stream_events(r))
        assert "injected fault" in error_events[-1]["error"]["message"]
        chunks = list(events)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    server.wait_until_idle()
    assert server.ctx.engine.is_running
    assert server.ctx.engine.engine.scheduler.kv_cache_usage == 0.0


def test_health_reports_a_stopped_engine(start_server: Callable[..., LiveServer]) -> None:
    server = start_server()
    server.ctx.engine.shutdown()
    deadline = time.monotonic() + 10
    while server.ctx.engine.is_running and time.monotonic() < deadline:
        time.sleep(0.01)
    with server.client() as http:
        assert_error(http.get("/health"), 503, "not running")
        assert_error(http.post("/v1/completions", json=BODY), 503, "shut down")
