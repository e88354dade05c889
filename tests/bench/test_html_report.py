"""kvflow.bench.html_report: self-contained HTML pages with inline SVG charts, safe with hostile strings."""

from __future__ import annotations

import copy
import re
from typing import Any
from xml.etree import ElementTree

import pytest

from kvflow.bench.html_report import TIMELINE_CAP, render_html, render_sweep_html

HOSTILE_ERROR = 'HTTP 500: <script>alert("x")</script> & more'
HOSTILE_MODEL = "tiny<b>llama</b>"


def _summary(values: list[float]) -> dict[str, float | None]:
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]  # noqa: E731
    return {
        "mean": sum(values) / len(values),
        "p50": pick(50),
        "p90": pick(90),
        "p95": pick(95),
        "p99": pick(99),
        "max": max(values),
    }


def _request(i: int) -> dict[str, Any]:
    send = 0.25 * i
    ttft = 40.0 + 7.5 * i
    itl = [10.0 + (i + k) % 4 for k in range(15)] + [0.0]  # a zero gap: two tokens in one chunk
    e2e = ttft + sum(itl)
    return {
        "index": i,
        "send_s": send,
        "ttft_ms": ttft,
        "ttft_first_chunk_ms": ttft - 1.0,
        "e2e_ms": e2e,
        "tpot_ms": (e2e - ttft) / 16,
        "prompt_tokens": 32,
        "output_tokens": 17,
        "error": None,
        "itl_ms": itl,
        "conversation": None,
        "turn": None,
        "language": None,
        "chunks": [[ttft / 1e3 - 0.001, "role", 0], [ttft / 1e3, "content", 1], [e2e / 1e3, "content", 2]],
    }


def _result() -> dict[str, Any]:
    requests = [_request(i) for i in range(11)]
    requests.append(
        {
            "index": 11,
            "send_s": 2.9,
            "ttft_ms": None,
            "ttft_first_chunk_ms": None,
            "e2e_ms": None,
            "tpot_ms": None,
            "prompt_tokens": 32,
            "output_tokens": 0,
            "error": HOSTILE_ERROR,
            "itl_ms": [],
            "conversation": None,
            "turn": None,
            "language": None,
            "chunks": [],
        }
    )
    ok = requests[:11]
    return {
        "config": {
            "base_url": "http://127.0.0.1:8000",
            "model": HOSTILE_MODEL,
            "endpoint": "/v1/completions",
            "dataset": "random",
            "num_requests": 12,
            "concurrency": 4,
            "seed": 0,
            "slo": {"ttft_ms": 500.0, "tpot_ms": 50.0},
        },
        "completed": 11,
        "failed": 1,
        "duration_s": 3.75,
        "request_throughput": 2.93,
        "output_throughput": 49.87,
        "total_token_throughput": 143.47,
        "goodput": 2.67,
        "slo_attainment_pct": 91.67,
        "ttft_ms": _summary([r["ttft_ms"] for r in ok]),
        "ttft_first_chunk_ms": _summary([r["ttft_first_chunk_ms"] for r in ok]),
        "tpot_ms": _summary([r["tpot_ms"] for r in ok]),
        "itl_ms": _summary([g for r in ok for g in r["itl_ms"]]),
        "itl_chunk_ms": dict.fromkeys(("mean", "p50", "p90", "p95", "p99", "max")),
        "e2e_ms": _summary([r["e2e_ms"] for r in ok]),
        "server": {
            "prefix_cache_hit_rate": 0.875,
            "num_preemptions": 3,
            "server_ttft_ms_mean": None,
            "steps": {"decode_only": {"count": 120}, "mixed": {"count": 7}},
        },
        "errors": {HOSTILE_ERROR: 1},
        "warnings": ["usage missing: token counts <estimated> locally"],
        "languages": {"en": {"chars": 1200, "tokens": 300, "tokens_per_char": 0.25}},
        "requests": requests,
    }


def _assert_document(page: str) -> None:
    assert page.startswith("<!DOCTYPE html>")
    assert page.rstrip().endswith("</html>")
    for tag in ("<html", "<head>", "<meta charset=", "<title>", "<body>", "</body>"):
        assert tag in page
    # Self-contained: no scripts, no external resources.
    assert "<script" not in page.lower()
    assert "src=" not in page
    assert "<link" not in page


def _svgs(page: str) -> list[str]:
    return re.findall(r"<svg\b.*?</svg>", page, flags=re.DOTALL)


def _assert_well_formed_svgs(page: str) -> None:
    for svg in _svgs(page):
        ElementTree.fromstring(svg)  # each chart is well-formed XML (escaping included)


def test_single_run_report_is_a_complete_document_with_four_charts() -> None:
    page = render_html(_result())
    _assert_document(page)
    assert page.count("<svg") == 4
    _assert_well_formed_svgs(page)
    for title in (
        "TTFT distribution",
        "Inter-token latency distribution",
        "Per-request timeline",
        "Latency against send time",
    ):
        assert title in page
    for axis_label in ("TTFT (ms)", "ITL (ms)", "time since the start of the run (s)", "latency (ms)"):
        assert axis_label in page
    # Percentile markers on the histograms, the failed request as a red bar on the timeline.
    assert "p50 " in page and "p99 " in page
    assert 'fill="#d62728"' in page


