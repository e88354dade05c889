"""Hand-written inline SVG charts: scales and ticks, the chart frame, and a few kinds of chart.

Nothing here knows what is plotted: values come in as plain numbers and labels, and every string that
ends up in the markup goes through `esc`. The kinds of chart: a histogram with labelled vertical markers,
lines with point markers (`series_svg`), a scatter plot (`scatter_svg`) and Gantt bars (`gantt_bars`,
drawn into a `chart` frame by the caller). A chart with nothing to draw still has its frame, with a
"no data" note in the middle.
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# A histogram switches to a log-scale x when its largest positive value is this many times its smallest.
LOG_RATIO = 20.0

HIST_COLOR = "#6f9bd1"
GRID_COLOR = "#e6e6e6"
AXIS_COLOR = "#444444"

# (lo, hi, ticks) of an axis.
Domain = tuple[float, float, tuple[float, ...]]
# A labelled line across the plot: (label, value, colour); a None value draws nothing.
Marker = tuple[str, float | None, str]


# ---------------------------------------------------------------------------------------------------------
# Text and numbers
# ---------------------------------------------------------------------------------------------------------


def esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def fmt(value: Any) -> str:
    """A value as text: None as a dash, floats rounded (3 significant digits below 1)."""
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


def fmt_short(value: Any) -> str:
    """A number as typed on the command line (a load, an SLO bound): 8.0 -> "8", 2.5 -> "2.5"."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return f"{value:g}"
    return fmt(value)


def tick_label(value: float) -> str:
    return f"{value:.6g}"


def _p(value: float) -> str:
    """A pixel coordinate as SVG text."""
    return f"{value:.1f}"


# ---------------------------------------------------------------------------------------------------------
# Scales, ticks and the chart box
# ---------------------------------------------------------------------------------------------------------


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


def linear_domain(
    values: Iterable[float], *, zero: bool = False, integer: bool = False, target: int = 5
) -> Domain:
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


def log_domain(values: Iterable[float], *, trim: bool = False) -> Domain:
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


@dataclass(frozen=True)
class Scale:
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
class Box:
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

    def x_scale(self, domain: Domain, *, log: bool = False) -> Scale:
        return Scale(domain[0], domain[1], self.x0, self.x1, domain[2], log)

    def y_scale(self, domain: Domain, *, downward: bool = False) -> Scale:
        """Values grow upward, or downward (rows listed top to bottom) when `downward`."""
        if downward:
            return Scale(domain[0], domain[1], self.y_top, self.y_bottom, domain[2])
        return Scale(domain[0], domain[1], self.y_bottom, self.y_top, domain[2])


# ---------------------------------------------------------------------------------------------------------
# The frame: text, lines, legend, markers
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LegendItem:
    label: str
    color: str
    shape: str = "rect"  # rect, dot or line
    dashed: bool = False


def _text(x: float, y: float, content: str, *, anchor: str = "start", css: str = "", extra: str = "") -> str:
    cls = f' class="{css}"' if css else ""
    return f'<text x="{_p(x)}" y="{_p(y)}" text-anchor="{anchor}"{cls}{extra}>{esc(content)}</text>'


def _line(
    x1: float, y1: float, x2: float, y2: float, color: str, *, width: float = 1, dashed: bool = False
) -> str:
    dash = ' stroke-dasharray="5,4"' if dashed else ""
    return (
        f'<line x1="{_p(x1)}" y1="{_p(y1)}" x2="{_p(x2)}" y2="{_p(y2)}" stroke="{color}" '
        f'stroke-width="{width}"{dash}/>'
    )


def _legend(items: Sequence[LegendItem], box: Box, y: float = 18.0) -> list[str]:
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


def no_data(box: Box, message: str = "no data") -> str:
    """A note in the middle of an empty plot."""
    return _text((box.x0 + box.x1) / 2, (box.y_top + box.y_bottom) / 2, message, anchor="middle", css="note")


