"""The console table at the end of a run, and writing the JSON and HTML results."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

LATENCY_ROWS = (
    ("ttft_ms", "TTFT (first content chunk)"),
    ("ttft_first_chunk_ms", "TTFT (first chunk, vLLM)"),
    ("tpot_ms", "TPOT"),
    ("itl_ms", "ITL per token"),
    ("itl_chunk_ms", "ITL per chunk"),
    ("e2e_ms", "E2E"),
)
STAT_COLUMNS = ("mean", "p50", "p90", "p95", "p99", "max")


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def console_table(result: dict[str, Any]) -> str:
    cfg = result["config"]
    load = (
        f"concurrency {cfg['concurrency']}" if "concurrency" in cfg else f"rate {cfg.get('request_rate')}/s"
    )
    lines = [
        f"kvflow bench: {cfg['model']} at {cfg['base_url']} "
        f"({cfg['endpoint']}, {cfg['dataset_name']}, {load})",
        f"  completed {result['completed']}, failed {result['failed']}, {_fmt(result['duration_s'], 2)} s; "
        f"{_fmt(result['request_throughput'], 2)} req/s, {_fmt(result['output_throughput'])} output tok/s, "
        f"{_fmt(result['total_token_throughput'])} total tok/s",
    ]
    if result.get("goodput") is not None:
        lines.append(
            f"  goodput {_fmt(result['goodput'], 2)} req/s, SLO attainment "
            f"{_fmt(result['slo_attainment_pct'])}% (SLO {cfg['slo']})"
        )
    lines.append(f"  {'ms':<28}" + "".join(f"{c:>10}" for c in STAT_COLUMNS))
    for key, label in LATENCY_ROWS:
        stats = result[key]
        lines.append(f"  {label:<28}" + "".join(f"{_fmt(stats[c]):>10}" for c in STAT_COLUMNS))
    lines += _server_lines(result.get("server") or {})
    for priority, row in (result.get("per_priority") or {}).items():
        ttft, e2e = row["ttft_ms"], row["e2e_ms"]
        lines.append(
            f"  priority {priority}: {row['completed']} requests, TTFT p50 {_fmt(ttft['p50'])} / p99 "
            f"{_fmt(ttft['p99'])} ms, e2e p50 {_fmt(e2e['p50'])} ms"
        )
    for language, row in (result.get("languages") or {}).items():
        lines.append(
            f"  {language}: {row['tokens']} tokens / {row['chars']} chars = {row['tokens_per_char']:.3f}"
        )
    for message, count in (result.get("errors") or {}).items():
        lines.append(f"  FAILED x{count}: {message}")
    for warning in result.get("warnings") or []:
        lines.append(f"  note: {warning}")
    return "\n".join(lines)


def _server_lines(server: dict[str, Any]) -> list[str]:
    """The server's own view in two lines; '-' is a number the server does not export (listed)."""
    if not server.get("metrics_prefix"):
        prefill = (server.get("prefill_time_ms") or {}).get("mean")
        streamed = f" (its streamed timings: prefill mean {_fmt(prefill)} ms)" if prefill is not None else ""
        return [f"  server: no /metrics in a known naming scheme{streamed}"]
    running = (server.get("gauges") or {}).get("running") or {}
    waiting = (server.get("gauges") or {}).get("waiting") or {}
    lines = [
        f"  server ({server['server']}, {server['metrics_prefix']}*): TTFT mean "
        f"{_fmt(server['ttft_ms']['mean'])} ms "
        f"(client - server {_fmt(server['client_minus_server_ttft_ms'])} ms), "
        f"queue mean {_fmt(server['queue_time_ms']['mean'])} ms, prefill mean "
        f"{_fmt(server['prefill_time_ms']['mean'])} ms, decode step {_fmt(server.get('decode_step_ms'))} ms, "
        f"prefix-cache hit rate {_fmt(server['prefix_cache_hit_rate'], 3)}, preemptions "
        f"{_fmt(server['num_preemptions'], 0)}, running max {_fmt(running.get('max'), 0)}, waiting max "
        f"{_fmt(waiting.get('max'), 0)}"
    ]
    if server.get("not_exported"):
        lines.append(f"  server does not export: {', '.join(server['not_exported'])}")
    return lines


def write_outputs(result: dict[str, Any], output: str | None, html: str | None, sweep: bool = False) -> None:
    from kvflow.bench.html_report import render_html, render_sweep_html

    if output:
        Path(output).write_text(json.dumps(result, indent=1), encoding="utf-8")
    if html:
        Path(html).write_text(render_sweep_html(result) if sweep else render_html(result), encoding="utf-8")