def test_strings_from_the_result_are_escaped() -> None:
    page = render_html(_result())
    assert "<script>" not in page
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; &amp; more" in page
    assert "<b>llama</b>" not in page
    assert "tiny&lt;b&gt;llama&lt;/b&gt;" in page
    assert "&lt;estimated&gt;" in page


def test_summary_latency_server_and_config_numbers_appear() -> None:
    result = _result()
    page = render_html(result)
    for number in ("3.75", "2.93", "49.87", "143.47", "2.67", "91.67"):
        assert number in page
    assert f"{result['ttft_ms']['p99']:.2f}" in page
    assert f"{result['e2e_ms']['max']:.2f}" in page
    # Server table: nested dicts as key paths; languages and config tables.
    assert "steps.decode_only.count" in page
    assert "prefix_cache_hit_rate" in page and "0.875" in page
    assert "slo.ttft_ms" in page
    assert "tokens per character" in page and "0.25" in page
    assert "http://127.0.0.1:8000" in page


@pytest.mark.parametrize(
    "mutate",
    [
        lambda r: r.update(requests=[]),
        lambda r: r.update(requests=[], server={}, errors={}, warnings=[], languages={}),
        lambda r: [r.pop(k) for k in list(r)],  # an empty dict
        lambda r: [req.update(ttft_ms=None, e2e_ms=None, itl_ms=[]) for req in r["requests"]],
        lambda r: [req.update(itl_ms=[5.0, 5.0, 5.0]) for req in r["requests"]],  # all values equal
        lambda r: r["requests"][0].update(itl_ms=[0.01, 900.0, float("nan")]),  # wide range -> log x
    ],
)
def test_degenerate_results_still_render(mutate: Any) -> None:
    result = _result()
    mutate(result)
    page = render_html(result)
    _assert_document(page)
    assert page.count("<svg") == 4
    _assert_well_formed_svgs(page)


def test_empty_requests_render_no_data_charts() -> None:
    result = _result()
    result["requests"] = []
    page = render_html(result)
    assert "no data" in page or "no requests" in page
    assert "49.87" in page


def test_timeline_is_capped() -> None:
    result = _result()
    result["requests"] = [_request(i) for i in range(TIMELINE_CAP + 30)]
    page = render_html(result)
    assert f"showing the first {TIMELINE_CAP} of {TIMELINE_CAP + 30} requests" in page
    timeline = next(svg for svg in _svgs(page) if "Per-request timeline" in svg)
    assert timeline.count("<g><title>") == TIMELINE_CAP


def _sweep() -> dict[str, Any]:
    runs = []
    for load in (1, 2, 4, 8, 16, 32):
        result = copy.deepcopy(_result())
        result["config"]["concurrency"] = load
        result["ttft_ms"] = {
            "mean": 50.0 * load,
            "p50": 45.0 * load,
            "p90": None,
            "p95": None,
            "p99": 80.0 * load,
        }
        result["tpot_ms"] = {"mean": 10.0 + load, "p50": 9.0 + load, "p99": 12.0 + load}
        result["output_throughput"] = 100.0 * min(load, 8) + 0.5
        runs.append({"load": float(load), "result": result})
    return {
        "load_key": "concurrency",
        "runs": runs,
        "capacity": {
            "load": 8.0,
            "first_failing_load": 16.0,
            "slo": {"ttft_ms": 700.0, "tpot_ms": 30.0},
            "percentile": 90.0,
        },
    }


def test_sweep_report_has_its_charts_and_table() -> None:
    page = render_sweep_html(_sweep())
    _assert_document(page)
    assert page.count("<svg") == 3
    _assert_well_formed_svgs(page)
    for title in ("TTFT against load", "TPOT against load", "Output throughput against load"):
        assert title in page
    assert "concurrency (requests in flight)" in page
    assert "capacity 8" in page
    assert "at least 90% of requests meeting the SLO (ttft_ms ≤ 700 ms, tpot_ms ≤ 30 ms)" in page
    assert "first failing concurrency: 16" in page
    assert "SLO ttft_ms ≤ 700 ms" in page
    assert "800.50" in page  # output throughput of the load-8 run, in the table
    assert "<polyline" in page
    assert "<script>" not in page
    assert "&lt;script&gt;" in page  # the runs' error tables, escaped


@pytest.mark.parametrize(
    "sweep",
    [
        {"load_key": "request_rate", "runs": [], "capacity": None},
        {},
        {
            "load_key": "request_rate",
            "runs": [
                {"load": float("inf"), "result": {}},
                {"load": 2.0, "result": {"ttft_ms": {"p50": None}}},
            ],
            "capacity": {"load": None, "slo": {}, "percentile": 99.0},
        },
    ],
)
def test_degenerate_sweeps_still_render(sweep: dict[str, Any]) -> None:
    page = render_sweep_html(sweep)
    _assert_document(page)
    assert page.count("<svg") == 3
    _assert_well_formed_svgs(page)
