"""The per-element error heatmap: any output folded to 2-D, max-pooled to the axes' pixels, the worst marked.

:func:`plot_heatmap` returns the ``Axes``; :func:`heatmap` the :class:`Heatmap` it drew (its pooled values,
folding and marked element), which the explorer reads back for clicks and rings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from rlx_nb.errors import InputError
from rlx_nb.figures import (
    COLORBAR_LABELS,
    EXACT_COLOUR,
    HEATMAP_MARGINS,
    METRIC_LABELS,
    log_ticks,
    new_axes,
    pixel_budget,
)
from rlx_nb.maps import METRICS, block_argmax, error_map, make_fold
from rlx_nb.safe import plot_text

if TYPE_CHECKING:
    from matplotlib.axes import Axes


@dataclasses.dataclass(frozen=True)
class HeatmapView:
    """How a heatmap folds, pools, colours and marks (the keywords of :func:`plot_heatmap`)."""

    fold: tuple[Sequence[int], Sequence[int]] | None = None
    select: dict[int, int] | None = None
    max_pixels: int | None = None
    cmap: str | None = None
    mark_worst: bool = True
    worst: Sequence[int] | None = None


@dataclasses.dataclass(frozen=True)
class Heatmap:
    """A drawn heatmap and what it shows, for code that reads it back (the explorer: a click on a pooled cell,
    a ring on a picked element).  ``pooled`` holds the exact pooled values (infinities included),
    ``factors`` the pooling along rows and columns, ``fold`` the folding of the output's axes
    (:class:`rlx_nb.maps.Fold`), ``worst`` the index of the element marked worst (None when none is)."""

    ax: Axes
    pooled: np.ndarray
    factors: tuple[int, int]
    fold: Any
    worst: tuple[int, ...] | None


def plot_heatmap(
    oracle: np.ndarray,
    backend: np.ndarray,
    reference: np.ndarray | None = None,
    *,
    metric: str = "abs",
    budget: float | None = None,
    fold: tuple[Sequence[int], Sequence[int]] | None = None,
    select: dict[int, int] | None = None,
    ax: Axes | None = None,
    max_pixels: int | None = None,
    title: str | None = None,
    cmap: str | None = None,
    mark_worst: bool = True,
    worst: Sequence[int] | None = None,
) -> Axes:
    """Per-element error map of one output on a log colour scale, the worst element marked.

    Parameters
    ----------
    oracle, backend : numpy.ndarray
        The two outputs (same shape, any rank; see :mod:`rlx_nb.maps` for folding).
    reference : numpy.ndarray, optional
        The fp64 reference; needed for ``metric="budget"``.
    metric : {"abs", "rel", "ulp", "budget"}
        ``budget`` divides the backend's error against fp64 by the output's
        round-off budget, so 1 is the oracle's own round-off and red stands out.
    budget : float, optional
        The output's RMSE budget (``OutputRecord.budget_rmse``) for ``metric="budget"``.
    fold, select
        The folding rule for N-D outputs (:func:`rlx_nb.maps.make_fold`).
    max_pixels : int, optional
        Cap on the pooled map's side; by default the axes' size in pixels.
    worst : tuple of int, optional
        The element to mark (e.g. the report's ``worst_index``); by default
        the worst element of the worst pooled block.

    Examples
    --------
    >>> import numpy as np
    >>> o = np.zeros((64, 64), np.float32); b = o.copy(); b[3, 5] = 1e-3
    >>> ax = plot_heatmap(o, b)
    >>> round(float(ax.images[0].get_array().max()), 6)
    0.001
    >>> import matplotlib.pyplot as plt; plt.close(ax.figure)
    """
    view = HeatmapView(fold, select, max_pixels, cmap, mark_worst, worst)
    return draw_heatmap(oracle, backend, reference, metric=metric, budget=budget, ax=ax, title=title, view=view).ax


def heatmap(oracle: np.ndarray, backend: np.ndarray, reference: np.ndarray | None = None, **kwargs: Any) -> Heatmap:
    """:func:`plot_heatmap` (its keywords), returning the :class:`Heatmap` it drew."""
    view = {k: kwargs.pop(k) for k in [f.name for f in dataclasses.fields(HeatmapView)] if k in kwargs}
    return draw_heatmap(oracle, backend, reference, view=HeatmapView(**view), **kwargs)


def draw_heatmap(
    oracle: np.ndarray,
    backend: np.ndarray,
    reference: np.ndarray | None = None,
    *,
    metric: str = "abs",
    budget: float | None = None,
    ax: Axes | None = None,
    title: str | None = None,
    view: HeatmapView = HeatmapView(),
) -> Heatmap:
    """:func:`plot_heatmap`, returning the :class:`Heatmap` it drew (what the explorer reads back)."""
    if metric not in METRICS:
        raise InputError(f"metric must be one of {', '.join(METRICS)}; got {metric!r}")
    import matplotlib
    from matplotlib.colors import LogNorm

    ax = new_axes(ax, margins=HEATMAP_MARGINS)
    try:
        folded = make_fold(oracle.shape, view.fold, view.select)
        data, factors, folded = error_map(
            oracle,
            backend,
            reference,
            metric=metric,
            budget=budget,
            fold=folded,
            max_pixels=pixel_budget(ax, view.max_pixels),
        )
    except ValueError as exc:
        raise InputError(str(exc)) from None
    finite = data[np.isfinite(data) & (data > 0)]
    if metric == "budget":
        vmax = max(10.0, float(finite.max()) if finite.size else 10.0)
        norm, cmap = LogNorm(1.0 / vmax, vmax), view.cmap or "coolwarm"
    else:
        vmax = float(finite.max()) if finite.size else 1.0
        vmin = max(vmax * 1e-6, float(finite.min()) if finite.size else vmax * 1e-6)
        norm, cmap = LogNorm(min(vmin, vmax / 2), vmax), view.cmap or "magma"
    # Exact agreement (an error of 0) has no place on a log scale: it is drawn in its own grey, below the
    # colour bar's range, so an output that matches bit for bit shows as grey, never as blank paper.
    colours = matplotlib.colormaps[cmap].with_extremes(under=EXACT_COLOUR, bad="white")
    shown = np.where(np.isinf(data), vmax, np.where(data > 0, data, norm.vmin * 1e-3))
    image = ax.imshow(np.ma.masked_invalid(shown), norm=norm, cmap=colours, interpolation="nearest", aspect="auto")
    exact = float(np.mean(data == 0)) if data.size else 0.0
    colorbar = ax.figure.colorbar(image, ax=ax, extend="min" if exact else "neither")
    log_ticks(colorbar, norm)
    colorbar.set_label(
        COLORBAR_LABELS[metric] + (f"  (grey: exact, {100 * exact:.3g}%)" if exact else ""), fontsize=9, labelpad=2
    )
    colorbar.ax.tick_params(labelsize=8)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rows and columns are whole
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(f"cols: {folded.side_label('cols')}" + (f", pooled x{factors[1]}" if factors[1] > 1 else ""))
    ax.set_ylabel(f"rows: {folded.side_label('rows')}" + (f", pooled x{factors[0]}" if factors[0] > 1 else ""))
    worst, index = view.worst, None
    cell = folded.cell(worst) if worst is not None else None
    if view.mark_worst and data.size and np.nanmax(data) > 0:
        if cell is not None:
            index = tuple(int(i) for i in worst)
            by, bx = cell[0] // factors[0], cell[1] // factors[1]
        else:
            by, bx = np.unravel_index(int(np.nanargmax(np.where(np.isnan(data), -1, data))), data.shape)
            index = block_argmax(oracle, backend, folded, (int(by), int(bx)), factors)
        ax.plot(
            [bx],
            [by],
            marker="s",
            markersize=12,
            markerfacecolor="none",
            markeredgecolor="cyan",
            markeredgewidth=2,
            label="worst",
            clip_on=False,  # a worst element on the edge is marked whole, not cut in half
        )
        # Keep the label inside the axes: below/left of the marker when it sits near the top/right edge.
        dy = 14 if by < data.shape[0] * 0.15 else -14
        dx, ha = (-8, "right") if bx > data.shape[1] * 0.6 else (8, "left")
        ax.annotate(
            f"worst {index}",
            (bx, by),
            xytext=(dx, -dy),
            textcoords="offset points",
            color="cyan",
            fontsize=9,
            fontweight="bold",
            ha=ha,
            va="center",
            bbox={"boxstyle": "round", "fc": "black", "alpha": 0.6, "lw": 0},
        )
    ax.set_title(plot_text(title) if title else f"{METRIC_LABELS[metric]}  [{folded.describe()}]", fontsize=9)
    return Heatmap(ax, data, factors, folded, index)
