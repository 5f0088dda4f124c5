"""Small inline-SVG charts for the HTML report (no JavaScript, no network)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from html import escape

__all__ = [
    "PALETTE",
    "bar_breakdown",
    "heatmap",
    "histogram",
    "line_chart",
    "nice_ticks",
    "state_lanes",
    "timeline",
]

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f")
MAX_POINTS = 1500

Point = tuple[float, float]
Marker = tuple[float, str, str]  # x, label, css class


def nice_step(span: float, target: int = 5) -> float:
    """The 1/2/5 × 10^k step nearest to cutting ``span`` into ``target`` intervals."""
    if not span > 0 or not math.isfinite(span):
        return 1.0
    raw = span / max(target, 1)
    magnitude = 10.0 ** math.floor(math.log10(raw))
    ratio = raw / magnitude  # in [1, 10): choose the 1/2/5/10 nearest on a log scale
    if ratio >= math.sqrt(50):
        return 10.0 * magnitude
    if ratio >= math.sqrt(10):
        return 5.0 * magnitude
    if ratio >= math.sqrt(2):
        return 2.0 * magnitude
    return magnitude


def nice_ticks(lo: float, hi: float, target: int = 5, step: float | None = None) -> list[float]:
    """Tick values inside ``[lo, hi]`` on round numbers: multiples of a 1/2/5 × 10^k step."""
    step = step or nice_step(hi - lo, target)
    first, last = math.ceil(lo / step - 1e-9), math.floor(hi / step + 1e-9)
    return [_on_grid(k * step, step) for k in range(first, last + 1)]


def _on_grid(v: float, step: float) -> float:
    """``v`` rounded to the step's decimals (``3 * 0.1`` is 0.3, not 0.30000000000000004)."""
    return round(v, max(0, -math.floor(math.log10(step))) + 1) + 0.0  # + 0.0: no "-0"


def _nice_axis(lo: float, hi: float, target: int) -> tuple[float, float, float]:
    """``[lo, hi]`` widened outwards to the nearest round ticks, and the tick step."""
    step = nice_step(hi - lo, target)
    return (
        _on_grid(math.floor(lo / step + 1e-9) * step, step),
        _on_grid(math.ceil(hi / step - 1e-9) * step, step),
        step,
    )


def _tick_label(v: float, step: float) -> str:
    """A tick shown with as many decimals as its step needs (``0.05``, ``2.5e+06``, ``120``)."""
    if v == 0:
        return "0"
    decimals = max(0, -math.floor(math.log10(step)))
    if abs(v) >= 1e6 or decimals > 4:
        return f"{v:g}"
    return f"{v:.{decimals}f}"


def _downsample(points: Sequence[Point]) -> Sequence[Point]:
    if len(points) <= MAX_POINTS:
        return points
    stride = math.ceil(len(points) / MAX_POINTS)
    return list(points[::stride]) + [points[-1]]


def _bounds(values: Sequence[float]) -> tuple[float, float]:
    lo, hi = min(values), max(values)
    if hi == lo:
        pad = abs(hi) * 0.1 or 1.0
        return lo - pad, hi + pad
    return lo, hi


