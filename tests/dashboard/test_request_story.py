"""One slow request explained (kvflow/doctor/request_story.py) from a live server's recorded window,
with a planted cause of each kind: one running slot (queued behind whom, and max_num_seqs named), a
KV pool too small for two requests (its preemptions and the gap they cost), and a token budget
smaller than the prompt (each chunk with the step that computed it, and the queue's wait named
max_num_batched_tokens), a structured-output request (its grammar compile in the queue). The same
story comes as JSON (`/dashboard/request/ID?format=json`, ID also the request's x-request-id), as
the page the dashboard links each Gantt row to, from `kvflow doctor --request ID --server URL`, and
from a kvflow bench result once the server is gone (`--bench RESULT`, ID the request's index)."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fixtures.dashboard_load import send_load
from fixtures.live_server import LiveServer

from kvflow.cli import main
from kvflow.server.dashboard.request_story import WindowView, explain_request
from kvflow.server.dashboard.schema import STEP_FIELDS


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
    # Its HTTP handoff (arrival -> the engine took it in) is part of the queue; the slot the rest.
    assert (
        0 <= queue["handoff_ms"] < queue["queue_ms"] / 2 and "the engine took it in after" in told["summary"]
    )
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


def test_a_token_budget_wait_and_a_grammar_compile(start_server: Callable[..., LiveServer]) -> None:
    server = start_server(served_model_name="budget", engine={"max_num_batched_tokens": 16})
    # Long enough that the queued requests wait many 16-token steps: a handoff of a few ms on a loaded
    # machine (the full suite's) must not be most of their wait (the story then names the handoff).
    send_load(server, 4, "a long shared preamble that takes several chunks of sixteen tokens each " * 6)
    limits = {rid: story(server, rid)["queue"] for rid in window_rows(server)}
    assert any(
        q["limit"] == "token_budget" and "max_num_batched_tokens=16" in q["why"] for q in limits.values()
    )
    body = {
        "model": "budget",
        "prompt": "a json object:",
        "max_tokens": 8,
        "response_format": {"type": "json_object"},
    }
    with server.client() as client:
        response = client.post("/v1/completions", json=body, headers={"x-request-id": "grammar-request-1"})
        assert response.status_code == 200, response.text
    told = story(server, "grammar-request-1")  # found by the x-request-id the client sent
    assert told["queue"]["grammar_ms"] is not None and told["queue"]["grammar_ms"] >= 0
    assert "grammar compile" in told["summary"]


def test_a_bench_results_request_after_the_server_is_gone(
    start_server: Callable[..., LiveServer], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = start_server(served_model_name="one-slot-bench", engine={"max_num_seqs": 1})
    out = tmp_path / "result.json"
    args = ["bench", "--base-url", server.base_url + "/v1", "--num-requests", "6", "--concurrency", "3"]
    # 32 outputs: a request holds the one slot ~32 steps, so a waiting request's wait outweighs its
    # HTTP handoff on a loaded machine (with 6 outputs the full suite once saw every wait named the
    # handoff: 2 x the handoff at least the queue, request_story._queue).
    args += ["--input-len", "24", "--output-len", "32", "--output", str(out), "--quiet"]
    assert main(args) == 0
    server.stop()
    capsys.readouterr()
    result = json.loads(out.read_text())
    sent = {r["index"]: r["x_request_id"] for r in result["requests"]}
    assert len(set(sent.values())) == 6 and all(sent.values())
    rows = result["server"]["window"]["requests"]
    assert set(sent.values()) <= {r["x_request_id"] for r in rows}  # each recorded under its header
    assert main(["doctor", "--request", "slowest", "--bench", str(out)]) == 0
    assert capsys.readouterr().out.startswith("bench request ")
    # Three clients, one slot: some request waited for it (which one was slowest at the client
    # depends on the machine: a delivery hiccup can outrank a queue).
    stories = []
    for i in sorted(sent):
        assert main(["doctor", "--request", str(i), "--bench", str(out), "--json"]) == 0
        stories.append(json.loads(capsys.readouterr().out))
    queues = [t["queue"] for t in stories]
    assert any(q["limit"] == "max_num_seqs" and "max_num_seqs=1" in q["why"] for q in queues)
    index = sorted(sent)[2]
    assert main(["doctor", "--request", str(index), "--bench", str(out), "--json"]) == 0
    told = json.loads(capsys.readouterr().out)
    client = told["client"]
    assert client["index"] == index and client["x_request_id"] == sent[index]
    assert client["ttft_ms"] == pytest.approx(told["ttft_ms"] + client["delivery_ms"])
    assert told["ttft_ms"] == pytest.approx(told["queue"]["queue_ms"] + told["prefill_ms"], abs=0.01)
    assert main(["doctor", "--request", "99", "--bench", str(out)]) == 2
    assert "not a succeeded request of this result" in capsys.readouterr().err


def test_a_kv_restore_from_the_offload_tier(start_server: Callable[..., LiveServer], tmp_path: Path) -> None:
    """A pool of 30 4-token blocks holds about two 44-token prompts: the first is evicted to the tier
    on disk by the next three, and its return (the same prompt and 5 more tokens) reads it back."""
    engine = {"block_size": 4, "num_kv_blocks": 30, "max_num_seqs": 1, "kv_offload_path": str(tmp_path)}
    server = start_server(served_model_name="offload", engine=engine)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 200) for _ in range(44 + i)] for i in range(4)]
    with server.client() as client:
        for i, prompt in enumerate([*prompts, prompts[0] + [5, 6, 7, 8, 9]]):
            body = {"model": "offload", "prompt": prompt, "max_tokens": 8, "ignore_eos": True}
            response = client.post("/v1/completions", json=body, headers={"x-request-id": f"turn-{i}"})
            assert response.status_code == 200, response.text
    told = story(server, "turn-4")
    assert told["cached_tokens"] >= 40 and told["queue"]["restore_ms"] is not None
    assert "KV restore" in told["summary"]


def test_a_wait_mostly_before_the_engine_had_it_is_named_the_handoff() -> None:
    """A request whose queue was mostly its HTTP handoff (arrival -> the engine took it in: its
    handler parsing and tokenizing between the engine's steps): the limit is the handoff, not the
    slots or the budget, which cannot hold back what the engine does not have."""

    def step(t: float, dur_ms: float) -> list[Any]:
        values = {"t": t, "dur_ms": dur_ms, "running": 1}
        return [values.get(name, 0) for name in STEP_FIELDS]

    row = {
        "id": "r", "state": "finished", "priority": 0, "arrival": 10.0, "handed_off": 10.004,
        "added": 10.005, "first_scheduled": 10.006, "first_token": 10.008, "chunks": [[10.006, 16]],
        "preemptions": [], "prompt_tokens": 16, "cached_tokens": 0, "output_tokens": 1, "ttft_ms": 8.0,
        "slowest_gaps": [],
    }  # fmt: skip
    view = WindowView(
        {"r": row}, [step(10.001, 3.0), step(10.006, 2.0)], max_num_seqs=1, max_num_batched_tokens=64
    )
    story = explain_request(view, "r")
    assert story["queue"]["handoff_ms"] == pytest.approx(5.0) and story["queue"]["queue_ms"] == pytest.approx(
        6.0
    )
    assert story["queue"]["limit"] == "handoff" and "before the engine had it" in story["queue"]["why"]
    assert "the engine took it in after 5.0 ms" in story["summary"]
