"""A training report's figure: the loss with the envelope as a band, and each backend's distance from the oracle."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from rlx_nb._support.safe import plot_text
from rlx_nb.plot.style import SUSPECT_COLOUR, pyplot

_COLOURS = ("#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f")


def plot_training(steps: pd.DataFrame, local: pd.DataFrame, backends: Sequence[str], *, oracle: Sequence[float],
                  limit: float, fig: Any = None, title: str = "") -> Any:  # fmt: skip
    """Two panels over the steps: the oracle's loss with each backend's, and the oracle's loss +- the envelope as a
    band; below, each backend's largest difference from the oracle in envelopes (log scale), the line at 1, its local
    steps marked (hollow: within round-off; a red cross: past the line).  Returns the upper axes."""
    plt = pyplot()
    if fig is None:
        fig = plt.figure(figsize=(8.5, 6.0), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    x = np.arange(len(oracle))
    tops: list[float] = [1.0]
    top.plot(x, oracle, color="black", linewidth=1.2, label="oracle (cpu, float32)")
    for i, name in enumerate(backends):
        rows = steps[steps.backend == name]
        if not len(rows):
            continue
        colour = SUSPECT_COLOUR if (local[(local.backend == name)].verdict == "SUSPECT").any() else _COLOURS[i % 8]
        if i == 0:  # (the envelope around the oracle: the round-off drift, the band a backend within chaos stays in)
            lo = rows.oracle_loss - limit * rows.loss_envelope
            hi = rows.oracle_loss + limit * rows.loss_envelope
            top.fill_between(rows.step, lo, hi, color="grey", alpha=0.25, linewidth=0,
                             label=f"envelope x{limit:g} (round-off's drift)")  # fmt: skip
        top.plot(rows.step, rows.loss, color=colour, linewidth=0.9, alpha=0.9, label=plot_text(name))
        bottom.plot(rows.step, rows.line.clip(lower=1e-6), color=colour, linewidth=0.9, label=plot_text(name))
        judged = local[local.backend == name]
        within, past = judged[judged.verdict != "SUSPECT"], judged[judged.verdict == "SUSPECT"]
        if len(within):  # (hollow: a local step within round-off, whatever its backend's verdict)
            bottom.scatter(within.step, within.line.clip(lower=1e-6), marker="o", s=36, zorder=3, facecolor="white",
                           edgecolor=colour, linewidth=1.2)  # fmt: skip
        if len(past):  # (a red cross: past the line)
            bottom.scatter(past.step, past.line.clip(lower=1e-6), marker="X", s=60, zorder=4, color=SUSPECT_COLOUR,
                           edgecolor="black", linewidth=0.5)  # fmt: skip
        tops.extend([float(rows.line.max()), float(judged.line.max()) if len(judged) else 0.0])
    bottom.axhline(1.0, color="black", linestyle="--", linewidth=1, label="the line")
    bottom.set_yscale("log")
    top_value = max(t for t in tops if np.isfinite(t))
    bottom.set_ylim(top=10 ** (np.log10(max(top_value, 1.0)) + 0.5))  # (every mark inside, the line with room)
    bottom.set_ylabel("x of the line\n(trajectory: line; local steps: marks)", fontsize=8)
    bottom.set_xlabel("step")
    top.set_ylabel("loss")
    top.set_title(plot_text(title), fontsize=10)
    top.legend(fontsize=8, loc="upper right")
    bottom.legend(fontsize=8, loc="upper left", ncol=2)
    return top


__all__ = ["plot_training"]
