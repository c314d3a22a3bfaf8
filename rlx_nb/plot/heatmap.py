"""The per-element error heatmap: any output folded to 2-D, max-pooled to the axes' pixels, the worst marked.

:func:`plot_heatmap` returns the ``Axes``; :func:`heatmap` the :class:`Heatmap` it drew (its pooled values,
folding and marked element), which the explorer reads back for clicks and rings.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from rlx_nb._support.safe import plot_text
from rlx_nb.errors import InputError
from rlx_nb.numerics.pairs import same_bits
from rlx_nb.plot.fold import METRICS, block_argmax, error_map, make_fold
from rlx_nb.plot.style import (
    COLORBAR_LABELS,
    EXACT_COLOUR,
    HEATMAP_MARGINS,
    METRIC_LABELS,
    SUSPECT_COLOUR,
    inside_annotation,
    log_ticks,
    new_axes,
    pixel_budget,
)

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
    profiles: bool = True
    """Each row's and column's largest error beside the map (a bad row or column is a spike there)."""
    band: tuple[tuple[int, ...], tuple[int, ...], str] | None = None
    """``(axes, indices, label)``: a slice of the output to outline whole (``((2,), (3,))``: position 3 of axis 2),
    its axes on one side of the map (the rows, or the columns for the last axis alone) so it is one band, pooled
    with no neighbour along that side."""


@dataclasses.dataclass(frozen=True)
class Heatmap:
    """A drawn heatmap and what it shows, for code that reads it back (the explorer: a click on a pooled cell,
    a ring on a picked element).  ``pooled`` holds the exact pooled values (infinities included),
    ``factors`` the pooling along rows and columns, ``fold`` the folding of the output's axes
    (:class:`rlx_nb.plot.fold.Fold`), ``worst`` the index of the element marked worst (None when none is)."""

    ax: Axes
    pooled: np.ndarray
    factors: tuple[int, int]
    fold: Any
    worst: tuple[int, ...] | None

    def __repr__(self) -> str:  # (not the pooled array's thousands of numbers at the end of a notebook cell)
        return f"<Heatmap {self.pooled.shape[0]}x{self.pooled.shape[1]} pooled x{self.factors}, worst {self.worst}>"

    def _ipython_display_(self) -> None:
        """Nothing: its figure shows itself (:func:`rlx_nb.plot.style.quiet`)."""


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
        The two outputs (same shape, any rank; see :mod:`rlx_nb.plot.fold` for folding).
    reference : numpy.ndarray, optional
        The fp64 reference; needed for ``metric="budget"``.
    metric : {"abs", "rel", "ulp", "budget"}
        ``budget`` divides the backend's error against fp64 by the output's
        round-off budget, so 1 is the oracle's own round-off and red stands out.
    budget : float, optional
        The output's RMSE budget (``OutputRecord.budget_rmse``) for ``metric="budget"``.
    fold, select
        The folding rule for N-D outputs (:func:`rlx_nb.plot.fold.make_fold`).
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
    fold = view.fold
    if view.band is not None and fold is None and not view.select and oracle.ndim >= 2:
        axes, others = view.band[0], tuple(a for a in range(oracle.ndim) if a not in view.band[0])
        fold = (others, axes) if axes == (oracle.ndim - 1,) else (axes, others)
    try:
        folded = make_fold(oracle.shape, fold, view.select)
        data, factors, folded = error_map(
            oracle,
            backend,
            reference,
            metric=metric,
            budget=budget,
            fold=folded,
            max_pixels=pixel_budget(ax, view.max_pixels) // MIN_CELL_PX,
        )
    except ValueError as exc:
        raise InputError(str(exc)) from None
    finite = data[np.isfinite(data) & (data > 0)]
    centred = metric in ("budget", "line", "quanta")  # (one quantum: what a correct int8 kernel may move an element)
    if centred:  # 1 (the oracle's round-off, or the SUSPECT line) in the middle of the colours, whatever the range
        vmax = max(10.0, float(finite.max()) if finite.size else 10.0)
        vmin = min(0.1, max(float(finite.min()) if finite.size else 0.1, vmax * 1e-9))
        norm, cmap = CentredLogNorm(vmin, vmax), view.cmap or "coolwarm"
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
    heading = _fit(plot_text(title) if title else f"{METRIC_LABELS[metric]}  [{folded.describe()}]", ax,
                   profiles=view.profiles)  # fmt: skip
    _room_for(heading, ax)
    top, side, cax = _margins(ax, view.profiles)
    colorbar = ax.figure.colorbar(image, cax=cax, extend="min" if exact else "neither")
    log_ticks(colorbar, norm)
    colorbar.set_label(
        COLORBAR_LABELS[metric] + (f"  (grey: exact, {100 * exact:.3g}%)" if exact else ""), fontsize=9, labelpad=2
    )
    colorbar.ax.tick_params(labelsize=8)
    from matplotlib.ticker import FixedLocator, FuncFormatter, MaxNLocator

    for axis, factor, n in ((ax.yaxis, factors[0], data.shape[0]), (ax.xaxis, factors[1], data.shape[1])):
        # Rows and columns are whole; one row (a batch of one's logits) is row 0, not -0.5 .. 0.5.  Columns get as
        # many ticks as their widest label leaves room for (a vocabulary's 50257 columns: labels ran together).
        bins = _tick_bins(ax, len(str(n * factor))) if axis is ax.xaxis else "auto"
        axis.set_major_locator(FixedLocator([0]) if n == 1 else MaxNLocator(nbins=bins, integer=True))
        if factor > 1:  # a pooled cell's tick reads the first element it holds: the index a user looks up
            axis.set_major_formatter(FuncFormatter(lambda v, _, f=factor: f"{round(v) * f:d}"))
    ax.set_xlabel(f"cols: {folded.side_label('cols')}" + (f", pooled x{factors[1]}" if factors[1] > 1 else ""))
    ax.set_ylabel(f"rows: {folded.side_label('rows')}" + (f", pooled x{factors[0]}" if factors[0] > 1 else ""))
    standout = _standouts(data, 1.0 if metric == "line" else None)
    if top is not None:
        _profiles(top, side, data, norm, standout, line=1.0 if metric == "line" else None)
    band = _band_cell(folded, factors, view.band) if view.band is not None and oracle.ndim >= 2 else None
    if band is not None:  # (its own frame, not the standouts' dashed one too)
        standout = {**standout, band[0]: [k for k in standout[band[0]] if k != band[1]]}
    _outline(ax, data.shape, standout)
    worst, index = view.worst, None
    cell = folded.cell(worst) if worst is not None else None
    # (a backend that gives the oracle's output bit for bit has no worst element, whatever fp64 says of both)
    differs = cell is not None or not same_bits(np.asarray(oracle), np.asarray(backend))
    if view.mark_worst and data.size and np.nanmax(data) > 0 and differs:
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
        # Keep the label inside the axes: below/left of the marker when it sits near the top/right edge.  Where a
        # band is outlined, the band's one label names the worst element too (two labels at one row collide).
        if band is None:
            dy = 14 if by < data.shape[0] * 0.15 else -14
            dx, ha = (-8, "right") if bx > data.shape[1] * 0.6 else (8, "left")
            inside_annotation(
                ax,
                f"worst {index}",
                (bx, by),
                xytext=(dx, -dy),
                color="cyan",
                fontsize=9,
                fontweight="bold",
                ha=ha,
                va="center",
                bbox={"boxstyle": "round", "fc": "black", "alpha": 0.6, "lw": 0},
            )
    if band is not None:
        words = view.band[2] + (f"; worst {index}" if index is not None else "")
        _band(ax, data.shape, band, words, label_right=index is not None and bx <= data.shape[1] / 2)
    where = top if top is not None else ax
    where.set_title(heading, fontsize=9)
    return Heatmap(ax, data, factors, folded, index)


class CentredLogNorm:
    """A log colour scale with 1 at its middle colour: below 1 spread over the lower half, above 1 over the upper
    half, however many decades each side spans (round-off far below the line stays blue, not the paper's grey)."""

    def __new__(cls, vmin: float, vmax: float):
        from matplotlib.colors import FuncNorm

        lo, hi = math.log10(vmin), math.log10(vmax)

        def forward(v: Any) -> Any:
            with np.errstate(divide="ignore", invalid="ignore"):
                x = np.log10(np.asarray(v, dtype=float))
            return np.where(x <= 0, 0.5 * (x - lo) / max(-lo, 1e-12), 0.5 + 0.5 * x / max(hi, 1e-12))

        def inverse(u: Any) -> Any:
            u = np.asarray(u, dtype=float)
            return 10.0 ** np.where(u <= 0.5, lo + (u / 0.5) * (-lo), (u - 0.5) / 0.5 * hi)

        # FuncNorm applies ``forward`` to vmin/vmax too: on this scale they are 0 and 1.
        return FuncNorm((forward, inverse), vmin=vmin, vmax=vmax)


MIN_CELL_PX = 5
"""A pooled cell is drawn at least this many screen pixels wide and tall: one bad row, column or element of an
output of any size is a band or a block a reader sees, never a one-pixel line under the frame."""

STANDOUT = 10.0
"""A pooled row or column whose largest error is this many times the median row's (column's) largest, and past
the SUSPECT line where the metric has one, stands out: it is outlined on the map and marked on its profile."""


def _margins(ax: Axes, profiles: bool) -> tuple[Any, Any, Any]:
    # (column-profile axes above the map, row-profile axes beside it, colour bar), carved from the map's axes.
    from mpl_toolkits.axes_grid1 import make_axes_locatable

    divider = make_axes_locatable(ax)
    top = side = None
    if profiles:
        top = divider.append_axes("top", size="13%", pad=0.08, sharex=ax)
        side = divider.append_axes("right", size="13%", pad=0.08, sharey=ax)
    cax = divider.append_axes("right", size="4%", pad=0.1 if profiles else 0.15)
    return top, side, cax


def _standouts(data: np.ndarray, line: float | None) -> dict[str, list[int]]:
    # Pooled rows and columns whose largest error stands far above the typical one's (and past the line).
    out: dict[str, list[int]] = {"rows": [], "cols": []}
    if data.size < 4 or not np.isfinite(data).any():
        return out
    with np.errstate(invalid="ignore"):
        for side, profile in (("rows", np.nanmax(data, axis=1)), ("cols", np.nanmax(data, axis=0))):
            if profile.size < 3:
                continue
            typical = float(np.nanmedian(np.where(np.isinf(profile), np.nan, profile)))
            floor = max(typical * STANDOUT, line or 0.0)
            hits = np.flatnonzero(profile > floor) if floor > 0 else np.array([], int)
            if 0 < hits.size <= max(3, profile.size // 20):  # a few stand out; not everything
                out[side] = hits.tolist()
    return out


def _profiles(top: Axes, side: Axes, data: np.ndarray, norm: Any, standout: dict, *, line: float | None) -> None:
    # Each pooled column's (top) and row's (side) largest error on the colour bar's log scale: one bad row or
    # column is a spike beside the map, whatever the output's size.
    with np.errstate(invalid="ignore"):
        cols, rows = np.nanmax(data, axis=0), np.nanmax(data, axis=1)
    low = norm.vmin
    cols, rows = (
        np.clip(np.nan_to_num(cols, posinf=norm.vmax), low, None),
        np.clip(np.nan_to_num(rows, posinf=norm.vmax), low, None),
    )
    top.step(np.arange(cols.size), cols, where="mid", color="#4a4a4a", linewidth=1.0)
    side.step(rows, np.arange(rows.size), where="mid", color="#4a4a4a", linewidth=1.0)
    top.set_yscale("log")
    side.set_xscale("log")
    top.set_ylim(low, norm.vmax * 1.5)
    side.set_xlim(low, norm.vmax * 1.5)
    for j in standout["cols"]:
        top.plot([j], [cols[j]], "v", color=SUSPECT_COLOUR if line else "cyan", markersize=6)
    for i in standout["rows"]:
        side.plot([rows[i]], [i], "<", color=SUSPECT_COLOUR if line else "cyan", markersize=6)
    if line is not None:
        top.axhline(line, linestyle="--", color="black", linewidth=0.8)
        side.axvline(line, linestyle="--", color="black", linewidth=0.8)
    for a in (top, side):
        a.tick_params(labelbottom=False, labelleft=False, labelsize=7, length=2)
        a.minorticks_off()
        for spine in a.spines.values():
            spine.set_linewidth(0.5)
    top.set_yticks([])
    side.set_xticks([])
    top.set_ylabel("max", fontsize=7, rotation=0, ha="right", va="center")
    side.set_xlabel("max", fontsize=7)


def _outline(ax: Axes, shape: tuple[int, int], standout: dict) -> None:
    # The rows and columns that stand out, outlined across the map (a frame a few pixels wide around a band).
    from matplotlib.patches import Rectangle

    pad = 1.0  # of a cell: the frame sits outside the band, which keeps its colour
    limits = ax.get_xlim(), ax.get_ylim()
    for i in standout["rows"]:
        lo, hi = _within(i, pad, shape[0])
        ax.add_patch(Rectangle((-0.5, lo), shape[1], hi - lo, fill=False, edgecolor="cyan",
                               linewidth=1.2, linestyle="--", clip_on=False))  # fmt: skip
    for j in standout["cols"]:
        lo, hi = _within(j, pad, shape[1])
        ax.add_patch(Rectangle((lo, -0.5), hi - lo, shape[0], fill=False, edgecolor="cyan",
                               linewidth=1.2, linestyle="--", clip_on=False))  # fmt: skip
    ax.set_xlim(*limits[0])  # the frames reach past the map's edge; the view stays on the map
    ax.set_ylim(*limits[1])


def _within(k: int, pad: float, n: int) -> tuple[float, float]:
    # A frame's two sides around cell ``k`` (``pad`` cells out), kept on the map's ``n`` cells: a frame past the map's
    # edge ran over the profile beside it and read as a stray line (a 16 x 10 output's first row).
    return max(k - 0.5 - pad, -0.5), min(k + 0.5 + pad, n - 0.5)


def _band_cell(folded: Any, factors: tuple[int, int], band: tuple) -> tuple[str, int] | None:
    # ("rows" or "cols", pooled index) of the band's slice on the map, or None where the fold has no such side.
    axes, indices, _ = band
    if folded.wrap:
        return None
    shape = folded.view_shape
    if folded.rows == axes:
        return "rows", int(np.ravel_multi_index(indices, [shape[a] for a in axes])) // factors[0]
    if folded.cols == axes:
        return "cols", int(np.ravel_multi_index(indices, [shape[a] for a in axes])) // factors[1]
    return None


def _band(ax: Axes, shape: tuple[int, int], cell: tuple[str, int], label: str, *, label_right: bool) -> None:
    # One slice of the output outlined whole: a solid frame just outside its row (or column) of the map, and its
    # words at one end of it, the other side from the worst element's label.
    from matplotlib.patches import Rectangle

    side, k = cell
    limits = ax.get_xlim(), ax.get_ylim()
    kw = {"fill": False, "edgecolor": "cyan", "linewidth": 2.0, "clip_on": False}
    pad = 0.6  # of a cell: the frame sits outside the slice, which keeps its colour
    if side == "cols":
        lo, hi = _within(k, pad, shape[1])
        ax.add_patch(Rectangle((lo, -0.5), hi - lo, shape[0], **kw))
        # (inside the map, just above its bottom edge, beside the column: never over the tick labels)
        ha = "left" if k < shape[1] * 0.3 else "right" if k > shape[1] * 0.7 else "center"
        x = k + 0.5 + pad if ha == "left" else k - 0.5 - pad if ha == "right" else k
        at, offset, va = (x, shape[0] - 0.5), ({"left": 4, "right": -4, "center": 0}[ha], 4), "bottom"
    else:
        lo, hi = _within(k, pad, shape[0])
        ax.add_patch(Rectangle((-0.5, lo), shape[1], hi - lo, **kw))
        below = k < shape[0] * 0.7
        x, ha = (shape[1] - 0.5, "right") if label_right else (-0.5, "left")
        at, offset, va = (
            (x, k + 0.5 + pad if below else k - 0.5 - pad),
            (-4 if label_right else 4, -2 if below else 2),
            "top" if below else "bottom",
        )
    inside_annotation(ax, plot_text(label), at, xytext=offset, color="cyan", fontsize=8, fontweight="bold", ha=ha,
                      va=va, multialignment="left",
                      bbox={"boxstyle": "round", "fc": "black", "alpha": 0.65, "lw": 0})  # fmt: skip
    ax.set_xlim(*limits[0])
    ax.set_ylim(*limits[1])


def _fit(text: str, ax: Axes, *, profiles: bool = False) -> str:
    # A title that fits inside the figure, centred over the map (about 7 pixels per character at size 9): on one
    # line, else on two broken between its parts (``backend · output · metric``) or words, else the second line
    # shortened after a whole word.  Never cut inside a word (``|back… fp64|``), but a word longer than a line.
    # The map's axes lose ~22% of their width to the row profile and the colour bar.
    width = ax.figure.get_figwidth() * ax.figure.dpi
    pos = ax.get_position()
    left, right = pos.x0 * width, pos.x1 * width
    if profiles:
        right = left + (right - left) * 0.78
    centre = (left + right) / 2
    room = max(24, int((2 * min(centre, width - centre) - 8) / 7))
    return fit_lines(text, room)


def _tick_bins(ax: Axes, chars: int) -> int:
    # How many tick intervals the map's width holds for labels of ``chars`` digits (size-10 digits ~6.5 px each,
    # 1.5 labels' room apart), at least 2.  (The row profile and colour bar carved out later take ~22% of it.)
    width = ax.get_position().width * ax.figure.get_figwidth() * ax.figure.dpi * 0.78
    return max(2, min(9, int(width / (1.5 * (chars * 6.5 + 6)))))


def _room_for(heading: str, ax: Axes) -> None:
    # A title of more than one line: the map's axes lowered by each further line (9 pt text, 1.2 line spacing),
    # so that it stays inside the figure.
    extra = heading.count("\n") * 9 * 1.2 / 72 / ax.figure.get_figheight()
    if extra:
        pos = ax.get_position()
        ax.set_position([pos.x0, pos.y0, pos.width, pos.height - extra])


def fit_lines(text: str, room: int, lines: int = 2) -> str:
    """``text`` in at most ``lines`` lines of ``room`` characters, broken between its `` · `` parts where it can,
    else between words; what does not fit ends the last line after a whole word, with an ellipsis.

    >>> print(fit_lines("executorch-xnnpack · logits · |backend - fp64|, x of the SUSPECT line", 40))
    executorch-xnnpack · logits ·
    |backend - fp64|, x of the SUSPECT line
    >>> print(fit_lines("a b c d e f g h i j k l m n o p", 8, lines=2))
    a b c d
    e f g …
    """
    if len(text) <= room:
        return text
    words = [w for part in text.split(" · ") for w in [*part.split(" "), "·"]][:-1]
    out: list[str] = [""]
    for k, word in enumerate(words):
        joined = f"{out[-1]} {word}" if out[-1] else word
        at_part = word != "·" and k > 0 and words[k - 1] == "·"  # (a part's first word: a good place to break)
        if len(joined) <= room and not (at_part and len(out[-1]) > room // 2 and _part_fits(words, k, room)):
            out[-1] = joined
        else:
            out.append(word)
    if len(out) > lines:
        rest = " ".join(out[lines - 1 :])
        out = [*out[: lines - 1], _shorten(rest, room)]
    return "\n".join(line if len(line) <= room else line[: room - 1] + "…" for line in out)


def _part_fits(words: list[str], k: int, room: int) -> bool:
    # Whether the part that starts at words[k] fits on a line of its own.
    end = next((i for i in range(k, len(words)) if words[i] == "·"), len(words))
    return len(" ".join(words[k:end])) <= room


def _shorten(text: str, room: int) -> str:
    # ``text`` cut after a whole word to fit ``room`` with " …".
    if len(text) <= room:
        return text
    cut = text[: room - 2].rsplit(" ", 1)[0] if " " in text[: room - 2] else text[: room - 2]
    return cut.rstrip(" ·") + " …"
