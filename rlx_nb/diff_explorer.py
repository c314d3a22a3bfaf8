"""The explorer of a diff (``rlx_nb.explore(diff)``): the per-module bars, a module and a side picker, and below them the
explorer of the picked module's change (:meth:`rlx_nb.changes.result.Diff.report`)."""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any

from rlx_nb.changes.result import Diff, default_side
from rlx_nb.errors import InputError
from rlx_nb.explorer import Explorer, W, _ipympl_active, _png, _require_widgets, _show_png
from rlx_nb.plot.charts import localization_figsize

if TYPE_CHECKING:
    from rlx_nb.report.report import DivergenceReport


def explore_diff(diff: Diff, *, module: str | None = None, side: str | None = None, top: int = 20,
                 interactive: bool | None = None, **others: Any) -> DiffExplorer:  # fmt: skip
    """``rlx_nb.explore(diff)``: the finding and the environment differences, the per-module bars, a module picker
    (changed modules marked) and a side picker (alone, fed the old inputs / in the whole run) above the explorer of the
    picked module's change: its old output as the oracle, the new one as the backend, the float64 module on the same
    inputs as the reference (:meth:`~rlx_nb.changes.result.Diff.report`).  It opens on ``module`` (default: the
    culprit, else where the runs part) and ``side`` (default: the side its verdict came from)."""
    if others:
        raise InputError(
            f"{', '.join(sorted(others))}: a report's explorer takes these; a diff's takes module= and side="
        )
    _require_widgets()
    return DiffExplorer(diff, module=module, side=side, top=top,
                        interactive=_ipympl_active() if interactive is None else interactive)  # fmt: skip


SIDES = [("alone, fed the old inputs", "local"), ("in the whole run", "propagated")]


class DiffExplorer(Explorer):
    """:func:`explore` of a :class:`~rlx_nb.changes.result.Diff`: the finding and the environment differences, the
    per-module bars (local and propagated, on the verdict's one scale), a module picker and a side picker; below them
    the explorer of the picked module's change (:meth:`~rlx_nb.changes.result.Diff.report`: the old output as the
    oracle, the new one as the backend, the float64 value as the reference)."""

    def __init__(self, diff: Diff, *, module: str | None, side: str | None, top: int, interactive: bool) -> None:
        from matplotlib.figure import Figure

        self.diff = diff
        row = diff._row(module)
        side = side or default_side(row)
        report = diff.report(row["module"], side)
        self.oracle_name = self._oracle_name(report)
        super().__init__(report, top=top, interactive=interactive)
        e = html.escape
        envs = "".join(f"<li>{e(d)}</li>" for d in diff.environment[:8])
        self.diff_head = W.HTML(
            f"<h4>{e(diff.heading).replace(' -&gt; ', ' &rarr; ')}</h4><p><b>{e(diff.finding)}</b></p>"
            + (f"<p>Environment differences:</p><ul>{envs}</ul>" if envs else "")
        )
        self.diff_bars = W.Output()
        ax = Figure(figsize=localization_figsize(len(diff.frame)), layout="constrained").add_subplot()
        diff.plot(ax=ax)
        _show_png(self.diff_bars, _png(ax.figure))
        judged = [r for r in diff.frame.itertuples() if r.local_verdict or r.propagated_verdict]
        options = [(f"⚠ {r.module} ({r.change})" if r.change in ("changed here", "carried in") else r.module, r.module)
                   for r in judged]  # fmt: skip
        longest = max((len(label) for label, _ in options), default=20)
        self.module_picker = W.Dropdown(options=options, value=row["module"], description="module",
                                        layout=W.Layout(width=f"calc({longest + 4}ch + 8em)", max_width="100%"))  # fmt: skip
        self.side_picker = W.ToggleButtons(
            options=SIDES, value=side, description="change", style={"button_width": "auto"}
        )  # (its words whole, never cut)
        self.children = (self.diff_head, self.diff_bars, W.HBox([self.module_picker, self.side_picker],
                         layout=W.Layout(flex_flow="row wrap")), *self.children)  # fmt: skip
        self.module_picker.observe(self._on_module, names="value")
        self.side_picker.observe(self._on_side, names="value")

    def _oracle_name(self, report: DivergenceReport) -> str:
        # The inspector's oracle row: the old run, or the new one where the report turned round (an edited module).
        if report.worst[0] == self.diff.new_label:
            return f"old run ({self.diff.old_label})"
        return f"new run ({self.diff.new_label})"

    def _on_module(self, _change: Any) -> None:
        row = self.diff._row(self.module_picker.value)
        if not row[f"{self.side_picker.value}_verdict"]:  # (that side was not judged for it: the one that was)
            self.side_picker.unobserve(self._on_side, names="value")
            self.side_picker.value = default_side(row)
            self.side_picker.observe(self._on_side, names="value")
        self._retarget()

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

    def _on_side(self, _change: Any) -> None:
        self._retarget()

    def _retarget(self) -> None:
        try:
            report = self.diff.report(self.module_picker.value, self.side_picker.value)
        except InputError as exc:
            self.status.value = f"<span style='color:#b00020'>{html.escape(str(exc))}</span>"
            return
        self.oracle_name = self._oracle_name(report)
        self.show_report(report)

    def snapshot(self) -> dict[str, str]:
        shot = super().snapshot()
        bars = self._image(self.diff_bars)
        picked = (f"<p>module: <code>{html.escape(str(self.module_picker.value))}</code>, "
                  f"{html.escape(dict((v, k) for k, v in SIDES)[self.side_picker.value])}</p>")  # fmt: skip
        head = self.diff_head.value + (
            f"<img src='data:image/png;base64,{bars}' style='max-width:100%'/>" if bars else ""
        )
        return {**shot, "text/html": head + picked + shot["text/html"]}


__all__ = ["DiffExplorer", "explore_diff"]