def line_chart(
    series: Mapping[str, Sequence[Point]],
    *,
    title: str,
    xlabel: str,
    ylabel: str = "",
    markers: Sequence[Marker] = (),
    width: int = 640,
    height: int = 240,
) -> str:
    """Lines per series; ``markers`` draw vertical lines (e.g. restarts) with a class."""
    series = {k: _downsample(v) for k, v in series.items() if v}
    left, right, top, bottom = 64, 12, 28, 40
    pw, ph = width - left - right, height - top - bottom
    parts = [
        f'<svg class="tg-chart" xmlns="http://www.w3.org/2000/svg" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" role="img">',
        f"<title>{escape(title)}</title>",
        f'<text x="{left}" y="18" class="tg-title">{escape(title)}</text>',
    ]
    if not series:
        parts.append(f'<text x="{left}" y="{top + ph / 2}" class="tg-empty">no data</text></svg>')
        return "".join(parts)
    xs = [p[0] for s in series.values() for p in s if p[0] == p[0]] + [m[0] for m in markers]
    ys = [p[1] for s in series.values() for p in s if p[1] == p[1]]
    x0, x1 = _bounds(xs)
    y0, y1, ystep = _nice_axis(*_bounds(ys), target=4)
    xstep = nice_step(x1 - x0, 4)

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * pw

    def sy(y: float) -> float:
        return top + ph - (y - y0) / (y1 - y0) * ph

    parts.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" class="tg-plot"/>')
    for yv in nice_ticks(y0, y1, step=ystep):
        y = sy(yv)
        parts.append(
            f'<line x1="{left}" x2="{left + pw}" y1="{y:.1f}" y2="{y:.1f}" class="tg-grid"/>'
        )
        label = _tick_label(yv, ystep)
        parts.append(f'<text x="{left - 4}" y="{y + 4:.1f}" class="tg-ytick">{label}</text>')
    for xv in nice_ticks(x0, x1, step=xstep):
        label = _tick_label(xv, xstep)
        parts.append(f'<text x="{sx(xv):.1f}" y="{top + ph + 14}" class="tg-xtick">{label}</text>')
    parts.append(
        f'<text x="{left + pw / 2}" y="{height - 6}" class="tg-xlabel">{escape(xlabel)}</text>'
    )
    if ylabel:
        parts.append(
            f'<text x="12" y="{top + ph / 2}" class="tg-ylabel" '
            f'transform="rotate(-90 12 {top + ph / 2})">{escape(ylabel)}</text>'
        )
    for x, label, cls in markers:
        parts.append(
            f'<line x1="{sx(x):.1f}" x2="{sx(x):.1f}" y1="{top}" y2="{top + ph}" '
            f'class="tg-marker {escape(cls)}"><title>{escape(label)}</title></line>'
        )
    for i, (name, pts) in enumerate(series.items()):
        color = PALETTE[i % len(PALETTE)]
        cmds, move = [], True
        for x, y in pts:
            if x != x or y != y:  # NaN: a gap (e.g. between attempts)
                move = True
                continue
            cmds.append(f"{'M' if move else 'L'}{sx(x):.1f},{sy(y):.1f}")
            move = False
        d = " ".join(cmds)
        parts.append(
            f'<path d="{d}" fill="none" stroke="{color}" stroke-width="1.5" class="tg-line">'
            f"<title>{escape(name)}</title></path>"
        )
        lx = left + pw - 150
        ly = top + 12 + 14 * i
        parts.append(
            f'<rect x="{lx}" y="{ly - 8}" width="10" height="10" fill="{color}"/>'
            f'<text x="{lx + 14}" y="{ly + 1}" class="tg-legend">{escape(name)}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def bar_breakdown(
    parts_s: dict[str, float], *, title: str, colors: dict[str, str], width: int = 640
) -> str:
    """One horizontal bar split by category (e.g. goodput: productive vs lost by cause)."""
    total = sum(v for v in parts_s.values() if v > 0) or 1.0
    h = 70
    out = [
        f'<svg class="tg-chart tg-goodput" xmlns="http://www.w3.org/2000/svg" width="{width}" '
        f'height="{h}" viewBox="0 0 {width} {h}" role="img"><title>{escape(title)}</title>',
        f'<text x="4" y="16" class="tg-title">{escape(title)}</text>',
    ]
    x = 4.0
    usable = width - 8
    for name, v in parts_s.items():
        if v <= 0:
            continue
        w = usable * v / total
        out.append(
            f'<rect x="{x:.1f}" y="26" width="{max(w, 0.5):.1f}" height="24" '
            f'fill="{colors.get(name, "#999")}" class="tg-seg-{escape(name)}">'
            f"<title>{escape(name)}: {v:.2f} s ({100 * v / total:.1f} %)</title></rect>"
        )
        if w > 60:
            out.append(f'<text x="{x + 4:.1f}" y="43" class="tg-seglabel">{escape(name)}</text>')
        x += w
    out.append("</svg>")
    return "".join(out)


