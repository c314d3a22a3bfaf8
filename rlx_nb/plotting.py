"""Matplotlib views: arrays or a report in, an ``Axes`` out.  Never ``plt.show()``.

Every function takes ``ax=None`` (a new figure is made) and returns the Axes
it drew on.  Error maps are max-pooled to the axes' pixel size first (see
:mod:`rlx_nb.maps`), so a single-element outlier never disappears.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from rlx_nb.elements import error_histogram, error_range, tolerance_curve
from rlx_nb.errors import InputError
from rlx_nb.maps import METRICS, block_argmax, error_map, make_fold, scatter_sample
from rlx_nb.safe import plot_text

if TYPE_CHECKING:
    from matplotlib.axes import Axes


METRIC_LABELS = {
    "abs": "|backend - oracle|",
    "rel": "|backend - oracle| / (|oracle| + 1e-6)",
    "ulp": "ULP distance",
    "budget": "|backend - fp64| / round-off budget",
}

COLORBAR_LABELS = {"abs": "abs error", "rel": "relative error", "ulp": "ULP distance", "budget": "x round-off budget"}
"""Short names for the colour bar (the title spells the metric out): a long one ran off a short figure."""

# The heatmap's own figure has fixed margins instead of a layout engine: constrained layout measures
# every label twice per draw, and the inline backend draws twice (once for bbox_inches="tight"), which
# made it about a third of a notebook heatmap's time.
HEATMAP_MARGINS = {"left": 0.13, "right": 0.92, "bottom": 0.12, "top": 0.92}
HISTOGRAM_MARGINS = {"left": 0.1, "right": 0.66, "bottom": 0.13, "top": 0.91}  # the legend to the right
# A colour bar spanning more decades than this shows no minor labels, so no minor ticks either:
# each tick is a few matplotlib objects, and a 6-decade bar had ~50 of them.
MINOR_TICK_DECADES = 2.0


def _pyplot():
    try:
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - depends on the environment
        raise InputError("plotting needs matplotlib: pip install 'rlx_nb[notebook]'") from None
    return plt


def _axes(ax: Axes | None, figsize: tuple[float, float] = (6.0, 4.5), margins: dict | None = None) -> Axes:
    # A new figure: constrained layout, or fixed ``margins`` (subplots_adjust's) and no layout engine.
    if ax is not None:
        return ax
    fig = _pyplot().figure(figsize=figsize, layout=None if margins else "constrained")
    if margins:
        fig.subplots_adjust(**margins)
    return fig.add_subplot()


def _pixel_budget(ax: Axes, max_pixels: int | None) -> int:
    # The axes' size in device pixels: finer data would be resampled away on screen.
    bbox = ax.get_window_extent()
    fit = int(max(16, min(bbox.width, bbox.height)))
    return max(1, min(max_pixels, fit) if max_pixels else fit)


EXACT_COLOUR = "#c8c8c8"
"""How an exact match (error 0) is drawn on the heatmaps."""


def _log_ticks(colorbar: Any, norm: Any) -> None:
    # Plain tick labels ("1e-07", "2.5e-07"), never mathtext (its parser costs ~0.02-0.1 s per label).  Over
    # more than MINOR_TICK_DECADES: labelled decades only.  Over less than one decade (errors of a few
    # ulps), a log locator's labels would all round to one value: a handful of ticks labelled to 3 digits.
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogFormatter, NullLocator

    decades = math.log10(norm.vmax / norm.vmin)
    axis = colorbar.ax.yaxis
    if decades < 1.0:
        axis.set_major_locator(FixedLocator(np.geomspace(norm.vmin, norm.vmax, 4)))
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.3g}" if 1e-3 <= v < 1e4 else f"{v:.2e}"))
        axis.set_minor_locator(NullLocator())
        return
    axis.set_major_formatter(LogFormatter(labelOnlyBase=True))
    axis.set_minor_formatter(LogFormatter(labelOnlyBase=False))
    if decades > MINOR_TICK_DECADES:
        colorbar.ax.minorticks_off()


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
    if metric not in METRICS:
        raise InputError(f"metric must be one of {', '.join(METRICS)}; got {metric!r}")
    import matplotlib
    from matplotlib.colors import LogNorm

    ax = _axes(ax, margins=HEATMAP_MARGINS)
    try:
        folded = make_fold(oracle.shape, fold, select)
        data, factors, folded = error_map(
            oracle,
            backend,
            reference,
            metric=metric,
            budget=budget,
            fold=folded,
            max_pixels=_pixel_budget(ax, max_pixels),
        )
    except ValueError as exc:
        raise InputError(str(exc)) from None
    finite = data[np.isfinite(data) & (data > 0)]
    if metric == "budget":
        vmax = max(10.0, float(finite.max()) if finite.size else 10.0)
        norm, cmap = LogNorm(1.0 / vmax, vmax), cmap or "coolwarm"
    else:
        vmax = float(finite.max()) if finite.size else 1.0
        vmin = max(vmax * 1e-6, float(finite.min()) if finite.size else vmax * 1e-6)
        norm, cmap = LogNorm(min(vmin, vmax / 2), vmax), cmap or "magma"
    # Exact agreement (an error of 0) has no place on a log scale: it is drawn in its own grey, below the
    # colour bar's range, so an output that matches bit for bit shows as grey, never as blank paper.
    colours = matplotlib.colormaps[cmap].with_extremes(under=EXACT_COLOUR, bad="white")
    shown = np.where(np.isinf(data), vmax, np.where(data > 0, data, norm.vmin * 1e-3))
    image = ax.imshow(np.ma.masked_invalid(shown), norm=norm, cmap=colours, interpolation="nearest", aspect="auto")
    image.rlx_pooled = data  # the exact pooled values, infinities included
    image.rlx_factors = factors
    image.rlx_fold = folded
    exact = float(np.mean(data == 0)) if data.size else 0.0
    colorbar = ax.figure.colorbar(image, ax=ax, extend="min" if exact else "neither")
    _log_ticks(colorbar, norm)
    colorbar.set_label(
        COLORBAR_LABELS[metric] + (f"  (grey: exact, {100 * exact:.3g}%)" if exact else ""), fontsize=9, labelpad=2
    )
    colorbar.ax.tick_params(labelsize=8)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rows and columns are whole
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(f"cols: {folded.side_label('cols')}" + (f", pooled x{factors[1]}" if factors[1] > 1 else ""))
    ax.set_ylabel(f"rows: {folded.side_label('rows')}" + (f", pooled x{factors[0]}" if factors[0] > 1 else ""))
    cell = folded.cell(worst) if worst is not None else None
    if mark_worst and data.size and np.nanmax(data) > 0:
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
        ax.rlx_worst_index = index
    ax.set_title(plot_text(title) if title else f"{METRIC_LABELS[metric]}  [{folded.describe()}]", fontsize=9)
    return ax


SUSPECT_COLOUR = "#b00020"
"""The one colour that means SUSPECT, on every figure."""
PALETTE = ["#4c72b0", "#55a868", "#8172b2", "#ccb974", "#64b5cd", "#dd8452", "#8c8c8c", "#937860"]
"""Colours for backends that are not SUSPECT (no red among them)."""
LINESTYLES = ["-", "--", ":", "-."]


def plot_histogram(
    pairs: Mapping[str, tuple[np.ndarray, np.ndarray]],
    *,
    metric: str = "abs",
    lines: Mapping[str, float] | None = None,
    scales: Mapping[str, float] | None = None,
    suspects: Sequence[str] = (),
    highlight: str | None = None,
    bins: int = 60,
    ax: Axes | None = None,
    title: str | None = None,
) -> Axes:
    """Log-binned histogram of element errors, one step line per backend, with tolerance/budget lines.

    ``pairs`` maps a backend name to ``(expected, backend)`` arrays of one output (the oracle, or the
    fp64 reference for ``metric="budget"``); ``scales`` multiplies each backend's errors (``1 / budget``
    for ``"budget"``); ``lines`` maps a name to an error value drawn as a dashed vertical line in that
    backend's colour (e.g. the largest error the budget allows).  ``metric`` is ``abs``, ``rel``,
    ``ulp`` or ``budget``.  SUSPECT backends (``suspects``) are drawn in :data:`SUSPECT_COLOUR`, the
    others in colours without red; ``highlight`` draws one backend thick and the others faint; a
    backend whose histogram repeats an earlier one's says so in the legend, which sits beside the axes.
    """
    if metric not in METRICS:
        raise InputError(f"the histogram's metric must be one of {', '.join(METRICS)}; got {metric!r}")
    if not pairs:
        raise InputError("plot_histogram needs at least one (oracle, backend) pair")
    scales = scales or {}
    kind = "abs" if metric == "budget" else metric
    ax = _axes(ax, figsize=(7.5, 4.2), margins=HISTOGRAM_MARGINS)
    hi, lo = 0.0, math.inf
    for name, (o, b) in pairs.items():
        lo_b, hi_b = error_range(o, b, metric=kind)
        hi, lo = max(hi, hi_b * scales.get(name, 1.0)), min(lo, lo_b * scales.get(name, 1.0))
    if hi == 0.0 or not math.isfinite(lo):
        hi, lo = 1.0, 1e-12
    lo = max(lo, hi * 1e-12)
    edges = np.logspace(math.log10(lo) - 0.01, math.log10(hi) + 0.01, bins + 1)
    colours, seen = {}, {}
    for k, (name, (o, b)) in enumerate(pairs.items()):
        counts, zeros, nonfinite = error_histogram(o, b, edges, metric=kind, scale=scales.get(name, 1.0))
        extra = [f"{zeros} exact" if zeros else "", f"{nonfinite} NaN/Inf" if nonfinite else ""]
        twin = seen.get(counts.tobytes())
        if twin is not None:
            extra.append(f"same as {twin}")
        seen.setdefault(counts.tobytes(), name)
        colour = SUSPECT_COLOUR if name in suspects else PALETTE[k % len(PALETTE)]
        faint = highlight is not None and name != highlight
        ax.stairs(
            counts,
            edges,
            label=plot_text(name) + (f" ({plot_text(', '.join(x for x in extra if x))})" if any(extra) else ""),
            linewidth=1.0 if faint else 2.2,
            alpha=0.45 if faint else 1.0,
            color=colour,
            linestyle="-" if twin is None else LINESTYLES[1 + k % (len(LINESTYLES) - 1)],  # a twin shows beside it
        )
        colours[name] = colour
    drawn: dict[float, list[str]] = {}
    for name, value in (lines or {}).items():
        if value and math.isfinite(value) and value > 0 and (highlight is None or name == highlight):
            drawn.setdefault(float(value), []).append(name)
    for value, names in drawn.items():
        # One line per distinct limit; shared limits (same output, same format) are drawn once.
        colour = colours.get(names[0], "black") if len(names) == 1 else "black"
        who = f"{plot_text(names[0])} limit" if len(names) == 1 else "limit"
        ax.axvline(value, linestyle="--", color=colour, linewidth=1.2, label=f"{who} {value:.3g}")
    ax.set_xscale("log")
    ax.set_yscale("symlog", linthresh=1)
    _plain_log_ticks(ax, edges)
    ax.set_xlabel(METRIC_LABELS[metric])
    ax.set_ylabel("elements")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, frameon=False)
    ax.set_title(plot_text(title or "error histogram"), fontsize=9)
    return ax


def _plain_log_ticks(ax: Axes, edges: np.ndarray) -> None:
    # Plain labels ("1e-07", "100") instead of mathtext, and no minor ticks over many decades: the
    # tick machinery was most of an explorer update's time.
    from matplotlib.ticker import FuncFormatter, LogFormatter, LogLocator, NullLocator

    ax.xaxis.set_major_locator(LogLocator(numticks=6))  # a label every few decades, never crowded
    ax.xaxis.set_major_formatter(LogFormatter(labelOnlyBase=True))
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    if math.log10(edges[-1] / edges[0]) > MINOR_TICK_DECADES:
        ax.xaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_locator(NullLocator())


def plot_scatter(
    oracle: np.ndarray,
    backend: np.ndarray,
    *,
    tol_rel: float = 2e-3,
    ax: Axes | None = None,
    max_points: int = 20_000,
    title: str | None = None,
) -> Axes:
    """Absolute error against the oracle's magnitude (log-log), with the seed's ``max_rel`` boundary.

    Errors near zero sit at the left: above the dashed line they fail a
    relative tolerance although they are tiny in absolute terms.  A sample of
    ``max_points`` elements plus the worst 200 is drawn.
    """
    ax = _axes(ax)
    mag, err = scatter_sample(oracle, backend, max_points=max_points)
    keep = err > 0
    floor = float(mag[mag > 0].min()) if (mag > 0).any() else 1e-12
    ax.scatter(np.maximum(mag[keep], floor), err[keep], s=4, alpha=0.5, label=f"{int(keep.sum())} differing elements")
    xs = np.logspace(math.log10(floor), math.log10(max(float(mag.max()), floor * 10)), 50)
    ax.plot(xs, tol_rel * (xs + 1e-6), "--", color="crimson", label=f"max_rel = {tol_rel:g}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("|oracle|")
    ax.set_ylabel("|backend - oracle|")
    ax.legend(fontsize=8)
    ax.set_title(plot_text(title or "error vs magnitude"), fontsize=9)
    return ax


def plot_tolerance_curve(
    pairs: Mapping[str, tuple[np.ndarray, np.ndarray]],
    *,
    rtols: np.ndarray | None = None,
    mark: float | None = 2e-3,
    ax: Axes | None = None,
    title: str | None = None,
) -> Axes:
    """Fraction of elements failing a relative tolerance, as the tolerance varies, per backend."""
    ax = _axes(ax)
    rtols = np.logspace(-9, 1, 81) if rtols is None else np.asarray(rtols)
    for name, (o, b) in pairs.items():
        ax.plot(rtols, tolerance_curve(o, b, rtols), label=plot_text(name))
    if mark:
        ax.axvline(mark, linestyle="--", color="grey", label=f"tol_rel {mark:g}")
    ax.set_xscale("log")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("relative tolerance")
    ax.set_ylabel("fraction of elements failing")
    ax.legend(fontsize=8)
    ax.set_title(plot_text(title or "tolerance curve"), fontsize=9)
    return ax


def plot_localization(frame, *, ax: Axes | None = None, title: str | None = None) -> Axes:
    """Local (bars) and propagated (line) error per module in execution order, in multiples of the budget.

    ``frame`` is :attr:`rlx_nb.localize.Localization.frame`.  The y axis is
    the verdict's ``excess`` (1 is the limit between round-off and SUSPECT):
    a module whose own bar crosses 1 introduces the error; one whose line
    crosses 1 but whose bar does not only carries it along.
    """
    ax = _axes(ax, figsize=(max(6.0, 0.35 * len(frame) + 2), 4.5))
    x = np.arange(len(frame))
    local = frame["local_excess"].to_numpy(dtype=float)
    colors = ["#b00020" if v == "SUSPECT" else "#4c72b0" for v in frame["verdict"]]
    floor = 1e-3
    bars = ax.bar(x, np.where(np.isfinite(local) & (local > floor), local, floor), color=colors, label="local")
    bars.set_label("local (module alone, oracle's inputs)")
    prop = frame["propagated_excess"].to_numpy(dtype=float)
    if np.isfinite(prop).any():
        ax.plot(
            x,
            np.where(np.isfinite(prop), np.maximum(prop, floor), np.nan),
            "o-",
            color="black",
            label="propagated (full run)",
        )
    ax.axhline(1.0, linestyle="--", color="grey", label="budget limit")
    ax.set_yscale("log")
    ax.set_xticks(x, [plot_text(n) for n in frame["name"]], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("x round-off budget (excess)")
    ax.legend(fontsize=8)
    ax.set_title(plot_text(title or "where the error is born"), fontsize=9)
    return ax


def plot_effective_bits(
    bits: Mapping[str, float],
    *,
    verdicts: Mapping[str, str] | None = None,
    ax: Axes | None = None,
    title: str | None = None,
) -> Axes:
    """Bars of effective mantissa bits per backend (or setting), with the standard formats marked.

    ``bits`` maps a name to its effective bits (e.g. ``OutputRecord.effective_bits``, or the
    ``effective_bits`` column of :func:`rlx_nb.precision_sweep`); ``verdicts`` colours each bar by its
    verdict (red only for SUSPECT).
    """
    ax = _axes(ax, figsize=(max(6.0, 0.8 * len(bits) + 2.5), 4.2))
    names = list(bits)
    values = [float(bits[n]) for n in names]
    verdicts = verdicts or {}
    colours = [
        SUSPECT_COLOUR if verdicts.get(n) == "SUSPECT" else "#8c8c8c" if verdicts.get(n) == "error" else PALETTE[0]
        for n in names
    ]
    ax.bar(np.arange(len(names)), values, color=colours)
    for level, label in ((24, "fp32 (24)"), (11, "tf32 / fp16 (11)"), (8, "bf16 (8)")):
        ax.axhline(level, linestyle="--", color="grey", linewidth=1)
        # Labelled inside the axes, at the left, just above the line: nothing cut off at the edge.
        ax.text(
            -0.45,
            level + 0.3,
            label,
            fontsize=8,
            color="dimgrey",
            va="bottom",
            ha="left",
            zorder=3,
            bbox={"fc": "white", "ec": "none", "alpha": 0.85, "pad": 1},
        )
    ax.set_xticks(np.arange(len(names)), [plot_text(n) for n in names], rotation=30, ha="right", fontsize=8)
    ax.set_xlim(-0.6, len(names) - 0.4)
    ax.set_ylim(0, 26.5)
    ax.set_ylabel("effective mantissa bits")
    ax.set_title(plot_text(title or "effective precision"), fontsize=9)
    return ax


__all__ = [
    "plot_effective_bits",
    "plot_heatmap",
    "plot_histogram",
    "plot_localization",
    "plot_scatter",
    "plot_tolerance_curve",
]
