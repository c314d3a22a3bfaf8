"""Per-element measures for tables and plots: the worst elements, ULP distances, the seed's relative error,
histograms and tolerance curves (numpy, chunked where the output is large)."""

from __future__ import annotations

from typing import Any

import numpy as np

from rlx_nb.errors import InputError
from rlx_nb.numerics.pairs import _INT_OF_FLOAT, CHUNK, REL_EPS, ordered_ints, ulp_gap


@np.errstate(invalid="ignore", over="ignore")
def top_k(expected: np.ndarray, actual: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Flat indices and absolute errors of the ``k`` worst elements, worst first.

    Ties go to the lower index, so the first row is the element
    :func:`pair_stats` reports as ``worst_index``.  O(n) time and
    O(k + CHUNK) memory: each chunk's candidates are merged into a running
    top-k.  NaN/Inf disagreements rank above every finite error.
    """
    e = np.ascontiguousarray(expected).reshape(-1)
    a = np.ascontiguousarray(actual).reshape(-1)
    work = np.float64 if np.float64 in (e.dtype, a.dtype) else np.float32
    best_i = np.empty(0, np.int64)
    best_v = np.empty(0, np.float64)
    for s in range(0, e.size, CHUNK):
        d = np.abs(np.subtract(a[s : s + CHUNK], e[s : s + CHUNK], dtype=work)).astype(np.float64)
        nonfinite = ~np.isfinite(d)
        if nonfinite.any():
            ec, ac = e[s : s + CHUNK], a[s : s + CHUNK]
            agree = (ec == ac) | (np.isnan(ec) & np.isnan(ac))
            d[nonfinite] = np.where(agree[nonfinite], 0.0, np.inf)
        idx = _k_largest(d, k)
        best_i = np.concatenate([best_i, idx + s])
        best_v = np.concatenate([best_v, d[idx]])
        if best_v.size > k:
            order = np.lexsort((best_i, -best_v))[:k]
            best_i, best_v = best_i[order], best_v[order]
    order = np.lexsort((best_i, -best_v))
    return best_i[order], best_v[order]


def _k_largest(d: np.ndarray, k: int) -> np.ndarray:
    # Indices of the k largest values, ties at the threshold resolved to the lowest indices.
    if d.size <= k:
        return np.arange(d.size)
    threshold = np.partition(d, d.size - k)[d.size - k]
    above = np.flatnonzero(d > threshold)
    ties = np.flatnonzero(d == threshold)[: k - above.size]
    return np.concatenate([above, ties])


def ulp_distance(expected: np.ndarray, actual: np.ndarray) -> np.ndarray:
    """Element-wise distance in units in the last place of ``expected``'s dtype (uint64: exact for float64 too)."""
    e = np.asarray(expected)
    a = np.asarray(actual, dtype=e.dtype)
    if e.dtype not in _INT_OF_FLOAT:
        raise InputError(f"ULP distance needs float16/32/64, got {e.dtype}")
    ie = ordered_ints(e.reshape(-1), np.empty(e.size, np.int64))
    ia = ordered_ints(a.reshape(-1), np.empty(a.size, np.int64))
    return ulp_gap(ia, ie).reshape(e.shape)


@np.errstate(invalid="ignore", over="ignore", divide="ignore")
def rel_error(expected: np.ndarray, actual: np.ndarray) -> np.ndarray:
    """The seed's element-wise ``|a - e| / (|e| + 1e-6)``, in float64."""
    e = np.asarray(expected, np.float64)
    return np.abs(np.asarray(actual, np.float64) - e) / (np.abs(e) + REL_EPS)


@np.errstate(invalid="ignore", over="ignore", divide="ignore")
def error_range(expected: np.ndarray, actual: np.ndarray, *, metric: str = "abs") -> tuple[float, float]:
    """The smallest non-zero and the largest finite element error (``metric`` as for :func:`error_histogram`),
    chunked; ``(inf, 0.0)`` when every error is zero or non-finite."""
    e = np.ascontiguousarray(expected).reshape(-1)
    a = np.ascontiguousarray(actual).reshape(-1)
    lo, hi = np.inf, 0.0
    for s in range(0, e.size, CHUNK):
        ec, ac = e[s : s + CHUNK], a[s : s + CHUNK]
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            if metric == "ulp":
                d = ulp_distance(ec, ac.astype(ec.dtype)).astype(np.float64)
                d[~(np.isfinite(ec) & np.isfinite(ac))] = np.nan
            else:
                d = np.abs(ac.astype(np.float64) - ec.astype(np.float64))
                if metric == "rel":
                    d /= np.abs(ec.astype(np.float64)) + REL_EPS
        d = d[np.isfinite(d) & (d > 0)]
        if d.size:
            lo, hi = min(lo, float(d.min())), max(hi, float(d.max()))
    return lo, hi


def error_histogram(
    expected: np.ndarray,
    actual: np.ndarray,
    edges: np.ndarray,
    *,
    relative: bool = False,
    metric: str | None = None,
    scale: float = 1.0,
) -> tuple[np.ndarray, int, int]:
    """Counts of element errors in ``edges`` (chunked), plus the exact zeros and the non-finite ones.

    ``metric``: ``"abs"`` (|a - e|, the default), ``"rel"`` (the seed's ``|a - e| / (|e| + 1e-6)``;
    also ``relative=True``) or ``"ulp"`` (float32/float64 ULP distance); every error is multiplied by
    ``scale`` (``1 / budget`` with the fp64 reference as ``expected`` gives errors in budgets).
    Returns ``(counts, zeros, nonfinite)``; counts has ``len(edges) - 1`` bins, values above the last
    edge land in the last bin and non-zero values below the first in the first.
    """
    metric = metric or ("rel" if relative else "abs")
    if metric not in ("abs", "rel", "ulp"):
        raise InputError(f"error_histogram's metric must be 'abs', 'rel' or 'ulp'; got {metric!r}")
    e = np.ascontiguousarray(expected).reshape(-1)
    a = np.ascontiguousarray(actual).reshape(-1)
    counts = np.zeros(len(edges) - 1, np.int64)
    zeros = nonfinite = 0
    lo, hi = float(edges[0]), float(edges[-1])
    for s in range(0, e.size, CHUNK):
        if metric == "ulp":
            ec, ac = e[s : s + CHUNK], a[s : s + CHUNK]
            d = ulp_distance(ec, ac.astype(ec.dtype)).astype(np.float64)
            d[~(np.isfinite(ec) & np.isfinite(ac))] = np.nan
        else:
            ec = e[s : s + CHUNK].astype(np.float64)
            d = np.abs(a[s : s + CHUNK].astype(np.float64) - ec)
            if metric == "rel":
                d /= np.abs(ec) + REL_EPS
        d *= scale
        fin = np.isfinite(d)
        nonfinite += int(d.size - np.count_nonzero(fin))
        d = d[fin]
        zeros += int(np.count_nonzero(d == 0))
        d = np.clip(d[d > 0], lo, np.nextafter(hi, 0))
        counts += np.histogram(d, bins=edges)[0]
    return counts, zeros, nonfinite


@np.errstate(invalid="ignore", over="ignore", divide="ignore")
def tolerance_curve(expected: np.ndarray, actual: np.ndarray, rtols: np.ndarray) -> np.ndarray:
    """Fraction of elements whose seed-style relative error exceeds each ``rtol`` (chunked).

    NaN/Inf disagreements fail at every tolerance.
    """
    rtols = np.asarray(rtols, np.float64)
    order = np.argsort(rtols)
    sorted_tols = rtols[order]
    e = np.ascontiguousarray(expected).reshape(-1)
    a = np.ascontiguousarray(actual).reshape(-1)
    failing = np.zeros(rtols.size, np.int64)
    for s in range(0, e.size, CHUNK):
        ec, ac = e[s : s + CHUNK].astype(np.float64), a[s : s + CHUNK].astype(np.float64)
        rel = np.abs(ac - ec) / (np.abs(ec) + REL_EPS)
        agree = (ec == ac) | (np.isnan(ec) & np.isnan(ac))
        rel = np.where(np.isfinite(rel), rel, np.where(agree, 0.0, np.inf))
        rel.sort()
        # elements with rel > t: size - (number <= t)
        failing[order] += rel.size - np.searchsorted(rel, sorted_tols, side="right")
    return failing / max(1, e.size)


@np.errstate(invalid="ignore", over="ignore")
def element_columns(
    shape: tuple[int, ...], reference: np.ndarray | None, idx: np.ndarray, err: np.ndarray, values: tuple
) -> dict[str, Any]:
    """The columns of the element rows at flat indices ``idx`` of an output of ``shape``: indices, the oracle's and
    the backend's values (``values``) and the reference's, and every error of each."""
    of, bf = values
    rf = reference.reshape(-1)[idx].astype(np.float64) if reference is not None else np.full(idx.size, np.nan)
    ulp = ulp_distance(of, bf.astype(of.dtype)) if of.dtype in (np.float16, np.float32, np.float64) else None
    return {
        "rank": np.arange(idx.size),
        "index": [tuple(int(v) for v in np.unravel_index(i, shape)) for i in idx],
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


def worst_columns(oracle: np.ndarray, backend: np.ndarray, reference: np.ndarray | None, k: int) -> dict[str, Any]:
    """:func:`element_columns` of the ``k`` worst elements (:func:`top_k`), worst first."""
    idx, err = top_k(oracle, backend, k)
    return element_columns(oracle.shape, reference, idx, err, (oracle.reshape(-1)[idx], backend.reshape(-1)[idx]))
