"""Heatmap of a large output rendered to PNG, next to the metric pass over the same pair, in one run.

    python bench/heatmap_speed.py [--elements 1e8]

Writes ``bench/results/heatmap_speed.md``.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
from IPython.core.pylabtools import print_figure
from matplotlib_inline.config import InlineBackend

from rlx_nb.numerics.pairs import pair_stats
from rlx_nb.plot.heatmap import heatmap, plot_heatmap


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _heatmap(a, b, figsize):
    # The user's call: plot_heatmap's own figure, or one axes of a figure the user made.
    if figsize is None:
        return plot_heatmap(a, b)
    return plot_heatmap(a, b, ax=plt.figure(figsize=figsize).add_subplot())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", default="1e8")
    args = parser.parse_args()
    n = int(float(args.elements))
    side = math.isqrt(n)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((side, side), dtype=np.float32)
    b = a + rng.standard_normal((side, side), dtype=np.float32) * np.float32(1e-7)
    rows, cols = rng.choice(side, 20, replace=False), rng.choice(side, 20, replace=False)
    b[rows, cols] += np.float32(1e-2)
    # Warm-ups, as in a notebook session: the compiled kernels are loaded and matplotlib's fonts
    # cached by the first plot; what is timed is the cost of each further look.
    ax = plot_heatmap(a[:64, :64], b[:64, :64])
    print_figure(ax.figure, "png", bbox_inches="tight")
    plt.close(ax.figure)
    pair_stats(a[:64], b[:64])
    t_metrics = min(_timed(lambda: pair_stats(a, b)) for _ in range(3))
    lines = []
    for size, figsize in (("default 6x4.5 in", None), ("large 8x8 in", (8, 8))):
        drawn, inline = [], []
        for _ in range(3):
            # What a live (ipympl) figure shows: the figure, pooled map, log colour scale and worst-element
            # marker, rendered to pixels by Agg.
            t0 = time.perf_counter()
            ax = _heatmap(a, b, figsize)
            ax.figure.canvas.draw()
            drawn.append(time.perf_counter() - t0)
            plt.close(ax.figure)
            # What the inline backend does with the same call: IPython's print_figure with its default
            # bbox_inches="tight" (one draw to measure, one to render) and the PNG encoding.
            t0 = time.perf_counter()
            ax = _heatmap(a, b, figsize)
            print_figure(ax.figure, "png", **InlineBackend().print_figure_kwargs)
            inline.append(time.perf_counter() - t0)
            plt.close(ax.figure)
        t_drawn, t_inline = min(drawn), min(inline)
        drawn = heatmap(a, b) if figsize is None else heatmap(a, b, ax=plt.figure(figsize=figsize).add_subplot())
        fy, fx = drawn.factors
        kept = sum(drawn.pooled[r // fy, c // fx] >= 1e-2 * 0.99 for r, c in zip(rows, cols, strict=True))
        pooled = "x".join(str(n) for n in drawn.pooled.shape)
        plt.close(drawn.ax.figure)
        line = (
            f"| {side * side:.2e} ({side}x{side}) | {size} ({pooled} pooled) | {t_metrics * 1e3:.0f} ms "
            f"| {t_drawn * 1e3:.0f} ms ({t_drawn / t_metrics:.2f}x) | {t_inline * 1e3:.0f} ms ({t_inline / t_metrics:.2f}x) "
            f"| {kept}/20 |"
        )
        print(line, flush=True)
        lines.append(line)
    out = Path(__file__).parent / "results" / "heatmap_speed.md"
    out.write_text(
        "# Heatmap vs metric pass (float32 pair, one run; best of 3 each, after a warm-up plot)\n\n"
        "| elements | figure | pair_stats (full metric set) | heatmap drawn, live figure (target < 2x metrics) "
        "| heatmap as the inline backend shows it (target < 2x metrics) | planted outliers visible |\n"
        "|---|---|---|---|---|---|\n"
        + "\n".join(lines)
        + "\n\nBoth columns time `plot_heatmap(oracle, backend)` from the arrays: the max-pooled error map, the "
        "figure, log colour scale and worst-element marker.  *Drawn* then renders it to pixels with Agg (what a "
        "live ipympl figure shows); *inline* hands it to IPython's `print_figure` with the inline backend's "
        'default `bbox_inches="tight"` (a measuring draw, the real draw and the PNG encoding of noise-like '
        "errors), which is what a notebook cell showing the figure costs.\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
