"""Self-contained HTML reports of kvflow bench results: tables plus hand-written inline SVG charts.

`render_html(result)` renders one run (the result JSON of `kvflow bench`); `render_sweep_html(sweep)`
renders a sweep of runs over load. The output is one HTML document with no scripts, no external
resources and no plotting library: each chart is a small SVG drawn here, so a report opens anywhere,
offline, and can be attached to an issue or archived next to the JSON it came from.

Every string that comes from a result (model names, config values, error messages, server keys) goes
through `html.escape`: a server's error text is data, never markup. Numbers that are missing (None)
or not finite are shown as a dash in tables and left out of charts.
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["render_html", "render_sweep_html"]

# At most this many bars in the per-request timeline: beyond it the bars are thinner than a pixel.
TIMELINE_CAP = 200
# A histogram switches to a log-scale x when its largest positive value is this many times its smallest.
LOG_RATIO = 20.0

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

TTFT_COLOR = "#e8871e"
DECODE_COLOR = "#3b6fb6"
FAIL_COLOR = "#d62728"
HIST_COLOR = "#6f9bd1"
P50_COLOR = "#2a9d4b"
P99_COLOR = "#9b3fb5"
SLO_COLOR = "#d62728"
CAPACITY_COLOR = "#555555"
GRID_COLOR = "#e6e6e6"
AXIS_COLOR = "#444444"

_CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #222; margin: 24px auto;
       max-width: 1000px; padding: 0 16px; }
h1 { font-size: 22px; margin-bottom: 2px; }
h2 { font-size: 17px; margin-top: 28px; border-bottom: 1px solid #ddd; padding-bottom: 3px; }
.subtitle { color: #555; margin-top: 0; }
table { border-collapse: collapse; margin: 8px 0; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td { white-space: pre-wrap; word-break: break-word; }
figure { margin: 14px 0; }
figcaption { color: #555; font-size: 13px; max-width: 760px; }
svg.chart { display: block; max-width: 100%; height: auto; font: 12px system-ui, sans-serif; }
svg.chart .title { font-size: 14px; font-weight: 600; }
svg.chart .note { font-size: 11px; fill: #666; }
.warnings { background: #fff6e0; border: 1px solid #f0d68a; padding: 8px 12px 8px 28px; }
.empty { color: #777; font-style: italic; }
details { margin: 6px 0; }
summary { cursor: pointer; }
"""


# ---------------------------------------------------------------------------------------------------------
# Values: reading an untrusted, possibly partial result
# ---------------------------------------------------------------------------------------------------------


def _num(value: Any) -> float | None:
    """`value` as a finite float; None for None, bools, strings, NaN and infinities."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _records(value: Any) -> list[Mapping[str, Any]]:
    """The mappings of a list (the requests or runs of a result); anything else is skipped."""
    if not isinstance(value, list | tuple):
        return []
    return [item for item in value if isinstance(item, Mapping)]


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _fmt(value: Any) -> str:
    """A table cell's text: None as a dash, floats rounded (3 significant digits below 1)."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value == 0 or abs(value) >= 1:
            return f"{value:.2f}"
        return f"{value:.3g}"
    if isinstance(value, Mapping) and not value:
        return "{}"
    return str(value)


