"""A diff's result: one row per module (its local and propagated change on the verdict's one scale), the first module
whose own change is past the line, and the environment differences beside it."""

from __future__ import annotations

import base64
import dataclasses
import html
import io
import math
import re
from pathlib import Path
from typing import Any

import pandas as pd

from rlx_nb.changes.ops import shown
from rlx_nb.comparison.tables import Table
from rlx_nb.errors import InputError, writing
from rlx_nb.verdict.records import OutputRecord
from rlx_nb.verdict.types import ROUNDOFF, SUSPECT, VERDICT_ERROR
from rlx_nb.verdict.words import Cause

COLUMNS = [
    "order", "module", "depth", "change", "local_verdict", "local_line", "propagated_verdict", "propagated_line",
    "local_ratio_rmse", "local_ratio_max", "propagated_ratio_rmse", "propagated_ratio_max", "output", "reason", "note",
]  # fmt: skip
"""A diff's frame: ``local_*`` the module alone fed its old inputs, ``propagated_*`` its output in the whole run;
``*_line`` on the verdict's one scale (past 1.0 is past the line); ``change`` in words."""

CHANGED_HERE = "changed here"
CARRIED_IN = "carried in"
WITHIN = "moved within round-off"
IDENTICAL = "bit for bit identical"
NOT_JUDGED = "not judged"

_KERNEL_BUG = re.compile(r" — likely a (?:kernel )?bug.*$")
EDITED = "the old output against the float64 value here"
"""How a judgement turned round reads (the old output past the line against the float64 value here)."""


def reading(change: str, reason: str, *, edit: bool | None = None) -> str:
    """A module's reason in the diff's own words: the verdict's "likely a kernel bug" is a backend's reading; a
    change between environments is computed differently here (a kernel), an edit of its function, or carried in."""
    edit = reason.startswith(EDITED) if edit is None else edit
    if change == CHANGED_HERE:
        words = ("its function changed: an edit of its code, or an op that now computes another function" if edit
                 else "it computes differently here on its own, fed the old inputs: a kernel that changed")  # fmt: skip
    elif change == CARRIED_IN:
        words = "carried in: within round-off alone, fed the old inputs, so the change came from before it"
    else:
        return reason
    return f"{_KERNEL_BUG.sub('', reason)} — {words}"


def row(m: dict, *, local: OutputRecord | None = None, propagated: OutputRecord | None = None, note: str = "") -> dict:
    """One module's row (``m``: its snapshot entry)."""
    out: dict[str, Any] = {"order": m["order"], "name": m["name"], "depth": m["depth"], "parent": m.get("parent")}
    for side, rec in (("local", local), ("propagated", propagated)):
        j = rec.judgement if rec is not None else None
        out[f"{side}_verdict"] = rec.verdict if rec is not None else ""
        out[f"{side}_line"] = j.line if j is not None else math.nan
        out[f"{side}_ratio_rmse"] = j.budget.ratio_rmse if j is not None and j.budget is not None else math.nan
        out[f"{side}_ratio_max"] = j.budget.ratio_max if j is not None and j.budget is not None else math.nan
    decisive = local if local is not None and local.verdict == SUSPECT else propagated or local
    out["output"] = (decisive.output or "") if decisive is not None else ""
    # (the verdict's words name the oracle: here it is the snapshot's run)
    out["reason"] = (decisive.reason or "").replace("the oracle", "the snapshot's run") if decisive is not None else ""
    out["note"] = note
    lv, pv = out["local_verdict"], out["propagated_verdict"]
    judged = [rec for rec in (local, propagated) if rec is not None]
    if lv == SUSPECT:
        out["change"] = CHANGED_HERE
    elif pv == SUSPECT:
        out["change"] = CARRIED_IN
    elif VERDICT_ERROR in (lv, pv):
        out["change"] = "error"
    elif judged and all(rec.judgement.cause == Cause.IDENTICAL for rec in judged):
        out["change"] = IDENTICAL
    elif ROUNDOFF in (lv, pv):
        out["change"] = WITHIN
    else:
        out["change"] = NOT_JUDGED
    out["reason"] = reading(out["change"], out["reason"])
    return out


