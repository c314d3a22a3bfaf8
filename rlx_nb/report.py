"""DivergenceReport: the frames, the seed's text lines, and the notebook view."""

from __future__ import annotations

import functools
import html
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from rlx_nb.backends import ORACLE
from rlx_nb.compare import OutputRecord, compare, on_device
from rlx_nb.elements import rel_error, top_k, ulp_distance
from rlx_nb.errors import InputError
from rlx_nb.frames import (
    backends_frame,
    compact_backends_frame,
    element_table,
    elements_frame,
    summary_frame,
    timings_frame,
)
from rlx_nb.reasons import seed_line
from rlx_nb.records import worst_record
from rlx_nb.results import RunResults
from rlx_nb.verdict import VERDICT_ERROR


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

    def __init__(self, results: RunResults, records: list[OutputRecord], *, rule: str, tol_rel: float | None):
        self.results = results
        self.records = records
        self.rule = rule
        self.tol_rel = tol_rel
        self._source: WeakSource | None = None  # the model and inputs, held weakly, when built by backend_divergence

    def localize(
        self,
        backend: str | None = None,
        *,
        model: Any = None,
        inputs: Any = None,
        params: Any = None,
        backward: bool | None = None,
        **kwargs: Any,
    ):
        """:func:`rlx_nb.localize` this report's model on ``backend`` (default: the first suspect).

        ``model`` and ``inputs`` default to the ones the report was made from, which it holds only
        weakly (a report keeps no model alive): pass them when those are gone, or for a loaded
        report.  ``backward=None`` localizes the backward when the backend's worst output is a
        ``grad:`` output.
        """
        from rlx_nb.localize import localize

        if model is None or inputs is None:
            held = self._source.get() if self._source is not None else None
            if held is None:
                why = "it was loaded or merged" if self._source is None else "they are no longer alive"
                raise InputError(
                    f"this report does not hold its model and inputs ({why}): "
                    "pass them, report.localize(backend, model=model, inputs=inputs)"
                )
            model, inputs, params = held if params is None else (*held[:2], params)
        if backend is None:
            if not self.suspects:
                raise InputError("no SUSPECT backend to localize; name one: report.localize('cpu-inductor')")
            backend = self.suspects[0]
        if backward is None:
            backward = (self.record(backend).output or "").startswith("grad:")
        return localize(model, inputs, backend=backend, params=params, backward=backward, **kwargs)

    @classmethod
    def from_results(
        cls, results: RunResults, *, rule: str = "budget", tol_rel: float | None = None, progress: bool = True
    ):
        """Compare ``results`` and wrap them in a report."""
        records = compare(results, tol_rel=tol_rel, rule=rule, progress=progress)
        return cls(results, records, rule=rule, tol_rel=tol_rel)

    def save(self, path) -> Path:
        """Save the outputs of every run, the fp64 reference, fingerprints and environment (no pickle).

        See :mod:`rlx_nb.persist` for the format; :func:`rlx_nb.load_report` reads it back exactly.
        """
        from rlx_nb.persist import save_results

        return save_results(self.results, path, rule=self.rule, tol_rel=self.tol_rel, records=self.records)

    def to_html(self, path, *, localization=None, title: str | None = None) -> Path:
        """Write one self-contained HTML file (inline images, no script, no network): the verdicts, the
        backends and summary tables, each SUSPECT output's heatmap, histogram and worst elements, the environment, and
        ``localization`` (a :class:`rlx_nb.Localization`) when given.  No model weights.  Returns the path."""
        from rlx_nb.html_report import write_html

        return write_html(self, path, localization=localization, title=title)

    @functools.cached_property
    def plot(self):
        """Plots of this report: ``report.plot.heatmap(backend, output)``, ``.histogram``, ``.scatter``,
        ``.tolerance_curve`` (see :class:`rlx_nb.report_plot.ReportPlotter`)."""
        from rlx_nb.report_plot import ReportPlotter

        return ReportPlotter(self)

    @property
    def label(self) -> str:
        return self.results.label

    @functools.cached_property
    def summary(self) -> pd.DataFrame:
        """One row per (backend, output): every metric, both verdicts and the reason."""
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
        return compact_backends_frame(self.backends_detail, self.records)

    @property
    def suspects(self) -> list[str]:
        """Names of the backends whose verdict is SUSPECT."""
        return [b for b in self.results.candidates if any(r.backend == b and r.suspect for r in self.records)]

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
            raise InputError(f"no backend {backend!r} in this report; it has: {', '.join(self.results.candidates)}")
        return self.results.candidates[backend].detail

    def record(self, backend: str, output: str | None = None) -> OutputRecord:
        """The record of one (backend, output); ``output=None`` picks the backend's worst."""
        recs = [r for r in self.records if r.backend == backend]
        if not recs:
            raise InputError(f"no backend {backend!r} in this report; it has: {', '.join(self.results.candidates)}")
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
        rec = self.record(backend, output)
        if rec.output is None:
            raise InputError(f"backend {backend!r} did not run: {rec.reason}")
        got = self.results.candidates[backend].outputs.get(rec.output)
        if got is None or not got.is_array:
            raise InputError(f"{backend!r} has no array output {rec.output!r}")
        ref = self.results.reference.outputs.get(rec.output)
        return (
            self.results.oracle.outputs[rec.output].value,
            got.value,
            ref.value if ref is not None and ref.is_array else None,
        )

    @np.errstate(invalid="ignore", over="ignore")
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
        if not isinstance(top, int) or top < 1:
            raise InputError(f"top must be a positive integer, got {top!r}")
        on_device = self._device_elements(backend, output, top)
        if on_device is not None:
            return on_device
        o, b, r = self.arrays(backend, output)
        if o.shape != b.shape:
            raise InputError(f"{backend!r} output shape {b.shape} differs from the oracle's {o.shape}")
        if np.iscomplexobj(o) or np.iscomplexobj(b):
            # Complex outputs are compared as interleaved (real, imag): the last index doubles.
            o, b = (np.ascontiguousarray(v.astype(np.complex128)).view(np.float64) for v in (o, b))
            r = np.ascontiguousarray(r.astype(np.complex128)).view(np.float64) if r is not None else None
        elif not np.issubdtype(o.dtype, np.floating):
            o, b = o.astype(np.float64), b.astype(np.float64)
        idx, err = top_k(o, b, top)
        return _elements_rows(o, r, idx, err, o.reshape(-1)[idx], b.reshape(-1)[idx])

    def _device_elements(self, backend: str, output: str | None, top: int) -> pd.DataFrame | None:
        # A candidate whose output stayed on its device: the top-k runs there and only the k
        # elements come to the host (None when the output is on the host).
        rec = self.record(backend, output)
        got = self.results.candidates[backend].outputs.get(rec.output) if rec.output is not None else None
        if got is None or not got.on_device:
            return None
        o = self.results.oracle.outputs[rec.output].value
        if o.shape != got.tensor.shape or not on_device(o, got):
            return None
        from rlx_nb import device_metrics

        eb = got.tensor.reshape(-1)
        idx, err = device_metrics.top_k(device_metrics.as_device(o, eb.device), eb, top)
        ref = self.results.reference.outputs.get(rec.output)
        r = ref.value if ref is not None and ref.is_array else None
        bf = eb[torch.from_numpy(idx).to(eb.device)].cpu().numpy()
        return _elements_rows(o, r, idx, err, o.reshape(-1)[idx], bf)

    def element(self, backend: str, output: str | None, index: tuple[int, ...]) -> pd.DataFrame:
        """One element of one output as a one-row frame (the columns of :meth:`elements`).

        Examples
        --------
        >>> import torch, rlx_nb
        >>> r = rlx_nb.backend_divergence(torch.nn.Linear(4, 2), torch.ones(3, 4), backends=["cpu-nomkldnn"])
        >>> r.element("cpu-nomkldnn", "out", (0, 1))["index"].iloc[0]
        (0, 1)
        """
        o, b, r = self.arrays(backend, output)
        index = tuple(int(i) for i in index)
        if len(index) != o.ndim or any(not (0 <= i < n) for i, n in zip(index, o.shape, strict=True)):
            raise InputError(f"index {index} is not inside the output's shape {o.shape}")
        flat = np.array([np.ravel_multi_index(index, o.shape) if o.ndim else 0])
        of, bf = o.reshape(-1)[flat], b.reshape(-1)[flat]
        with np.errstate(invalid="ignore", over="ignore"):
            err = np.abs(bf.astype(np.float64) - of.astype(np.float64))
        return _elements_rows(o, r, flat, err, of, bf)

    def neighbourhood(
        self, backend: str, output: str | None, index: tuple[int, ...], fold: Any, radius: int = 2
    ) -> np.ndarray:
        """``|backend - oracle|`` around ``index`` on a heatmap's folded grid (``fold``, see :mod:`rlx_nb.maps`)."""
        from rlx_nb.maps import error_window

        o, b, _ = self.arrays(backend, output)
        return error_window(o, b, fold, index, radius)

    def worst_in_block(
        self, backend: str, output: str | None, fold: Any, block: tuple[int, int], factors: tuple[int, int]
    ) -> tuple[int, ...]:
        """The index of the worst element in one pooled cell of a heatmap (what a click on it picks)."""
        from rlx_nb.maps import block_argmax

        o, b, _ = self.arrays(backend, output)
        return block_argmax(o, b, fold, block, factors)

    @np.errstate(invalid="ignore", over="ignore", divide="ignore")
    def element_frame(self, backend: str, output: str | None = None, *, max_bytes: float = 5e8) -> pd.DataFrame:
        """Every element of one output as a frame, with compact dtypes — only on explicit request.

        Columns: one index column per axis (the smallest integer type that fits), ``oracle``,
        ``backend`` (the output's float type), ``reference`` (float64), ``abs_err``, ``rel_err``
        (float32) and ``ulp_err`` (uint32, saturated).  Anything above ``max_bytes`` (500 MB by
        default) is refused with its size; :meth:`elements` gives the worst ``top`` rows in O(top) memory.
        """
        o, b, r = self.arrays(backend, output)
        if o.shape != b.shape or o.dtype.kind not in "f":
            raise InputError(f"a per-element frame needs a real floating output of one shape; got {o.dtype} {o.shape}")
        width = 8 + 4 + 4 + 4 + sum(np.dtype(np.min_scalar_type(max(n - 1, 0))).itemsize for n in o.shape)
        width += 2 * o.dtype.itemsize
        size = o.size * width
        if size > max_bytes:
            raise InputError(
                f"a per-element frame of {o.size:,} rows would take about {size / 1e9:.2f} GB "
                f"(max_bytes={max_bytes:.3g}); use report.elements(..., top=k) for the worst elements, "
                "or pass a larger max_bytes"
            )
        return element_table(o, b, r)

    def lines(self) -> list[str]:
        """The seed's report lines, one per backend."""
        label = self.label
        if not self.results.candidates and not self.incomplete:
            return [f"[{label}] backend divergence: CPU-only node — nothing to compare"]
        out = []
        for name in self.results.candidates:
            recs = [r for r in self.records if r.backend == name]
            out.append(seed_line(label, name, recs))
        if self.incomplete:
            out.append(f"[{label}] INCOMPLETE: {self.incomplete}")
        return out

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


