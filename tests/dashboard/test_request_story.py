"""One slow request explained (kvflow/doctor/request_story.py) from a live server's recorded window,
with a planted cause of each kind: one running slot (queued behind whom, and max_num_seqs named), a
KV pool too small for two requests (its preemptions and the gap they cost), and a token budget
smaller than the prompt (each chunk with the step that computed it). The same story comes as JSON
(`/dashboard/request/ID?format=json`), as the page the dashboard links each Gantt row to, and from
`kvflow doctor --request ID --server URL`."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from fixtures.dashboard_load import send_load
from fixtures.live_server import LiveServer

from kvflow.cli import main


def window_rows(server: LiveServer) -> dict[str, dict[str, Any]]:
    """The dashboard window's request rows (the event stream's hello frame)."""
    with server.client() as client, client.stream("GET", "/dashboard/events") as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                return {r["id"]: r for r in json.loads(line.removeprefix("data: "))["requests"]}
    raise AssertionError("no frame")


def story(server: LiveServer, request_id: str) -> dict[str, Any]:
    with server.client() as client:
        response = client.get(f"/dashboard/request/{request_id}", params={"format": "json"})
        assert response.status_code == 200, response.text
        return dict(response.json())


def test_queued_behind_the_running_slot(start_server: Callable[..., LiveServer]) -> None:
    server = start_server(served_model_name="one-slot", engine={"max_num_seqs": 1})
    send_load(server, 4)
    told = story(server, "slowest")  # the highest TTFT in the window
    queue = told["queue"]
    assert queue["limit"] == "max_num_seqs" and "max_num_seqs=1" in queue["why"]
    assert queue["running_when_it_arrived"] or queue["scheduled_ahead_of_it"]
    assert queue["queue_ms"] > 0 and queue["steps_waited"] > 0
    assert told["ttft_ms"] == pytest.approx(queue["queue_ms"] + told["prefill_ms"], abs=0.01)
    assert "max_num_seqs=1" in told["summary"]
    with server.client() as client:  # the page the Gantt row links to
        page = client.get(f"/dashboard/request/{told['id']}")
        assert page.status_code == 200 and told["id"] in page.text and "queued" in page.text
        missing = client.get("/dashboard/request/no-such-request", params={"format": "json"})
        assert missing.status_code == 404 and "no-such-request" in missing.json()["error"]["message"]


def test_preemptions_and_the_gap_they_cost(start_server: Callable[..., LiveServer]) -> None:
    # 3 blocks of 16 tokens; each request grows to 2 blocks, so two decoding at once preempt one another.
    server = start_server(served_model_name="preempting", engine={"num_kv_blocks": 3})
    send_load(server, 6, "p ")
    preempted = [rid for rid, row in window_rows(server).items() if row["preemptions"]]
    assert preempted
    told = story(server, preempted[0])
    assert told["preemptions"] and all(p["recompute_from_ms"] > p["at_ms"] for p in told["preemptions"])
    assert any(g["preempted"] and "preempted" in g["why"] for g in told["slowest_gaps"])


def test_each_prefill_chunk_with_the_step_that_computed_it(
    start_server: Callable[..., LiveServer], capsys: pytest.CaptureFixture[str]
) -> None:
    server = start_server(served_model_name="chunked", engine={"max_num_batched_tokens": 16})
    send_load(server, 3, "a long shared preamble that takes several chunks of sixteen tokens each " * 2)
    rows = window_rows(server)
    rid = max(rows, key=lambda r: len(rows[r]["chunks"]))
    told = story(server, rid)
    chunks = told["prefill_chunks"]
    uncached = told["prompt_tokens"] - told["cached_tokens"]
    assert len(chunks) >= 3 and sum(c["tokens"] for c in chunks) >= uncached
    assert all(c["step_ms"] is not None and c["step_ms"] > 0 for c in chunks)
    assert all(c["tokens"] + c["other_prefill_tokens"] <= 16 for c in chunks)
    # The command line reads the same story from the server.
    assert main(["doctor", "--request", rid, "--server", server.base_url]) == 0
    printed = capsys.readouterr().out
    assert f"request {rid}" in printed and "prefill chunk at +" in printed


def test_the_command_sends_the_servers_api_key(
    start_server: Callable[..., LiveServer], capsys: pytest.CaptureFixture[str]
) -> None:
    server = start_server(served_model_name="keyed", api_key="sesame")
    with server.client() as client:
        body = {"model": "keyed", "prompt": "hello", "max_tokens": 4}
        assert (
            client.post("/v1/completions", json=body, headers={"Authorization": "Bearer sesame"}).status_code
            == 200
        )
    assert main(["doctor", "--request", "slowest", "--server", server.base_url]) == 1
    assert "HTTP 401" in capsys.readouterr().err
    assert main(["doctor", "--request", "slowest", "--server", server.base_url, "--api-key", "sesame"]) == 0
    assert "TTFT" in capsys.readouterr().out