class Diff:
    """Where two environments part: one row per module, its change judged against its own round-off.

    Attributes
    ----------
    frame : pandas.DataFrame
        One row per module in the order the model first called it (:data:`COLUMNS`).
    culprit : str or None
        The first module whose *local* change (alone, fed the old inputs) is past the line, none of whose
        children's is: where the new environment computes differently.  None when none is.
    first_parted : str or None
        The first module whose output in the whole run is past the line, none of whose children's is (what two
        snapshots, without the model, can tell).
    environment : list of str
        How the two environments differ (``key: old -> new (what it can move)``), the kernel-changing ones first.
    notes : list of str
        What else differs (the weights, the inputs) or could not be judged.
    """

    def __init__(self, rows: list[dict], old: Any, *, new_label: str, backend: str, environment: list[str],
                 notes: list[str], checked_alone: bool, keyword: bool, arrays: Any = None,
                 environments: tuple[dict, dict] = ({}, {})) -> None:  # fmt: skip
        self.old_label, self.new_label, self.backend = old.label, new_label, backend
        self.environments = environments
        """The two environments whole (old, new): what the HTML page lists."""
        self._arrays = arrays  # (name, side) -> (old outputs, new outputs, float64 outputs): what report() shows
        self.environment, self.notes, self.checked_alone = environment, notes, checked_alone
        for r in rows:
            r["module"] = shown(r["name"], keyword)
        self._rows = rows
        self.frame = Table(sorted(rows, key=lambda r: r["order"]), columns=COLUMNS)
        self.culprit = _innermost(rows, "local_verdict")
        self.first_parted = _innermost(rows, "propagated_verdict")

    @property
    def _units(self) -> str:
        # What its rows are: modules, or modules and their ops (a snapshot written with ops=True).
        return "module(s) and op(s)" if self.frame.module.str.contains(" :: ", regex=False).any() else "module(s)"

    @property
    def changed(self) -> list[str]:
        """Every module whose own change is past the line, in order."""
        return self.frame[self.frame.change == CHANGED_HERE].module.tolist()

    @property
    def past_line(self) -> bool:
        """Whether any module's change (local or propagated) is past the line."""
        return bool((self.frame.local_verdict == SUSPECT).any() or (self.frame.propagated_verdict == SUSPECT).any())

    @property
    def finding(self) -> str:
        """What the diff found, in one sentence."""
        n = len(self.frame)
        if self.culprit is not None:
            r = self.frame[self.frame.module == self.culprit].iloc[0]
            carried = int((self.frame.change == CARRIED_IN).sum())
            return (
                f"{self.culprit} computes differently here: its own change is {r.local_line:.3g}x the line "
                f"(fed the old inputs)" + (f"; {carried} {self._units} after it carry the change" if carried else "")
            )
        if self.first_parted is not None:
            r = self.frame[self.frame.module == self.first_parted].iloc[0]
            how = (
                (
                    "every module alone is within round-off: the change is in code between modules, or in what a "
                    "module reads besides its inputs"
                )
                if self.checked_alone
                else "local changes need the model"
            )
            return f"the runs first part at {self.first_parted} ({r.propagated_line:.3g}x the line); {how}"
        judged = int(self.frame.change.isin([WITHIN, IDENTICAL]).sum())
        if not judged:
            return f"no module could be judged ({n} not judged: the notes say why)"
        same = int((self.frame.change == IDENTICAL).sum())
        if same == judged:
            return f"every module is bit for bit identical ({judged} of {n} judged)"
        return f"every module moved within round-off ({judged} of {n} judged{f', {same} bit for bit identical' if same else ''})"

    def report(self, module: str | None = None, side: str | None = None) -> Any:
        """One module's change as a report: its old output as the oracle, its new one as the backend, the float64
        value as the reference; what :func:`rlx_nb.explore` shows (heatmap, histogram, worst elements, inspector).

        Parameters
        ----------
        module : str, optional
            A module of the frame (default: the culprit, else where the runs first part, else the module furthest
            from the line).
        side : {"local", "propagated"}, optional
            ``"local"``: the module alone, fed the old inputs (run again here); ``"propagated"``: its output in the
            whole run (the model run again here, or the second snapshot's).  Default: the side its verdict came
            from (local when past the line alone).

        Returns
        -------
        DivergenceReport
            With one backend, the new run.  Where the change is past the line only the other way round (the old
            output against the float64 value here: the module's function changed, an edit), the new output is the
            oracle and the old one the backend, so the heatmap shows the side that is past the line.
        """
        from rlx_nb.backends.base import ORACLE, REFERENCE
        from rlx_nb.comparison.compare import compare
        from rlx_nb.execution.results import OK, BackendRun, RunResults
        from rlx_nb.report.report import DivergenceReport

        if self._arrays is None:
            raise InputError("this diff keeps no way to its arrays (a diff read back from its table)")
        r = self._row(module)
        side = side or default_side(r)
        if side not in ("local", "propagated"):
            raise InputError(f"side must be 'local' or 'propagated', got {side!r}")
        if not r[f"{side}_verdict"]:
            raise InputError(f"{r['module']} has no {side} change judged: {r['note'] or 'it was not checked'}")
        old, new, ref = self._arrays(r["name"], side)
        shared = [k for k in old if k in new and k in ref and new[k].shape == old[k].shape]
        if not shared:
            raise InputError(f"{r['module']}: no output of it was recorded in both runs with its float64 value")

        def build(oracle: dict, candidate: dict, name: str) -> DivergenceReport:
            results = RunResults(
                label=f"{r['module']} ({'alone, fed the old inputs' if side == 'local' else 'in the whole run'})",
                oracle=BackendRun(ORACLE, OK, {k: oracle[k] for k in shared}),
                reference=BackendRun(REFERENCE, OK, {k: ref[k] for k in shared}, compute_dtype="float64"),
                candidates={name: BackendRun(name, OK, {k: candidate[k] for k in shared})},
                backward=False,
                environment={"diff": f"{self.old_label} -> {self.new_label}", "module": r["module"], "side": side},
            )
            return DivergenceReport(results, compare(results, progress=False), rule="budget", tol_rel=None)

        forward = build(old, new, self.new_label)
        if forward.suspects or r[f"{side}_verdict"] != SUSPECT:
            return _reworded(forward, r["change"], edit=False)
        back = build(new, old, f"{self.old_label} (old)")  # (past the line only the other way round: an edit)
        return _reworded(back, r["change"], edit=True) if back.suspects else _reworded(forward, r["change"], edit=False)

    def _row(self, module: str | None) -> dict:
        # A row by its module's name as the frame shows it (default: the culprit, where the runs part, the worst).
        rows = {r["module"]: r for r in self._rows}
        if module is None:
            module = self.culprit or self.first_parted
        if module is None:
            lines = [(max(_or0(r["local_line"]), _or0(r["propagated_line"])), r["module"]) for r in self._rows]
            module = max(lines)[1] if lines else None
        if module not in rows:
            raise InputError(f"module {module!r} is not in this diff; its modules: {', '.join(list(rows)[:12])}"
                             + (" ..." if len(rows) > 12 else ""))  # fmt: skip
        return rows[module]

    def lines(self) -> list[str]:
        """The diff as text lines (what ``rlx-nb diff`` prints)."""
        out = [f"rlx_nb diff: {self.heading}: {self.finding}"]
        counts = self.frame.change.value_counts()
        out.append("  modules: " + ", ".join(f"{counts[k]} {k}" for k in counts.index))
        if self.environment:
            out.append("  environment differences" + (" that could explain it:" if self.past_line else ":"))
            out += [f"    {d}" for d in self.environment]
        else:
            out.append("  environment: no difference recorded")
        out += [f"  note: {n}" for n in self.notes]
        changed = [r for r in self._rows if r["change"] == CHANGED_HERE]
        holders = _ancestors(changed, self._rows)
        for r in sorted(changed, key=lambda r: r["order"]):
            if r["name"] in holders:
                continue  # (a module that holds a changed one: its change is that one's, said with it)
            around = [self._module(a) for a in _chain(r, self._rows) if a in holders]
            held = f" (so {len(around)} module(s) holding it: {', '.join(around)})" if around else ""
            out.append(f"  changed here: {r['module']} ({r['local_line']:.3g}x the line){held} {r['reason']}".rstrip())
        carried = self.frame[self.frame.change == CARRIED_IN]
        if len(carried):
            top = carried.loc[carried.propagated_line.idxmax()]
            out.append(f"  carried in: {len(carried)} {self._units}, the furthest {top.module} at "
                       f"{top.propagated_line:.3g}x the line (within it alone)")  # fmt: skip
        return out

    @property
    def heading(self) -> str:
        """``old -> new (backend)``: the two environments by name (the backend said once)."""
        on = "" if f"({self.backend})" in self.new_label else f" ({self.backend})"
        return f"{self.old_label} -> {self.new_label}{on}"

    def _module(self, name: str) -> str:
        return next((r["module"] for r in self._rows if r["name"] == name), name)

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def __repr__(self) -> str:
        return f"<Diff {self.old_label!r} -> {self.new_label!r}: culprit={self.culprit!r}, {len(self.frame)} modules>"

    def _repr_html_(self) -> str:
        return self._body(figure=False)

    def plot(self, *, ax=None):
        """Each module's local (bars) and propagated (dots) change on the verdict's one scale, in execution order."""
        from rlx_nb.plot.charts import plot_localization

        frame = pd.DataFrame({
            "name": self.frame.module,
            "verdict": self.frame.local_verdict if self.checked_alone else self.frame.propagated_verdict,
            "local_line": self.frame.local_line,
            "propagated_line": self.frame.propagated_line,
        })  # fmt: skip
        labels = ("alone, fed the old inputs", "in the whole run")
        return plot_localization(frame, ax=ax, culprit=self.culprit or self.first_parted, labels=labels,
                                 title=f"{self.old_label} -> {self.new_label}: where the runs part")  # fmt: skip

    def to_html(self, path: str | Path, *, title: str | None = None) -> Path:
        """Write the diff as one self-contained HTML file (a title, the finding, the environment differences, the
        plot, the table with its change column coloured, and both environments whole); returns the path (``.html``
        appended when it has no suffix)."""
        from rlx_nb.report.html import STYLE, environment_html

        path = Path(path)
        if path.suffix.lower() not in (".html", ".htm"):
            path = path.with_name(path.name + ".html")
        title = title or f"rlx_nb diff: {self.old_label} -> {self.new_label}"
        old, new = self.environments
        envs = "".join(f"<h3>{html.escape(label)}</h3>{environment_html(env)}"
                       for label, env in ((self.old_label, old), (self.new_label, new)) if env)  # fmt: skip
        page = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
                f"<style>{STYLE}{_CHANGE_STYLE}</style></head><body><h1>{html.escape(title)}</h1>"
                + self._body(figure=True) + (f"<h2>Environment</h2>{envs}" if envs else "") + "</body></html>")  # fmt: skip
        with writing(path, "the diff"):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(page, encoding="utf-8", errors="replace")
        return path

    def _body(self, *, figure: bool) -> str:
        e = html.escape
        parts = [f"<h3>{e(self.heading).replace(' -&gt; ', ' &rarr; ')}</h3>",
                 f"<p><b>{e(self.finding)}</b></p>"]  # fmt: skip
        if self.environment:
            parts.append("<p>Environment differences:</p><ul>" + "".join(f"<li>{e(d)}</li>" for d in self.environment)
                         + "</ul>")  # fmt: skip
        parts += [f"<p>Note: {e(n)}</p>" for n in self.notes]
        if figure:
            import matplotlib.pyplot as plt

            ax = self.plot()
            buf = io.BytesIO()
            ax.figure.savefig(buf, format="png", dpi=100, bbox_inches="tight")
            plt.close(ax.figure)
            parts.append(f"<img alt='where the runs part' src='data:image/png;base64,"
                         f"{base64.b64encode(buf.getvalue()).decode()}'>")  # fmt: skip
        cols = ["module", "change", "local_verdict", "local_line", "propagated_verdict", "propagated_line", "reason"]
        head = "".join(f"<th>{e(c)}</th>" for c in cols)
        body = []
        for _, r in self.frame.iterrows():
            cells = []
            for c in cols:
                v = r[c]
                text = "" if isinstance(v, float) and v != v else f"{v:.3g}" if isinstance(v, float) else str(v)
                cls = f" class='{e(str(v))}'" if c.endswith("_verdict") and v in (SUSPECT, ROUNDOFF) else ""
                if c == "change" and v in _CHANGE_CLASSES:
                    cls = f" class='{_CHANGE_CLASSES[v]}'"
                cells.append(f"<td{cls}>{e(text)}</td>")
            body.append("<tr>" + "".join(cells) + "</tr>")
        parts.append(f"<div class='wide'><table><tr>{head}</tr>{''.join(body)}</table></div>")
        return "".join(parts)