def chart(
    box: Box,
    title: str,
    x_label: str,
    y_label: str,
    x: Scale,
    y: Scale,
    body: Sequence[str],
    *,
    legend: Sequence[LegendItem] = (),
    notes: Sequence[str] = (),
) -> str:
    """One SVG chart: title, notes, legend, grid, ticks, axes and axis labels around the `body` shapes."""
    w, h = box.width, box.height
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" width="{_p(w)}" height="{_p(h)}" '
        f'viewBox="0 0 {_p(w)} {_p(h)}" role="img" aria-label="{esc(title)}">',
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
        out.append(_text(box.x0 - 6, py + 4, tick_label(tick), anchor="end"))
    for tick in x.ticks:
        px = x.px(tick)
        out.append(_line(px, box.y_bottom, px, box.y_bottom + 5, AXIS_COLOR))
        out.append(_text(px, box.y_bottom + 18, tick_label(tick), anchor="middle"))
    out.extend(body)
    out.append(_line(box.x0, box.y_bottom, box.x1, box.y_bottom, AXIS_COLOR))
    out.append(_line(box.x0, box.y_top, box.x0, box.y_bottom, AXIS_COLOR))
    out.append(_text((box.x0 + box.x1) / 2, h - 10, x_label, anchor="middle"))
    y_mid = (box.y_top + box.y_bottom) / 2
    out.append(_text(16, y_mid, y_label, anchor="middle", extra=f' transform="rotate(-90 16 {_p(y_mid)})"'))
    out.append("</svg>")
    return "\n".join(out)


def _vertical_marker(x: Scale, box: Box, value: float | None, label: str, color: str, row: int) -> list[str]:
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


def _horizontal_marker(y: Scale, box: Box, value: float | None, label: str, color: str) -> list[str]:
    if value is None or not y.contains(value):
        return []
    py = y.px(value)
    return [
        _line(box.x0, py, box.x1, py, color, width=1.2, dashed=True),
        _text(box.x1 - 4, py - 4, label, anchor="end", extra=f' fill="{color}"'),
    ]


# ---------------------------------------------------------------------------------------------------------
# Histogram
# ---------------------------------------------------------------------------------------------------------


def _bin_edges(domain: Domain, log: bool, target_bins: int) -> list[float]:
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


def histogram_svg(
    title: str,
    x_label: str,
    values: Sequence[float],
    markers: Sequence[Marker],
    *,
    noun: str,
    unit: str = "ms",
    allow_log: bool = False,
) -> str:
    """A histogram of `values` (in `unit`) with labelled dashed vertical `markers`, one legend entry each;
    the x axis turns logarithmic (when `allow_log`) if the positive values span LOG_RATIO or more."""
    box = Box()
    notes: list[str] = [f"{len(values)} {noun}"]
    positive = [v for v in values if v > 0]
    log = allow_log and len(positive) >= 2 and max(positive) / min(positive) >= LOG_RATIO
    if log:
        x_domain = log_domain(positive)
        notes.append("log-scale x")
        if len(positive) < len(values):
            notes.append(f"{len(values) - len(positive)} zero values counted in the first bin")
    else:
        x_domain = linear_domain(values)
    # About sqrt(n) bins (5 to 40): enough to show the shape, few enough that bins are not mostly empty.
    target_bins = min(40, max(5, round(math.sqrt(len(values)))))
    edges = _bin_edges(x_domain, log, target_bins)
    counts = _bin_counts(values, edges, log)
    y_domain = linear_domain(counts, zero=True, integer=True)
    x = box.x_scale(x_domain, log=log)
    y = box.y_scale(y_domain)
    body: list[str] = []
    if not values:
        body.append(no_data(box))
    for count, left, right in zip(counts, edges, edges[1:], strict=False):
        if count == 0:
            continue
        # At least 2 px tall: a single outlier among thousands of samples must stay visible.
        x_left, x_right, y_top = x.px(left), x.px(right), min(y.px(count), box.y_bottom - 2)
        tip = f"{tick_label(left)} to {tick_label(right)} {unit}: {count} {noun}"
        body.append(
            f'<rect x="{_p(x_left)}" y="{_p(y_top)}" width="{_p(max(x_right - x_left - 1, 0.5))}" '
            f'height="{_p(box.y_bottom - y_top)}" fill="{HIST_COLOR}"><title>{esc(tip)}</title></rect>'
        )
    for row, (name, value, color) in enumerate(markers):
        body.extend(_vertical_marker(x, box, value, f"{name} {fmt(value)} {unit}", color, row))
    legend = [LegendItem(name, color, "line", dashed=True) for name, _, color in markers]
    return chart(box, title, x_label, noun, x, y, body, legend=legend, notes=notes)


