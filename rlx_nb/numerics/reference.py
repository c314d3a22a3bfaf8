"""Errors against the float64 reference: RMSE, largest error and the reference's scale, and per-slice sums.

What the verdict's budgets are made of (:mod:`rlx_nb.verdict.rule`).  Nothing here imports torch, pandas
or matplotlib; float32 and float64 arrays go through one compiled pass (:mod:`rlx_nb.numerics.fused`), one
range per core, others (and machines without numba) through numpy in chunks.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np

from rlx_nb.errors import InputError
from rlx_nb.numerics import fused as _fused
from rlx_nb.numerics.pairs import CHUNK, dot, on_cores, ranges, workers


@dataclasses.dataclass(frozen=True)
class ReferenceStats:
    """Error of one array against a float64 reference: RMSE and max-abs, plus the reference's scale."""

    rmse: float
    max_err: float
    ref_rms: float
    ref_max: float
    count: int = 0
    """The finite pairs the figures are over (0 where only the four figures were given)."""
    sum_err: float = math.nan
    """Sum of the signed errors ``x - reference``."""
    sum_ref: float = math.nan
    """Sum of the reference's values."""
    sum_err_ref: float = math.nan
    """Sum of each error times its reference value."""

    @classmethod
    def of_sums(cls, sums: tuple) -> ReferenceStats:
        """The statistics from the sums one pass forms, in :func:`_reference_range`'s order: the squared errors'
        sum, the largest error, the reference's squared sum and largest magnitude, the count, and the error's
        pattern sums (the errors', the reference's, the errors times the reference)."""
        sq, mx, rsq, rmx, count, se, sr, ser = sums
        if count == 0:
            return cls(0.0, 0.0, 0.0, 0.0)
        return cls(math.sqrt(sq / count), mx, math.sqrt(rsq / count), rmx, int(count), se, sr, ser)

    @property
    def pattern(self) -> tuple[float, float]:
        """``(bias, correlation)`` of the error: its mean over its RMS, and its correlation with the
        reference's values; NaN without the sums or with fewer than two pairs.  Noise has neither
        (:func:`rlx_nb.verdict.readings.noise_like`).

        Examples
        --------
        >>> r = np.float64([1.0, 2.0, 3.0, 4.0])
        >>> [round(v, 3) for v in reference_stats(r + 0.1 * r, r).pattern]
        [0.913, 1.0]
        """
        n = self.count
        if n < 2 or not math.isfinite(self.sum_err_ref):
            return math.nan, math.nan
        see, srr = self.rmse**2 * n, self.ref_rms**2 * n
        bias = self.sum_err / n / self.rmse if self.rmse > 0 else 0.0
        cov = self.sum_err_ref - self.sum_err * self.sum_ref / n
        var = max(see - self.sum_err**2 / n, 0.0) * max(srr - self.sum_ref**2 / n, 0.0)
        return bias, (max(-1.0, min(1.0, cov / math.sqrt(var))) if var > 0 else 0.0)


@dataclasses.dataclass(frozen=True)
class SliceStats:
    """Error of one array against a float64 reference, summed over each slice of each axis.

    For axis ``k`` (``axes[k]``), slice ``j`` is every element whose index along that axis is ``j``;
    ``sums[k][j]`` and ``squares[k][j]`` are the sum of the errors and of their squares over it, and
    ``counts[k][j]`` how many finite errors it holds.  Only axes whose slices hold at least two
    elements and that have at least two slices are kept.
    """

    axes: tuple[int, ...]
    sums: tuple[np.ndarray, ...]
    squares: tuple[np.ndarray, ...]
    counts: tuple[np.ndarray, ...]