class WeakSource:
    """A report's model, inputs and params held by weak reference: the report can localize its model while the
    caller keeps them, and keeps nothing alive itself (plain values, which cannot be weakly referenced, are held)."""

    def __init__(self, model: Any, inputs: Any, params: Any) -> None:
        self._refs = _weak((model, inputs, params))

    def get(self) -> tuple[Any, Any, Any] | None:
        """``(model, inputs, params)``, or None when any of them has been freed."""
        try:
            return _strong(self._refs)
        except LookupError:
            return None


def _weak(obj: Any) -> Any:
    if isinstance(obj, (tuple, list)):
        return type(obj)(_weak(v) for v in obj) if not hasattr(obj, "_fields") else obj
    if isinstance(obj, dict):
        return {k: _weak(v) for k, v in obj.items()}
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


def _strong(refs: Any) -> Any:
    if isinstance(refs, (tuple, list)) and not hasattr(refs, "_fields"):
        return type(refs)(_strong(v) for v in refs)
    if isinstance(refs, dict):
        return {k: _strong(v) for k, v in refs.items()}
    if callable(refs):
        obj = refs()
        if obj is None and isinstance(refs, weakref.ref):
            raise LookupError("freed")
        return obj
    return refs


def load_report(path) -> DivergenceReport:
    """Read a report saved by :meth:`DivergenceReport.save`; arrays are read lazily, on first use.

    Raises :class:`rlx_nb.persist.ReportFormatError` (an :class:`RlxError`) for anything that is not
    a readable report of this version; never unpickles or executes anything.
    """
    from rlx_nb.persist import load_results, records_from_meta

    results, meta = load_results(path)  # (rule and tol_rel checked there)
    rule = meta.get("rule") or "budget"
    tol = float(meta["tol_rel"]) if meta.get("tol_rel") is not None else None
    records = records_from_meta(meta, path, results)
    if records is None:
        return DivergenceReport.from_results(results, rule=rule, tol_rel=tol)
    return DivergenceReport(results, records, rule=rule, tol_rel=tol)


@np.errstate(invalid="ignore", over="ignore")
def _elements_rows(
    o: np.ndarray, r: np.ndarray | None, idx: np.ndarray, err: np.ndarray, of: np.ndarray, bf: np.ndarray
) -> pd.DataFrame:
    rf = r.reshape(-1)[idx].astype(np.float64) if r is not None else np.full(idx.size, np.nan)
    ulp = ulp_distance(of, bf.astype(of.dtype)) if of.dtype in (np.float16, np.float32, np.float64) else None
    rows = {
        "rank": np.arange(idx.size),
        "index": [tuple(int(v) for v in np.unravel_index(i, o.shape)) for i in idx],
        "flat_index": idx,
        "oracle": of,
        "backend": bf,
        "reference": rf,
        "abs_err": err,
        "rel_err": rel_error(of, bf),
        "ulp_err": ulp if ulp is not None else np.zeros(idx.size, np.int64),
        "oracle_err_fp64": of.astype(np.float64) - rf,
        "backend_err_fp64": bf.astype(np.float64) - rf,
    }
    return elements_frame(rows)
