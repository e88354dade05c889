"""The HTML report of a sweep over load (`kvflow bench` with a list of loads): `render_sweep_html`.

Latency and throughput against load as charts, the capacity found (with --find-capacity), a table with a
row per run, and each run's own tables folded below it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvflow.bench.html_page import (
    DECODE_COLOR,
    P50_COLOR,
    P99_COLOR,
    empty,
    errors_html,
    figure,
    flatten,
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
from kvflow.bench.svg import Series, esc, fmt_short, series_svg

__all__ = ["render_sweep_html"]

SLO_COLOR = "#d62728"
CAPACITY_COLOR = "#555555"

# (load, the run's result) with a finite load: what the charts plot.
_Runs = Sequence[tuple[float, Mapping[str, Any]]]


def _load_label(load_key: str) -> str:
    if load_key == "concurrency":
        return "concurrency (requests in flight)"
    if load_key == "request_rate":
        return "request rate (req/s)"
    return load_key


def _sweep_points(runs: _Runs, metric: str, stat: str | None = None) -> list[tuple[float, float | None]]:
    """(load, result[metric][stat]) of each run, or result[metric] when `stat` is None."""
    points: list[tuple[float, float | None]] = []
    for load, result in runs:
        value = result.get(metric)
        if stat is not None:
            value = mapping(value).get(stat)
        points.append((load, num(value)))
    return points


def _capacity_lines(capacity: float | None) -> list[tuple[str, float | None, str]]:
    return [(f"capacity {fmt_short(capacity)}", capacity, CAPACITY_COLOR)] if capacity is not None else []


def _latency_chart(
    runs: _Runs, metric: str, name: str, x_label: str, capacity: float | None, slo: Mapping[str, Any]
) -> str:
    """p50 (solid) and p99 (dashed) of `metric` against load, with its SLO bound and the capacity marked."""
    bound = num(slo.get(metric))
    return series_svg(
        f"{name} against load",
        x_label,
        f"{name} (ms)",
        [
            Series(f"{name} p50", P50_COLOR, _sweep_points(runs, metric, "p50")),
            Series(f"{name} p99", P99_COLOR, _sweep_points(runs, metric, "p99"), dashed=True),
        ],
        vlines=_capacity_lines(capacity),
        hlines=[(f"SLO {metric} ≤ {fmt_short(bound)} ms", bound, SLO_COLOR)],
    )


def _capacity_text(capacity: Mapping[str, Any], load_key: str) -> str:
    """The outcome of --find-capacity: the highest load whose SLO attainment reached `percentile` %."""
    slo = ", ".join(f"{key} ≤ {fmt_short(value)} ms" for key, value in flatten(mapping(capacity.get("slo"))))
    condition = f"the SLO ({slo or 'none recorded'})"
    if capacity.get("percentile") is not None:
        condition = f"at least {fmt_short(capacity.get('percentile'))}% of requests meeting {condition}"
    failing = capacity.get("first_failing_load")
    after = f" (first failing {load_key}: {fmt_short(failing)})" if failing is not None else ""
    if num(capacity.get("load")) is None:
        return f"No {load_key} in the sweep had {condition}{after}."
    return f"Capacity: the highest {load_key} with {condition} is {fmt_short(capacity.get('load'))}{after}."


_TABLE_LATENCY = (
    ("ttft_ms", "p50"),
    ("ttft_ms", "p99"),
    ("tpot_ms", "p50"),
    ("tpot_ms", "p99"),
    ("itl_ms", "p99"),
    ("e2e_ms", "p99"),
)


def _sweep_table(runs: Sequence[tuple[Any, Mapping[str, Any]]], load_key: str, capacity: float | None) -> str:
    headers = (
        load_key,
        "completed",
        "failed",
        "req/s",
        "output tok/s",
        "goodput (req/s)",
        "SLO attainment (%)",
        "TTFT p50 (ms)",
        "TTFT p99 (ms)",
        "TPOT p50 (ms)",
        "TPOT p99 (ms)",
        "ITL p99 (ms)",
        "E2E p99 (ms)",
        "note",
    )
    rows = []
    for load, result in runs:
        latency = [num(mapping(result.get(metric)).get(stat)) for metric, stat in _TABLE_LATENCY]
        note = "capacity" if capacity is not None and num(load) == capacity else ""
        rows.append(
            [
                fmt_short(load),
                result.get("completed"),
                result.get("failed"),
                result.get("request_throughput"),
                result.get("output_throughput"),
                result.get("goodput"),
                result.get("slo_attainment_pct"),
                *latency,
                note,
            ]
        )
    return table(headers, rows)


def _run_details(load: Any, result: Mapping[str, Any], load_key: str) -> str:
    """One run of a sweep, folded: its summary, latency, errors and warnings tables."""
    inner = [
        warnings_html(result),
        summary_table(result),
        latency_table(result),
        errors_html(result) if mapping(result.get("errors")) else "",
    ]
    body = "\n".join(part for part in inner if part)
    return f"<details>\n<summary>{esc(load_key)} {esc(fmt_short(load))}</summary>\n{body}\n</details>"


def _sweep_charts(runs: _Runs, x_label: str, capacity: float | None, slo: Mapping[str, Any]) -> list[str]:
    """TTFT, TPOT and output throughput against load, each a figure with its caption."""
    # TTFT and TPOT are drawn on separate charts: TTFT is often seconds while TPOT is tens of ms, and one
    # shared axis would flatten TPOT into the floor. Each marks its SLO bound (when given) and the capacity:
    # the load where p99 crosses the SLO line is where the server stops keeping its promise.
    ttft_chart = _latency_chart(runs, "ttft_ms", "TTFT", x_label, capacity, slo)
    tpot_chart = _latency_chart(runs, "tpot_ms", "TPOT", x_label, capacity, slo)
    # Output throughput against load: it rises while the server has spare capacity and flattens at
    # saturation; past that point more load only adds queueing (TTFT) without adding tokens per second.
    throughput_chart = series_svg(
        "Output throughput against load",
        x_label,
        "output tokens per second",
        [Series("output tok/s", DECODE_COLOR, _sweep_points(runs, "output_throughput"))],
        vlines=_capacity_lines(capacity),
    )
    return [
        figure(ttft_chart, "p50 (solid) and p99 (dashed) TTFT of each run; red dashed: the TTFT SLO."),
        figure(tpot_chart, "p50 (solid) and p99 (dashed) TPOT of each run; red dashed: the TPOT SLO."),
        figure(throughput_chart, "Output tokens per second of each run; grey dashed: the capacity found."),
    ]


def render_sweep_html(sweep: dict[str, Any]) -> str:
    """A sweep over load as a self-contained HTML page: latency and throughput against load, and tables."""
    load_key = str(sweep.get("load_key") or "load")
    x_label = _load_label(load_key)
    entries = sorted(
        ((entry.get("load"), mapping(entry.get("result"))) for entry in records(sweep.get("runs"))),
        key=lambda item: (num(item[0]) is None, num(item[0]) or 0.0),
    )
    # Charts need a finite load (an unbounded request rate is a row of the table only).
    plotted = [(load, result) for raw, result in entries if (load := num(raw)) is not None]
    capacity_info = mapping(sweep.get("capacity"))
    capacity = num(capacity_info.get("load"))
    charts = _sweep_charts(plotted, x_label, capacity, mapping(capacity_info.get("slo")))
    capacity_html = f"<p>{esc(_capacity_text(capacity_info, load_key))}</p>" if capacity_info else ""
    first_config = mapping(entries[0][1].get("config")) if entries else {}
    sections = [
        section("Capacity", capacity_html) if capacity_html else "",
        section("Charts", "\n".join(charts)),
        section("Runs", _sweep_table(entries, load_key, capacity) if entries else empty("no runs")),
        section("Each run", "\n".join(_run_details(load, result, load_key) for load, result in entries))
        if entries
        else "",
        section("Configuration (first run)", kv_html(first_config, "no configuration recorded")),
    ]
    model = first_config.get("model")
    title = f"kvflow bench sweep: {model}" if model is not None else "kvflow bench sweep"
    line = " · ".join(
        part
        for part in (subtitle(first_config, with_load=False), f"{len(entries)} runs over {load_key}")
        if part
    )
    return page(title, "kvflow bench sweep report", line, sections)
