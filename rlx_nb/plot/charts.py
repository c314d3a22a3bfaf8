"""Matplotlib views: arrays or a report in, an ``Axes`` out.  Never ``plt.show()``.

The heatmap is :mod:`rlx_nb.plot.heatmap` (re-exported here); what every figure shares, :mod:`rlx_nb.plot.style`.

Every function takes ``ax=None`` (a new figure is made) and returns the Axes
it drew on.  Error maps are max-pooled to the axes' pixel size first (see
:mod:`rlx_nb.plot.fold`), so a single-element outlier never disappears.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from rlx_nb._support.safe import plot_text
from rlx_nb.errors import InputError
from rlx_nb.numerics.elements import error_histogram, error_range, tolerance_curve
from rlx_nb.plot.fold import METRICS, scatter_sample
from rlx_nb.plot.style import (
    HISTOGRAM_MARGINS,
    LINESTYLES,
    METRIC_LABELS,
    MINOR_TICK_DECADES,
    PALETTE,
    SUSPECT_COLOUR,
    new_axes,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes


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
    kind = "abs" if metric in ("budget", "line", "quanta") else metric
    ax = new_axes(ax, figsize=(7.5, 4.2), margins=HISTOGRAM_MARGINS)
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
        if metric == "line":
            colour, who = "black", "SUSPECT line"
        label = who if metric == "line" else f"{who} {value:.3g}"
        ax.axvline(value, linestyle="--", color=colour, linewidth=1.2, label=label)
    ax.set_xscale("log")
    ax.set_yscale("symlog", linthresh=1)
    _plainlog_ticks(ax, edges)
    ax.set_xlabel(METRIC_LABELS[metric])
    ax.set_ylabel("elements")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, frameon=False)
    ax.set_title(plot_text(title or "error histogram"), fontsize=9)
    return ax


def _plainlog_ticks(ax: Axes, edges: np.ndarray) -> None:
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
    ax = new_axes(ax)
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
    suspects: Sequence[str] = (),
    ax: Axes | None = None,
    title: str | None = None,
) -> Axes:
    """Fraction of elements failing a relative tolerance, as the tolerance varies, per backend (``suspects`` in
    :data:`SUSPECT_COLOUR`, the others in colours without red)."""
    ax = new_axes(ax)
    rtols = np.logspace(-9, 1, 81) if rtols is None else np.asarray(rtols)
    for k, (name, (o, b)) in enumerate(pairs.items()):
        colour = SUSPECT_COLOUR if name in suspects else PALETTE[k % len(PALETTE)]
        ax.plot(rtols, tolerance_curve(o, b, rtols), label=plot_text(name), color=colour)
    if mark:
        ax.axvline(mark, linestyle="--", color="grey", label=f"tol_rel {mark:g}")
    ax.set_xscale("log")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("relative tolerance")
    ax.set_ylabel("fraction of elements failing")
    ax.legend(fontsize=8)
    ax.set_title(plot_text(title or "tolerance curve"), fontsize=9)
    return ax


ROW_INCHES = 0.24
"""Height of one module's row in :func:`plot_localization` (its name, 7-point, fits with room)."""


def localization_figsize(rows: int) -> tuple[float, float]:
    """The figure :func:`plot_localization` needs for ``rows`` modules and ops: one readable row each."""
    return 8.5, max(3.0, ROW_INCHES * rows + 1.3)


def plot_localization(
    frame,
    *,
    ax: Axes | None = None,
    title: str | None = None,
    culprit: str | None = None,
    labels: tuple[str, str] = ("module alone", "in the full run (propagated)"),
) -> Axes:
    """Local (bars) and propagated (dots) error per module in execution order, on the verdict's one scale.

    ``frame`` is :attr:`rlx_nb.localization.Localization.frame`; one row per module and op, top to bottom in execution
    order, the names beside their bars.  The x axis is x of the SUSPECT line (1 is the line between round-off and
    SUSPECT): a module whose own bar crosses 1 introduces the error; one whose dot crosses 1 but whose bar does not
    only carries it along.  ``culprit`` (:attr:`~rlx_nb.localization.Localization.culprit`) is marked.  ``labels``
    name the bars and the dots in the legend (a diff's: alone fed the old inputs, in the whole run).
    """
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    ax = new_axes(ax, figsize=localization_figsize(len(frame)))
    y = np.arange(len(frame))
    local = frame["local_line"].to_numpy(dtype=float)
    suspect = (frame["verdict"] == "SUSPECT").to_numpy()
    colours = [SUSPECT_COLOUR if s else PALETTE[0] for s in suspect]
    floor = 1e-3
    # (a row not checked alone -- a diff's module its parent's descent never entered, a full-run search -- has no bar)
    ax.barh(y, np.where(np.isfinite(local), np.maximum(local, floor), np.nan), color=colours, height=0.7)
    prop = frame["propagated_line"].to_numpy(dtype=float)
    handles = [Patch(color=PALETTE[0], label=f"{labels[0]}: round-off"), Patch(color=SUSPECT_COLOUR,
               label=f"{labels[0]}: SUSPECT")]  # fmt: skip
    if np.isfinite(prop).any():
        ax.plot(np.where(np.isfinite(prop), np.maximum(prop, floor), np.nan), y, "o", color="black", markersize=4)
        handles.append(Line2D([], [], marker="o", color="black", ls="", label=labels[1]))
    ax.axvline(1.0, linestyle="--", color="grey")
    handles.append(Line2D([], [], ls="--", color="grey", label="SUSPECT line"))
    ax.set_xscale("log")
    ax.set_yticks(y, [plot_text(n) for n in frame["name"]], fontsize=7)
    ax.set_ylim(len(frame) - 0.5, -0.5)  # execution order, top to bottom
    names = frame["name"].tolist()
    if culprit is not None and culprit in names:
        k = names.index(culprit)
        ax.axhspan(k - 0.5, k + 0.5, color="cyan", alpha=0.25, zorder=0)
        ax.get_yticklabels()[k].set_fontweight("bold")
        handles.append(Patch(color="cyan", alpha=0.25, label=plot_text(f"culprit: {culprit}")))
    ax.set_xlabel("x of the SUSPECT line")
    # Beside the axes, never over a bar.
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0,
              frameon=False)  # fmt: skip
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
    ax = new_axes(ax, figsize=(max(6.0, 0.8 * len(bits) + 2.5), 4.2))
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


__all__ = ["plot_effective_bits", "plot_histogram", "plot_localization", "plot_scatter", "plot_tolerance_curve"]


__all__ = [
    "localization_figsize", "plot_effective_bits", "plot_histogram", "plot_localization", "plot_scatter",
    "plot_tolerance_curve",
]  # fmt: skip
