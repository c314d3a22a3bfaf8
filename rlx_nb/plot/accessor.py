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
from rlx_nb.numerics.formats import INT8
from rlx_nb.plot.charts import plot_effective_bits, plot_histogram, plot_scatter, plot_tolerance_curve
from rlx_nb.plot.heatmap import Heatmap, heatmap
from rlx_nb.plot.style import METRIC_LABELS
from rlx_nb.verdict.readings import localized_slice
from rlx_nb.verdict.records import OutputRecord
from rlx_nb.verdict.types import MAX_LIMIT, SUSPECT, VERDICT_SKIPPED
from rlx_nb.verdict.words import Cause


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
    rec: OutputRecord,
    o: np.ndarray,
    b: np.ndarray,
    ref: np.ndarray | None,
    *,
    metric: str | None = None,
    quantum: float | None = None,
    **kwargs: Any,
) -> Heatmap:
    """The heatmap of one judged (backend, output): on the SUSPECT line's scale where the fp64 reference ran
    (``metric=None``: ``"line"``, else ``"abs"``; an int8 output, ``quantum`` given: ``"quanta"``, each element's
    error against the Q/DQ simulation in quanta), titled with what it is, the record's worst element marked and the
    slice a verdict rests on (one judged slice, or a localized error's) outlined with its figure; what
    :meth:`ReportPlotter.heatmap` and a localization's module heatmaps draw."""
    j = rec.judgement
    if metric is None:
        metric = (
            "quanta"
            if quantum
            else "line"
            if ref is not None and j.budget.budget_max == j.budget.budget_max and j.budget.budget_max > 0
            else "abs"
        )
    complex_ = _is_complex(o, b)
    o, b, ref = _real(o), _real(b), _real(ref)
    what = " (real, imag)" if complex_ else ""
    kwargs.setdefault("title", f"{rec.backend} · {rec.output}{what} · {METRIC_LABELS.get(metric, metric)}")
    if rec.pair.worst_index is not None and not complex_:  # the record's worst element, on every metric
        kwargs.setdefault("worst", rec.pair.worst_index)
    band = judged_band(rec)
    if band is not None and not complex_ and "fold" not in kwargs and "select" not in kwargs:
        kwargs.setdefault("band", band)  # (axes, indices, words)
    budget = (MAX_LIMIT * j.budget.budget_max if metric == "line" else quantum if metric == "quanta"
              else j.budget.budget_rmse)  # fmt: skip
    return heatmap(o, b, ref, metric=metric, budget=budget, **kwargs)


def judged_band(rec: OutputRecord) -> tuple[tuple[int, ...], tuple[int, ...], str] | None:
    """``(axes, indices, words)`` of the slice a record's verdict rests on, to outline: the one slice a SUSPECT
    verdict judged (its figure on the line's scale: past the line when no element alone is), else the slice a
    localized error sits on (its share of the error); None where there is none."""
    j = rec.judgement
    if rec.verdict == SUSPECT and j.cause == Cause.SLICE:
        where = _slice_of(j.where.slice_at)
        if where is not None:
            what = "RMS" if rec.compute_dtype == INT8 else "mean"
            return (*where, f"{j.where.slice_at}: {j.line:.3g}x the line; its {what} error "
                            f"{j.where.slice_ratio:.3g}x the round-off there")  # fmt: skip
    where = localized_slice(j)
    if where is not None:
        return (*where, f"{j.where.slice_share_at}: {j.where.slice_share:.0%} of the error")
    return None


def _slice_of(at: str) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    # ``[:, 1]`` -> ((1,), (1,)); None for anything else.
    parts = [p.strip() for p in at.strip("[]").split(",")]
    if not at or not all(p == ":" or p.isdigit() for p in parts) or not any(p.isdigit() for p in parts):
        return None
    axes = tuple(a for a, p in enumerate(parts) if p != ":")
    return axes, tuple(int(parts[a]) for a in axes)


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
        return record_heatmap(self._report.record(backend, output), o, b, ref, metric=metric,
                              quantum=self._quantum(output), **kwargs)  # fmt: skip

    def _quantum(self, output: str) -> float | None:
        # An int8 report's quantum of ``output`` (what its pictures measure errors in); None for a float report.
        int8 = getattr(self._report, "int8", None)
        q = (int8.get("quanta") or {}).get(output) if int8 else None
        return float(q) if q else None

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
        metric: str | None = None,
        highlight: str | None = None,
        **kwargs: Any,
    ):
        """:func:`plot_histogram` of one output across backends (``highlight`` one of them).

        The dashed line is the largest error the verdict allows: the SUSPECT line (``line``: at 1, each
        element's error against fp64 in units of it), the max-based budget's limit (``abs``; ``budget``: in
        budgets; ``quanta``: an int8 output's, in quanta of it), or ``tol_rel`` (``rel``); none for ``ulp``.
        ``metric=None``: ``"quanta"`` for an int8 report, else ``"abs"``.
        """
        output, pairs = self._pairs(output, backends)
        lines, scales = {}, {}
        r = self._report
        quantum = self._quantum(output)
        metric = metric or ("quanta" if quantum else "abs")
        if metric == "quanta" and not quantum:
            raise InputError(f"the 'quanta' histogram is an int8 report's; {output!r} has no quantum")
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
            elif metric == "quanta":
                scales[name] = 1.0 / quantum
                lines[name] = MAX_LIMIT * rec.judgement.budget.budget_max / quantum
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
