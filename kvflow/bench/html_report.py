"""Self-contained HTML reports of kvflow bench results: tables plus hand-written inline SVG charts.

`render_html(result)` renders one run (the result JSON of `kvflow bench`); `render_sweep_html(sweep)`
(kvflow/bench/html_sweep.py, re-exported here) renders a sweep of runs over load. The output is one HTML
document with no scripts, no external resources and no plotting library: each chart is a small SVG drawn
by kvflow/bench/svg.py, so a report opens anywhere, offline, and can be attached to an issue or archived
next to the JSON it came from. The page, its tables and the escaping rules: kvflow/bench/html_page.py.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvflow.bench.html_page import (
    DECODE_COLOR,
    FAIL_COLOR,
    P50_COLOR,
    P99_COLOR,
    TTFT_COLOR,
    errors_html,
    figure,
    kv_html,
    latency_table,
    mapping,
    num,
    page,
    records,
    section,
    subtitle,
    summary_table,
    table,
    warnings_html,
)
from kvflow.bench.html_sweep import render_sweep_html
from kvflow.bench.metrics import percentile
from kvflow.bench.svg import (
    Box,
    GanttBar,
    LegendItem,
    Marker,
    chart,
    fmt,
    gantt_bars,
    histogram_svg,
    linear_domain,
    no_data,
    scatter_svg,
)

__all__ = ["render_html", "render_sweep_html"]

# At most this many bars in the per-request timeline: beyond it the bars are thinner than a pixel.
TIMELINE_CAP = 200


# ---------------------------------------------------------------------------------------------------------
# The requests of a run
# ---------------------------------------------------------------------------------------------------------


def _successful(requests: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The requests the summary statistics cover (metrics.aggregate only counts successful ones)."""
    return [r for r in requests if r.get("error") is None]


def _percentile_markers(summary: Mapping[str, Any], values: Sequence[float]) -> list[Marker]:
    """p50 and p99 from the run's summary, else computed from the per-request values."""
    markers: list[Marker] = []
    for name, q, color in (("p50", 50, P50_COLOR), ("p99", 99, P99_COLOR)):
        value = num(summary.get(name))
        if value is None and values:
            value = percentile(values, q)
        markers.append((name, value, color))
    return markers


def _request_end_s(request: Mapping[str, Any], send: float) -> float | None:
    """When a request ended: send + E2E, else its last chunk (failed requests have no E2E), else TTFT."""
    e2e = num(request.get("e2e_ms"))
    if e2e is not None:
        return send + e2e / 1e3
    chunks = request.get("chunks")
    chunk_times = [
        t
        for chunk in (chunks if isinstance(chunks, list | tuple) else ())
        if isinstance(chunk, list | tuple) and chunk and (t := num(chunk[0])) is not None
    ]
    if chunk_times:
        return send + max(chunk_times)
    ttft = num(request.get("ttft_ms"))
    return None if ttft is None else send + ttft / 1e3


# ---------------------------------------------------------------------------------------------------------
# Charts of one run
# ---------------------------------------------------------------------------------------------------------


def _ttft_histogram_svg(result: Mapping[str, Any], requests: Sequence[Mapping[str, Any]]) -> str:
    # TTFT distribution of the successful requests (the ones the summary covers), with the run's p50 and
    # p99 marked: a long right tail or a second mode (requests that queued behind others) shows at a glance,
    # where the percentiles alone would hide it.
    values = [v for r in _successful(requests) if (v := num(r.get("ttft_ms"))) is not None]
    markers = _percentile_markers(mapping(result.get("ttft_ms")), values)
    return histogram_svg("TTFT distribution", "TTFT (ms)", values, markers, noun="requests")


def _itl_histogram_svg(result: Mapping[str, Any], requests: Sequence[Mapping[str, Any]]) -> str:
    # Distribution of every per-token gap of every successful request. Steady decoding is one narrow peak;
    # stalls (a prefill chunk sharing the step, a preemption) form a tail or a separate cluster far to the
    # right, which is why the x axis turns logarithmic when the gaps span a wide range.
    values: list[float] = []
    for request in _successful(requests):
        gaps = request.get("itl_ms")
        if isinstance(gaps, list | tuple):
            values.extend(v for g in gaps if (v := num(g)) is not None)
    markers = _percentile_markers(mapping(result.get("itl_ms")), values)
    return histogram_svg(
        "Inter-token latency distribution", "ITL (ms)", values, markers, noun="token gaps", allow_log=True
    )


def _timeline_bar(row: int, request: Mapping[str, Any], send: float) -> tuple[GanttBar, list[float]]:
    """One request on the timeline, in seconds from the start of the run; and the times it spans."""
    ttft = num(request.get("ttft_ms"))
    error = request.get("error")
    first_token = None if ttft is None else send + ttft / 1e3
    end = _request_end_s(request, send)
    last = end if end is not None else send
    tip = (
        f"request {request.get('index', row)}: sent at {send:.3f} s, TTFT {fmt(ttft)} ms, "
        f"E2E {fmt(num(request.get('e2e_ms')))} ms, {fmt(request.get('prompt_tokens'))} prompt tokens, "
        f"{fmt(request.get('output_tokens'))} output tokens"
    )
    segments: list[tuple[float, float, str, float]]
    if error is not None:
        tip += f", error: {error}"
        segments = [(send, last, FAIL_COLOR, 3.0)]
    elif first_token is not None:
        segments = [(send, first_token, TTFT_COLOR, 1.0), (first_token, last, DECODE_COLOR, 0.0)]
    else:
        segments = [(send, last, DECODE_COLOR, 1.0)]
    times = [t for t in (send, first_token, end) if t is not None]
    return GanttBar(row, segments, tip), times


