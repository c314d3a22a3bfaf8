"""The ipywidgets explorer: from a suspect backend down to the offending element.

It composes the report's frames and :mod:`rlx_nb.plot.charts`; it computes no metric itself.  Without ipympl the
plots are static PNG images; under ``%matplotlib widget`` (ipympl) the heatmap is a live canvas and a click on it
selects the worst element of the clicked block.  Where a repro was written, the status says where the error is born.
"""

from __future__ import annotations

import base64
import html
import io
from typing import TYPE_CHECKING, Any

import numpy as np

from rlx_nb.comparison.tables import element_html
from rlx_nb.errors import InputError
from rlx_nb.generation.decode import step_of
from rlx_nb.generation.report import GenerationReport
from rlx_nb.plot.charts import localization_figsize
from rlx_nb.plot.style import HEATMAP_MARGINS, HISTOGRAM_MARGINS, SNAPSHOT_HIDES
from rlx_nb.report import elements as lookups
from rlx_nb.report.issue import where_born
from rlx_nb.verdict.records import worst_first
from rlx_nb.verdict.types import SUSPECT, VERDICT_ERROR, VERDICT_SKIPPED

if TYPE_CHECKING:
    from rlx_nb.report.report import DivergenceReport

try:
    import ipywidgets as W
except ImportError:  # pragma: no cover - depends on the environment
    W = None

METRIC_OPTIONS = [("x SUSPECT line", "line"), ("x budget", "budget"), ("abs", "abs"), ("rel", "rel"), ("ULP", "ulp")]
"""The heatmap's metrics, the default first: each element's error against fp64 on the verdict's own scale (1 is
the SUSPECT line; an exact match to the oracle is an error of 0 on the oracle-based metrics, and a backend that
matches it bit for bit would open on an empty map)."""
FP64_METRICS = ("line", "budget")
"""The metrics that need the fp64 reference (the others are offered where it did not run)."""
INT8_METRIC_OPTIONS = [("quanta", "quanta"), ("x SUSPECT line", "line"), ("abs", "abs")]  # (no float32 ULP: #62)


def _require_widgets() -> None:
    if W is None:
        raise InputError("the explorer needs ipywidgets: pip install 'rlx_nb[notebook]'")


def _ipympl_active() -> bool:
    import matplotlib

    backend = matplotlib.get_backend().lower()
    return "ipympl" in backend or backend.endswith("widget")


def _png(fig) -> bytes:
    buf = io.BytesIO()
    # The fastest zlib level: the explorer's PNGs are sent once and shown at once, not stored.
    fig.savefig(buf, format="png", dpi=80, pil_kwargs={"compress_level": 1})
    return buf.getvalue()


def _show_png(out, png: bytes) -> None:
    # One assignment: one message, one redraw (clearing first is two); with or without a kernel (``with out:`` is not).
    image = {"image/png": base64.b64encode(png).decode("ascii"), "text/plain": "<explorer figure>"}
    out.outputs = ({"output_type": "display_data", "data": image, "metadata": {}},)


def explore(report: DivergenceReport | GenerationReport, *, top: int = 20, interactive: bool | None = None,
            localization: Any = None, step: int | None = None, backend: str | None = None) -> Explorer:  # fmt: skip
    """An explorer widget for ``report``: pickers, heatmap, histogram, worst elements, inspector.

    Parameters
    ----------
    report : DivergenceReport or GenerationReport
        A generation report opens on ``step``'s logits of ``backend`` (:meth:`GenerationReport.explorer_view`).
    top : int
        How many worst elements the table and picker list.
    interactive : bool, optional
        Use live ipympl canvases (click to select).  Default: when the
        ``%matplotlib widget`` backend is active.
    localization : Localization, optional
        Adds the localization view: per-module local/propagated bars and a
        module picker that shows the picked module's output heatmap.

    Examples
    --------
    >>> import torch, rlx_nb
    >>> r = rlx_nb.backend_divergence(torch.nn.Linear(4, 4), torch.randn(3, 4), backends=["cpu-nomkldnn"])
    >>> ex = rlx_nb.explore(r)
    >>> ex.backend_picker.value
    'cpu-nomkldnn'
    """
    _require_widgets()
    view = report.explorer_view(backend, step) if isinstance(report, GenerationReport) else None
    if view is None and (step, backend) != (None, None):
        raise InputError("step= and backend= pick a generation report's step; this is a forward report")
    explorer = Explorer(
        report if view is None else view[0],
        top=top,
        interactive=_ipympl_active() if interactive is None else interactive,
        steps=view is not None,
    )
    if view is not None:
        explorer.backend_picker.value, explorer.output_picker.value = view[1], view[2]
    if localization is not None:
        explorer.add_localization(localization)
    return explorer


