"""The explorers of what a report is made of: a diff's modules, a training's local steps, an invariance's pairs.

One layout for all of them (:class:`PickingExplorer`): a heading (the finding), the report's own figure, pickers
that choose one part (a module and a side; a backend and a step; a backend, a configuration and a row), and below
them the explorer of that part as a report (:class:`rlx_nb.explorer.Explorer`: the heatmap, histogram, worst elements
and inspector of any report), retargeted whenever a picker changes.  ``rlx_nb.explore`` opens the one that fits.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rlx_nb.changes.result import Diff, default_side
from rlx_nb.errors import InputError
from rlx_nb.explorer import Explorer, W, _ipympl_active, _png, _require_widgets, _show_png
from rlx_nb.plot.charts import localization_figsize

if TYPE_CHECKING:
    from rlx_nb.report.report import DivergenceReport


class PickingExplorer(Explorer):
    """A heading and a figure of the whole, pickers of one part, and the explorer of that part below them.

    ``pick(values) -> DivergenceReport`` turns the pickers' values (by name) into the part's report; ``pickers`` are
    ``(name, widget)`` pairs in the order shown; ``draw(figure)`` draws the whole's figure.
    """

    def __init__(self, heading: str, draw: Callable[[Any], None] | None, pickers: list[tuple[str, Any]],
                 pick: Callable[[dict[str, Any]], DivergenceReport], *, top: int, interactive: bool,
                 about: Callable[[dict[str, Any]], str] | None = None) -> None:  # fmt: skip
        from matplotlib.figure import Figure

        self.pick = pick
        self.about = about
        self.pickers = dict(pickers)
        report = pick(self.values)
        super().__init__(report, top=top, interactive=interactive)
        self.whole_head = W.HTML(heading)
        self.whole_figure = W.Output()
        if draw is not None:
            figure = Figure(figsize=(8.5, 4.5), layout="constrained")
            draw(figure)
            _show_png(self.whole_figure, _png(figure))
        row = W.HBox([w for _, w in pickers], layout=W.Layout(flex_flow="row wrap"))
        self.part_about = W.HTML(self._about())
        self.children = (self.whole_head, self.whole_figure, row, self.part_about, *self.children)
        for _, widget in pickers:
            widget.observe(self._on_pick, names="value")

    @property
    def values(self) -> dict[str, Any]:
        return {name: w.value for name, w in self.pickers.items()}

    def _on_pick(self, _change: Any) -> None:
        self._retarget()

    def _retarget(self) -> None:
        try:
            report = self.pick(self.values)
        except InputError as exc:
            self.status.value = f"<span style='color:#b00020'>{html.escape(str(exc))}</span>"
            return
        self.part_about.value = self._about()
        self.show_report(report)

    def _about(self) -> str:
        # What the caller knows of the picked part beyond its elements (an invariance pair's first op), as HTML.
        return self.about(self.values) if self.about is not None else ""

    def show_report(self, report: DivergenceReport) -> None:
        """Show another report in the same explorer (its worst backend, its worst output)."""
        self.report = report
        self.backend_picker.unobserve(self._on_backend, names="value")
        try:
            self.backend_picker.options = [(f"⚠ {b} (SUSPECT)" if b in report.suspects else b, b) for b in report.worst]
            self.backend_picker.value = report.worst[0]
        finally:
            self.backend_picker.observe(self._on_backend, names="value")
        self._on_backend(None)

    def snapshot(self) -> dict[str, str]:
        shot = super().snapshot()
        whole = self._image(self.whole_figure)
        head = self.whole_head.value + (
            f"<img src='data:image/png;base64,{whole}' style='max-width:100%'/>" if whole else ""
        )
        return {**shot, "text/html": head + f"<p>{self.picked_text()}</p>" + self._about() + shot["text/html"]}

    def picked_text(self) -> str:
        """The part shown, in words (the snapshot's line above the part's explorer)."""
        return ", ".join(f"{html.escape(k)}: <code>{html.escape(str(v))}</code>" for k, v in self.values.items())


def _dropdown(name: str, options: list, value: Any) -> Any:
    longest = max((len(str(label)) for label, _ in options), default=20)
    return W.Dropdown(options=options, value=value, description=name,
                      layout=W.Layout(width=f"calc({longest + 4}ch + 8em)", max_width="100%"))  # fmt: skip


def _no_others(others: dict[str, Any], what: str, takes: str) -> None:
    if others:
        raise InputError(f"{', '.join(sorted(others))}: a report's explorer takes these; {what}'s takes {takes}")


# -- a diff ---------------------------------------------------------------------------------------------------------


def explore_diff(diff: Diff, *, module: str | None = None, side: str | None = None, top: int = 20,
                 interactive: bool | None = None, **others: Any) -> DiffExplorer:  # fmt: skip
    """``rlx_nb.explore(diff)``: the finding and the environment differences, the per-module bars, a module picker
    (changed modules marked) and a side picker (alone, fed the old inputs / in the whole run) above the explorer of the
    picked module's change: its old output as the oracle, the new one as the backend, the float64 module on the same
    inputs as the reference (:meth:`~rlx_nb.changes.result.Diff.report`).  It opens on ``module`` (default: the
    culprit, else where the runs part) and ``side`` (default: the side its verdict came from)."""
    _no_others(others, "a diff", "module= and side=")
    _require_widgets()
    return DiffExplorer(diff, module=module, side=side, top=top,
                        interactive=_ipympl_active() if interactive is None else interactive)  # fmt: skip


SIDES = [("alone, fed the old inputs", "local"), ("in the whole run", "propagated")]


class DiffExplorer(PickingExplorer):
    """:func:`explore_diff`: the module and side pickers (:attr:`module_picker`, :attr:`side_picker`) above the
    explorer of the picked module's change (:meth:`~rlx_nb.changes.result.Diff.report`)."""

    def __init__(self, diff: Diff, *, module: str | None, side: str | None, top: int, interactive: bool) -> None:
        self.diff = diff
        row = diff._row(module)
        judged = [r for r in diff.frame.itertuples() if r.local_verdict or r.propagated_verdict]
        options = [(f"⚠ {r.module} ({r.change})" if r.change in ("changed here", "carried in") else r.module, r.module)
                   for r in judged]  # fmt: skip
        self.module_picker = _dropdown("module", options, row["module"])
        self.side_picker = W.ToggleButtons(
            options=SIDES, value=side or default_side(row), description="change", style={"button_width": "auto"}
        )  # fmt: skip  (its words whole, never cut)
        e = html.escape
        envs = "".join(f"<li>{e(d)}</li>" for d in diff.environment[:8])
        heading = (f"<h4>{e(diff.heading).replace(' -&gt; ', ' &rarr; ')}</h4><p><b>{e(diff.finding)}</b></p>"
                   + (f"<p>Environment differences:</p><ul>{envs}</ul>" if envs else ""))  # fmt: skip

        def draw(figure: Any) -> None:
            figure.set_size_inches(*localization_figsize(len(diff.frame)))
            diff.plot(ax=figure.add_subplot())

        super().__init__(heading, draw, [("module", self.module_picker), ("change", self.side_picker)], self._pick,
                         top=top, interactive=interactive)  # fmt: skip
        self.diff_head, self.diff_bars = self.whole_head, self.whole_figure

    def _pick(self, values: dict[str, Any]) -> DivergenceReport:
        report = self.diff.report(values["module"], values["change"])
        self.oracle_name = self._oracle_name(report)
        return report

    def picked_text(self) -> str:
        side = dict((v, k) for k, v in SIDES)[self.side_picker.value]
        return f"module: <code>{html.escape(str(self.module_picker.value))}</code>, {html.escape(side)}"

    def _oracle_name(self, report: DivergenceReport) -> str:
        # The inspector's oracle row: the old run, or the new one where the report turned round (an edited module).
        if report.worst[0] == self.diff.new_label:
            return f"old run ({self.diff.old_label})"
        return f"new run ({self.diff.new_label})"

    def _on_pick(self, change: Any) -> None:
        if change is not None and change.get("owner") is self.module_picker:
            row = self.diff._row(self.module_picker.value)
            if not row[f"{self.side_picker.value}_verdict"]:  # (that side was not judged for it: the one that was)
                self.side_picker.unobserve(self._on_pick, names="value")
                self.side_picker.value = default_side(row)
                self.side_picker.observe(self._on_pick, names="value")
        self._retarget()


