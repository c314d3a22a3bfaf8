"""DivergenceReport: the frames, the seed's text lines, and the notebook view."""

from __future__ import annotations

import functools
import html
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from rlx_nb.backends.base import ORACLE
from rlx_nb.comparison.compare import compare
from rlx_nb.comparison.tables import (
    backends_frame,
    compact_backends_frame,
    summary_frame,
    timings_frame,
)
from rlx_nb.errors import InputError, did_you_mean
from rlx_nb.execution.results import RunResults
from rlx_nb.execution.source import WeakSource
from rlx_nb.report import elements as lookups
from rlx_nb.verdict.records import OutputRecord, worst_record
from rlx_nb.verdict.types import ROUNDOFF, SUSPECT, VERDICT_ERROR, VERDICT_SKIPPED
from rlx_nb.verdict.words import seed_line


def wide_budget(int8: dict) -> str:
    # An int8 report's search for decisive elements, where it gave up, in words ("" where it found them all).
    search = int8.get("decisive_search") or {}
    if search.get("complete", True):
        return ""
    runs, seconds = int(search.get("runs") or 0), float(search.get("seconds") or 0.0)
    more = int(search.get("to_finish") or 0)
    cost = f", about {more * seconds / runs:.0f} s" if runs and seconds else ""
    outputs = ", ".join(search.get("outputs") or []) or "every output"
    return (
        f"the search for decisive elements (values whose rounding alone moves the output) stopped after {runs} runs "
        f"({seconds:.1f} s) with {search.get('left', '?')} of {int8.get('candidates', '?')} near-boundary values "
        f"unresolved, so none is held and the budget of {outputs} is as wide as all their roundings leave it (a "
        f"fault can read as round-off); about {more} more runs{cost} would finish it: "
        "quantized_divergence(..., search_runs=math.inf)"
    )


