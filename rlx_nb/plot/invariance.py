"""An invariance report's map: rows x configurations, each cell bit for bit, within round-off, or past the line."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from rlx_nb._support.safe import plot_text
from rlx_nb.plot.style import SUSPECT_COLOUR, pyplot

_STATES = ("bit for bit", "round-off", "past the line")
_COLOURS = ("#e8f5e9", "#ffcc80", SUSPECT_COLOUR)


def plot_invariance(frame: pd.DataFrame, backend: str, *, ax: Any = None, title: str = "") -> Any:
    """Rows (down) by configurations (across) of ``backend``: green bit for bit, orange within round-off (the cell
    says its place on the line), red past the line.  Returns the axes."""
    plt = pyplot()
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    mine = frame[frame.backend == backend]
    configs = list(dict.fromkeys(mine.config))
    rows = sorted(set(mine.row))
    if ax is None:
        _, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(configs) + 2), 1.2 + 0.6 * len(rows)), layout="constrained")
    state = np.zeros((len(rows), len(configs)))
    for i, r in enumerate(rows):
        for j, c in enumerate(configs):
            cell = mine[(mine.row == r) & (mine.config == c)]
            worst = 0.0 if len(cell) == 0 else float(np.nan_to_num(cell.line.max()))
            state[i, j] = 0 if cell.bitwise.all() else (2 if (cell.verdict == "SUSPECT").any() else 1)
            if state[i, j] > 0:
                ax.text(j, i, f"{worst:.2g}x", ha="center", va="center", fontsize=8,
                        color="white" if state[i, j] == 2 else "black")  # fmt: skip
    ax.imshow(state, cmap=ListedColormap(_COLOURS), vmin=0, vmax=2, aspect="auto")
    ax.set_xticks(range(len(configs)), [plot_text(c) for c in configs], rotation=35, ha="right", fontsize=8)
    ax.set_yticks(range(len(rows)), [f"row {r}" for r in rows], fontsize=8)
    ax.set_title(plot_text(f"{title} · {backend}" if title else backend), fontsize=10)
    ax.legend(handles=[Patch(color=c, label=s) for c, s in zip(_COLOURS, _STATES, strict=True)], fontsize=7,
              loc="upper left", bbox_to_anchor=(1.0, 1.0))  # fmt: skip
    return ax


__all__ = ["plot_invariance"]
