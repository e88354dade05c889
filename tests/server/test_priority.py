"""The request's `priority` field (vLLM's): refused with a 400 naming the flag on a first-come server,
honoured on one started with `--scheduling-policy priority` (ordering: tests/engine/)."""

from __future__ import annotations

from collections.abc import Callable

from fixtures.live_server import LiveServer


def test_priority_needs_the_priority_policy(server: LiveServer) -> None:
    with server.client() as client:
        body = {"model": server.model, "prompt": "hello", "max_tokens": 2, "priority": 3}
        refused = client.post("/v1/completions", json=body)
        assert (
            refused.status_code == 400
            and "--scheduling-policy priority" in refused.json()["error"]["message"]
        )
        assert client.post("/v1/completions", json={**body, "priority": 0}).status_code == 200


def test_a_priority_server_takes_priorities(start_server: Callable[..., LiveServer]) -> None:
    live = start_server(engine={"scheduling_policy": "priority"})
    with live.client() as client:
        for priority in (-5, 0, 7):
            body = {"model": live.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            response = client.post("/v1/chat/completions", json={**body, "priority": priority})
            assert response.status_code == 200, response.text
