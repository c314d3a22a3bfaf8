"""What every figure of rlx_nb shares: metric labels, margins, colours, a new axes, log colour-bar ticks."""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

import numpy as np

from rlx_nb.errors import InputError

if TYPE_CHECKING:
    from matplotlib.axes import Axes


METRIC_LABELS = {
    "abs": "|backend - oracle|",
    "rel": "|backend - oracle| / (|oracle| + 1e-6)",
    "ulp": "ULP distance",
    "budget": "|backend - fp64| / round-off budget",
    "line": "|backend - fp64|, x of the SUSPECT line",
    "quanta": "|backend - Q/DQ simulation|, in quanta of the output",
}

COLORBAR_LABELS = {
    "abs": "abs error",
    "rel": "relative error",
    "ulp": "ULP distance",
    "budget": "x round-off budget",
    "line": "x of the SUSPECT line",
    "quanta": "quanta",
}
"""Short names for the colour bar (the title spells the metric out): a long one ran off a short figure."""

# The heatmap's own figure has fixed margins instead of a layout engine: constrained layout measures
# every label twice per draw, and the inline backend draws twice (once for bbox_inches="tight"), which
# made it about a third of a notebook heatmap's time.
HEATMAP_MARGINS = {"left": 0.13, "right": 0.85, "bottom": 0.12, "top": 0.92}
HISTOGRAM_MARGINS = {"left": 0.12, "right": 0.66, "bottom": 0.13, "top": 0.91}  # the legend to the right
# A colour bar spanning more decades than this shows no minor labels, so no minor ticks either:
# each tick is a few matplotlib objects, and a 6-decade bar had ~50 of them.
MINOR_TICK_DECADES = 2.0


def pyplot():
    try:
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - depends on the environment
        raise InputError("plotting needs matplotlib: pip install 'rlx_nb[notebook]'") from None
    return plt


def new_axes(ax: Axes | None, figsize: tuple[float, float] = (6.0, 4.5), margins: dict | None = None) -> Axes:
    # A new figure: constrained layout, or fixed ``margins`` (subplots_adjust's) and no layout engine.  Either way
    # the axes a plot returns show nothing of their own in a notebook (quiet).
    if ax is not None:
        return quiet(ax)
    fig = pyplot().figure(figsize=figsize, layout=None if margins else "constrained")
    if margins:
        fig.subplots_adjust(**margins)
    return quiet(fig.add_subplot())


def _shown_by_its_figure() -> None:
    """Nothing: a notebook shows the figure itself (the inline backend at the cell's end, ipympl's canvas)."""


def quiet(ax: Axes) -> Axes:
    """``ax`` as a plot function returns it: a notebook cell ending in ``report.plot.heatmap()`` shows the figure, not a
    raw ``<Axes: title={...}>`` line above it (``_ipython_display_``, which IPython asks before any repr)."""
    ax._ipython_display_ = _shown_by_its_figure
    return ax


def pixel_budget(ax: Axes, max_pixels: int | None) -> int:
    # The axes' size in device pixels: finer data would be resampled away on screen.
    bbox = ax.get_window_extent()
    fit = int(max(16, min(bbox.width, bbox.height)))
    return max(1, min(max_pixels, fit) if max_pixels else fit)


EXACT_COLOUR = "#c8c8c8"
"""How an exact match (error 0) is drawn on the heatmaps."""