def _timeline_svg(requests: Sequence[Mapping[str, Any]]) -> str:
    # One bar per request, in send order, from its send time to its last token: the orange part is the wait
    # for the first token (queueing + prefill), the blue part is decoding, red bars failed. It shows how
    # many requests overlapped, whether TTFT grew as the queue built up, and when failures happened.
    timed = sorted(
        ((send, r) for r in requests if (send := num(r.get("send_s"))) is not None), key=lambda item: item[0]
    )
    notes: list[str] = []
    if len(timed) > TIMELINE_CAP:
        notes.append(f"showing the first {TIMELINE_CAP} of {len(timed)} requests (by send time)")
    if len(timed) < len(requests):
        notes.append(f"{len(requests) - len(timed)} requests without a send time not shown")
    bars_times = [
        _timeline_bar(row, request, send) for row, (send, request) in enumerate(timed[:TIMELINE_CAP])
    ]
    plot_height = min(max(len(bars_times) * 6.0, 120.0), 600.0)
    box = Box(height=plot_height + Box.top + Box.bottom)
    x = box.x_scale(linear_domain((t for _, times in bars_times for t in times), zero=True))
    y = box.y_scale(
        linear_domain([0.0, float(max(len(bars_times), 1))], zero=True, integer=True), downward=True
    )
    body = gantt_bars(x, y, [bar for bar, _ in bars_times]) if bars_times else [no_data(box, "no requests")]
    legend = [
        LegendItem("to first token", TTFT_COLOR),
        LegendItem("decode", DECODE_COLOR),
        LegendItem("failed", FAIL_COLOR),
    ]
    return chart(
        box,
        "Per-request timeline",
        "time since the start of the run (s)",
        "request (send order)",
        x,
        y,
        body,
        legend=legend,
        notes=notes,
    )


def _latency_over_time_svg(requests: Sequence[Mapping[str, Any]]) -> str:
    # TTFT and E2E of each successful request against when it was sent: a rising cloud means the server fell
    # behind (queueing), periodic spikes point at something recurring (preemption, a long prefill), and a
    # slow start is warm-up. TTFT is drawn over E2E since it is usually the smaller of the two.
    ok = _successful(requests)
    series: list[tuple[str, str, Sequence[tuple[float, float]]]] = []
    for key, label, color in (("e2e_ms", "E2E", DECODE_COLOR), ("ttft_ms", "TTFT", TTFT_COLOR)):
        points = [
            (send, value)
            for r in ok
            if (send := num(r.get("send_s"))) is not None and (value := num(r.get(key))) is not None
        ]
        series.append((label, color, points))
    failed = len(requests) - len(ok)
    notes = [f"{failed} failed requests not shown"] if failed else []
    return scatter_svg(
        "Latency against send time",
        "send time since the start of the run (s)",
        "latency (ms)",
        series,
        notes=notes,
    )


def _run_charts(result: Mapping[str, Any]) -> list[str]:
    requests = records(result.get("requests"))
    return [
        figure(
            _ttft_histogram_svg(result, requests),
            "Time to first token of each successful request; dashed lines: the run's p50 and p99.",
        ),
        figure(
            _itl_histogram_svg(result, requests),
            "Every gap between consecutive output tokens; a tail to the right is decode stalls.",
        ),
        figure(
            _timeline_svg(requests),
            "Each request from send to last token: orange until the first token, blue while decoding, "
            "red if it failed. Hover a bar for its numbers.",
        ),
        figure(
            _latency_over_time_svg(requests),
            "TTFT and E2E of each request against its send time: a rising trend means a growing queue.",
        ),
    ]


# ---------------------------------------------------------------------------------------------------------
# The page
# ---------------------------------------------------------------------------------------------------------


def _languages_html(result: Mapping[str, Any]) -> str:
    languages = mapping(result.get("languages"))
    rows = []
    for lang, stats in sorted(languages.items(), key=lambda item: str(item[0])):
        entry = mapping(stats)
        rows.append([lang, entry.get("chars"), entry.get("tokens"), entry.get("tokens_per_char")])
    return table(("language", "characters", "tokens", "tokens per character"), rows)


def render_html(result: dict[str, Any]) -> str:
    """One benchmark run as a self-contained HTML page: summary, latency tables and four SVG charts."""
    config = mapping(result.get("config"))
    model = config.get("model")
    warnings = warnings_html(result)
    sections = [
        section("Warnings", warnings) if warnings else "",
        section("Summary", summary_table(result)),
        section("Latency", latency_table(result)),
        section("Charts", "\n".join(_run_charts(result))),
        section("Errors", errors_html(result)),
        section("Server-side numbers", kv_html(mapping(result.get("server")), "no server-side numbers")),
        section("Languages", _languages_html(result)) if mapping(result.get("languages")) else "",
        section("Configuration", kv_html(config, "no configuration recorded")),
    ]
    title = f"kvflow bench: {model}" if model is not None else "kvflow bench"
    return page(title, "kvflow bench report", subtitle(config), sections)
