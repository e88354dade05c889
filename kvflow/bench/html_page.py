"""The HTML around the charts that the run and the sweep reports share: the page, its tables, and the
reading of an untrusted, possibly partial result.

Every string that comes from a result (model names, config values, error messages, server keys) goes
through `esc`: a server's error text is data, never markup. Numbers that are missing (None) or not
finite are shown as a dash in tables and left out of charts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvflow.assets import shared_css
from kvflow.bench.svg import esc, fmt

LATENCY_COLUMNS = ("mean", "p50", "p90", "p95", "p99", "max")
# (result key, row label, what it measures): the definitions of kvflow/bench/metrics.py.
LATENCY_ROWS = (
    ("ttft_ms", "TTFT", "first content token - send"),
    ("ttft_first_chunk_ms", "TTFT (first chunk)", "first chunk of any kind - send (vLLM bench's definition)"),
    ("tpot_ms", "TPOT", "(E2E - TTFT) / (output tokens - 1), one value per request"),
    ("itl_ms", "ITL (per token)", "a chunk of n tokens after a gap g counts as n gaps of g/n"),
    ("itl_chunk_ms", "ITL (per chunk)", "gap between consecutive content chunks"),
    ("e2e_ms", "E2E", "last content chunk - send"),
)

# One meaning each, on the charts of both reports and on the live dashboard (kvflow.css's palette).
TTFT_COLOR = "#e69f00"  # --kv-prefill
DECODE_COLOR = "#0072b2"  # --kv-decode
FAIL_COLOR = "#d62728"  # --kv-fail
P50_COLOR = "#009e73"  # --kv-p50
P99_COLOR = "#cc79a7"  # --kv-p99

# kvflow's one look (kvflow/assets/kvflow.css), shared with the live dashboard and the doctor's page.
_CSS = shared_css()


# ---------------------------------------------------------------------------------------------------------
# Values: reading an untrusted, possibly partial result
# ---------------------------------------------------------------------------------------------------------


def num(value: Any) -> float | None:
    """`value` as a finite float; None for None, bools, strings, NaN and infinities."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def records(value: Any) -> list[Mapping[str, Any]]:
    """The mappings of a list (the requests or runs of a result); anything else is skipped."""
    if not isinstance(value, list | tuple):
        return []
    return [item for item in value if isinstance(item, Mapping)]


def flatten(items: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """Nested dicts as dotted key paths: {"a": {"b": 1}} -> [("a.b", 1)]."""
    rows: list[tuple[str, Any]] = []
    for key, value in items.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            rows.extend(flatten(value, path))
        else:
            rows.append((path, value))
    return rows


# ---------------------------------------------------------------------------------------------------------
# Building blocks and the page
# ---------------------------------------------------------------------------------------------------------


def _cell(value: Any) -> str:
    numeric = value is None or (isinstance(value, int | float) and not isinstance(value, bool))
    if numeric:
        return f'<td class="num">{esc(fmt(value))}</td>'
    return f"<td>{esc(fmt(value))}</td>"


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A table of plain values: every header and cell is escaped here; numbers are right-aligned."""
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(_cell(c) for c in row) + "</tr>\n" for row in rows)
    return f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n{body}</tbody>\n</table>"


def section(heading: str, content: str) -> str:
    return f"<section>\n<h2>{esc(heading)}</h2>\n{content}\n</section>"


def empty(message: str) -> str:
    return f'<p class="empty">{esc(message)}</p>'


def figure(svg: str, caption: str) -> str:
    return f"<figure>\n{svg}\n<figcaption>{esc(caption)}</figcaption>\n</figure>"


def page(title: str, heading: str, subtitle: str, sections: Sequence[str]) -> str:
    """The whole document; `title`, `heading` and `subtitle` are plain text, `sections` are HTML."""
    sub = f'<p class="subtitle">{esc(subtitle)}</p>\n' if subtitle else ""
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{esc(title)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n"
        f"<h1>{esc(heading)}</h1>\n{sub}" + "\n".join(s for s in sections if s) + "\n</body>\n</html>\n"
    )


# ---------------------------------------------------------------------------------------------------------
# The tables of one run (a sweep shows them for each of its runs)
# ---------------------------------------------------------------------------------------------------------


def subtitle(config: Mapping[str, Any], *, with_load: bool = True) -> str:
    """One line naming what was measured: model, server, endpoint, dataset and (unless a sweep) load."""
    load_keys = ("concurrency", "request_rate") if with_load else ()
    parts = [
        f"{label} {config[key]}"
        for key, label in (
            ("model", "model"),
            ("base_url", "server"),
            ("endpoint", "endpoint"),
            ("dataset", "dataset"),
            ("dataset_name", "dataset"),
            ("concurrency", "concurrency"),
            ("request_rate", "request rate"),
        )
        if config.get(key) is not None and (key in load_keys or key not in ("concurrency", "request_rate"))
    ]
    return " · ".join(parts)


def summary_table(result: Mapping[str, Any]) -> str:
    rows: list[tuple[str, Any]] = [
        ("completed requests", result.get("completed")),
        ("failed requests", result.get("failed")),
        ("duration (s)", result.get("duration_s")),
        ("request throughput (req/s)", result.get("request_throughput")),
        ("output throughput (tok/s)", result.get("output_throughput")),
        ("total token throughput (tok/s)", result.get("total_token_throughput")),
    ]
    rows.extend(
        (label, result[key])
        for key, label in (("total_input_tokens", "input tokens"), ("total_output_tokens", "output tokens"))
        if key in result
    )
    rows.append(("goodput (req/s meeting every SLO; – when no SLO)", result.get("goodput")))
    rows.append(("SLO attainment (%)", result.get("slo_attainment_pct")))
    return table(("metric", "value"), rows)


def latency_table(result: Mapping[str, Any]) -> str:
    rows = []
    for key, label, meaning in LATENCY_ROWS:
        summary = mapping(result.get(key))
        rows.append([label, *(num(summary.get(c)) for c in LATENCY_COLUMNS), meaning])
    return table(("metric (ms)", *LATENCY_COLUMNS, "definition"), rows)


def errors_html(result: Mapping[str, Any]) -> str:
    errors = mapping(result.get("errors"))
    if not errors:
        return empty("no errors")
    ordered = sorted(errors.items(), key=lambda item: -(num(item[1]) or 0))
    return table(("error", "count"), ordered)


def warnings_html(result: Mapping[str, Any]) -> str:
    warnings = result.get("warnings")
    if not isinstance(warnings, list | tuple) or not warnings:
        return ""
    items = "".join(f"<li>{esc(w)}</li>" for w in warnings)
    return f'<ul class="warnings">{items}</ul>'


def kv_html(items: Mapping[str, Any], empty_message: str) -> str:
    """Nested key-value pairs (a config, server numbers) as a two-column table of dotted key paths."""
    rows = flatten(items)
    return table(("key", "value"), rows) if rows else empty(empty_message)
