"""`kvflow bench --priority-mix`: each measured request carries vLLM's `priority` field in the mix's
exact proportions, the result reports TTFT per priority class, and the doctor reads the classes.

Against a priority server with one running slot (max_num_seqs=1) and eight requests in flight, the
requests of priority 0 go ahead of the queued priority-5 ones whenever the slot frees. The test reads
that order of service from the bench's records (how many other requests got their first token while
each one waited), not from TTFT medians: a stall of the shared CI machine during the first wave (three
of the four priority-0 requests are in it) once made the priority-0 median the larger."""

from __future__ import annotations

import json
import statistics
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from fixtures.live_server import LiveServer

from kvflow.bench.priority import assign_priorities, parse_priority_mix
from kvflow.cli import main
from kvflow.doctor.evidence import evidence_from_bench

NUM_REQUESTS = 16


def test_the_mix_is_parsed_and_assigned_exactly() -> None:
    assert parse_priority_mix("0:0.25,5:0.75") == {0: 0.25, 5: 0.75}
    assert parse_priority_mix(None) == {}
    for bad in ("0:0.5", "0:0.5,x:0.5", "0-1", "0:1.5,1:-0.5"):
        with pytest.raises(ValueError, match="--priority-mix"):
            parse_priority_mix(bad)
    order = assign_priorities(10, {0: 0.25, 5: 0.75}, seed=3)
    assert Counter(order) == {0: 2, 5: 8}  # round(2.5) = 2; the largest class takes the rest
    assert (
        order
        == assign_priorities(10, {0: 0.25, 5: 0.75}, seed=3)
        != assign_priorities(10, {0: 0.25, 5: 0.75}, seed=4)
    )
    assert assign_priorities(3, {}, seed=0) == [None, None, None]


def served_ahead(records: list[dict]) -> dict[int, int]:
    """Per request index: how many other requests got their first token between its send and its
    own first token (its place in the order of service; a machine-wide stall moves every time, not
    this count)."""
    first_token_s = {r["index"]: r["send_s"] + r["ttft_ms"] / 1000 for r in records}
    return {
        r["index"]: sum(
            r["send_s"] < t < first_token_s[r["index"]]
            for index, t in first_token_s.items()
            if index != r["index"]
        )
        for r in records
    }


def test_bench_sends_priorities_and_reports_each_class(
    start_server: Callable[..., LiveServer],
    server_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    live = start_server(engine={"scheduling_policy": "priority", "max_num_seqs": 1})
    out = tmp_path / "result.json"
    args = ["bench", "--base-url", live.base_url + "/v1", "--num-requests", str(NUM_REQUESTS)]
    args += ["--concurrency", "8", "--input-len", "16", "--output-len", "24", "--warmup", "0"]
    args += ["--priority-mix", "0:0.25,5:0.75", "--output", str(out), "--quiet"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "priority 0: 4 requests" in printed and "priority 5: 12 requests" in printed
    result = json.loads(out.read_text())
    assert result["failed"] == 0
    assert Counter(r["priority"] for r in result["requests"]) == {0: 4, 5: 12}
    classes = result["per_priority"]
    assert (classes["0"]["completed"], classes["5"]["completed"]) == (4, 12)
    # Served first whenever the one slot frees: while a priority-0 request waits, at most the running
    # request and earlier priority-0 ones get a first token; a priority-5 one waits behind the queue.
    ahead = served_ahead(result["requests"])
    ahead_0 = [ahead[r["index"]] for r in result["requests"] if r["priority"] == 0]
    ahead_5 = [ahead[r["index"]] for r in result["requests"] if r["priority"] == 5]
    assert statistics.median(ahead_0) < statistics.median(ahead_5), (ahead_0, ahead_5)
    assert classes["0"]["ttft_ms"]["p50"] == pytest.approx(
        statistics.median(r["ttft_ms"] for r in result["requests"] if r["priority"] == 0)
    )
    run = evidence_from_bench(result)
    assert list(run.ttft_by_priority) == [0, 5]
    assert run.ttft_by_priority[0][0] == classes["0"]["ttft_ms"]["p50"]
    # The doctor's TTFT step carries the classes (and names them in a queueing finding).
    assert main(["doctor", str(server_model_dir), "--bench", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    ttft = next(f for f in report["findings"] if f["id"] == "ttft")
    assert set(ttft["evidence"]["ttft_ms_by_priority"]) == {"0", "5"}
    # Eight requests in flight for one slot: queueing is most of TTFT, and the finding splits it.
    assert "by priority class, priority 0: p50" in ttft["summary"]
