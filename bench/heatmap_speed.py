"""Heatmap of a large output rendered to PNG, next to the metric pass over the same pair, in one run.

    python bench/heatmap_speed.py [--elements 1e8]

Writes ``bench/results/heatmap_speed.md``.
"""

from __future__ import annotations

import argparse
import io
import math
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from rlx_nb.maps import error_map
from rlx_nb.metrics import pair_stats
from rlx_nb.plotting import plot_heatmap


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


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
    small = Figure(figsize=(2, 2))
    plot_heatmap(a[:64, :64], b[:64, :64], ax=small.add_subplot())
    small.savefig(io.BytesIO(), format="png")
    pair_stats(a[:64], b[:64])
    t_metrics = min(_timed(lambda: pair_stats(a, b)) for _ in range(3))
    drawn, encoded = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        fig = Figure(figsize=(8, 8), dpi=100)
        FigureCanvasAgg(fig)
        ax = plot_heatmap(a, b, ax=fig.add_subplot())
        fig.canvas.draw()  # rendered to pixels: what a live (ipympl) figure shows
        drawn.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        fig.savefig(io.BytesIO(), format="png")  # what the inline backend sends: a redraw plus encoding
        encoded.append(drawn[-1] + time.perf_counter() - t0)
    t_drawn, t_png = min(drawn), min(encoded)
    t_map = min(_timed(lambda: error_map(a, b, max_pixels=800)) for _ in range(3))
    image = ax.images[0]
    fy, fx = image.rlx_factors
    kept = sum(image.rlx_pooled[r // fy, c // fx] >= 1e-2 * 0.99 for r, c in zip(rows, cols, strict=True))
    line = (
        f"| {side * side:.2e} ({side}x{side}) | {t_metrics * 1e3:.0f} ms | {t_map * 1e3:.0f} ms ({t_map / t_metrics:.2f}x) "
        f"| {t_drawn * 1e3:.0f} ms ({t_drawn / t_metrics:.2f}x) | {t_png * 1e3:.0f} ms ({t_png / t_metrics:.2f}x) "
        f"| {kept}/20 |"
    )
    print(line)
    out = Path(__file__).parent / "results" / "heatmap_speed.md"
    out.write_text(
        "# Heatmap vs metric pass (float32 pair, one run; best of 3 each, after a warm-up plot)\n\n"
        "| elements | pair_stats (full metric set) | pooled error map | heatmap drawn (target < 2x metrics) "
        "| heatmap drawn + PNG-encoded | planted outliers visible |\n|---|---|---|---|---|---|\n"
        + line
        + "\n\nDrawn: figure, pooled map, log colour scale, worst-element marker, rendered to pixels by Agg "
        "(what a live ipympl figure shows). PNG-encoded adds savefig's redraw and the encoding of an 800-px "
        "image of noise-like errors (what the inline backend sends), a fixed cost that does not depend on "
        "the output's size.\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