def histogram(
    counts: Mapping[int, int], *, title: str, xlabel: str, limit: int | None = None,
    width: int = 460,
) -> str:  # fmt: skip
    """Vertical bars, one per integer value (``counts``: value → how many); ``limit`` draws
    a dashed line after that value (a bound the values must not pass)."""
    lo = min([0, *counts])
    hi = max([*counts, limit if limit is not None else 0, lo])
    values = list(range(lo, hi + 1))
    top = max(counts.values(), default=0) or 1
    h, left, bottom, head = 200, 48, 34, 26
    bw = (width - left - 8) / len(values)
    plot_h = h - bottom - head
    out = [
        f'<svg class="tg-chart tg-histogram" xmlns="http://www.w3.org/2000/svg" width="{width}" '
        f'height="{h}" viewBox="0 0 {width} {h}" role="img"><title>{escape(title)}</title>',
        f'<text x="4" y="16" class="tg-title">{escape(title)}</text>',
        f'<text x="4" y="{head + 10}" class="tg-axis">{top}</text>',
        f'<text x="{width // 2}" y="{h - 4}" class="tg-axis">{escape(xlabel)}</text>',
    ]
    for i, v in enumerate(values):
        n = counts.get(v, 0)
        bh = plot_h * n / top
        x = left + i * bw
        out.append(
            f'<rect x="{x + 1:.1f}" y="{head + plot_h - bh:.1f}" width="{max(bw - 2, 0.5):.1f}" '
            f'height="{bh:.1f}" fill="{PALETTE[0]}" class="tg-bar" data-value="{v}" '
            f'data-count="{n}"><title>{v}: {n}</title></rect>'
            f'<text x="{x + bw / 2:.1f}" y="{h - bottom + 14}" class="tg-axis">{v}</text>'
        )
    if limit is not None and lo <= limit <= hi:
        x = left + (limit - lo + 1) * bw
        out.append(
            f'<line x1="{x:.1f}" y1="{head}" x2="{x:.1f}" y2="{head + plot_h}" '
            f'stroke="#d62728" stroke-dasharray="4 3" class="tg-limit"><title>bound {limit}'
            "</title></line>"
        )
    out.append("</svg>")
    return "".join(out)


def heatmap(
    rows: Mapping[str, Sequence[float | None]],
    *,
    title: str,
    col_label: str,
    col_start: float = 0,
    col_step: float = 1,
    width: int = 640,
) -> str:
    """Rows (e.g. ranks) × columns (step bins); color = value relative to the overall range."""
    left, top = 64, 28
    ncols = max((len(v) for v in rows.values()), default=0)
    cell_h = 16
    h = top + cell_h * max(len(rows), 1) + 30
    out = [
        f'<svg class="tg-chart tg-heatmap" xmlns="http://www.w3.org/2000/svg" width="{width}" '
        f'height="{h}" viewBox="0 0 {width} {h}" role="img"><title>{escape(title)}</title>',
        f'<text x="{left}" y="18" class="tg-title">{escape(title)}</text>',
    ]
    vals = [v for r in rows.values() for v in r if v is not None]
    if not vals or not ncols:
        out.append(f'<text x="{left}" y="{top + 14}" class="tg-empty">no data</text></svg>')
        return "".join(out)
    ordered = sorted(vals)
    lo, hi = ordered[0], ordered[int(0.95 * (len(ordered) - 1))]  # robust to a slow first step
    span = (hi - lo) or 1.0
    cw = (width - left - 8) / ncols
    for ri, (name, r) in enumerate(rows.items()):
        y = top + ri * cell_h
        out.append(f'<text x="{left - 4}" y="{y + 12}" class="tg-ytick">{escape(name)}</text>')
        for ci, v in enumerate(r):
            if v is None:
                continue
            t = min(1.0, (v - lo) / span)
            color = f"rgb({int(40 + 215 * t)},{int(90 + 100 * (1 - abs(2 * t - 1)))},{int(200 - 170 * t)})"
            c0 = col_start + ci * col_step
            out.append(
                f'<rect x="{left + ci * cw:.1f}" y="{y}" width="{cw + 0.3:.1f}" height="{cell_h - 1}" '
                f'fill="{color}"><title>{escape(name)} {escape(col_label)} {c0:g}: '
                f"{v * 1000:.1f} ms</title></rect>"
            )
    out.append(
        f'<text x="{left}" y="{h - 8}" class="tg-xlabel-left">{escape(col_label)} '
        f"{col_start:g} → {col_start + ncols * col_step:g}; blue {lo * 1000:.1f} ms → red "
        f"≥ {hi * 1000:.1f} ms (95th percentile)</text></svg>"
    )
    return "".join(out)