def log_ticks(colorbar: Any, norm: Any) -> None:
    # Plain tick labels ("1e-07", "2.5e-07"), never mathtext (its parser costs ~0.02-0.1 s per label).  Over
    # more than MINOR_TICK_DECADES: labelled decades only.  Over less than one decade (errors of a few
    # ulps), a log locator's labels would all round to one value: a handful of ticks labelled to 3 digits.
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogFormatter, NullLocator

    decades = math.log10(norm.vmax / norm.vmin)
    axis = colorbar.ax.yaxis
    if not hasattr(norm, "base") and type(norm).__name__ == "FuncNorm":  # a centred scale: its decades, and 1
        lo, hi = math.floor(math.log10(norm.vmin)), math.ceil(math.log10(norm.vmax))
        step = max(1, (hi - lo) // 6)
        ticks = sorted({10.0**k for k in range(lo, hi + 1, step)} | {1.0})
        axis.set_major_locator(FixedLocator([t for t in ticks if norm.vmin <= t <= norm.vmax]))
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        axis.set_minor_locator(NullLocator())
        return
    if decades < 1.0:
        axis.set_major_locator(FixedLocator(np.geomspace(norm.vmin, norm.vmax, 4)))
        axis.set_major_formatter(FuncFormatter(lambda v, _: _compact(v)))
        axis.set_minor_locator(NullLocator())
        return
    axis.set_major_formatter(LogFormatter(labelOnlyBase=True))
    axis.set_minor_formatter(LogFormatter(labelOnlyBase=False))
    if decades > MINOR_TICK_DECADES:
        colorbar.ax.minorticks_off()


def _compact(v: float) -> str:
    # 3 digits, and an exponent without padding ("4.99e-4", not "4.99e-04"): a colour bar's ticks stay narrow.
    mantissa, exponent = f"{v:.2e}".split("e")
    mantissa = mantissa.rstrip("0").rstrip(".")
    return min(f"{v:.3g}".replace("e+0", "e").replace("e-0", "e-"), f"{mantissa}e{int(exponent)}", key=len)


SUSPECT_COLOUR = "#b00020"
"""The one colour that means SUSPECT, on every figure."""
PALETTE = ["#4c72b0", "#55a868", "#8172b2", "#ccb974", "#64b5cd", "#2a9d8f", "#8c8c8c", "#6b6bb3"]
"""Colours for backends that are not SUSPECT (no red among them)."""
LINESTYLES = ["-", "--", ":", "-."]


SNAPSHOT_HIDES = (
    "<style>.jp-OutputArea-child:has(.rlx-snapshot):has(+ .jp-OutputArea-child .rlx-explorer){display:none}</style>"
)
"""The snapshot's rule: its output is hidden when the next output holds a drawn explorer (a live kernel's, or one
drawn from saved widget state).  JupyterLab drops ``<style>`` from an untrusted notebook (one the reader did not
run), and a notebook without the widget's state draws no explorer: in both the snapshot stays."""


INSIDE_PX = 3.0
"""How close to the figure's edge a label may come, in pixels."""


@functools.cache
def _inside_class() -> type:
    from matplotlib.text import Annotation

    class Inside(Annotation):
        # An annotation moved inside its figure at every draw (:func:`inside_annotation`).
        given_text: str = ""
        given_offset: tuple[float, float] = (0.0, 0.0)

        def draw(self, renderer: Any) -> None:
            if renderer is None or not self.get_visible():
                return super().draw(renderer)
            self.set_text(self.given_text)
            self.xyann = self.given_offset
            fb = self.figure.bbox
            bb = self.get_window_extent(renderer)
            room = self.axes.bbox.width if self.axes is not None else fb.width  # (over the map, not past it)
            if bb.width > room - 2 * INSIDE_PX and "; " in self.given_text:
                self.set_text(self.given_text.replace("; ", "\n"))
                bb = self.get_window_extent(renderer)
            box = 0.3 * self.get_fontsize() * self.figure.dpi / 72 if self.get_bbox_patch() is not None else 0.0
            margin = INSIDE_PX + box  # (the rounded box around the words, whose pad is 0.3 of the font size)
            dx = max(0.0, fb.x0 + margin - bb.x0) or min(0.0, fb.x1 - margin - bb.x1)
            dy = max(0.0, fb.y0 + margin - bb.y0) or min(0.0, fb.y1 - margin - bb.y1)
            points = 72.0 / self.figure.dpi
            self.xyann = (self.given_offset[0] + dx * points, self.given_offset[1] + dy * points)
            return super().draw(renderer)

    return Inside


def inside_annotation(ax: Axes, text: str, xy: tuple[float, float], **kwargs: Any) -> Any:
    """``ax.annotate(text, xy, **kwargs)`` that keeps itself whole inside the figure: at every draw (at the size and
    layout the figure has then) it is measured and moved in, and a label wider than its axes is broken at its
    "; ".  A label clipped at the edge changed what it said (``[:, 1]: 53% of the error`` read ``3% of the
    error``)."""
    kwargs.setdefault("xytext", (0, 0))
    kwargs.setdefault("textcoords", "offset points")
    note = _inside_class()(text, xy, **kwargs)
    note.given_text, note.given_offset = text, tuple(note.xyann)
    ax._add_text(note)
    return note
