"""Baselines: how each backend's error moved between two reports of the same model (two versions of the
stack: torch, ONNX Runtime, OpenVINO, drivers), and whether it got worse beyond round-off.

Records are matched by (backend, output).  A pair **got worse** when the new verdict is SUSPECT and the
old one was not, or both are SUSPECT and the new error, in multiples of its round-off budget
(``excess``), is more than :data:`WORSE_FACTOR` times the old one.  Movement within round-off (a
legitimate change of summation order moves ``excess`` by a few times, below 1) is reported, never
called worse.  Only the saved records are read, never the arrays, so comparing two saved reports of
any size takes milliseconds.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pandas as pd

from rlx_nb.comparison.tables import baseline_frame
from rlx_nb.errors import InputError
from rlx_nb.execution.results import GENERATION_KEY
from rlx_nb.verdict.types import SUSPECT

WORSE_FACTOR = 2.0
"""Both SUSPECT: worse when the new excess is more than this many times the old one."""


class BaselineComparison:
    """Per (backend, output): old and new verdict and excess, how far it moved, and a status.

    ``notes`` says what of the two reports' models and inputs differs (compared anyway with
    ``allow_different_model=True``) or could not be checked.
    """

    def __init__(self, frame: pd.DataFrame, old_label: str, new_label: str, notes: list[str] | None = None) -> None:
        self.frame = frame
        self.old_label, self.new_label = old_label, new_label
        self.notes = list(notes or [])

    @property
    def worse(self) -> pd.DataFrame:
        """The pairs that got worse beyond round-off."""
        return self.frame[self.frame.status == "worse"].reset_index(drop=True)

    @property
    def any_worse(self) -> bool:
        return bool(len(self.worse))

    def lines(self) -> list[str]:
        """One line per backend: its worst movement, and whether it got worse (after a line per note)."""
        out = [f"[{self.new_label}] baseline: {note}" for note in self.notes]
        for backend, rows in self.frame.groupby("backend", sort=False):
            worst = rows.loc[rows.moved.fillna(0).idxmax()] if rows.moved.notna().any() else rows.iloc[0]
            statuses = set(rows.status)
            status = (
                "WORSE" if "worse" in statuses else "better" if "better" in statuses
                else statuses.pop() if statuses <= {"new"} or statuses <= {"gone"} else "same"
            )  # fmt: skip
            move = f"worst move x{worst.moved:.3g}" if worst.moved == worst.moved else "not in both reports"
            out.append(
                f"[{self.new_label}] {backend}: {status} — {move} on {worst.output} "
                f"(x of the SUSPECT line {worst.old_line:.3g} -> {worst.new_line:.3g}; "
                f"{worst.old_verdict or '-'} -> {worst.new_verdict or '-'})"
            )
        return out

    def plot(self, ax: Any = None) -> Any:
        """Old against new place on the SUSPECT line per (backend, output), log-log, the line and y = x drawn;
        each point labelled (the first few), red where the new verdict is SUSPECT."""
        from rlx_nb._support.safe import plot_text
        from rlx_nb.plot.style import PALETTE, SUSPECT_COLOUR, new_axes

        ax = new_axes(ax, figsize=(6.5, 4.8))
        f = self.frame.dropna(subset=["old_line", "new_line"])
        x, y = f.old_line.clip(lower=1e-6), f.new_line.clip(lower=1e-6)
        markers = {"worse": "^", "better": "v", "same": "o"}
        for status, marker in markers.items():
            for suspect in (False, True):
                sel = (f.status == status) & ((f.new_verdict == SUSPECT) == suspect)
                if sel.any():
                    ax.scatter(x[sel], y[sel], marker=marker, s=28, color=SUSPECT_COLOUR if suspect else PALETTE[0],
                               label=f"{status}{' (SUSPECT now)' if suspect else ''}")  # fmt: skip
        for k, row in enumerate(f.itertuples()):
            if k < 12:  # a label for each of the first points; the frame has them all
                ax.annotate(plot_text(f"{row.backend} · {row.output}"), (x.iloc[k], y.iloc[k]), xytext=(4, 3),
                            textcoords="offset points", fontsize=6, color="#333333")  # fmt: skip
        lo = 1e-3
        ax.plot([lo, 1e4], [lo, 1e4], color="grey", linewidth=1, label="unchanged")
        ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="SUSPECT line (new)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(plot_text(f"old: x of the SUSPECT line ({self.old_label})"))
        ax.set_ylabel(plot_text(f"new: x of the SUSPECT line ({self.new_label})"))
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, frameon=False)
        ax.set_title("each output's place on the SUSPECT line, old vs new", fontsize=9)
        return ax

    def _repr_html_(self) -> str:
        return self.frame._repr_html_()


def _load(report: Any) -> Any:
    # A forward report as it is; a generation's, its steps' logits report (compared step by step).
    from rlx_nb.report.report import DivergenceReport, read_report

    if isinstance(report, (str, Path)):
        report = read_report(report)
    report = getattr(report, "logits", report)  # (a GenerationReport's steps)
    if isinstance(report, DivergenceReport):
        return report
    raise InputError(f"a report or the path of a saved one (.rlxnb) is needed; got {type(report).__name__}")


def _status(old: Any, new: Any) -> str:
    if old is None:
        return "new"
    if new is None:
        return "gone"
    if new.verdict == SUSPECT and old.verdict != SUSPECT:
        return "worse"
    if old.verdict == SUSPECT and new.verdict != SUSPECT:
        return "better"
    if new.verdict == SUSPECT and old.verdict == SUSPECT and new.judgement.line > WORSE_FACTOR * old.judgement.line:
        return "worse"
    if new.verdict == SUSPECT and old.verdict == SUSPECT and old.judgement.line > WORSE_FACTOR * new.judgement.line:
        return "better"
    return "same"


def compare_reports(old: Any, new: Any, *, allow_different_model: bool = False) -> BaselineComparison:
    """Compare ``new`` against the baseline ``old`` (reports, or paths of saved ones), output by output.

    Both forward reports, or both generation reports (their steps' logits compared step by step).

    A baseline only means something for the same model on the same inputs: their saved fingerprints
    (the structure -- names, dtypes, shapes -- and the values of the inputs and of the weights) are
    checked first, and a difference is an :class:`~rlx_nb.InputError` naming it, unless
    ``allow_different_model=True`` (then it is a note in ``.notes`` and ``.lines()``).  A fingerprint
    one report lacks (an older file, inputs changed in place after the run) is a note too.

    Examples
    --------
    >>> import torch, rlx_nb
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    >>> x = torch.randn(4, 8)
    >>> old = rlx_nb.backend_divergence(model, x, backends=["cpu-nomkldnn"])
    >>> new = rlx_nb.backend_divergence(model, x, backends=["cpu-nomkldnn", "fault:gelu-approx"])
    >>> rlx_nb.compare_reports(old, new).frame.status.tolist()
    ['same', 'new']
    """
    if not isinstance(allow_different_model, bool):
        raise InputError(f"allow_different_model must be True or False, got {allow_different_model!r}")
    a, b = _load(old), _load(new)
    kinds = [("a generation" if GENERATION_KEY in r.results.environment else "a forward pass") for r in (a, b)]
    if kinds[0] != kinds[1]:
        raise InputError(f"the baseline is {kinds[0]}'s report and the new one {kinds[1]}'s: compare like with like")
    differ, unchecked = fingerprint_differences(a.results.fingerprints, b.results.fingerprints)
    if differ and not allow_different_model:
        raise InputError(
            f"the baseline and the new report were not made from the same model and inputs: {'; '.join(differ)} "
            "-- a baseline compares one model across versions of the stack; pass allow_different_model=True "
            "(--allow-different-model) to compare them anyway"
        )
    notes = [f"compared although {d}" for d in differ] + unchecked
    olds = {(r.backend, r.output): r for r in a.records if r.output is not None}
    news = {(r.backend, r.output): r for r in b.records if r.output is not None}
    rows = []
    for key in list(olds) + [k for k in news if k not in olds]:
        o, n = olds.get(key), news.get(key)
        oe = o.judgement.line if o is not None else math.nan
        ne = n.judgement.line if n is not None else math.nan
        moved = ne / oe if oe > 0 and ne == ne else math.nan  # NaN when either is missing
        rows.append(
            {
                "backend": key[0],
                "output": key[1],
                "status": _status(o, n),
                "old_verdict": o.verdict if o is not None else "",
                "new_verdict": n.verdict if n is not None else "",
                "old_line": oe,
                "new_line": ne,
                "moved": moved,
            }
        )
    return BaselineComparison(baseline_frame(rows), a.label, b.label, notes)


_CHECKED = (
    ("input_structure", "the inputs' structure (names, dtypes, shapes)", "inputs", "the inputs' values"),
    ("model_structure", "the model's structure (parameter and buffer names, dtypes, shapes)", "model", "the weights"),
)


def fingerprint_differences(old: Any, new: Any) -> tuple[list[str], list[str]]:
    """``(differences, unchecked)`` between two reports' fingerprints, each a phrase.

    Structures first; the values' hashes only where the structures agree (other shapes, other values).
    """
    differ, unchecked = [], []
    for structure, structure_words, values, value_words in _CHECKED:
        so, sn = old.get(structure), new.get(structure)
        if so is not None and sn is not None and so != sn:
            differ.append(f"{structure_words} differs: {so} vs {sn}")
            continue
        vo, vn = old.get(values), new.get(values)
        if vo is None or vn is None:
            who = "the baseline" if vo is None else "the new report"
            unchecked.append(f"{value_words} not checked: {who} has no fingerprint of them (an older file, or "
                             "changed in place after its run)")  # fmt: skip
        elif vo != vn:
            differ.append(f"{value_words} differ (fingerprint {vo} vs {vn})")
    return differ, unchecked
