"""`kvflow doctor --request N --bench RESULT` on results that cannot answer (torch-free): a result
without the server's window (another server, or an older kvflow bench), a request the window no
longer holds, an index the result does not have. The story itself, from a live run, is in
tests/dashboard/test_request_story.py."""

from __future__ import annotations

from typing import Any

import pytest

from kvflow.doctor.bench_request import bench_story, pick_bench_request, window_view


def _result(window: dict[str, Any] | None) -> dict[str, Any]:
    requests = [
        {"index": i, "x_request_id": f"kvflow-bench-abc-{i}", "ttft_ms": 10.0 * (i + 1), "error": None}
        for i in range(3)
    ]
    requests.append({"index": 3, "x_request_id": "kvflow-bench-abc-3", "ttft_ms": 99.0, "error": "HTTP 500"})
    server: dict[str, Any] = {} if window is None else {"window": window}
    return {"requests": requests, "server": server}


def _window(held: list[int]) -> dict[str, Any]:
    rows = [{"id": f"cmpl-{i}-0", "x_request_id": f"kvflow-bench-abc-{i}"} for i in held]
    return {
        "step_fields": ["t"],
        "steps": [],
        "requests": rows,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 64,
    }


def test_a_result_without_the_servers_window_says_what_to_do() -> None:
    with pytest.raises(ValueError, match=r"no server window.*--server URL"):
        bench_story(_result(None), "slowest")


def test_requests_are_found_by_index_header_or_server_id() -> None:
    result = _result(_window([0, 1, 2]))
    view = window_view(result)
    assert view is not None
    assert pick_bench_request(result, view, "1")[1] == "cmpl-1-0"
    assert pick_bench_request(result, view, "kvflow-bench-abc-2")[1] == "cmpl-2-0"
    assert pick_bench_request(result, view, "cmpl-0-0")[0]["index"] == 0
    # slowest: the highest client TTFT among the requests the window holds (a failed one is not a candidate)
    assert pick_bench_request(result, view, "slowest")[0]["index"] == 2


def test_what_the_window_no_longer_holds_and_what_the_result_lacks() -> None:
    result = _result(_window([2]))
    view = window_view(result)
    assert view is not None
    with pytest.raises(ValueError, match="no longer holds it"):
        pick_bench_request(result, view, "0")
    with pytest.raises(ValueError, match="not a succeeded request"):
        pick_bench_request(result, view, "3")  # it failed
    empty = _result(_window([]))
    empty_view = window_view(empty)
    assert empty_view is not None
    with pytest.raises(ValueError, match="no request of this run is in the server's window"):
        pick_bench_request(empty, empty_view, "slowest")
