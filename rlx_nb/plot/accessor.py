"""``report.plot``: the plot functions of :mod:`rlx_nb.plot.charts`, fed from a report by backend and output name.

:mod:`rlx_nb.plot.charts` takes arrays and frames and knows no report; this module picks a report's
arrays, records and budgets and hands them over.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from rlx_nb.errors import InputError
from rlx_nb.execution.results import RunResults
from rlx_nb.plot.charts import plot_effective_bits, plot_histogram, plot_scatter, plot_tolerance_curve
from rlx_nb.plot.heatmap import Heatmap, heatmap
from rlx_nb.plot.style import METRIC_LABELS
from rlx_nb.verdict.readings import localized_slice
from rlx_nb.verdict.records import OutputRecord
from rlx_nb.verdict.types import MAX_LIMIT, VERDICT_SKIPPED


class Plottable(Protocol):
    """What the plots read of a report (a :class:`~rlx_nb.DivergenceReport` is one)."""

    results: RunResults
    records: list[OutputRecord]
    suspects: list[str]
    errors: list[str]
    worst: list[str]

    def record(self, backend: str, output: str | None = None) -> OutputRecord: ...

    def arrays(self, backend: str, output: str | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]: ...


def record_heatmap(
    rec: OutputRecord, o: np.ndarray, b: np.ndarray, ref: np.ndarray | None, *, metric: str | None = None, **kwargs: Any
) -> Heatmap:
    """The heatmap of one judged (backend, output): on the SUSPECT line's scale where the fp64 reference ran
    (``metric=None``: ``"line"``, else ``"abs"``), titled with what it is, the record's worst element marked and
    a localized error's slice outlined; :meth:`ReportPlotter.heatmap` and a localization's module heatmaps."""
    j = rec.judgement
    if metric is None:
        metric = (
            "line"
            if ref is not None and j.budget.budget_max == j.budget.budget_max and j.budget.budget_max > 0
            else "abs"
        )
    complex_ = _is_complex(o, b)
    o, b, ref = _real(o), _real(b), _real(ref)
    what = " (real, imag)" if complex_ else ""
    kwargs.setdefault("title", f"{rec.backend} · {rec.output}{what} · {METRIC_LABELS.get(metric, metric)}")
    if rec.pair.worst_index is not None and not complex_:  # the record's worst element, on every metric
        kwargs.setdefault("worst", rec.pair.worst_index)
    where = localized_slice(j)
    if where is not None and not complex_ and "fold" not in kwargs and "select" not in kwargs:
        # A localized error's slice (one position of every batch x head, one channel) outlined as what it is.
        kwargs.setdefault(
            "band", (*where, f"{j.where.slice_share_at}: {j.where.slice_share:.0%} of the error")
        )  # (axes, indices)
    budget = MAX_LIMIT * j.budget.budget_max if metric == "line" else j.budget.budget_rmse
    return heatmap(o, b, ref, metric=metric, budget=budget, **kwargs)


class ReportPlotter:
    """``report.plot``: the plot functions fed from a report (backend and output by name).

    ``backend=None`` picks the first suspect (else the first backend);
    ``output=None`` picks that backend's worst output.
    """

    def __init__(self, report: Plottable) -> None:
        self._report = report

    def _pick(self, backend: str | None, output: str | None) -> tuple[str, str]:
        r = self._report
        names = r.worst
        if not names:
            raise InputError("no backend in this report produced outputs to plot")
        backend = backend or names[0]  # the worst: the first SUSPECT, else the one nearest the line
        rec = r.record(backend, output)
        if rec.output is None:
            raise InputError(f"backend {backend!r} did not run: {rec.reason}")
        return backend, rec.output

    def heatmap(
        self, backend: str | None = None, output: str | None = None, *, metric: str | None = None, **kwargs: Any
    ):
        """:func:`plot_heatmap` of one (backend, output).  ``metric=None``: ``"line"`` (each element's error
        against fp64 in units of the SUSPECT line: past 1 it alone makes the output SUSPECT) where the fp64
        reference ran, else ``"abs"``."""
        return self.heatmap_picture(backend, output, metric=metric, **kwargs).ax

    def heatmap_picture(
        self, backend: str | None = None, output: str | None = None, *, metric: str | None = None, **kwargs: Any
    ) -> Heatmap:
        """:meth:`heatmap`, returning the :class:`~rlx_nb.plot.charts.Heatmap` it drew (its pooled values, folding
        and marked element: what the explorer reads back)."""
        backend, output = self._pick(backend, output)
        o, b, ref = self._report.arrays(backend, output)
        return record_heatmap(self._report.record(backend, output), o, b, ref, metric=metric, **kwargs)

    def _pairs(self, output: str | None, backends: Sequence[str] | None) -> tuple[str, dict]:
        r = self._report
        _, output = self._pick(backends[0] if backends else None, output)
        names = list(backends) if backends else [b for b in r.results.candidates if b not in r.errors]
        pairs = {}
        for name in names:
            try:
                rec = r.record(name, output)
            except InputError:  # a backend that did not run (a skipped row): nothing to draw
                continue
            if rec.output is not None and rec.shape is not None and rec.verdict != VERDICT_SKIPPED:
                try:
                    o, b, _ = r.arrays(name, output)
                except InputError:
                    continue
                o, b = _real(o), _real(b)
                if o.shape == b.shape and np.issubdtype(o.dtype, np.floating):
                    pairs[name] = (o, b)
        return output, pairs

    def histogram(
        self,
        output: str | None = None,
        backends: Sequence[str] | None = None,
        *,
        metric: str = "abs",
        highlight: str | None = None,
        **kwargs: Any,
    ):
        """:func:`plot_histogram` of one output across backends (``highlight`` one of them).

        The dashed line is the largest error the verdict allows: the SUSPECT line (``line``: at 1, each
        element's error against fp64 in units of it), the max-based budget's limit (``abs``; ``budget``: in
        budgets), or ``tol_rel`` (``rel``); none for ``ulp``.
        """
        output, pairs = self._pairs(output, backends)
        lines, scales = {}, {}
        r = self._report
        if metric in ("budget", "line"):
            reference = r.results.reference.outputs.get(output)
            if reference is None or not reference.is_array:
                raise InputError(f"the {metric!r} histogram needs the fp64 reference of {output!r}")
            pairs = {name: (_real(reference.value), b) for name, (_, b) in pairs.items()}
        for name in pairs:
            rec = r.record(name, output)
            if metric == "line":
                unit = MAX_LIMIT * rec.judgement.budget.budget_max
                scales[name] = 1.0 / unit if unit > 0 else 1.0
                lines[name] = 1.0
            elif metric == "budget":
                scales[name] = 1.0 / rec.judgement.budget.budget_rmse if rec.judgement.budget.budget_rmse > 0 else 1.0
                lines[name] = MAX_LIMIT * rec.judgement.budget.budget_max * scales[name]
            elif metric in ("abs", "rel"):
                lines[name] = (
                    rec.judgement.rules.tol_rel if metric == "rel" else MAX_LIMIT * rec.judgement.budget.budget_max
                )
        kwargs.setdefault("title", f"{output}: error histogram")
        return plot_histogram(
            pairs, metric=metric, lines=lines, scales=scales, suspects=r.suspects, highlight=highlight, **kwargs
        )

    def scatter(self, backend: str | None = None, output: str | None = None, **kwargs: Any):
        """:func:`plot_scatter` of one (backend, output)."""
        backend, output = self._pick(backend, output)
        o, b, _ = self._report.arrays(backend, output)
        o, b = _real(o), _real(b)
        kwargs.setdefault("tol_rel", self._report.record(backend, output).judgement.rules.tol_rel)
        kwargs.setdefault("title", f"{backend} · {output}: error vs magnitude")
        return plot_scatter(o, b, **kwargs)

    def effective_bits(self, output: str | None = None, **kwargs: Any):
        """:func:`plot_effective_bits` of each backend's worst (lowest) reading, or of one output, coloured
        by the backend's verdict."""
        bits: dict[str, float] = {}
        for rec in self._report.records:
            if (
                output is None or rec.output == output
            ) and rec.judgement.reading.effective_bits == rec.judgement.reading.effective_bits:
                bits[rec.backend] = min(bits.get(rec.backend, 99.0), rec.judgement.reading.effective_bits)
        if not bits:
            if getattr(self._report, "int8", None) is not None:
                raise InputError("no effective-precision readings in an int8 report: its errors are quanta of the "
                                 "output, not a float format's bits (report.plot.heatmap shows them on the line's scale)")  # fmt: skip
            raise InputError("no effective-precision readings in this report (no fp64 reference?)")
        verdicts = {name: self._report.record(name, output).verdict for name in bits}
        return plot_effective_bits(bits, verdicts=verdicts, **kwargs)

    def tolerance_curve(self, output: str | None = None, backends: Sequence[str] | None = None, **kwargs: Any):
        """:func:`plot_tolerance_curve` of one output across backends."""
        output, pairs = self._pairs(output, backends)
        kwargs.setdefault("title", f"{output}: fraction failing vs tol_rel")
        return plot_tolerance_curve(pairs, suspects=self._report.suspects, **kwargs)


def _is_complex(*arrays: Any) -> bool:
    return any(a is not None and np.iscomplexobj(a) for a in arrays)


def _real(x: Any) -> Any:
    # A complex output is drawn as its (real, imag) parts, a last axis of 2: the interleaved view the
    # comparison measures (rlx_nb.compare).
    if x is None or not np.iscomplexobj(x):
        return x
    wide = np.complex128 if x.dtype == np.complex128 else np.complex64
    return (
        np.ascontiguousarray(x.astype(wide, copy=False))
        .view(np.float64 if wide is np.complex128 else np.float32)
        .reshape(*x.shape, 2)
    )