_CHANGE_CLASSES = {CHANGED_HERE: "changed", CARRIED_IN: "carried", WITHIN: "within", IDENTICAL: "identical"}
_CHANGE_STYLE = (
    "td.changed{background:#f8d0d0;color:#b00020;font-weight:bold}td.carried{background:#fde8c8}"
    "td.within{background:#e6f2e6}td.identical{background:#eeeeee;color:#555}"
    ".SUSPECT{background:#f8d0d0}.round-off{background:#e6f2e6}img{max-width:100%}td{text-align:left}"
)


def _reworded(report: Any, change: str, *, edit: bool) -> Any:
    # A module's change as a report, its words the diff's own (reading): never "likely a kernel bug" for a module
    # whose change was carried in, or whose function was edited.
    records = [dataclasses.replace(r, reason=reading(change, r.reason, edit=edit)) for r in report.records]
    return type(report)(report.results, records, rule=report.rule, tol_rel=report.tol_rel)


def _chain(r: dict, rows: list[dict]) -> list[str]:
    # The modules holding row ``r``, innermost first.
    parents = {x["name"]: x.get("parent") for x in rows}
    out, p = [], parents.get(r["name"])
    while p is not None and p not in out:
        out.append(p)
        p = parents.get(p)
    return out


def _ancestors(changed: list[dict], rows: list[dict]) -> set[str]:
    # Every changed module that holds another changed one (with local="all", each ancestor of a changed module is
    # changed too: it runs that module).
    names = {r["name"] for r in changed}
    return {a for r in changed for a in _chain(r, rows) if a in names}


def default_side(row: dict) -> str:
    """The side a row's verdict came from: local when the module alone is past the line (or only it was judged)."""
    return "local" if row["local_verdict"] == SUSPECT or not row["propagated_verdict"] else "propagated"


def _or0(x: float) -> float:
    return 0.0 if x != x else float(x)


def _innermost(rows: list[dict], column: str) -> str | None:
    # The first suspect row, in order, with no suspect below it (no suspect has it as an ancestor).
    parents = {r["name"]: r.get("parent") for r in rows}
    suspects = [r for r in rows if r.get(column) == SUSPECT]
    above: set[str] = set()
    for r in suspects:
        p = parents.get(r["name"])
        while p is not None and p not in above:
            above.add(p)
            p = parents.get(p)
    inner = [r for r in suspects if r["name"] not in above]
    return min(inner, key=lambda r: r["order"])["module"] if inner else None


__all__ = ["CARRIED_IN", "CHANGED_HERE", "COLUMNS", "IDENTICAL", "WITHIN", "Diff", "default_side", "reading", "row"]