def _fmt_short(value: Any) -> str:
    """A number as typed on the command line (a load, an SLO bound): 8.0 -> "8", 2.5 -> "2.5"."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return f"{value:g}"
    return _fmt(value)


def _percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between order statistics (as kvflow/bench/metrics.py); None when empty."""
    ordered = sorted(values)
    if not ordered:
        return None
    k = (len(ordered) - 1) * q / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def _flatten(mapping: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """Nested dicts as dotted key paths: {"a": {"b": 1}} -> [("a.b", 1)]."""
    rows: list[tuple[str, Any]] = []
    for key, value in mapping.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            rows.extend(_flatten(value, path))
        else:
            rows.append((path, value))
    return rows


def _failed(request: Mapping[str, Any]) -> bool:
    return request.get("error") is not None


def _successful(requests: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The requests the summary statistics cover (metrics.aggregate only counts successful ones)."""
    return [r for r in requests if not _failed(r)]


def _marker(summary: Mapping[str, Any], key: str, values: Sequence[float], q: float) -> float | None:
    """A percentile from the run's summary, else computed from the per-request values."""
    given = _num(summary.get(key))
    return given if given is not None else _percentile(values, q)


# ---------------------------------------------------------------------------------------------------------
# Scales, ticks and the chart frame
# ---------------------------------------------------------------------------------------------------------

# (lo, hi, ticks) of an axis.
_Domain = tuple[float, float, tuple[float, ...]]


def _clean(value: float) -> float:
    """Drop floating-point dust from a tick (0.30000000000000004 -> 0.3)."""
    return float(f"{value:.12g}")


def _nice_step(span: float, target: int) -> float:
    """A 1, 2, 2.5 or 5 times a power of ten step that cuts `span` into about `target` intervals."""
    raw = span / max(target, 1)
    magnitude = 10.0 ** math.floor(math.log10(raw))
    for multiple in (1.0, 2.0, 2.5, 5.0):
        if raw <= multiple * magnitude * (1 + 1e-9):
            return multiple * magnitude
    return 10.0 * magnitude


def _linear_domain(
    values: Iterable[float], *, zero: bool = False, integer: bool = False, target: int = 5
) -> _Domain:
    """[lo, hi] covering `values`, widened to round ticks; from 0 when `zero`; 0..1 when empty."""
    data = list(values)
    lo, hi = min(data, default=0.0), max(data, default=1.0)
    if zero:
        lo, hi = min(lo, 0.0), max(hi, 0.0)
    if hi <= lo:
        if lo == 0:
            hi = 1.0
        else:
            pad = abs(lo) * 0.1
            lo, hi = lo - pad, hi + pad
    step = _nice_step(hi - lo, target)
    if integer:
        step = max(1.0, float(math.ceil(step)))
    nice_lo = math.floor(lo / step + 1e-9) * step
    nice_hi = math.ceil(hi / step - 1e-9) * step
    if nice_hi <= nice_lo:
        nice_hi = nice_lo + step
    count = round((nice_hi - nice_lo) / step)
    ticks = tuple(_clean(nice_lo + i * step) for i in range(count + 1))
    return _clean(nice_lo), _clean(nice_hi), ticks


def _log_domain(values: Iterable[float], *, trim: bool = False) -> _Domain:
    """Whole decades covering the positive `values`, ticks at 1, 2, 5 x 10^k (decades only if many);
    `trim` narrows the range to the ticks just around the data (a sweep over 1..32 stops at 50, not 100)."""
    positive = [v for v in values if v > 0] or [1.0]
    lo_dec = math.floor(math.log10(min(positive)))
    hi_dec = math.ceil(math.log10(max(positive)))
    if hi_dec <= lo_dec:
        hi_dec = lo_dec + 1
    multiples = (1.0,) if hi_dec - lo_dec > 3 else (1.0, 2.0, 5.0)
    top = 10.0**hi_dec
    ticks = tuple(
        _clean(m * 10.0**d)
        for d in range(lo_dec, hi_dec + 1)
        for m in multiples
        if m * 10.0**d <= top * 1.000001
    )
    if trim:
        low, high = min(positive), max(positive)
        lo = max((t for t in ticks if t <= low * 1.000001), default=ticks[0])
        hi = min((t for t in ticks if t >= high / 1.000001), default=ticks[-1])
        if hi <= lo:
            hi = next((t for t in ticks if t > lo), lo * 10)
        return lo, hi, tuple(t for t in ticks if lo <= t <= hi)
    return _clean(10.0**lo_dec), _clean(top), ticks


def _tick_label(value: float) -> str:
    return f"{value:.6g}"


@dataclass(frozen=True)
class _Scale:
    """Maps data in [lo, hi] to pixels in [p0, p1] (p0 > p1 for an upward y axis); log10 when `log`."""

    lo: float
    hi: float
    p0: float
    p1: float
    ticks: tuple[float, ...]
    log: bool = False

    def px(self, value: float) -> float:
        lo, hi, v = self.lo, self.hi, value
        if self.log:
            lo, hi, v = math.log10(lo), math.log10(hi), math.log10(max(value, self.lo))
        frac = (v - lo) / (hi - lo) if hi > lo else 0.5
        frac = min(max(frac, 0.0), 1.0)  # out-of-range values stay on the plot's edge
        return self.p0 + frac * (self.p1 - self.p0)

    def contains(self, value: float) -> bool:
        return self.lo <= value <= self.hi


@dataclass(frozen=True)
class _Box:
    """A chart of `width` x `height` pixels; the margins hold the title, notes, ticks and axis labels."""

    width: float = 760.0
    height: float = 300.0
    left: float = 72.0
    right: float = 24.0
    top: float = 48.0
    bottom: float = 50.0

    @property
    def x0(self) -> float:
        return self.left

    @property
    def x1(self) -> float:
        return self.width - self.right

    @property
    def y_top(self) -> float:
        return self.top

    @property
    def y_bottom(self) -> float:
        return self.height - self.bottom

    def x_scale(self, domain: _Domain, *, log: bool = False) -> _Scale:
        return _Scale(domain[0], domain[1], self.x0, self.x1, domain[2], log)

    def y_scale(self, domain: _Domain, *, downward: bool = False) -> _Scale:
        """Values grow upward, or downward (rows listed top to bottom) when `downward`."""
        if downward:
            return _Scale(domain[0], domain[1], self.y_top, self.y_bottom, domain[2])
        return _Scale(domain[0], domain[1], self.y_bottom, self.y_top, domain[2])


@dataclass(frozen=True)
class _LegendItem:
    label: str
    color: str
    shape: str = "rect"  # rect, dot or line
    dashed: bool = False


def _p(value: float) -> str:
    """A pixel coordinate as SVG text."""
    return f"{value:.1f}"


def _text(x: float, y: float, content: str, *, anchor: str = "start", css: str = "", extra: str = "") -> str:
    cls = f' class="{css}"' if css else ""
    return f'<text x="{_p(x)}" y="{_p(y)}" text-anchor="{anchor}"{cls}{extra}>{_esc(content)}</text>'


def _line(
    x1: float, y1: float, x2: float, y2: float, color: str, *, width: float = 1, dashed: bool = False
) -> str:
    dash = ' stroke-dasharray="5,4"' if dashed else ""
    return (
        f'<line x1="{_p(x1)}" y1="{_p(y1)}" x2="{_p(x2)}" y2="{_p(y2)}" stroke="{color}" '
        f'stroke-width="{width}"{dash}/>'
    )


def _legend(items: Sequence[_LegendItem], box: _Box, y: float = 18.0) -> list[str]:
    """Legend entries in a row, right-aligned with the plot, on the title's line."""
    widths = [22 + 6.6 * len(item.label) + 14 for item in items]
    x = box.x1 - sum(widths)
    out: list[str] = []
    for item, width in zip(items, widths, strict=True):
        if item.shape == "dot":
            out.append(f'<circle cx="{_p(x + 7)}" cy="{_p(y - 4)}" r="4" fill="{item.color}"/>')
        elif item.shape == "line":
            out.append(_line(x, y - 4, x + 16, y - 4, item.color, width=2, dashed=item.dashed))
        else:
            out.append(f'<rect x="{_p(x)}" y="{_p(y - 10)}" width="14" height="10" fill="{item.color}"/>')
        out.append(_text(x + 20, y, item.label))
        x += width
    return out


def _no_data(box: _Box, message: str = "no data") -> str:
    return _text((box.x0 + box.x1) / 2, (box.y_top + box.y_bottom) / 2, message, anchor="middle", css="note")


def _chart(
    box: _Box,
    title: str,
    x_label: str,
    y_label: str,
    x: _Scale,
    y: _Scale,
    body: Sequence[str],
    *,
    legend: Sequence[_LegendItem] = (),
    notes: Sequence[str] = (),
) -> str:
    """One SVG chart: title, notes, legend, grid, ticks, axes and axis labels around the `body` shapes."""
    w, h = box.width, box.height
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" width="{_p(w)}" height="{_p(h)}" '
        f'viewBox="0 0 {_p(w)} {_p(h)}" role="img" aria-label="{_esc(title)}">',
        f'<rect x="0" y="0" width="{_p(w)}" height="{_p(h)}" fill="#ffffff"/>',
        _text(box.x0, 18, title, css="title"),
    ]
    if notes:
        out.append(_text(box.x0, 35, " · ".join(notes), css="note"))
    out.extend(_legend(legend, box))
    # Horizontal grid lines at the y ticks (labels left of the plot), tick marks below it on the x axis.
    for tick in y.ticks:
        py = y.px(tick)
        out.append(_line(box.x0, py, box.x1, py, GRID_COLOR))
        out.append(_text(box.x0 - 6, py + 4, _tick_label(tick), anchor="end"))
    for tick in x.ticks:
        px = x.px(tick)
        out.append(_line(px, box.y_bottom, px, box.y_bottom + 5, AXIS_COLOR))
        out.append(_text(px, box.y_bottom + 18, _tick_label(tick), anchor="middle"))
    out.extend(body)
    out.append(_line(box.x0, box.y_bottom, box.x1, box.y_bottom, AXIS_COLOR))
    out.append(_line(box.x0, box.y_top, box.x0, box.y_bottom, AXIS_COLOR))
    out.append(_text((box.x0 + box.x1) / 2, h - 10, x_label, anchor="middle"))
    y_mid = (box.y_top + box.y_bottom) / 2
    out.append(_text(16, y_mid, y_label, anchor="middle", extra=f' transform="rotate(-90 16 {_p(y_mid)})"'))
    out.append("</svg>")
    return "\n".join(out)


def _vertical_marker(
    x: _Scale, box: _Box, value: float | None, label: str, color: str, row: int
) -> list[str]:
    """A dashed vertical line at `value` labelled near the top; `row` staggers labels of close lines."""
    if value is None or not x.contains(value):
        return []
    px = x.px(value)
    label_y = box.y_top + 12 + 13 * row
    near_right = px > box.x1 - 120
    label_x, anchor = (px - 4, "end") if near_right else (px + 4, "start")
    return [
        _line(px, box.y_top, px, box.y_bottom, color, width=1.5, dashed=True),
        _text(label_x, label_y, label, anchor=anchor, extra=f' fill="{color}"'),
    ]


def _horizontal_marker(y: _Scale, box: _Box, value: float | None, label: str, color: str) -> list[str]:
    if value is None or not y.contains(value):
        return []
    py = y.px(value)
    return [
        _line(box.x0, py, box.x1, py, color, width=1.2, dashed=True),
        _text(box.x1 - 4, py - 4, label, anchor="end", extra=f' fill="{color}"'),
    ]


# ---------------------------------------------------------------------------------------------------------
# Charts of one run
# ---------------------------------------------------------------------------------------------------------


def _bin_edges(domain: _Domain, log: bool, target_bins: int) -> list[float]:
    """Bin edges aligned with the axis ticks: a whole number of bins per tick interval (or per decade)."""
    lo, hi, ticks = domain
    if log:
        l_lo, l_hi = math.log10(lo), math.log10(hi)
        decades = max(round(l_hi - l_lo), 1)
        n = decades * max(2, round(target_bins / decades))
        return [10.0 ** (l_lo + (l_hi - l_lo) * i / n) for i in range(n + 1)]
    intervals = max(len(ticks) - 1, 1)
    n = intervals * max(1, round(target_bins / intervals))
    return [lo + (hi - lo) * i / n for i in range(n + 1)]


def _bin_counts(values: Sequence[float], edges: Sequence[float], log: bool) -> list[int]:
    """Counts per bin; values below the first edge (zeros on a log axis) land in the first bin."""
    n = len(edges) - 1
    counts = [0] * n
    lo, hi = edges[0], edges[-1]
    for value in values:
        if log:
            l_lo, l_hi = math.log10(lo), math.log10(hi)
            frac = (math.log10(value) - l_lo) / (l_hi - l_lo) if value > 0 else 0.0
        else:
            frac = (value - lo) / (hi - lo) if hi > lo else 0.0
        counts[min(max(int(frac * n), 0), n - 1)] += 1
    return counts


def _histogram_svg(
    title: str,
    x_label: str,
    values: Sequence[float],
    markers: Sequence[tuple[str, float | None, str]],
    *,
    noun: str,
    allow_log: bool = False,
) -> str:
    """A histogram of `values` (ms) with labelled vertical `markers` (name, value, colour)."""
    box = _Box()
    notes: list[str] = [f"{len(values)} {noun}"]
    positive = [v for v in values if v > 0]
    log = allow_log and len(positive) >= 2 and max(positive) / min(positive) >= LOG_RATIO
    if log:
        x_domain = _log_domain(positive)
        notes.append("log-scale x")
        if len(positive) < len(values):
            notes.append(f"{len(values) - len(positive)} zero values counted in the first bin")
    else:
        x_domain = _linear_domain(values)
    # About sqrt(n) bins (5 to 40): enough to show the shape, few enough that bins are not mostly empty.
    target_bins = min(40, max(5, round(math.sqrt(len(values)))))
    edges = _bin_edges(x_domain, log, target_bins)
    counts = _bin_counts(values, edges, log)
    y_domain = _linear_domain(counts, zero=True, integer=True)
    x = box.x_scale(x_domain, log=log)
    y = box.y_scale(y_domain)
    body: list[str] = []
    if not values:
        body.append(_no_data(box))
    for count, left, right in zip(counts, edges, edges[1:], strict=False):
        if count == 0:
            continue
        # At least 2 px tall: a single outlier among thousands of samples must stay visible.
        x_left, x_right, y_top = x.px(left), x.px(right), min(y.px(count), box.y_bottom - 2)
        tip = f"{_tick_label(left)} to {_tick_label(right)} ms: {count} {noun}"
        body.append(
            f'<rect x="{_p(x_left)}" y="{_p(y_top)}" width="{_p(max(x_right - x_left - 1, 0.5))}" '
            f'height="{_p(box.y_bottom - y_top)}" fill="{HIST_COLOR}"><title>{_esc(tip)}</title></rect>'
        )
    for row, (name, value, color) in enumerate(markers):
        label = f"{name} {_fmt(value)} ms"
        body.extend(_vertical_marker(x, box, value, label, color, row))
    legend = [_LegendItem(name, color, "line", dashed=True) for name, _, color in markers]
    return _chart(box, title, x_label, noun, x, y, body, legend=legend, notes=notes)


def _ttft_histogram_svg(result: Mapping[str, Any], requests: Sequence[Mapping[str, Any]]) -> str:
    # TTFT distribution of the successful requests (the ones the summary covers), with the run's p50 and
    # p99 marked: a long right tail or a second mode (requests that queued behind others) shows at a glance,
    # where the percentiles alone would hide it.
    values = [v for r in _successful(requests) if (v := _num(r.get("ttft_ms"))) is not None]
    summary = _mapping(result.get("ttft_ms"))
    markers = [
        ("p50", _marker(summary, "p50", values, 50), P50_COLOR),
        ("p99", _marker(summary, "p99", values, 99), P99_COLOR),
    ]
    return _histogram_svg("TTFT distribution", "TTFT (ms)", values, markers, noun="requests")


def _itl_histogram_svg(result: Mapping[str, Any], requests: Sequence[Mapping[str, Any]]) -> str:
    # Distribution of every per-token gap of every successful request. Steady decoding is one narrow peak;
    # stalls (a prefill chunk sharing the step, a preemption) form a tail or a separate cluster far to the
    # right, which is why the x axis turns logarithmic when the gaps span a wide range.
    values: list[float] = []
    for request in _successful(requests):
        gaps = request.get("itl_ms")
        if isinstance(gaps, list | tuple):
            values.extend(v for g in gaps if (v := _num(g)) is not None)
    summary = _mapping(result.get("itl_ms"))
    markers = [
        ("p50", _marker(summary, "p50", values, 50), P50_COLOR),
        ("p99", _marker(summary, "p99", values, 99), P99_COLOR),
    ]
    return _histogram_svg(
        "Inter-token latency distribution", "ITL (ms)", values, markers, noun="token gaps", allow_log=True
    )


@dataclass(frozen=True)
class _Span:
    """One request on the timeline, in seconds from the start of the run."""

    row: int
    send: float
    first_token: float | None
    end: float | None
    failed: bool
    tip: str


def _request_end_s(request: Mapping[str, Any], send: float) -> float | None:
    """When a request ended: send + E2E, else its last chunk (failed requests have no E2E), else TTFT."""
    e2e = _num(request.get("e2e_ms"))
    if e2e is not None:
        return send + e2e / 1e3
    chunk_times = [
        t for chunk in _records_or_lists(request.get("chunks")) if chunk and (t := _num(chunk[0])) is not None
    ]
    if chunk_times:
        return send + max(chunk_times)
    ttft = _num(request.get("ttft_ms"))
    return None if ttft is None else send + ttft / 1e3


def _records_or_lists(value: Any) -> list[Sequence[Any]]:
    """The list-shaped items of a list (the [t, kind, n] chunks of a request)."""
    if not isinstance(value, list | tuple):
        return []
    return [item for item in value if isinstance(item, list | tuple)]


def _span(row: int, request: Mapping[str, Any], send: float) -> _Span:
    ttft = _num(request.get("ttft_ms"))
    error = request.get("error")
    tip = (
        f"request {request.get('index', row)}: sent at {send:.3f} s, TTFT {_fmt(ttft)} ms, "
        f"E2E {_fmt(_num(request.get('e2e_ms')))} ms, {_fmt(request.get('prompt_tokens'))} prompt tokens, "
        f"{_fmt(request.get('output_tokens'))} output tokens"
    )
    if error is not None:
        tip += f", error: {error}"
    return _Span(
        row=row,
        send=send,
        first_token=None if ttft is None else send + ttft / 1e3,
        end=_request_end_s(request, send),
        failed=error is not None,
        tip=tip,
    )


def _timeline_svg(requests: Sequence[Mapping[str, Any]]) -> str:
    # One bar per request, in send order, from its send time to its last token: the orange part is the wait
    # for the first token (queueing + prefill), the blue part is decoding, red bars failed. It shows how
    # many requests overlapped, whether TTFT grew as the queue built up, and when failures happened.
    timed = sorted(
        ((send, r) for r in requests if (send := _num(r.get("send_s"))) is not None), key=lambda item: item[0]
    )
    notes: list[str] = []
    if len(timed) > TIMELINE_CAP:
        notes.append(f"showing the first {TIMELINE_CAP} of {len(timed)} requests (by send time)")
    if len(timed) < len(requests):
        notes.append(f"{len(requests) - len(timed)} requests without a send time not shown")
    spans = [_span(row, request, send) for row, (send, request) in enumerate(timed[:TIMELINE_CAP])]
    plot_height = min(max(len(spans) * 6.0, 120.0), 600.0)
    box = _Box(height=plot_height + _Box.top + _Box.bottom)
    times = [t for s in spans for t in (s.send, s.first_token, s.end) if t is not None]
    x = box.x_scale(_linear_domain(times, zero=True))
    y = box.y_scale(_linear_domain([0.0, float(max(len(spans), 1))], zero=True, integer=True), downward=True)
    band = y.px(1) - y.px(0)
    thickness = max(band * 0.75, 1.0)
    body: list[str] = [] if spans else [_no_data(box, "no requests")]
    for span in spans:
        top = y.px(span.row) + (band - thickness) / 2
        start = x.px(span.send)
        end = x.px(span.end) if span.end is not None else start
        parts: list[tuple[float, float, str]] = []
        if span.failed:
            parts.append((start, max(end - start, 3.0), FAIL_COLOR))
        elif span.first_token is not None:
            first = x.px(span.first_token)
            parts.append((start, max(first - start, 1.0), TTFT_COLOR))
            if end > first:
                parts.append((first, end - first, DECODE_COLOR))
        else:
            parts.append((start, max(end - start, 1.0), DECODE_COLOR))
        height = _p(thickness)
        rects = "".join(
            f'<rect x="{_p(left)}" y="{_p(top)}" width="{_p(width)}" height="{height}" fill="{color}"/>'
            for left, width, color in parts
        )
        body.append(f"<g><title>{_esc(span.tip)}</title>{rects}</g>")
    legend = [
        _LegendItem("to first token", TTFT_COLOR),
        _LegendItem("decode", DECODE_COLOR),
        _LegendItem("failed", FAIL_COLOR),
    ]
    return _chart(
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
    box = _Box()
    ok = _successful(requests)
    series: list[tuple[str, str, list[tuple[float, float]]]] = []
    for key, label, color in (("e2e_ms", "E2E", DECODE_COLOR), ("ttft_ms", "TTFT", TTFT_COLOR)):
        points = [
            (send, value)
            for r in ok
            if (send := _num(r.get("send_s"))) is not None and (value := _num(r.get(key))) is not None
        ]
        series.append((label, color, points))
    x = box.x_scale(_linear_domain((p[0] for _, _, pts in series for p in pts), zero=True))
    y = box.y_scale(_linear_domain((p[1] for _, _, pts in series for p in pts), zero=True))
    body: list[str] = []
    if not any(points for _, _, points in series):
        body.append(_no_data(box))
    for _, color, points in series:
        body.extend(
            f'<circle cx="{_p(x.px(sx))}" cy="{_p(y.px(sy))}" r="2.5" fill="{color}" fill-opacity="0.7"/>'
            for sx, sy in points
        )
    notes = []
    failed = len(requests) - len(ok)
    if failed:
        notes.append(f"{failed} failed requests not shown")
    legend = [_LegendItem(label, color, "dot") for label, color, _ in reversed(series)]
    return _chart(
        box,
        "Latency against send time",
        "send time since the start of the run (s)",
        "latency (ms)",
        x,
        y,
        body,
        legend=legend,
        notes=notes,
    )


# ---------------------------------------------------------------------------------------------------------
# Charts of a sweep
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Series:
    label: str
    color: str
    points: list[tuple[float, float | None]]  # (load, value); None breaks the line
    dashed: bool = False


def _load_label(load_key: str) -> str:
    if load_key == "concurrency":
        return "concurrency (requests in flight)"
    if load_key == "request_rate":
        return "request rate (req/s)"
    return load_key


def _series_svg(
    title: str,
    x_label: str,
    y_label: str,
    series: Sequence[_Series],
    *,
    capacity: float | None,
    hlines: Sequence[tuple[str, float | None]] = (),
) -> str:
    """Lines with point markers against load; a vertical capacity line and horizontal SLO lines if given."""
    box = _Box()
    loads = [load for s in series for load, _ in s.points]
    values = [v for s in series for _, v in s.points if v is not None]
    values.extend(v for _, v in hlines if v is not None)
    # Sweeps usually double the load (1, 2, 4, ... 256): a log-scale x keeps the low loads apart.
    log = bool(loads) and min(loads) > 0 and max(loads) / min(loads) >= 20
    x_domain = _log_domain(loads, trim=True) if log else _linear_domain(loads, zero=True)
    x = box.x_scale(x_domain, log=log)
    y = box.y_scale(_linear_domain(values, zero=True))
    body: list[str] = []
    if not any(v is not None for s in series for _, v in s.points):
        body.append(_no_data(box))
    for label, value in hlines:
        body.extend(_horizontal_marker(y, box, value, label, SLO_COLOR))
    if capacity is not None:
        body.extend(_vertical_marker(x, box, capacity, f"capacity {_fmt_short(capacity)}", CAPACITY_COLOR, 0))
    for s in series:
        segment: list[str] = []
        segments: list[list[str]] = [segment]
        for load, value in s.points:
            if value is None:
                segment = []
                segments.append(segment)
                continue
            segment.append(f"{_p(x.px(load))},{_p(y.px(value))}")
            body.append(
                f'<circle cx="{_p(x.px(load))}" cy="{_p(y.px(value))}" r="3.5" fill="{s.color}">'
                f"<title>{_esc(f'{s.label} at {_fmt_short(load)}: {_fmt(value)}')}</title></circle>"
            )
        dash = ' stroke-dasharray="6,4"' if s.dashed else ""
        body.extend(
            f'<polyline points="{" ".join(seg)}" fill="none" stroke="{s.color}" stroke-width="2"{dash}/>'
            for seg in segments
            if len(seg) >= 2
        )
    notes = ["log-scale x"] if log else []
    legend = [_LegendItem(s.label, s.color, "line", dashed=s.dashed) for s in series]
    return _chart(box, title, x_label, y_label, x, y, body, legend=legend, notes=notes)


def _sweep_points(
    runs: Sequence[tuple[float, Mapping[str, Any]]], metric: str, stat: str | None = None
) -> list[tuple[float, float | None]]:
    """(load, result[metric][stat]) of each run, or result[metric] when `stat` is None."""
    points: list[tuple[float, float | None]] = []
    for load, result in runs:
        value = result.get(metric)
        if stat is not None:
            value = _mapping(value).get(stat)
        points.append((load, _num(value)))
    return points


def _slo_line(slo: Mapping[str, Any], key: str) -> tuple[str, float | None]:
    """The label and bound of one SLO (`ttft_ms=500` -> "SLO ttft_ms ≤ 500 ms"); None when not given."""
    bound = _num(slo.get(key))
    return (f"SLO {key} ≤ {_fmt_short(bound)} ms", bound)


def _latency_series(runs: Sequence[tuple[float, Mapping[str, Any]]], metric: str, name: str) -> list[_Series]:
    return [
        _Series(f"{name} p50", P50_COLOR, _sweep_points(runs, metric, "p50")),
        _Series(f"{name} p99", P99_COLOR, _sweep_points(runs, metric, "p99"), dashed=True),
    ]


# ---------------------------------------------------------------------------------------------------------
# Tables and the page
# ---------------------------------------------------------------------------------------------------------


def _cell(value: Any) -> str:
    numeric = value is None or (isinstance(value, int | float) and not isinstance(value, bool))
    if numeric:
        return f'<td class="num">{_esc(_fmt(value))}</td>'
    return f"<td>{_esc(_fmt(value))}</td>"


def _table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A table of plain values: every header and cell is escaped here; numbers are right-aligned."""
    head = "".join(f"<th>{_esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(_cell(c) for c in row) + "</tr>\n" for row in rows)
    return f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n{body}</tbody>\n</table>"


def _section(heading: str, content: str) -> str:
    return f"<section>\n<h2>{_esc(heading)}</h2>\n{content}\n</section>"


def _empty(message: str) -> str:
    return f'<p class="empty">{_esc(message)}</p>'


def _figure(svg: str, caption: str) -> str:
    return f"<figure>\n{svg}\n<figcaption>{_esc(caption)}</figcaption>\n</figure>"


def _summary_table(result: Mapping[str, Any]) -> str:
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
    return _table(("metric", "value"), rows)


def _latency_table(result: Mapping[str, Any]) -> str:
    rows = []
    for key, label, meaning in LATENCY_ROWS:
        summary = _mapping(result.get(key))
        rows.append([label, *(_num(summary.get(c)) for c in LATENCY_COLUMNS), meaning])
    return _table(("metric (ms)", *LATENCY_COLUMNS, "definition"), rows)


def _errors_html(result: Mapping[str, Any]) -> str:
    errors = _mapping(result.get("errors"))
    if not errors:
        return _empty("no errors")
    ordered = sorted(errors.items(), key=lambda item: -(_num(item[1]) or 0))
    return _table(("error", "count"), ordered)


def _warnings_html(result: Mapping[str, Any]) -> str:
    warnings = result.get("warnings")
    if not isinstance(warnings, list | tuple) or not warnings:
        return ""
    items = "".join(f"<li>{_esc(w)}</li>" for w in warnings)
    return f'<ul class="warnings">{items}</ul>'


def _kv_html(mapping: Mapping[str, Any], empty: str) -> str:
    rows = _flatten(mapping)
    return _table(("key", "value"), rows) if rows else _empty(empty)


def _languages_html(result: Mapping[str, Any]) -> str:
    languages = _mapping(result.get("languages"))
    rows = []
    for lang, stats in sorted(languages.items(), key=lambda item: str(item[0])):
        entry = _mapping(stats)
        rows.append([lang, entry.get("chars"), entry.get("tokens"), entry.get("tokens_per_char")])
    return _table(("language", "characters", "tokens", "tokens per character"), rows)


def _subtitle(config: Mapping[str, Any], *, with_load: bool = True) -> str:
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


def _page(title: str, heading: str, subtitle: str, sections: Sequence[str]) -> str:
    """The whole document; `title`, `heading` and `subtitle` are plain text, `sections` are HTML."""
    sub = f'<p class="subtitle">{_esc(subtitle)}</p>\n' if subtitle else ""
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{_esc(title)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n"
        f"<h1>{_esc(heading)}</h1>\n{sub}" + "\n".join(s for s in sections if s) + "\n</body>\n</html>\n"
    )


def _run_charts(result: Mapping[str, Any]) -> list[str]:
    requests = _records(result.get("requests"))
    return [
        _figure(
            _ttft_histogram_svg(result, requests),
            "Time to first token of each successful request; dashed lines: the run's p50 and p99.",
        ),
        _figure(
            _itl_histogram_svg(result, requests),
            "Every gap between consecutive output tokens; a tail to the right is decode stalls.",
        ),
        _figure(
            _timeline_svg(requests),
            "Each request from send to last token: orange until the first token, blue while decoding, "
            "red if it failed. Hover a bar for its numbers.",
        ),
        _figure(
            _latency_over_time_svg(requests),
            "TTFT and E2E of each request against its send time: a rising trend means a growing queue.",
        ),
    ]


def render_html(result: dict[str, Any]) -> str:
    """One benchmark run as a self-contained HTML page: summary, latency tables and four SVG charts."""
    config = _mapping(result.get("config"))
    model = config.get("model")
    warnings = _warnings_html(result)
    sections = [
        _section("Warnings", warnings) if warnings else "",
        _section("Summary", _summary_table(result)),
        _section("Latency", _latency_table(result)),
        _section("Charts", "\n".join(_run_charts(result))),
        _section("Errors", _errors_html(result)),
        _section("Server-side numbers", _kv_html(_mapping(result.get("server")), "no server-side numbers")),
        _section("Languages", _languages_html(result)) if _mapping(result.get("languages")) else "",
        _section("Configuration", _kv_html(config, "no configuration recorded")),
    ]
    title = f"kvflow bench: {model}" if model is not None else "kvflow bench"
    return _page(title, "kvflow bench report", _subtitle(config), sections)


def _capacity_text(capacity: Mapping[str, Any], load_key: str) -> str:
    """The outcome of --find-capacity: the highest load whose SLO attainment reached `percentile` %."""
    slo = ", ".join(
        f"{key} ≤ {_fmt_short(value)} ms" for key, value in _flatten(_mapping(capacity.get("slo")))
    )
    condition = f"the SLO ({slo or 'none recorded'})"
    if capacity.get("percentile") is not None:
        condition = f"at least {_fmt_short(capacity.get('percentile'))}% of requests meeting {condition}"
    failing = capacity.get("first_failing_load")
    after = f" (first failing {load_key}: {_fmt_short(failing)})" if failing is not None else ""
    if _num(capacity.get("load")) is None:
        return f"No {load_key} in the sweep had {condition}{after}."
    return f"Capacity: the highest {load_key} with {condition} is {_fmt_short(capacity.get('load'))}{after}."


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
        latency = [
            _num(_mapping(result.get(metric)).get(stat))
            for metric, stat in (
                ("ttft_ms", "p50"),
                ("ttft_ms", "p99"),
                ("tpot_ms", "p50"),
                ("tpot_ms", "p99"),
                ("itl_ms", "p99"),
                ("e2e_ms", "p99"),
            )
        ]
        note = "capacity" if capacity is not None and _num(load) == capacity else ""
        rows.append(
            [
                _fmt_short(load),
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
    return _table(headers, rows)


def _run_details(load: Any, result: Mapping[str, Any], load_key: str) -> str:
    """One run of a sweep, folded: its summary, latency, errors and warnings tables."""
    inner = [
        _warnings_html(result),
        _summary_table(result),
        _latency_table(result),
        _errors_html(result) if _mapping(result.get("errors")) else "",
    ]
    body = "\n".join(part for part in inner if part)
    return f"<details>\n<summary>{_esc(load_key)} {_esc(_fmt_short(load))}</summary>\n{body}\n</details>"


def render_sweep_html(sweep: dict[str, Any]) -> str:
    """A sweep over load as a self-contained HTML page: latency and throughput against load, and tables."""
    load_key = str(sweep.get("load_key") or "load")
    x_label = _load_label(load_key)
    entries = sorted(
        ((entry.get("load"), _mapping(entry.get("result"))) for entry in _records(sweep.get("runs"))),
        key=lambda item: (_num(item[0]) is None, _num(item[0]) or 0.0),
    )
    # Charts need a finite load (an unbounded request rate is a row of the table only).
    plotted = [(load, result) for raw, result in entries if (load := _num(raw)) is not None]
    capacity_info = _mapping(sweep.get("capacity"))
    capacity = _num(capacity_info.get("load"))
    slo = _mapping(capacity_info.get("slo"))

    # TTFT and TPOT are drawn on separate charts: TTFT is often seconds while TPOT is tens of ms, and one
    # shared axis would flatten TPOT into the floor. Each marks its SLO bound (when given) and the capacity:
    # the load where p99 crosses the SLO line is where the server stops keeping its promise.
    ttft_chart = _series_svg(
        "TTFT against load",
        x_label,
        "TTFT (ms)",
        _latency_series(plotted, "ttft_ms", "TTFT"),
        capacity=capacity,
        hlines=[_slo_line(slo, "ttft_ms")],
    )
    tpot_chart = _series_svg(
        "TPOT against load",
        x_label,
        "TPOT (ms)",
        _latency_series(plotted, "tpot_ms", "TPOT"),
        capacity=capacity,
        hlines=[_slo_line(slo, "tpot_ms")],
    )
    # Output throughput against load: it rises while the server has spare capacity and flattens at
    # saturation; past that point more load only adds queueing (TTFT) without adding tokens per second.
    throughput_chart = _series_svg(
        "Output throughput against load",
        x_label,
        "output tokens per second",
        [_Series("output tok/s", DECODE_COLOR, _sweep_points(plotted, "output_throughput"))],
        capacity=capacity,
    )
    charts = [
        _figure(ttft_chart, "p50 (solid) and p99 (dashed) TTFT of each run; red dashed: the TTFT SLO."),
        _figure(tpot_chart, "p50 (solid) and p99 (dashed) TPOT of each run; red dashed: the TPOT SLO."),
        _figure(throughput_chart, "Output tokens per second of each run; grey dashed: the capacity found."),
    ]
    capacity_html = f"<p>{_esc(_capacity_text(capacity_info, load_key))}</p>" if capacity_info else ""
    first_config = _mapping(entries[0][1].get("config")) if entries else {}
    sections = [
        _section("Capacity", capacity_html) if capacity_html else "",
        _section("Charts", "\n".join(charts)),
        _section("Runs", _sweep_table(entries, load_key, capacity) if entries else _empty("no runs")),
        _section("Each run", "\n".join(_run_details(load, result, load_key) for load, result in entries))
        if entries
        else "",
        _section("Configuration (first run)", _kv_html(first_config, "no configuration recorded")),
    ]
    model = first_config.get("model")
    title = f"kvflow bench sweep: {model}" if model is not None else "kvflow bench sweep"
    subtitle = " · ".join(
        part
        for part in (_subtitle(first_config, with_load=False), f"{len(entries)} runs over {load_key}")
        if part
    )
    return _page(title, "kvflow bench sweep report", subtitle, sections)