# ---------------------------------------------------------------------------------------------------------
# Lines, scatter, Gantt bars
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Series:
    label: str
    color: str
    points: list[tuple[float, float | None]]  # (x, value); None breaks the line
    dashed: bool = False


def series_svg(
    title: str,
    x_label: str,
    y_label: str,
    series: Sequence[Series],
    *,
    vlines: Sequence[Marker] = (),
    hlines: Sequence[Marker] = (),
) -> str:
    """Lines with point markers; labelled dashed vertical and horizontal lines if given. The x axis turns
    logarithmic when x spans 20x or more (a sweep doubling its load, 1 to 256, keeps its low end apart)."""
    box = Box()
    loads = [load for s in series for load, _ in s.points]
    values = [v for s in series for _, v in s.points if v is not None]
    values.extend(v for _, v, _ in hlines if v is not None)
    log = bool(loads) and min(loads) > 0 and max(loads) / min(loads) >= 20
    x_domain = log_domain(loads, trim=True) if log else linear_domain(loads, zero=True)
    x = box.x_scale(x_domain, log=log)
    y = box.y_scale(linear_domain(values, zero=True))
    body: list[str] = []
    if not any(v is not None for s in series for _, v in s.points):
        body.append(no_data(box))
    for label, value, color in hlines:
        body.extend(_horizontal_marker(y, box, value, label, color))
    for row, (label, value, color) in enumerate(vlines):
        body.extend(_vertical_marker(x, box, value, label, color, row))
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
                f"<title>{esc(f'{s.label} at {fmt_short(load)}: {fmt(value)}')}</title></circle>"
            )
        dash = ' stroke-dasharray="6,4"' if s.dashed else ""
        body.extend(
            f'<polyline points="{" ".join(seg)}" fill="none" stroke="{s.color}" stroke-width="2"{dash}/>'
            for seg in segments
            if len(seg) >= 2
        )
    notes = ["log-scale x"] if log else []
    legend = [LegendItem(s.label, s.color, "line", dashed=s.dashed) for s in series]
    return chart(box, title, x_label, y_label, x, y, body, legend=legend, notes=notes)


def scatter_svg(
    title: str,
    x_label: str,
    y_label: str,
    series: Sequence[tuple[str, str, Sequence[tuple[float, float]]]],
    *,
    notes: Sequence[str] = (),
) -> str:
    """(label, colour, points) dot clouds on axes from 0; later series are drawn on top of earlier ones,
    and the legend lists the topmost first."""
    box = Box()
    x = box.x_scale(linear_domain((p[0] for _, _, pts in series for p in pts), zero=True))
    y = box.y_scale(linear_domain((p[1] for _, _, pts in series for p in pts), zero=True))
    body: list[str] = []
    if not any(points for _, _, points in series):
        body.append(no_data(box))
    for _, color, points in series:
        body.extend(
            f'<circle cx="{_p(x.px(sx))}" cy="{_p(y.px(sy))}" r="2.5" fill="{color}" fill-opacity="0.7"/>'
            for sx, sy in points
        )
    legend = [LegendItem(label, color, "dot") for label, color, _ in reversed(series)]
    return chart(box, title, x_label, y_label, x, y, body, legend=legend, notes=notes)


@dataclass(frozen=True)
class GanttBar:
    """One row of a Gantt chart: coloured segments (start, end, colour, minimum width in px) and a tooltip;
    a segment narrower than its minimum is widened to it, one of no width at all is left out."""

    row: int
    segments: Sequence[tuple[float, float, str, float]]
    tip: str


def gantt_bars(x: Scale, y: Scale, bars: Sequence[GanttBar]) -> list[str]:
    """The bars, each filling 3/4 of its row of the (downward, one unit a row) `y` scale."""
    band = y.px(1) - y.px(0)
    thickness = max(band * 0.75, 1.0)
    height = f'height="{_p(thickness)}"'
    out: list[str] = []
    for bar in bars:
        top = y.px(bar.row) + (band - thickness) / 2
        rects = ""
        for start, end, color, min_width in bar.segments:
            left = x.px(start)
            width = max(x.px(end) - left, min_width)
            if width > 0:
                rects += f'<rect x="{_p(left)}" y="{_p(top)}" width="{_p(width)}" {height} fill="{color}"/>'
        out.append(f"<g><title>{esc(bar.tip)}</title>{rects}</g>")
    return out
