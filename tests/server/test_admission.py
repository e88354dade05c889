"""How much work one request may ask for, and what `--max-waiting` counts: requests queued while every
running slot is busy, not requests the engine thread has merely not picked up yet."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
from fixtures.live_server import LiveServer

BODY = {"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0}


def test_prompts_times_n_is_capped_and_the_error_says_so(start_server: Callable[..., LiveServer]) -> None:
    server = start_server(max_choices_per_request=8)
    with server.client() as http:
        fan_out = http.post("/v1/completions", json={**BODY, "prompt": [[5, 6]] * 3, "n": 3})
        assert fan_out.status_code == 400
        error = fan_out.json()["error"]
        assert "9 completions (3 prompt(s) x n=3)" in error["message"] and "at most 8" in error["message"]
        assert error["param"] == "prompt"
        chat = {"messages": [{"role": "user", "content": "x"}], "n": 9, "max_tokens": 2}
        assert http.post("/v1/chat/completions", json=chat).json()["error"]["param"] == "n"
        assert http.post("/v1/completions", json={**BODY, "prompt": [[5, 6]] * 2, "n": 4}).status_code == 200


def test_a_request_larger_than_the_queue_can_ever_hold_is_400_not_429(
    start_server: Callable[..., LiveServer],
) -> None:
    server = start_server(max_waiting=2, engine={"max_num_seqs": 2})
    with server.client() as http:
        too_many = http.post("/v1/completions", json={**BODY, "n": 5})  # 2 running + 2 waiting, ever
        assert too_many.status_code == 400, too_many.text
        message = too_many.json()["error"]["message"]
        assert "needs 5 engine requests" in message and "at most 4" in message
        assert http.post("/v1/completions", json={**BODY, "n": 4}).status_code == 200


def test_a_burst_on_an_idle_server_fills_the_free_slots_first(
    start_server: Callable[..., LiveServer],
) -> None:
    """max_num_seqs + max_waiting requests at once, on an idle server: all admitted (the old count
    took every request not yet picked up by the engine thread for a waiting one, and refused most)."""
    server = start_server(max_waiting=2, engine={"max_num_seqs": 14})
    burst = 16
    with server.client(limits=httpx.Limits(max_connections=burst)) as http, ThreadPoolExecutor(burst) as pool:
        statuses = list(pool.map(lambda _: http.post("/v1/completions", json=BODY).status_code, range(burst)))
    assert statuses == [200] * burst
    server.wait_until_idle()
    assert server.ctx.engine.num_admitted == 0