# -- a training ----------------------------------------------------------------------------------------------------


def explore_training(training: Any, *, backend: str | None = None, step: int | None = None, top: int = 20,
                     interactive: bool | None = None, **others: Any) -> PickingExplorer:  # fmt: skip
    """``rlx_nb.explore(training_report)``: its lines and figure (the loss with the envelope, each trajectory and its
    local steps), a backend and a step picker over the local steps the report kept (those past the line), and the
    explorer of the picked local step: its loss, buffers, gradients and updated parameters against float64's."""
    _no_others(others, "a training report", "backend= and step=")
    _require_widgets()
    kept = sorted(training.kept)
    if not kept:
        raise InputError("no local step of this training report was kept (none past the line, or keep=0): its "
                         "figure and frames hold the whole (report.plot(), report.local)")  # fmt: skip
    backend, step = training._picked(backend, step)
    steps_of = {b: [s for bb, s in kept if bb == b] for b, _ in kept}
    backends = _dropdown("backend", [(b, b) for b in steps_of], backend)
    steps = _dropdown("step", [(str(s), s) for s in steps_of[backend]], step)

    def follow(_change: Any) -> None:  # (a backend's own kept steps)
        steps.options = [(str(s), s) for s in steps_of[backends.value]]

    backends.observe(follow, names="value")
    heading = "".join(f"<p>{html.escape(line)}</p>" for line in training.lines())
    return PickingExplorer(heading, lambda fig: training.plot(fig=fig), [("backend", backends), ("step", steps)],
                           lambda v: training.local_report(v["backend"], v["step"]), top=top,
                           interactive=_ipympl_active() if interactive is None else interactive)  # fmt: skip


