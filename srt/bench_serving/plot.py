"""``--plot PATH``: the TTFT and ITL distributions side by side (histograms, median and p99
marked). With matplotlib (a dev extra) any format it writes; without it a small SVG drawn
here, so the picture needs no new dependency."""

from __future__ import annotations

import html
import os

import numpy as np

_BINS = 40
_W, _H, _PAD = 420, 260, 40  # one panel of the SVG


def _have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot_latency(
    path: str,
    ttft_ms: list[float],
    itl_ms: list[float],
    title: str = "",
    use_matplotlib: bool | None = None,
) -> str:
    """Draw the two distributions into ``path``; returns the file written (without
    matplotlib an SVG: ``path`` with its suffix replaced by .svg)."""
    if use_matplotlib is None:
        use_matplotlib = _have_matplotlib()
    if use_matplotlib:
        return _matplotlib(path, ttft_ms, itl_ms, title)
    root, _ = os.path.splitext(path)
    out = root + ".svg"
    with open(out, "w", encoding="utf-8") as f:
        f.write(svg_histograms([("TTFT (ms)", ttft_ms), ("ITL (ms)", itl_ms)], title))
    return out


def _matplotlib(path: str, ttft_ms: list[float], itl_ms: list[float], title: str) -> str:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (name, values) in zip(
        axes, [("TTFT (ms)", ttft_ms), ("ITL (ms)", itl_ms)], strict=True
    ):
        if values:
            ax.hist(values, bins=_BINS, color="#4878cf")
            for q, style in ((50, "--"), (99, ":")):
                ax.axvline(float(np.percentile(values, q)), color="k", ls=style, label=f"p{q}")
            ax.legend()
        ax.set_xlabel(name)
        ax.set_ylabel("count")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _panel(x0: int, name: str, values: list[float]) -> list[str]:
    """One histogram panel's SVG elements, its left edge at x0."""
    out = [f'<text x="{x0 + _W // 2}" y="{_H - 8}" text-anchor="middle">{html.escape(name)}</text>']
    plot_w, plot_h = _W - 2 * _PAD, _H - 2 * _PAD
    out.append(
        f'<rect x="{x0 + _PAD}" y="{_PAD}" width="{plot_w}" height="{plot_h}" '
        'fill="none" stroke="#888"/>'
    )
    if not values:
        out.append(f'<text x="{x0 + _W // 2}" y="{_H // 2}" text-anchor="middle">no data</text>')
        return out
    arr = np.asarray(values, dtype=np.float64)
    lo, hi = float(arr.min()), float(arr.max())
    if hi <= lo:
        hi = lo + 1e-9
    counts, edges = np.histogram(arr, bins=_BINS, range=(lo, hi))
    top = max(int(counts.max()), 1)
    bar_w = plot_w / _BINS
    for i, c in enumerate(counts):
        h = plot_h * int(c) / top
        out.append(
            f'<rect x="{x0 + _PAD + i * bar_w:.1f}" y="{_PAD + plot_h - h:.1f}" '
            f'width="{max(bar_w - 1, 0.5):.1f}" height="{h:.1f}" fill="#4878cf"/>'
        )
    for q, dash in ((50, "4,3"), (99, "1,2")):
        v = float(np.percentile(arr, q))
        x = x0 + _PAD + plot_w * (v - lo) / (hi - lo)
        out.append(
            f'<line x1="{x:.1f}" y1="{_PAD}" x2="{x:.1f}" y2="{_PAD + plot_h}" '
            f'stroke="black" stroke-dasharray="{dash}"/>'
        )
        out.append(f'<text x="{x + 2:.1f}" y="{_PAD - 4 - (q == 99) * 12}">p{q} {v:.2f}</text>')
    for v, anchor in ((lo, "start"), (hi, "end")):
        x = x0 + _PAD + (0 if anchor == "start" else plot_w)
        out.append(f'<text x="{x}" y="{_PAD + plot_h + 14}" text-anchor="{anchor}">{v:.2f}</text>')
    out.append(f'<text x="{x0 + 4}" y="{_PAD + 10}">{top}</text>')
    return out


def svg_histograms(panels: list[tuple[str, list[float]]], title: str = "") -> str:
    """An SVG document: one histogram per (name, values), side by side."""
    width = _W * len(panels)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{_H + 20}" '
        'font-family="sans-serif" font-size="11">',
        f'<text x="{width // 2}" y="14" text-anchor="middle">{html.escape(title)}</text>',
        '<g transform="translate(0,20)">',
    ]
    for i, (name, values) in enumerate(panels):
        parts += _panel(i * _W, name, values)
    parts += ["</g>", "</svg>"]
    return "\n".join(parts) + "\n"


__all__ = ["plot_latency", "svg_histograms"]