def slice_axes(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The axes :func:`slice_stats` sums over: at least two slices, each of at least two elements.

    The leading axes come from per-row sums over the last axis (24 bytes a row), kept when the last
    axis has at least ``SLICE_MIN_ROW`` elements (at most one float32 output's memory) or there are
    at most ``SLICE_SMALL_ROWS`` rows.
    """
    n = math.prod(shape)
    wide = len(shape) >= 1 and (shape[-1] >= SLICE_MIN_ROW or n // max(1, shape[-1]) <= SLICE_SMALL_ROWS)
    return tuple(k for k, d in enumerate(shape) if d >= 2 and n // d >= 2 and (k == len(shape) - 1 or wide))


SLICE_MIN_ROW = 6  # 3 float64 sums per row of >= 6 float32 elements: at most the output's own size

SLICE_SMALL_ROWS = 1 << 16  # or 1.5 MB of row sums whatever the rows' length


def slices_from_rows(
    shape: tuple[int, ...], axes: tuple[int, ...], col: list[np.ndarray], row: list[np.ndarray]
) -> SliceStats:
    """:class:`SliceStats` from the (sum, squares, count) of each column and each row of the last axis:
    the columns are the last axis's slices, and the rows, shaped like the leading axes, give the others."""
    lead = shape[:-1]
    out: list[tuple[np.ndarray, ...]] = []
    for k in axes:
        if k == len(shape) - 1:
            out.append(tuple(col))
        else:
            other = tuple(a for a in range(len(lead)) if a != k)
            out.append(tuple(v.reshape(lead).sum(axis=other) for v in row))
    return SliceStats(axes, *(tuple(o[i] for o in out) for i in range(3)))


def slice_stats(x: np.ndarray, reference: np.ndarray) -> SliceStats:
    """:class:`SliceStats` of ``x - reference`` (float64), elements where either is non-finite left out.

    One pass over the pair viewed as rows of the last axis (compiled, one range of rows per core;
    numpy in chunks without numba): per-column sums give the last axis, per-row sums the others.

    Examples
    --------
    >>> st = slice_stats(np.float32([[1, 2], [3, 4]]), np.float64([[1, 2], [3, 3.5]]))
    >>> st.axes, [float(v) for v in st.sums[-1]]
    ((0, 1), [0.0, 0.5])
    """
    return error_stats(x, reference)[1]


def error_stats(x: np.ndarray, reference: np.ndarray) -> tuple[ReferenceStats, SliceStats]:
    """:func:`reference_stats` and :func:`slice_stats` of one pair, in one pass where there are slices."""
    if x.shape != reference.shape:
        raise InputError(f"shapes differ: {x.shape} vs {reference.shape}")
    axes = slice_axes(x.shape)
    if not axes:
        return reference_stats(x, reference), SliceStats((), (), (), ())
    cols = x.shape[-1]
    xf = np.ascontiguousarray(x).reshape(-1, cols)
    rf = np.ascontiguousarray(reference, dtype=np.float64).reshape(-1, cols)
    rows = xf.shape[0]
    keep_rows = any(k < x.ndim - 1 for k in axes)
    row = [np.zeros(rows if keep_rows else 0, np.float64) for _ in range(3)]
    kern = _fused.slice_kernel() if xf.dtype in (np.float32, np.float64) else None
    count = workers(xf.size) if kern is not None else 1
    bands = list(itertools.pairwise([k * rows // count for k in range(count)] + [rows]))
    parts = [[np.zeros(cols, np.float64) for _ in range(3)] for _ in bands]
    if kern is not None:
        scalars = on_cores(lambda a, b: kern(xf, rf, a, b, *row, *parts[bands.index((a, b))]), bands)
    else:  # (largest error, reference squares, largest reference, reference sum, error-times-reference sum)
        scalars = []
        step = max(1, CHUNK // cols)
        for a in range(0, rows, step):
            rc = rf[a : a + step]
            e = xf[a : a + step].astype(np.float64) - rc
            ok = np.isfinite(e) & np.isfinite(rc)
            e, rc = np.where(ok, e, 0.0), np.where(ok, rc, 0.0)
            sums = (e, e * e, ok.astype(np.float64))
            for acc, v in zip(parts[0], sums, strict=True):
                acc += v.sum(axis=0)
            if keep_rows:
                for acc, v in zip(row, sums, strict=True):
                    acc[a : a + step] = v.sum(axis=1)
            scalars.append(
                (
                    float(np.abs(e).max(initial=0.0)),
                    dot(rc.ravel(), rc.ravel()),
                    float(np.abs(rc).max(initial=0.0)),
                    float(rc.sum()),
                    dot(e.ravel(), rc.ravel()),
                )
            )
    col = [sum(p[i] for p in parts) for i in range(3)]
    slices = slices_from_rows(x.shape, axes, col, row)
    mx, rsq, rmx = max(v[0] for v in scalars), sum(v[1] for v in scalars), max(v[2] for v in scalars)
    sr, ser = sum(v[3] for v in scalars), sum(v[4] for v in scalars)
    stats = ReferenceStats.of_sums((float(col[1].sum()), mx, rsq, rmx, int(col[2].sum()), float(col[0].sum()), sr, ser))
    return stats, slices


@np.errstate(invalid="ignore", over="ignore")
def reference_stats(x: np.ndarray, reference: np.ndarray) -> ReferenceStats:
    """RMSE and max-abs error of ``x`` against a float64 ``reference``, chunked.

    Non-finite elements (in either) are skipped; the reference's RMS and max
    magnitude give the scale for absolute floors.

    Examples
    --------
    >>> r = reference_stats(np.float32([1, 2]), np.float64([1, 2.5]))
    >>> round(r.max_err, 3), round(r.rmse, 3)
    (0.5, 0.354)
    """
    xf = np.ascontiguousarray(x).reshape(-1)
    rf = np.ascontiguousarray(reference).reshape(-1)
    if xf.shape != rf.shape:
        raise InputError(f"shapes differ: {x.shape} vs {reference.shape}")
    if rf.dtype == np.float64 and xf.dtype in (np.float32, np.float64):
        kern = _fused.reference_kernel()
        if kern is not None:  # (any size: a small output is one range, one call, ~10 numpy calls' overhead saved)
            return _fused_reference_stats(kern, xf, rf)
    sq = mx = rsq = rmx = se = sr = ser = 0.0
    count = 0
    buf = np.empty(min(CHUNK, xf.size), np.float64)
    for s in range(0, xf.size, CHUNK):
        xc, rc = xf[s : s + CHUNK], rf[s : s + CHUNK].astype(np.float64, copy=False)
        d = np.subtract(xc, rc, out=buf[: xc.size], dtype=np.float64)
        ok = None
        if not np.isfinite(d).all() or not np.isfinite(rc).all():
            ok = np.isfinite(d) & np.isfinite(rc)
            d, rc = d[ok], rc[ok]
        count += d.size
        if d.size:
            sq += dot(d, d)
            mx = max(mx, float(np.abs(d).max()))
            rsq += dot(rc, rc)
            rmx = max(rmx, float(np.abs(rc).max()))
            se, sr, ser = se + float(d.sum()), sr + float(rc.sum()), ser + dot(d, rc)
    return ReferenceStats.of_sums((sq, mx, rsq, rmx, count, se, sr, ser))


def _fused_reference_stats(kern, xf: np.ndarray, rf: np.ndarray) -> ReferenceStats:
    # One compiled pass per core, like the fused pair_stats (one range, on the calling thread, for a small output).
    parts = on_cores(lambda start, stop: kern(xf, rf, start, stop), ranges(xf.size))
    return ReferenceStats.of_sums(tuple((max if k in (1, 3) else sum)(p[k] for p in parts) for k in range(8)))