class Explorer(W.VBox if W is not None else object):
    """The explorer layout; its child widgets are attributes so tests and users can drive them."""

    def __init__(
        self, report: DivergenceReport, *, top: int = 20, interactive: bool = False, steps: bool = False
    ) -> None:
        _require_widgets()
        self.report = report
        self.steps = steps  # a generation's steps: listed in step order, the step kept when the backend changes
        self.top = top
        self.interactive = interactive
        self.selected_index: tuple[int, ...] | None = None
        self.heatmap_data: np.ndarray | None = None
        self.histogram_data: list[np.ndarray] = []
        self._heatmap_ax = None
        self._heatmap = None  # the drawn heatmap (plotting.Heatmap): its folding and pooling, for clicks and rings
        self._picked = None
        self._busy = False
        wide = W.Layout(width="max-content", min_width="260px")  # a name and "(SUSPECT)" never cut
        ordered = report.worst  # the worst backend first
        if not ordered:
            raise InputError("nothing to explore: no candidate backend in this report produced outputs")
        self.backend_picker = W.Dropdown(
            options=[(f"⚠ {b} (SUSPECT)" if b in report.suspects else b, b) for b in ordered],
            description="backend",
            layout=wide,
        )
        self.output_picker = W.Dropdown(description="output", layout=wide)
        self.metric_toggle = W.ToggleButtons(
            options=METRIC_OPTIONS, value="line", description="metric", style={"button_width": "auto"}
        )  # (its words whole, never cut)
        self.heatmap_out = W.Output()
        self.histogram_out = W.Output()
        self.element_picker = W.Select(description="worst", rows=10, layout=W.Layout(width="340px"))
        self.index_box = W.Text(description="index", placeholder="e.g. 0, 3, 17", continuous_update=False)
        self.table = W.HTML(layout=W.Layout(overflow="auto", max_width="100%"))  # (scrolls in a narrow notebook)
        self.inspector = W.HTML()
        self.status = W.HTML()
        self._canvas_box = W.Box(layout=W.Layout(flex="0 0 auto"))  # the live canvas keeps its size
        heat = self._canvas_box if interactive else self.heatmap_out
        super().__init__(
            [
                W.HBox([self.backend_picker, self.output_picker]),
                self.metric_toggle,
                self.status,
                # Side by side where the notebook is wide enough, the histogram below the heatmap where not.
                W.HBox([heat, self.histogram_out], layout=W.Layout(flex_flow="row wrap")),
                W.HBox(
                    [W.VBox([self.element_picker, self.index_box]), self.inspector],
                    layout=W.Layout(flex_flow="row wrap"),
                ),
                self.table,
            ]
        )
        self.add_class("rlx-explorer")  # a handle for pages and tests: the explorer's own box
        heat.add_class("rlx-heatmap")
        self.backend_picker.observe(self._on_backend, names="value")
        self.output_picker.observe(self._on_output, names="value")
        self.metric_toggle.observe(self._on_metric, names="value")
        self.element_picker.observe(self._on_element, names="value")
        self.index_box.observe(self._on_index, names="value")
        self._on_backend(None)

    # -- the static snapshot -------------------------------------------------------------------

    def _ipython_display_(self) -> None:
        # Two outputs: a static snapshot of the current view, then the live widget.  A notebook opened without
        # a kernel (JupyterLab, GitHub, nbviewer) has no widget state to draw the explorer from; it shows the
        # snapshot instead of a raw ``Explorer(children=...)``.  Where the live widget is drawn right after it,
        # the snapshot hides (SNAPSHOT_HIDES): a reader with a kernel sees the explorer once.
        from IPython.display import display

        shot = self.snapshot()
        display({**shot, "text/html": SNAPSHOT_HIDES + shot["text/html"]}, raw=True)
        bundle = dict(self._repr_mimebundle_())
        # What a reader without the widget's state sees in its place (Lab shows text/plain): a line, not the repr.
        bundle["text/plain"] = "rlx_nb explorer: the live widget needs a running kernel (a static copy is above)"
        display(bundle, raw=True)

    def snapshot(self) -> dict[str, str]:
        """The explorer's current view as a static picture: ``{"text/html": ..., "image/png": ..., "text/plain": ...}``
        (the status line, the heatmap and histogram, the worst elements and the picked element)."""
        images = [self._image(out) for out in (self.heatmap_out, self.histogram_out)]
        if self.interactive and self._heatmap_ax is not None:
            images[0] = base64.b64encode(_png(self._heatmap_ax.figure)).decode("ascii")
        # Side by side where they fit at their own size, one below the other where not: never shrunk to half the
        # cell (a histogram's legend read 6 px high at 48%).
        shown = "".join(f"<img src='data:image/png;base64,{png}' style='max-width:100%;flex:0 0 auto'/>"
                        for png in images if png)  # fmt: skip
        caption = (
            "<p style='color:#555;font-size:smaller'>rlx_nb explorer — a static copy of its view, for readers "
            "without a running kernel (the live explorer, when a kernel runs, is below)</p>"
        )
        # The table and the inspector side by side where they fit, one below the other where not; neither squeezed
        # (a squeezed table wrapped its indices and numbers and cut its last column).
        box = "flex:0 0 auto;max-width:100%;overflow-x:auto"
        body = (
            f"<div class='rlx-snapshot'>{caption}<p>{self.status.value}</p>"
            f"<div style='display:flex;flex-wrap:wrap;gap:0.5em;align-items:flex-start'>{shown}</div>"
            f"<div style='display:flex;flex-wrap:wrap;gap:1em 2em'><div style='{box}'>{self.table.value}</div>"
            f"<div style='{box}'>{self.inspector.value}</div></div>{self._localization_snapshot()}</div>"
        )
        bundle = {
            "text/html": body,
            "text/plain": f"<rlx_nb explorer: {self.backend_picker.value} · {self.output_picker.value}>",
        }
        if images[0]:
            bundle["image/png"] = images[0]
        return bundle

    def _localization_snapshot(self) -> str:
        # The localization view as the static copy shows it: its heading, the per-module bars, the module picked and
        # its heatmap ("" without a localization).
        if getattr(self, "localization", None) is None:
            return ""
        pictures = "".join(f"<img src='data:image/png;base64,{png}' style='max-width:100%;vertical-align:top'/>"
                           for png in (self._image(self.localization_bars), self._image(self.module_heatmap)) if png)  # fmt: skip
        picked = html.escape(str(self.module_picker.value or ""))
        return f"<div>{self._localization_head.value}<p>module: <code>{picked}</code></p>{pictures}</div>"

    @staticmethod
    def _image(out: Any) -> str:
        # The base64 PNG an Output widget shows ("" when none).
        for item in getattr(out, "outputs", ()) or ():
            png = item.get("data", {}).get("image/png")
            if png:
                return png
        return ""

    # -- state changes -------------------------------------------------------------------------

    def _outputs_worst_first(self, backend: str) -> list[tuple[str, str]]:
        recs = [
            r
            for r in self.report.records
            if r.backend == backend
            and r.output is not None
            and r.shape is not None
            and r.verdict not in (VERDICT_SKIPPED, VERDICT_ERROR)
            and r.numel > 0
        ]
        ordered = sorted(recs, key=lambda r: step_of(r.output)) if self.steps else worst_first(recs)
        return [(f"⚠ {r.output}" if r.verdict == SUSPECT else r.output, r.output) for r in ordered]

    def _on_backend(self, _change: Any) -> None:
        options = self._outputs_worst_first(self.backend_picker.value)
        kept = self.output_picker.value if self.steps else None  # (comparing backends at one step)
        self._busy = True
        self.output_picker.options = options
        values = [v for _, v in options]
        self.output_picker.value = kept if kept in values else values[0] if values else None
        self._busy = False
        self._on_output(None)

    def _on_output(self, _change: Any) -> None:
        if self._busy:
            return
        backend, output = self.backend_picker.value, self.output_picker.value
        if output is None:
            self.status.value = f"<i>{html.escape(backend)} has no array outputs to show</i>"
            return
        rec = self.report.record(backend, output)
        reason = rec.reason.removeprefix(f"{rec.verdict}, ").removeprefix(
            f"{rec.verdict} "
        )  # ("round-off — round-off")
        self.status.value = (
            f"<b>{html.escape(backend)}</b> · <code>{html.escape(output)}</code>: "
            f"<span style='color:{'#b00020' if rec.verdict == SUSPECT else '#1b5e20'}'><b>{html.escape(rec.verdict)}</b></span> — "
            f"{html.escape(reason)}{'<br>' if where_born(self.report, backend) else ''}"
            f"{html.escape(where_born(self.report, backend))}"
        )
        has_ref = rec.judgement.budget.budget_rmse == rec.judgement.budget.budget_rmse
        self._busy = True
        quantum = self.report.plot._quantum(output)
        choices = INT8_METRIC_OPTIONS if quantum else METRIC_OPTIONS
        options = choices if has_ref else [o for o in choices if o[1] not in FP64_METRICS]
        if self.metric_toggle.options != tuple(options):
            self.metric_toggle.options = options
            self.metric_toggle.value = options[0][1]
        self._busy = False
        frame = self.report.elements(backend, output, top=self.top)
        if len(frame) and (frame.abs_err > 0).any():  # elements that differ; exact ones only when none does
            frame = frame[frame.abs_err > 0]
        self._elements = frame
        self.table.value = element_html(frame)
        self._busy = True
        self.element_picker.options = [
            (f"#{r.rank} {tuple(r.index)} abs={r.abs_err:.2e}", tuple(r.index)) for r in frame.itertuples()
        ]
        self.element_picker.value = None
        self._busy = False
        # The element the heatmap marks worst is the one the inspector opens on (the record's worst element).
        first = rec.pair.worst_index or (tuple(frame["index"].iloc[0]) if len(frame) else None)
        self._draw_heatmap(picked=first)  # one rendering, the first element already ringed
        self._draw_histogram()
        if first is not None:
            self.select(first, redraw=False)

    def _on_metric(self, _change: Any) -> None:
        if not self._busy:
            self._draw_heatmap()
            self._draw_histogram()

    def _on_element(self, change: Any) -> None:
        if not self._busy and change["new"] is not None:
            self.select(change["new"])
            self._busy = True
            self.index_box.value = ""  # the typed index is not what is shown any more
            self._busy = False

    def _on_index(self, change: Any) -> None:
        text = change["new"].strip().strip("()[]")
        if not text or self._busy:
            return
        try:
            index = tuple(int(p) for p in text.replace(" ", ",").split(",") if p)
            self.select(index)
            self._busy = True  # the worst list follows: its row if the element is in it, else none highlighted
            self.element_picker.value = index if index in [v for _, v in self.element_picker.options] else None
            self._busy = False
        except (ValueError, InputError) as exc:
            self.inspector.value = f"<span style='color:#b00020'>{html.escape(str(exc))}</span>"

    # -- drawing -------------------------------------------------------------------------------

    def _arrays(self):
        return self.report.arrays(self.backend_picker.value, self.output_picker.value)

    def _new_axes(self, width: float = 5.0, height: float = 4.0):
        # The heatmap's figure: fixed margins, no layout engine (plotting.HEATMAP_MARGINS says why).
        if self.interactive:
            import matplotlib.pyplot as plt

            with plt.ioff():
                fig = plt.figure(figsize=(width, height))
        else:
            from matplotlib.figure import Figure

            fig = Figure(figsize=(width, height))
        fig.subplots_adjust(**HEATMAP_MARGINS)
        return fig.add_subplot()

    def _draw_heatmap(self, picked: tuple[int, ...] | None = None) -> None:
        if self.output_picker.value is None:
            return
        ax = self._new_axes()
        drawn = self.report.plot.heatmap_picture(
            self.backend_picker.value, self.output_picker.value, metric=self.metric_toggle.value, ax=ax, max_pixels=400
        )
        self.heatmap_data = drawn.pooled
        if self.interactive and self._heatmap_ax is not None:
            import matplotlib.pyplot as plt

            plt.close(self._heatmap_ax.figure)
        self._heatmap_ax, self._heatmap = ax, drawn
        self._picked = None
        if picked is None and self.selected_index is not None and len(self.selected_index) == len(drawn.fold.shape):
            picked = self.selected_index  # a metric change keeps the picked element ringed
        if picked is not None:
            self._mark(picked, render=False)
        if self.interactive:
            canvas = ax.figure.canvas
            canvas.header_visible = canvas.footer_visible = False  # the figure alone: nothing cut off beside it
            canvas.toolbar_position = "left"
            canvas.mpl_connect("button_press_event", self._on_click)
            self._canvas_box.children = (canvas,)
        else:
            _show_png(self.heatmap_out, _png(ax.figure))

    def _mark(self, index: tuple[int, ...], *, render: bool = True) -> None:
        # The picked element, marked on the heatmap (a white ring on its pooled cell).
        ax, drawn = self._heatmap_ax, self._heatmap
        if ax is None or drawn is None:
            return
        cell = drawn.fold.cell(index)
        if cell is None:
            return
        y, x = cell[0] // drawn.factors[0], cell[1] // drawn.factors[1]
        if self._picked is None:
            (self._picked,) = ax.plot(
                [x], [y], marker="o", markersize=14, markerfacecolor="none", markeredgecolor="white",
                markeredgewidth=2.5, clip_on=False, label="picked",
            )  # fmt: skip
        else:
            self._picked.set_data([x], [y])
        if not render:
            return
        if self.interactive:
            ax.figure.canvas.draw_idle()
        else:
            _show_png(self.heatmap_out, _png(ax.figure))

    def _draw_histogram(self) -> None:
        # Always a static image: nothing to click on in a histogram.
        from matplotlib.figure import Figure

        fig = Figure(figsize=(6.5, 4.0))
        fig.subplots_adjust(**HISTOGRAM_MARGINS)  # no layout engine: it measured every label on each draw
        ax = fig.add_subplot()
        metric = self.metric_toggle.value
        backend, output = self.backend_picker.value, self.output_picker.value
        self.report.plot.histogram(
            output, ax=ax, metric=metric, highlight=backend, title=f"{output}: {backend}'s errors"
        )
        self.histogram_data = [artist.get_data().values for artist in ax.patches]
        self._histogram_ax = ax
        _show_png(self.histogram_out, _png(ax.figure))

    def _on_click(self, event: Any) -> None:
        if event.inaxes is not self._heatmap_ax or event.xdata is None or self._heatmap is None:
            return
        block = (round(event.ydata), round(event.xdata))
        rec = self.report.record(self.backend_picker.value, self.output_picker.value)
        self.select(lookups.worst_in_block(self.report.results, rec, self._heatmap.fold, block, self._heatmap.factors))

    # -- the localization view -----------------------------------------------------------------

    def add_localization(self, loc: Any) -> None:
        """Append the localization view for ``loc`` (a :class:`rlx_nb.localization.Localization`)."""
        from matplotlib.figure import Figure

        self.localization = loc
        self.localization_bars = W.Output()
        ax = Figure(figsize=localization_figsize(len(loc.frame)), layout="constrained").add_subplot()
        loc.plot(ax=ax)
        _show_png(self.localization_bars, _png(ax.figure))
        names = loc.checked
        options = [(f"⚠ {n}" if n in loc.frame.query("verdict == 'SUSPECT'")["name"].tolist() else n, n) for n in names]
        longest = max((len(label) for label, _ in options), default=20)
        self.module_picker = W.Dropdown(  # (as wide as its longest name, which it cut; up to the notebook's width)
            options=options,
            description="module",
            layout=W.Layout(width=f"calc({longest + 4}ch + 8em)", max_width="100%"),
        )
        self.module_heatmap = W.Output()
        self.module_heatmap_data: np.ndarray | None = None
        self.module_picker.observe(lambda _: self._draw_module(), names="value")
        culprit = loc.culprit
        self._localization_head = head = W.HTML(
            f"<h4>Localization on {html.escape(loc.backend)}: culprit "
            f"<code>{html.escape(culprit or 'none')}</code> ({loc.preparations} preparations)</h4>"
        )
        self.children = (*self.children, head, self.localization_bars, self.module_picker, self.module_heatmap)
        suspects = [n for n in names if n in loc.frame.query("verdict == 'SUSPECT'")["name"].tolist()]
        if suspects:
            self.module_picker.value = suspects[-1]
        self._draw_module()

    def _draw_module(self) -> None:
        from matplotlib.figure import Figure

        name = self.module_picker.value
        if name is None:
            return
        fig = Figure(figsize=(5.0, 4.0))  # (the explorer's own heatmap's size and margins; a PNG, never a canvas)
        fig.subplots_adjust(**HEATMAP_MARGINS)
        ax = fig.add_subplot()
        try:
            drawn = self.localization.heatmap_picture(name, ax=ax, max_pixels=300)
        except InputError as exc:
            self.module_heatmap.outputs = ()
            self.module_heatmap.append_display_data(W.HTML(html.escape(str(exc))))
            return
        self.module_heatmap_data = drawn.pooled
        _show_png(self.module_heatmap, _png(ax.figure))

    # -- the element inspector -----------------------------------------------------------------

    def select(self, index: tuple[int, ...], *, redraw: bool = True) -> None:
        """Show one element (by its index in the output) in the inspector, ringed on the heatmap."""
        index = tuple(int(i) for i in index)
        backend, output = self.backend_picker.value, self.output_picker.value
        e = self.report.element(backend, output, index).iloc[0]  # (an InputError for an index outside the output)
        self.selected_index = index
        drawn = self._heatmap
        oracle = html.escape(getattr(self, "oracle_name", "oracle (cpu fp32)"))
        rows = lookups.inspector_rows(e, index, oracle, html.escape(backend), self.report.plot._quantum(output))
        body = "".join(f"<tr><th style='text-align:left'>{k}</th><td>{v}</td></tr>" for k, v in rows)
        hood = ""
        rec = self.report.record(backend, output)
        if drawn is not None and rec.dtype.startswith(("float", "bfloat")):
            try:
                hood = lookups.neighbourhood_html(lookups.neighbourhood(self.report.results, rec, index, drawn.fold))
            except ValueError:
                hood = ""
        self.inspector.value = f"<table>{body}</table>{hood}"
        if redraw:
            self._mark(index)