class DivergenceReport:
    """Every candidate backend compared with the CPU oracle and the fp64 reference.

    Attributes
    ----------
    results : RunResults
        The raw outputs (numpy) of every run; kept once, shared by every view.
    records : list of OutputRecord
        One per (backend, output).
    rule : str
        The verdict in charge: ``"budget"`` (default) or ``"fixed"``.

    Examples
    --------
    >>> import torch, rlx_nb
    >>> report = rlx_nb.backend_divergence(torch.nn.Linear(4, 2), torch.ones(3, 4), backends=["cpu-nomkldnn"])
    >>> report.any_suspect
    False
    """

    def __init__(
        self,
        results: RunResults,
        records: list[OutputRecord],
        *,
        rule: str,
        tol_rel: float | None,
        source: WeakSource | None = None,
    ):
        self.results = results
        self.records = records
        self.rule = rule
        self.tol_rel = tol_rel
        self.source = source
        """The model, inputs and params it was made from, held weakly (None for a loaded or merged report)."""
        self.backend_objects: dict[str, Any] = {}
        """The :class:`~rlx_nb.backends.base.Backend` objects passed in ``backends=[...]`` unregistered, by name."""
        self.repros: dict[str, Any] = {}
        """The standalone repros written for this report's backends (:meth:`repro`), by backend."""
        self.localizer: Any = None
        """What :meth:`localize` calls instead of the module search, where the call that made the report gave one
        (:func:`rlx_nb.quantized_divergence`'s: the requantization points of its converted graph)."""

    @property
    def int8(self) -> dict[str, Any] | None:
        """For an int8 model's report (:func:`rlx_nb.quantized_divergence`), what its budget was measured from:
        ``oracle`` (what the oracle and reference are), ``trials``, each output's ``quanta`` and the
        ``requantizations``; None for a float model's."""
        return self.results.environment.get("int8")

    @property
    def requantizations(self) -> pd.DataFrame:
        """An int8 report's requantizations in graph order: the op and module that computed each, its
        accumulator's step, the fp32 simulation's largest and mean error there (in its quanta), the width within
        which a correct kernel may round the other way, and the spread its trials jitter within, which sets how
        often they do (:func:`rlx_nb.int8.requantization.requantizations`)."""
        from rlx_nb.comparison.tables import Table

        if self.int8 is None:
            raise InputError("requantizations are an int8 report's (rlx_nb.quantized_divergence); this is a float "
                             "model's")  # fmt: skip
        columns = ["node", "op", "module", "accumulator_quantum", "fp32_error", "fp32_mean_error", "width", "spread"]
        return Table(self.int8.get("requantizations") or [], columns=columns)

    def localize(self, backend: str | None = None, **kwargs: Any):
        """:func:`rlx_nb.localize` this report's model on ``backend`` (default: the first suspect).

        ``model`` and ``inputs`` default to the ones the report was made from, which it holds only
        weakly (a report keeps no model alive): pass them when those are gone, or for a loaded
        report.  ``backward=None`` localizes the backward when the backend's worst output is a
        ``grad:`` output.  See :func:`rlx_nb.localization.localize_report`.
        """
        if self.localizer is not None:
            return self.localizer(backend, **kwargs)
        if self.int8 is not None:
            raise InputError("this int8 report was loaded or merged: it holds no converted graph to localize on; run "
                             "rlx_nb.quantized_divergence(model, inputs) again and localize its report")  # fmt: skip
        from rlx_nb.localization.locate import localize_report

        return localize_report(self, backend, **kwargs)

    def repro(self, backend: str, path: str | Path, **kwargs: Any):
        """Localize ``backend`` and write its culprit's standalone repro to ``path`` (see
        :meth:`rlx_nb.Localization.repro`: one file that imports only torch, numpy and the runtime, shrunk, with
        where the error is born): a :class:`~rlx_nb.localization.reproduce.Repro`.  ``model``/``inputs``/``params``
        as for :meth:`localize`; the other options go to ``Localization.repro``.  A backend within round-off gets
        none, and an error saying so."""
        from rlx_nb.report.issue import repro_for

        return repro_for(self, backend, path, **kwargs)

    def issue(self, backend: str, path: str | Path, **kwargs: Any):
        """Write markdown ready to file for ``backend``'s divergence (a ``.md`` path, or a directory): a title, the
        environment, what diverges and by how much against float64 (float32 eager's own error for scale), where it
        is born (the compiler pass, the runtime's layer), and the standalone repro inline (written beside it).
        Reuses the repro :meth:`repro` wrote where the options would write the same one (``progress`` changes
        nothing), or writes one (options as for :meth:`repro`).  Returns an :class:`~rlx_nb.report.issue.Issue`:
        its ``path`` and ``text``, shown as markdown in a notebook."""
        from rlx_nb.report.issue import issue_for

        return issue_for(self, backend, path, **kwargs)

    @classmethod
    def from_results(
        cls, results: RunResults, *, rule: str = "budget", tol_rel: float | None = None, progress: bool = True
    ):
        """Compare ``results`` and wrap them in a report."""
        records = compare(results, tol_rel=tol_rel, rule=rule, progress=progress)
        return cls(results, records, rule=rule, tol_rel=tol_rel)

    def save(self, path) -> Path:
        """Save the outputs of every run, the fp64 reference, fingerprints and environment (no pickle).

        See :mod:`rlx_nb.report.files` for the format; :func:`rlx_nb.load_report` reads it back exactly.
        """
        from rlx_nb.report.files import save_results

        return save_results(self.results, path, rule=self.rule, tol_rel=self.tol_rel, records=self.records)

    def to_html(self, path, *, localization=None, title: str | None = None) -> Path:
        """Write one self-contained HTML file (inline images, no script, no network): the verdicts, the
        backends and summary tables, each SUSPECT output's heatmap, histogram and worst elements, the environment, and
        ``localization`` (a :class:`rlx_nb.Localization`) when given.  No model weights.  Returns the path."""
        from rlx_nb.report.html import write_html

        return write_html(self, path, localization=localization, title=title)

    @functools.cached_property
    def plot(self):
        """Plots of this report: ``report.plot.heatmap(backend, output)``, ``.histogram``, ``.scatter``,
        ``.tolerance_curve`` (see :class:`rlx_nb.plot.accessor.ReportPlotter`)."""
        from rlx_nb.plot.accessor import ReportPlotter

        return ReportPlotter(self)

    @property
    def label(self) -> str:
        return self.results.label

    @functools.cached_property
    def summary(self) -> pd.DataFrame:
        """One row per (backend, output), the columns read first: the verdict, ``line`` (its place on the SUSPECT
        line: 1.0 is the line), a few words why, the largest difference and where; every other figure and the
        whole reason: :attr:`summary_detail`."""
        return self._in_quanta(summary_frame(self.records, short=True))

    @functools.cached_property
    def summary_detail(self) -> pd.DataFrame:
        """One row per (backend, output): every figure of its record, both verdicts and the whole reason."""
        return summary_frame(self.records)

    @functools.cached_property
    def backends_detail(self) -> pd.DataFrame:
        """One row per backend, every column: both verdicts, the worst output and its whole reason, the
        seed's maxima, counts, timing and the backend's notes."""
        runs = self.results.candidates
        return backends_frame(
            self.records, {n: r.seconds for n, r in runs.items()}, {n: list(r.notes) for n, r in runs.items()}
        )

    @property
    def backends(self) -> pd.DataFrame:
        """One row per backend at a glance: verdict, worst output, how far over the limits, effective bits
        and a few words why (the whole reason and the rest: :attr:`backends_detail`)."""
        return self._in_quanta(compact_backends_frame(self.backends_detail, self.records))

    def _in_quanta(self, frame: pd.DataFrame) -> pd.DataFrame:
        # An int8 report's frames read its largest error in quanta of the output where a float report's read
        # effective bits (a float format's measure: none here).
        if self.int8 is None or "effective_bits" not in frame:
            return frame
        quanta = self.int8.get("quanta") or {}
        outputs = frame["output"] if "output" in frame else frame["worst_output"]  # (a backend's row: its worst)
        q = outputs.map(lambda o: quanta.get(o) or np.nan).astype(float)
        at = list(frame.columns).index("effective_bits")
        frame = frame.drop(columns="effective_bits")
        frame.insert(at, "max_quanta", frame["max_abs"] / q)
        return frame

    @property
    def suspects(self) -> list[str]:
        """Names of the backends whose verdict is SUSPECT."""
        return [b for b in self.results.candidates if any(r.backend == b and r.suspect for r in self.records)]

    @property
    def worst(self) -> list[str]:
        """The backends that produced outputs, worst first: SUSPECT ones, then by their worst output's place on
        the SUSPECT line (what the explorer and the plots open on when no backend is named)."""

        def rank(backend: str) -> tuple[bool, float]:
            rec = self.record(backend)
            line = rec.judgement.line
            return rec.verdict == SUSPECT, line if line == line else -1.0

        ran = [b for b in self.results.candidates if b not in self.errors]
        return sorted(ran, key=rank, reverse=True)

    @property
    def any_suspect(self) -> bool:
        return bool(self.suspects)

    @property
    def errors(self) -> list[str]:
        """Names of the backends that failed to run (verdict ``error``)."""
        return [
            b
            for b in self.results.candidates
            if any(r.backend == b and r.verdict == VERDICT_ERROR and r.output is None for r in self.records)
        ]

    @property
    def not_run(self) -> list[str]:
        """Names of the backends that did not run: failed (``error``) or skipped (``skipped``: memory, an export
        that does not apply)."""
        return [b for b in self.results.candidates
                if any(r.backend == b and r.verdict in (VERDICT_ERROR, VERDICT_SKIPPED) and r.output is None
                       for r in self.records)]  # fmt: skip

    def judged_nothing(self) -> str:
        """Why this report cannot pass a gate although it names no SUSPECT, or "": the call was interrupted, no
        backend but the oracle ran, or no backend's output was judged (each skipped, failed or not compared).

        Examples
        --------
        >>> import torch, rlx_nb
        >>> rlx_nb.backend_divergence(torch.nn.Linear(2, 2), torch.ones(1, 2), backends=["cpu"]).judged_nothing()
        'no backend but the CPU oracle ran: nothing was compared'
        """
        if self.incomplete:
            return f"the call was interrupted, so not every backend was judged ({self.incomplete})"
        if not self.results.candidates:
            return "no backend but the CPU oracle ran: nothing was compared"
        if not any(r.verdict in (ROUNDOFF, SUSPECT) for r in self.records):
            why = "; ".join(f"{b}: {self.record(b).verdict}" for b in self.results.candidates)
            return f"no backend's output was judged ({why})"
        return ""

    def error_detail(self, backend: str) -> str:
        """The whole error of a backend that failed to run (or whose backward failed).

        An error row's reason is the gist (the exception's first line and the lines that name the
        cause); this is every line of it, the errors it was raised from, and the traceback.

        Examples
        --------
        >>> import torch, rlx_nb
        >>> r = rlx_nb.backend_divergence(torch.nn.Linear(2, 2), torch.ones(1, 2), backends=["cpu-nomkldnn"])
        >>> r.error_detail("cpu-nomkldnn")
        ''
        """
        if backend not in self.results.candidates:
            hint = did_you_mean(backend, self.results.candidates)
            raise InputError(
                f"no backend {backend!r} in this report{hint}; it has: {', '.join(self.results.candidates)}"
            )
        return self.results.candidates[backend].detail

    def record(self, backend: str, output: str | None = None) -> OutputRecord:
        """The record of one (backend, output); ``output=None`` picks the backend's worst."""
        recs = [r for r in self.records if r.backend == backend]
        if not recs:
            hint = did_you_mean(backend, self.results.candidates)
            raise InputError(
                f"no backend {backend!r} in this report{hint}; it has: {', '.join(self.results.candidates)}"
            )
        if output is None:
            return worst_record(recs)
        for r in recs:
            if r.output == output:
                return r
        if all(r.output is None for r in recs):
            raise InputError(f"backend {backend!r} did not run, so it has no output {output!r}: {recs[0].reason}")
        names = ", ".join(str(r.output) for r in recs)
        raise InputError(f"no output {output!r} for backend {backend!r}; outputs: {names}")

    def arrays(self, backend: str, output: str | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """``(oracle, backend, fp64 reference)`` arrays of one output (reference may be None)."""
        return lookups.arrays(self.results, self.record(backend, output))

    def elements(self, backend: str, output: str | None = None, *, top: int = 20) -> pd.DataFrame:
        """The ``top`` worst elements (by absolute error) of one output, worst first.

        O(n) time and O(top) memory over the output.  ``output=None`` picks
        the backend's worst output.

        Examples
        --------
        >>> import torch, rlx_nb
        >>> r = rlx_nb.backend_divergence(torch.nn.Linear(4, 2), torch.ones(3, 4), backends=["cpu-nomkldnn"])
        >>> list(r.elements("cpu-nomkldnn", top=2).columns[:3])
        ['rank', 'index', 'flat_index']
        """
        return lookups.elements(self.results, self.record(backend, output), top)

    def element(self, backend: str, output: str | None, index: tuple[int, ...]) -> pd.DataFrame:
        """One element of one output as a one-row frame (the columns of :meth:`elements`).

        Examples
        --------
        >>> import torch, rlx_nb
        >>> r = rlx_nb.backend_divergence(torch.nn.Linear(4, 2), torch.ones(3, 4), backends=["cpu-nomkldnn"])
        >>> r.element("cpu-nomkldnn", "out", (0, 1))["index"].iloc[0]
        (0, 1)
        """
        return lookups.element(self.results, self.record(backend, output), index)

    def element_frame(self, backend: str, output: str | None = None, *, max_bytes: float = 5e8) -> pd.DataFrame:
        """Every element of one output as a frame, with compact dtypes — only on explicit request.

        Columns: one index column per axis (the smallest integer type that fits), ``oracle``,
        ``backend`` (the output's float type), ``reference`` (float64), ``abs_err``, ``rel_err``
        (float32) and ``ulp_err`` (uint32, saturated).  Anything above ``max_bytes`` (500 MB by
        default) is refused with its size; :meth:`elements` gives the worst ``top`` rows in O(top) memory.
        """
        return lookups.element_frame(self.results, self.record(backend, output), max_bytes)

    def lines(self) -> list[str]:
        """The seed's report lines, one per backend."""
        label = self.label
        if not self.results.candidates and not self.incomplete:
            return [f"[{label}] backend divergence: CPU-only node — nothing to compare"]
        out = []
        for name in self.results.candidates:
            recs = [r for r in self.records if r.backend == name]
            out.append(seed_line(label, name, recs, (self.int8 or {}).get("quanta") if self.int8 else None))
        if self.incomplete:
            out.append(f"[{label}] INCOMPLETE: {self.incomplete}")
        gave_up = wide_budget(self.int8) if self.int8 else ""
        if gave_up:
            out.append(f"[{label}] INT8 BUDGET WIDE: {gave_up}")
        return out

    @property
    def budget_note(self) -> str:
        """Why an int8 report's budget is wider than it need be (the search for decisive elements gave up), and what
        finishing it would cost; "" where it is not."""
        return wide_budget(self.int8) if self.int8 else ""

    @property
    def timings(self) -> pd.DataFrame:
        """Where the call's time and memory went: one row per phase (the private copy, the oracle, its
        determinism rerun, the fp64 reference, the sequential-sums run, the precision anchors, each backend
        and, for one with a preparation, its ``: prepare`` and ``: first run`` inside it), with ``seconds``,
        ``peak_bytes`` (the process's resident memory at its highest during the phase) and
        ``rss_after_bytes``.  Empty for reports saved before it existed or merged from several nodes."""
        found = self.results.environment.get("timings") or {}
        return timings_frame(found if isinstance(found, dict) else {})

    @property
    def incomplete(self) -> str:
        """Why the report is incomplete (an interrupt stopped its call: which backends did not run), or ""."""
        return str(self.results.environment.get("incomplete") or "")

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def __repr__(self) -> str:
        n = len(self.results.candidates)
        return f"<DivergenceReport {self.label!r}: {n} backend(s) vs {ORACLE}, suspects={self.suspects}>"

    def _repr_html_(self) -> str:
        head = (
            f"<p><b>{html.escape(self.label)}</b>: {len(self.results.candidates)} backend(s) vs the "
            f"<code>{ORACLE}</code> oracle, judged by the <i>{self.rule}</i> rule. "
            f"Suspects: <b>{html.escape(', '.join(self.suspects) or 'none')}</b>. "
            "<code>report.backends_detail</code> has every column and the whole reasons.</p>"
        )
        return head + self.backends._repr_html_()


def read_report(path) -> DivergenceReport:
    """Read a report saved by :meth:`DivergenceReport.save` as a forward report (a generation's: its steps' logits
    report); arrays are read lazily, on first use.  :func:`rlx_nb.load_report` makes a generation's a
    GenerationReport.

    Raises :class:`rlx_nb.report.files.ReportFormatError` (an :class:`RlxError`) for anything that is not
    a readable report of this version; never unpickles or executes anything.
    """
    from rlx_nb.report.files import load_results, records_from_meta

    results, meta = load_results(path)  # (rule and tol_rel checked there)
    rule = meta.get("rule") or "budget"
    tol = float(meta["tol_rel"]) if meta.get("tol_rel") is not None else None
    records = records_from_meta(meta, path, results)
    if records is None:
        report = DivergenceReport.from_results(results, rule=rule, tol_rel=tol)
    else:
        report = DivergenceReport(results, records, rule=rule, tol_rel=tol)
    return report
