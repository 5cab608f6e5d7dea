"""Charts drawn on the server as inline SVG: no script, no library, nothing fetched."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from html import escape


def _e(value) -> str:
    return escape(str(value), quote=True)


def bars(points: Sequence[tuple[str, float]], title: str,
         shown: Callable[[float], str] = lambda v: f"{v:g}",
         width: int = 320, height: int = 90) -> str:
    """A bar chart of ``points`` (label, value), oldest first: each bar says its label and
    value on hover, the largest value is written at the top."""
    top = max((value for _, value in points), default=0) or 1
    n = max(len(points), 1)
    step = (width - 40) / n
    plot = height - 14
    parts = [f'<svg class="chart" viewBox="0 0 {width} {height}" role="img" '
             f'aria-label="{_e(title)}"><title>{_e(title)}</title>',
             f'<line x1="40" y1="{plot}" x2="{width}" y2="{plot}" class="axis"/>',
             f'<text x="36" y="10" class="tick" text-anchor="end">{_e(shown(top))}</text>',
             f'<text x="36" y="{plot}" class="tick" text-anchor="end">0</text>']
    for i, (label, value) in enumerate(points):
        h = plot * value / top
        x = 40 + i * step
        parts.append(f'<rect x="{x + step * 0.1:.1f}" y="{plot - h:.1f}" '
                     f'width="{max(step * 0.8, 1):.1f}" height="{h:.1f}">'
                     f'<title>{_e(label)}: {_e(shown(value))}</title></rect>')
    if points:
        parts.append(f'<text x="40" y="{height - 4}" class="tick">{_e(points[0][0])}</text>')
        parts.append(f'<text x="{width}" y="{height - 4}" class="tick" text-anchor="end">'
                     f'{_e(points[-1][0])}</text>')
    parts.append("</svg>")
    return "".join(parts)


def meter(used: float, limit: float, label: str, width: int = 240) -> str:
    """One horizontal bar: ``used`` against ``limit``, red once past 90%."""
    share = min(used / limit, 1.0) if limit > 0 else 1.0
    level = "over" if share >= 0.9 else "fine"
    return (f'<svg class="meter" viewBox="0 0 {width} 14" width="{width}" height="14" '
            f'role="img" aria-label="{_e(label)}"><title>{_e(label)}</title>'
            f'<rect x="0" y="0" width="{width}" height="14" class="track"/>'
            f'<rect x="0" y="0" width="{width * share:.1f}" height="14" class="{level}"/></svg>')


def sequence(lanes: Sequence[str], steps: Sequence[tuple[str, str, str]], width: int = 760
             ) -> str:
    """A sequence drawing: one lifeline per lane, one arrow per step ``(from, to, label)``
    from the top down, in order."""
    n = max(len(lanes), 1)
    gap = width / n
    where = {lane: gap * (i + 0.5) for i, lane in enumerate(lanes)}
    row = 26
    height = 40 + row * len(steps) + 10
    parts = [f'<svg class="sequence" viewBox="0 0 {width} {height}" role="img" '
             f'aria-label="the exchange as a sequence of steps"><title>timeline</title>'
             '<defs><marker id="arrow" viewBox="0 0 8 8" refX="8" refY="4" markerWidth="7" '
             'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L8,4 L0,8 z"/>'
             '</marker></defs>']
    for lane, x in where.items():
        parts.append(f'<text x="{x:.1f}" y="16" class="lane" text-anchor="middle">{_e(lane)}</text>'
                     f'<line x1="{x:.1f}" y1="24" x2="{x:.1f}" y2="{height - 6}" class="life"/>')
    for i, (source, target, label) in enumerate(steps):
        y = 44 + i * row
        x1, x2 = where.get(source, 0.0), where.get(target, 0.0)
        if x1 == x2:  # a step's own note: a dot on its lifeline
            parts.append(f'<circle cx="{x1:.1f}" cy="{y}" r="4"/>'
                         f'<text x="{x1 + 8:.1f}" y="{y + 4}" class="step">{_e(label)}</text>')
            continue
        parts.append(f'<line x1="{x1:.1f}" y1="{y}" x2="{x2:.1f}" y2="{y}" class="msg" '
                     f'marker-end="url(#arrow)"/>'
                     f'<text x="{min(x1, x2) + 6:.1f}" y="{y - 5}" class="step">{_e(label)}</text>')
    parts.append("</svg>")
    return "".join(parts)
