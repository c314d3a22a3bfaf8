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
from matplotlib.figure import Figure

from rlx_nb.metrics import pair_stats
from rlx_nb.plotting import plot_heatmap


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
    t0 = time.perf_counter()
    pair_stats(a, b)
    t_metrics = time.perf_counter() - t0
    t0 = time.perf_counter()
    fig = Figure(figsize=(8, 8), dpi=100)
    ax = plot_heatmap(a, b, ax=fig.add_subplot())
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    t_heatmap = time.perf_counter() - t0
    image = ax.images[0]
    fy, fx = image.rlx_factors
    kept = sum(image.rlx_pooled[r // fy, c // fx] >= 1e-2 * 0.99 for r, c in zip(rows, cols, strict=True))
    line = (
        f"| {side * side:.2e} ({side}x{side}) | {t_metrics * 1e3:.0f} ms | {t_heatmap * 1e3:.0f} ms "
        f"| {t_heatmap / t_metrics:.2f} | {kept}/20 |"
    )
    print(line)
    out = Path(__file__).parent / "results" / "heatmap_speed.md"
    out.write_text(
        "# Heatmap vs metric pass (float32 pair, one run)\n\n"
        "| elements | pair_stats (full metric set) | heatmap to PNG (800 px) | heatmap / metrics (target < 2) "
        "| planted outliers visible |\n|---|---|---|---|---|\n" + line + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
