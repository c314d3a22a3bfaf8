"""Element look-ups of one (backend, output): its arrays, its worst elements, one element, every element.

What :class:`~rlx_nb.DivergenceReport`'s ``arrays``, ``elements``, ``element`` and ``element_frame`` hand out,
and what the explorer reads around a picked element (:func:`neighbourhood`, :func:`worst_in_block`).  Each
takes the runs (:class:`~rlx_nb.execution.results.RunResults`) and the record that names the output; a candidate whose
output stayed on its device gives its top-k there, and only k elements come to the host.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from rlx_nb.comparison.comparators import on_device
from rlx_nb.comparison.tables import element_table, elements_frame, worst_elements_frame
from rlx_nb.errors import InputError
from rlx_nb.execution.results import RunResults
from rlx_nb.numerics.elements import element_columns
from rlx_nb.plot.fold import block_argmax, error_window
from rlx_nb.verdict.records import OutputRecord


def arrays(results: RunResults, rec: OutputRecord) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``(oracle, backend, fp64 reference)`` arrays of the record's output (reference may be None)."""
    if rec.output is None:
        raise InputError(f"backend {rec.backend!r} did not run: {rec.reason}")
    got = results.candidates[rec.backend].outputs.get(rec.output)
    if got is None or not got.is_array:
        raise InputError(f"{rec.backend!r} has no array output {rec.output!r}")
    ref = results.reference.outputs.get(rec.output)
    return results.oracle.outputs[rec.output].value, got.value, ref.value if ref is not None and ref.is_array else None


def elements(results: RunResults, rec: OutputRecord, top: int) -> pd.DataFrame:
    """The ``top`` worst elements (by absolute error) of the record's output, worst first; O(top) memory."""
    if not isinstance(top, int) or top < 1:
        raise InputError(f"top must be a positive integer, got {top!r}")
    return worst_elements_frame(*_compared(results, rec), top)


@np.errstate(invalid="ignore", over="ignore")
def _compared(results: RunResults, rec: OutputRecord) -> tuple[np.ndarray, Any, np.ndarray | None]:
    # (oracle, backend, reference) as the worst elements are ranked: the backend's tensor where its output stayed on
    # its device (only the top-k come to the host), complex outputs as interleaved (real, imag), others as floats.
    got = results.candidates[rec.backend].outputs.get(rec.output) if rec.output is not None else None
    if got is not None and got.on_device:
        o = results.oracle.outputs[rec.output].value
        if o.shape == got.tensor.shape and on_device(o, got):
            ref = results.reference.outputs.get(rec.output)
            return o, got.tensor, ref.value if ref is not None and ref.is_array else None
    o, b, r = arrays(results, rec)
    if o.shape != b.shape:
        raise InputError(f"{rec.backend!r} output shape {b.shape} differs from the oracle's {o.shape}")
    if np.iscomplexobj(o) or np.iscomplexobj(b):
        # Complex outputs are compared as interleaved (real, imag): the last index doubles.
        o, b = (np.ascontiguousarray(v.astype(np.complex128)).view(np.float64) for v in (o, b))
        r = np.ascontiguousarray(r.astype(np.complex128)).view(np.float64) if r is not None else None
    elif not np.issubdtype(o.dtype, np.floating):
        o, b = o.astype(np.float64), b.astype(np.float64)
    return o, b, r


def element(results: RunResults, rec: OutputRecord, index: tuple[int, ...]) -> pd.DataFrame:
    """One element of the record's output as a one-row frame (the columns of :func:`elements`)."""
    o, b, r = arrays(results, rec)
    index = tuple(int(i) for i in index)
    if len(index) != o.ndim or any(not (0 <= i < n) for i, n in zip(index, o.shape, strict=True)):
        raise InputError(f"index {index} is not inside the output's shape {o.shape}")
    flat = np.array([np.ravel_multi_index(index, o.shape) if o.ndim else 0])
    of, bf = o.reshape(-1)[flat], b.reshape(-1)[flat]
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.abs(bf.astype(np.float64) - of.astype(np.float64))
    return _rows(o, r, flat, err, (of, bf))


@np.errstate(invalid="ignore", over="ignore", divide="ignore")
def element_frame(results: RunResults, rec: OutputRecord, max_bytes: float) -> pd.DataFrame:
    """Every element of the record's output as a frame with compact dtypes, refused past ``max_bytes``."""
    o, b, r = arrays(results, rec)
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


def neighbourhood(
    results: RunResults, rec: OutputRecord, index: tuple[int, ...], fold: Any, radius: int = 2
) -> np.ndarray:
    """``|backend - oracle|`` around ``index`` on a heatmap's folded grid (``fold``, see :mod:`rlx_nb.plot.fold`)."""
    o, b, _ = arrays(results, rec)
    return error_window(o, b, fold, index, radius)


def worst_in_block(
    results: RunResults, rec: OutputRecord, fold: Any, block: tuple[int, int], factors: tuple[int, int]
) -> tuple[int, ...]:
    """The index of the worst element in one pooled cell of a heatmap (what a click on it picks)."""
    o, b, _ = arrays(results, rec)
    return block_argmax(o, b, fold, block, factors)


def _rows(o: np.ndarray, r: np.ndarray | None, idx: np.ndarray, err: np.ndarray, values: tuple) -> pd.DataFrame:
    # The element rows of ``idx`` (flat indices into ``o``'s shape); ``values``: the oracle's and backend's there.
    return elements_frame(element_columns(o.shape, r, idx, err, values))


def inspector_rows(e: Any, index: tuple[int, ...], oracle: str, backend: str, quantum: float | None) -> list:
    """One element's (name, value) rows as the explorer's inspector shows them: its values, its errors, and for an
    int8 output its error in quanta (float32's ULP and the seed's relative error read a one-quantum gap as millions)."""
    measures = ([("error in quanta", f"{e.abs_err / quantum:.3g} (a quantum is {quantum:.4g})")] if quantum else
                [("rel error (seed)", f"{e.rel_err:.3e}"), ("ULP distance", str(int(e.ulp_err)))])  # fmt: skip
    return [
        ("index", str(index)),
        (oracle, f"{float(e.oracle):.9g}"),
        (f"backend ({backend})", f"{float(e.backend):.9g}"),
        ("fp64 reference", f"{float(e.reference):.12g}"),
        ("abs error", f"{e.abs_err:.3e}"),
        *measures,
        ("oracle - fp64", f"{e.oracle_err_fp64:.3e}"),
        ("backend - fp64", f"{e.backend_err_fp64:.3e}"),
    ]


def neighbourhood_html(window: Any) -> str:
    """A picked element's 5 x 5 neighbourhood (:func:`neighbourhood`) as an HTML table, the element in the middle."""
    cells = "".join(
        "<tr>"
        + "".join(
            f"<td style='padding:2px 6px;{'font-weight:bold;background:#fde0dc' if (i, j) == (2, 2) else ''}'>"
            f"{'' if v != v else f'{v:.1e}'}</td>"
            for j, v in enumerate(row)
        )
        + "</tr>"
        for i, row in enumerate(window)
    )
    return f"<p><b>neighbourhood</b> (abs error, folded grid)</p><table>{cells}</table>"