# -- an invariance -------------------------------------------------------------------------------------------------


def explore_invariance(invariance: Any, *, backend: str | None = None, config: str | None = None, top: int = 20,
                       interactive: bool | None = None, **others: Any) -> PickingExplorer:  # fmt: skip
    """``rlx_nb.explore(invariance_report)``: its lines and map, a backend and a configuration picker over the pairs
    that are not bit for bit, and the explorer of the picked pair (the row alone as the oracle, the row in that
    configuration as the backend, float64 of the row alone as the reference)."""
    _no_others(others, "an invariance report", "backend= and config=")
    _require_widgets()
    parted = [(b, c) for (b, c), v in invariance.pairs.items() if v != "bit for bit"]
    if not parted:
        raise InputError("every configuration is bit for bit the row alone's: there is no difference to explore")
    backend = backend or parted[0][0]
    configs = [c for b, c in parted if b == backend]
    backends = _dropdown("backend", [(b, b) for b in dict.fromkeys(b for b, _ in parted)], backend)
    chosen = _dropdown("configuration", [(c, c) for c in configs], config or configs[0])

    def follow(_change: Any) -> None:
        chosen.options = [(c, c) for b, c in parted if b == backends.value]

    backends.observe(follow, names="value")
    heading = "".join(f"<p>{html.escape(line)}</p>" for line in invariance.lines())

    def about(values: dict[str, Any]) -> str:  # (the pair's op: where it parts, how, and where the row moves)
        op = invariance.ops.get((values["backend"], values["configuration"]))
        if op is None:
            return (
                "<p>No op recorded for this pair (ops are recorded where a pair's outputs differ, with ops=True).</p>"
            )
        if not op.op:  # (a backend searched module by module where no module alone parts: why, in words)
            why = op.note or "no op whose inputs are the row alone's parts"
            return f"<p>No op named for this pair: {html.escape(why)}.</p>"
        said = [f"first op that parts: <code>{html.escape(op.op)}</code> {html.escape(op.shapes)}"]
        if op.kernels:
            said.append(f"kernel path: <code>{html.escape(op.kernels)}</code>")
        if op.moved or op.unaligned:
            said.append(f"the row moves at <code>{html.escape(op.moved or op.unaligned or '')}</code>")
        return "<p class='rlx-pair-op'>" + "<br>".join(said) + "</p>"

    return PickingExplorer(heading, lambda fig: invariance.plot(backends.value, ax=fig.add_subplot()),
                           [("backend", backends), ("configuration", chosen)],
                           lambda v: invariance.report(v["backend"], v["configuration"]), top=top,
                           interactive=_ipympl_active() if interactive is None else interactive,
                           about=about)  # fmt: skip


__all__ = ["DiffExplorer", "PickingExplorer", "explore_diff", "explore_invariance", "explore_training"]