def timeline(
    spans: Sequence[tuple[float, float, str, str]],
    markers: Sequence[tuple[float, str, str, str]],
    *,
    title: str,
    t_end: float,
    width: int = 960,
) -> str:
    """Attempt bars ``(start, end, label, class)`` and point ``markers`` ``(t, label, class,
    glyph)`` on a time axis in seconds since launch."""
    left, top, lane_h = 70, 28, 22
    lanes = ["attempts", "failures", "recovery", "checkpoints", "health"]
    h = top + lane_h * len(lanes) + 34
    pw = width - left - 12
    t1 = max(t_end, 1e-9)

    def sx(t: float) -> float:
        return left + max(0.0, min(t, t1)) / t1 * pw

    out = [
        f'<svg class="tg-chart tg-timeline" xmlns="http://www.w3.org/2000/svg" width="{width}" '
        f'height="{h}" viewBox="0 0 {width} {h}" role="img"><title>{escape(title)}</title>',
        f'<text x="{left}" y="18" class="tg-title">{escape(title)}</text>',
    ]
    for i, lane in enumerate(lanes):
        y = top + i * lane_h
        out.append(f'<text x="{left - 4}" y="{y + 15}" class="tg-ytick">{lane}</text>')
        out.append(
            f'<line x1="{left}" x2="{left + pw}" y1="{y + lane_h}" y2="{y + lane_h}" class="tg-grid"/>'
        )
    for s, e, label, cls in spans:
        out.append(
            f'<rect x="{sx(s):.1f}" y="{top + 3}" width="{max(sx(e) - sx(s), 1):.1f}" '
            f'height="{lane_h - 6}" class="{escape(cls)}"><title>{escape(label)}</title></rect>'
        )
    lane_of = {"tg-failure": 1, "tg-hang": 1, "tg-restart": 2, "tg-rendezvous": 2,
               "tg-restore": 2, "tg-checkpoint": 3, "tg-health": 4}  # fmt: skip
    for t, label, cls, glyph in markers:
        y = top + lane_of.get(cls, 4) * lane_h + 15
        out.append(
            f'<text x="{sx(t):.1f}" y="{y}" class="tg-glyph {escape(cls)}" '
            f'data-t="{t:.3f}">{escape(glyph)}<title>{escape(label)}</title></text>'
        )
    step = nice_step(t1, 5)
    for t in nice_ticks(0.0, t1, step=step):
        label = _tick_label(t, step)
        out.append(f'<text x="{sx(t):.1f}" y="{h - 14}" class="tg-xtick">{label} s</text>')
    out.append("</svg>")
    return "".join(out)


def state_lanes(
    lanes: Sequence[tuple[str, Sequence[tuple[float, float, str, str]]]],
    *,
    title: str,
    t_end: float,
    width: int = 960,
) -> str:
    """One lane per process (the trainer's attempts, each engine replica): spans ``(start,
    end, css class, label)`` on a time axis in seconds since launch, e.g. a replica's states."""
    left, top, lane_h = 110, 28, 20
    h = top + lane_h * max(len(lanes), 1) + 34
    pw = width - left - 12
    t1 = max(t_end, 1e-9)

    def sx(t: float) -> float:
        return left + max(0.0, min(t, t1)) / t1 * pw

    out = [
        f'<svg class="tg-chart tg-lanes" xmlns="http://www.w3.org/2000/svg" width="{width}" '
        f'height="{h}" viewBox="0 0 {width} {h}" role="img"><title>{escape(title)}</title>',
        f'<text x="{left}" y="18" class="tg-title">{escape(title)}</text>',
    ]
    for i, (name, spans) in enumerate(lanes):
        y = top + i * lane_h
        out.append(f'<text x="{left - 4}" y="{y + 14}" class="tg-ytick">{escape(name)}</text>')
        out.append(
            f'<line x1="{left}" x2="{left + pw}" y1="{y + lane_h}" y2="{y + lane_h}" class="tg-grid"/>'
        )
        for s, e, cls, label in spans:
            out.append(
                f'<rect x="{sx(s):.1f}" y="{y + 3}" width="{max(sx(e) - sx(s), 1):.1f}" '
                f'height="{lane_h - 6}" class="{escape(cls)}" data-t="{s:.3f}">'
                f"<title>{escape(label)}</title></rect>"
            )
    step = nice_step(t1, 5)
    for t in nice_ticks(0.0, t1, step=step):
        label = _tick_label(t, step)
        out.append(f'<text x="{sx(t):.1f}" y="{h - 14}" class="tg-xtick">{label} s</text>')
    out.append("</svg>")
    return "".join(out)
