"""Divergence metrics on numpy arrays, computed in chunks, one range per core.

Nothing here imports torch, pandas or matplotlib.  Float32 pairs (the common
case) go through one fused numba pass (:mod:`rlx_nb._fused`); everything else,
and every pair where numba is missing, walks the arrays in chunks of
:data:`CHUNK` elements with preallocated buffers.  Both paths give the same
statistics, and the only large allocation is the exact p99's candidate buffer
(a tenth of one output; the rare fallback takes at most one output's size).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from rlx_nb import _fused

CHUNK = 1 << 16
REL_EPS = 1e-6
"""The seed's guard in ``max_rel = |a - b| / (|a| + 1e-6)``."""

# torch.testing.assert_close's default (rtol, atol) per dtype.
DEFAULT_TOLERANCES: dict[str, tuple[float, float]] = {
    "float16": (1e-3, 1e-5),
    "bfloat16": (1.6e-2, 1e-5),
    "float32": (1.3e-6, 1e-5),
    "float64": (1e-7, 1e-7),
}

# Unit round-off (half an ulp at 1.0) of each compute format.
UNIT_ROUNDOFF: dict[str, float] = {
    "float64": 2.0**-53,
    "float32": 2.0**-24,
    "tf32": 2.0**-11,
    "float16": 2.0**-11,
    "bfloat16": 2.0**-8,
}

_INT_OF_FLOAT = {
    np.dtype(np.float16): np.int16,
    np.dtype(np.float32): np.int32,
    np.dtype(np.float64): np.int64,
}


@dataclasses.dataclass(frozen=True)
class PairStats:
    """How far ``actual`` is from ``expected``, element by element.

    Indices are flat (C order) into the arrays; ``-1`` when there is no element.
    ``max_abs``, ``max_rel`` and the other finite statistics skip elements where
    either side is NaN or infinite; those are counted in ``nonfinite_mismatch``
    unless both sides agree (NaN and NaN, or the same infinity).
    """

    numel: int
    max_abs: float
    worst_index: int
    max_rel: float
    max_rel_index: int
    mean_abs: float
    p99_abs: float
    mismatched: int
    max_ulp: int
    nonfinite_mismatch: int


@dataclasses.dataclass(frozen=True)
class ReferenceStats:
    """Error of one array against a float64 reference: RMSE and max-abs, plus the reference's scale."""

    rmse: float
    max_err: float
    ref_rms: float
    ref_max: float


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
        raise ValueError(f"shapes differ: {x.shape} vs {reference.shape}")
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
    workers = _workers(xf.size) if kern is not None else 1
    ranges = list(itertools.pairwise([k * rows // workers for k in range(workers)] + [rows]))
    parts = [[np.zeros(cols, np.float64) for _ in range(3)] for _ in ranges]
    if kern is not None:
        scalars = _on_cores(lambda a, b: kern(xf, rf, a, b, *row, *parts[ranges.index((a, b))]), ranges)
    else:
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
                    _sum_sq(rc.ravel()),
                    float(np.abs(rc).max(initial=0.0)),
                )
            )
    col = [sum(p[i] for p in parts) for i in range(3)]
    slices = slices_from_rows(x.shape, axes, col, row)
    count = float(col[2].sum())
    if count == 0:
        return ReferenceStats(0.0, 0.0, 0.0, 0.0), slices
    mx, rsq, rmx = max(v[0] for v in scalars), sum(v[1] for v in scalars), max(v[2] for v in scalars)
    return ReferenceStats(math.sqrt(float(col[1].sum()) / count), mx, math.sqrt(rsq / count), rmx), slices


def default_tolerance(dtype_name: str) -> tuple[float, float]:
    """``(rtol, atol)`` that ``torch.testing.assert_close`` uses for ``dtype_name``."""
    return DEFAULT_TOLERANCES.get(dtype_name, DEFAULT_TOLERANCES["float32"])


def _ordered_ints(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    # Map float bit patterns onto int64s ordered like the floats, with -0.0
    # and +0.0 both at 0, so ULP distance is a plain difference.
    bits = x.view(_INT_OF_FLOAT[x.dtype])
    np.copyto(out, bits, casting="unsafe")
    lowest = np.int64(np.iinfo(bits.dtype).min)
    np.copyto(out, lowest - out, where=out < 0)
    return out


def _ulp_gap(ia: np.ndarray, ie: np.ndarray) -> np.ndarray:
    # |ia - ie| for ordered int64 keys, exact in uint64 (float64 values of opposite signs can be
    # more than 2**63 ulps apart, which int64 arithmetic would wrap).
    hi, lo = np.maximum(ia, ie).view(np.uint64), np.minimum(ia, ie).view(np.uint64)
    return hi - lo


def _chunk_max_ulp(ec: np.ndarray, ac: np.ndarray, bufs: _Buffers, excluded: np.ndarray | None) -> int:
    ints = _INT_OF_FLOAT[ec.dtype]
    m = ec.size
    ie, ia = ec.view(ints), ac.view(ints)
    if ints is np.int32:
        # Same sign: the distance is the difference of the raw bit patterns, which fits in int32.
        # Opposite signs (rare: values straddling zero) take the exact path below.
        it = bufs.ints[:m]
        np.bitwise_xor(ia, ie, out=it)
        if it.min() >= 0:
            np.subtract(ia, ie, out=it)
            np.abs(it, out=it)
            if excluded is not None:
                it[excluded] = 0
            return int(it.max())
    gap = _ulp_gap(_ordered_ints(ac, np.empty(m, np.int64)), _ordered_ints(ec, np.empty(m, np.int64)))
    if excluded is not None:
        gap[excluded] = 0
    return int(gap.max())


@dataclasses.dataclass
class _Partial:
    max_abs: float = -1.0
    worst_index: int = -1
    max_rel: float = -1.0
    max_rel_index: int = -1
    sum_abs: float = 0.0
    finite: int = 0
    mismatched: int = 0
    max_ulp: int = 0
    nonfinite_mismatch: int = 0
    above: list = dataclasses.field(default_factory=list)
    above_count: int = 0
    at_least: int = 0
    chunk_max: list = dataclasses.field(default_factory=list)


class _Buffers:
    def __init__(self, size: int, dtype: np.dtype) -> None:
        self.d = np.empty(size, dtype)
        self.t = np.empty(size, dtype)
        self.mask = np.empty(size, np.bool_)
        self.ints = np.empty(size, np.int32)


@np.errstate(invalid="ignore", over="ignore", divide="ignore")
def _pair_range(
    e: np.ndarray,
    a: np.ndarray,
    start: int,
    stop: int,
    rtol: float,
    atol: float,
    floor: float | None,
    work_dtype: np.dtype,
    cap: int,
) -> _Partial:
    part = _Partial()
    bufs = _Buffers(min(CHUNK, stop - start), work_dtype)
    exact_ulp = e.dtype in _INT_OF_FLOAT and e.dtype == a.dtype
    for s in range(start, stop, CHUNK):
        ec, ac = e[s : s + CHUNK], a[s : s + CHUNK]
        m = ec.size
        d = np.subtract(ac, ec, out=bufs.d[:m], dtype=work_dtype)
        np.abs(d, out=d)
        total = float(d.sum())
        finite = m
        excluded = None
        if not math.isfinite(total):
            # Slow path, only for chunks holding NaN/Inf: agreeing patterns are
            # not mismatches, disagreeing ones are counted, and both are left
            # out of the finite statistics.
            both_finite = np.isfinite(ec) & np.isfinite(ac)
            agree = (ec == ac) | (np.isnan(ec) & np.isnan(ac))
            part.nonfinite_mismatch += int(np.count_nonzero(~both_finite & ~agree))
            excluded = ~both_finite
            d[excluded] = 0
            finite = m - int(np.count_nonzero(excluded))
            total = float(d.sum(dtype=np.float64))
        part.sum_abs += total
        part.finite += finite
        i = int(d.argmax())
        dmax = float(d[i])
        part.chunk_max.append((s, dmax))
        if dmax > part.max_abs:
            part.max_abs, part.worst_index = dmax, s + i
        if floor is not None and dmax >= floor:
            # Candidates for the exact p99: everything above a sampled floor,
            # and how many equal it (errors are often whole ulps, so ties are common).
            part.at_least += int(np.count_nonzero(np.greater_equal(d, floor, out=bufs.mask[:m])))
            sel = np.greater(d, floor, out=bufs.mask[:m])
            part.above_count += int(np.count_nonzero(sel))
            if part.above_count <= cap:
                part.above.append(d[sel])
        t = np.abs(ec, out=bufs.t[:m], dtype=work_dtype)
        if excluded is not None:
            t[excluded] = 0
        if dmax > atol:
            # Only elements whose error exceeds atol can mismatch: find those, then test them exactly.
            over = np.flatnonzero(np.greater(d, atol, out=bufs.mask[:m]))
            part.mismatched += int(np.count_nonzero(d[over] > atol + rtol * t[over]))
        t += REL_EPS
        np.divide(d, t, out=t)
        j = int(t.argmax())
        if t[j] > part.max_rel:
            part.max_rel, part.max_rel_index = float(t[j]), s + j
        if exact_ulp and dmax > 0:
            part.max_ulp = max(part.max_ulp, _chunk_max_ulp(ec, ac, bufs, excluded))
    return part


def _exact_worst(e: np.ndarray, a: np.ndarray, total: _Partial) -> tuple[float, int]:
    # Float32 differences can tie where the exact ones do not (rounding is monotonic, so the true
    # worst element is among the ties): redo only the chunks that reached the maximum, in float64.
    best, where = -1.0, -1
    for s, v in sorted(total.chunk_max):
        if v != total.max_abs:
            continue
        ec, ac = e[s : s + CHUNK].astype(np.float64), a[s : s + CHUNK].astype(np.float64)
        d = np.abs(ac - ec)
        d[~(np.isfinite(ec) & np.isfinite(ac))] = -1.0
        i = int(d.argmax())
        if d[i] > best:
            best, where = float(d[i]), s + i
    return (best, where) if where >= 0 else (total.max_abs, total.worst_index)


def _workers(n: int) -> int:
    return max(1, min(os.cpu_count() or 1, n // (8 * CHUNK)))


def _ranges(n: int, align: int = 1) -> list[tuple[int, int]]:
    # One contiguous (start, stop) per worker, starts aligned to ``align`` elements.
    workers = _workers(n)
    return list(itertools.pairwise([k * n // workers // align * align for k in range(workers)] + [n]))


def _on_cores(fn: Callable[[int, int], Any], ranges: list[tuple[int, int]]) -> list:
    # fn(start, stop) for each range, one thread each (numpy and the compiled kernels release the GIL).
    if len(ranges) == 1:
        return [fn(*ranges[0])]
    with ThreadPoolExecutor(len(ranges)) as pool:
        return list(pool.map(lambda r: fn(*r), ranges))


def _p99_from(
    candidates: list[np.ndarray] | None, above: int, at_least: int, n: int, floor: float, exact: Callable[[], float]
) -> float:
    # The exact p99 from the errors kept above a sampled floor (``candidates`` is None when not all
    # of them were kept): a partition of the candidates, the floor itself when the p99 rank falls
    # among the ties at the floor, else ``exact()`` (a full pass).
    need = n - _p99_rank(n)  # elements at ranks k..n-1
    if candidates is not None and need <= above:
        kept = np.concatenate(candidates)
        r = kept.size - need
        return float(np.partition(kept, r)[r])
    if above < need <= at_least:
        return float(floor)
    return exact()


def _p99_floor(e: np.ndarray, a: np.ndarray, work: np.dtype) -> float:
    # A value below the true p99 with overwhelming probability: the 97th
    # percentile of a strided sample of the errors.  If it turns out not to be
    # below, pair_stats falls back to a full pass.
    step = max(1, e.size // 65536)
    d = np.abs(np.subtract(a[::step], e[::step], dtype=work))
    d = d[np.isfinite(d)]
    if d.size < 100:
        return -1.0
    return float(np.partition(d, int(0.97 * d.size))[int(0.97 * d.size)])


def _exact_p99(e: np.ndarray, a: np.ndarray, work: np.dtype) -> float:
    d = np.abs(np.subtract(a, e, dtype=work))
    d[~np.isfinite(d)] = 0
    k = _p99_rank(d.size)
    return float(np.partition(d, k)[k])


def _p99_rank(n: int) -> int:
    # numpy's "nearest lower" rank of the 99th percentile of n values, 0-based.
    return max(0, math.ceil(0.99 * n) - 1)


@np.errstate(invalid="ignore", over="ignore", divide="ignore")
def pair_stats(
    expected: np.ndarray,
    actual: np.ndarray,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    p99: bool = True,
) -> PairStats:
    """Compare two floating arrays of the same shape, element by element.

    Parameters
    ----------
    expected, actual : numpy.ndarray
        The oracle's and the candidate's output.  Same shape; float16, float32
        or float64.  Work is done in float32 (float64 for float64 inputs).
    rtol, atol : float, optional
        Mismatch tolerances; default to ``torch.testing.assert_close``'s for
        the dtype.
    p99 : bool
        Also compute the exact 99th percentile (rank ``ceil(0.99 n) - 1`` of
        the sorted errors) of the absolute error.

    Examples
    --------
    >>> s = pair_stats(np.array([1.0, 2.0], np.float32), np.array([1.0, 2.5], np.float32))
    >>> s.max_abs, s.worst_index, s.mismatched
    (0.5, 1, 1)
    """
    if expected.shape != actual.shape:
        raise ValueError(f"shapes differ: {expected.shape} vs {actual.shape}")
    e = np.ascontiguousarray(expected).reshape(-1)
    a = np.ascontiguousarray(actual).reshape(-1)
    work = np.dtype(np.float64) if np.float64 in (e.dtype, a.dtype) else np.dtype(np.float32)
    d_rtol, d_atol = default_tolerance(str(e.dtype))
    rtol = d_rtol if rtol is None else rtol
    atol = d_atol if atol is None else atol
    n = e.size
    if n == 0:
        return PairStats(0, 0.0, -1, 0.0, -1, 0.0, 0.0, 0, 0, 0)
    if e.dtype == a.dtype == np.float32 and _fused.kernel() is not None:
        return _fused_pair_stats(e, a, rtol, atol, p99)
    floor = _p99_floor(e, a, work) if p99 else None
    cap = max(1, n // 20)  # keep at most 5% of the errors as p99 candidates
    parts = _on_cores(
        lambda start, stop: _pair_range(e, a, start, stop, rtol, atol, floor, work, cap), _ranges(n, CHUNK)
    )
    total = _Partial()
    for p in parts:
        if p.max_abs > total.max_abs:
            total.max_abs, total.worst_index = p.max_abs, p.worst_index
        if p.max_rel > total.max_rel:
            total.max_rel, total.max_rel_index = p.max_rel, p.max_rel_index
        total.sum_abs += p.sum_abs
        total.finite += p.finite
        total.mismatched += p.mismatched
        total.max_ulp = max(total.max_ulp, p.max_ulp)
        total.nonfinite_mismatch += p.nonfinite_mismatch
        total.above_count += p.above_count
        total.at_least += p.at_least
        total.above.extend(p.above)
        total.chunk_max.extend(p.chunk_max)
    if work != np.float64 and total.max_abs > 0:
        total.max_abs, total.worst_index = _exact_worst(e, a, total)
    p99_abs = 0.0
    if p99:
        kept = total.above if total.above_count <= cap else None
        p99_abs = _p99_from(kept, total.above_count, total.at_least, n, floor, lambda: _exact_p99(e, a, work))
    mean = total.sum_abs / total.finite if total.finite else 0.0
    return PairStats(
        numel=n,
        max_abs=max(total.max_abs, 0.0),
        worst_index=total.worst_index,
        max_rel=max(total.max_rel, 0.0),
        max_rel_index=total.max_rel_index,
        mean_abs=mean,
        p99_abs=p99_abs,
        mismatched=total.mismatched + total.nonfinite_mismatch,
        max_ulp=total.max_ulp,
        nonfinite_mismatch=total.nonfinite_mismatch,
    )


def _fused_pair_stats(e: np.ndarray, a: np.ndarray, rtol: float, atol: float, p99: bool) -> PairStats:
    # One compiled pass per core (numba, GIL released); same statistics as the numpy path.
    n = e.size
    floor = _p99_floor(e, a, np.dtype(np.float32)) if p99 else math.inf
    if floor < 0:
        floor = -math.inf  # too few finite samples for a floor: keep every error as a candidate
    ranges = _ranges(n)
    # Each range keeps its errors above the floor, up to 5% of its elements (pages are only
    # touched as they are written, so the usual ~3% costs ~3% of n float64s).
    caps = {start: max(1, (stop - start) // 20) if p99 else 0 for start, stop in ranges}
    bufs = {start: np.empty(cap + _fused.BLOCK, np.float64) for start, cap in caps.items()}
    ei, ai = e.view(np.int32), a.view(np.int32)
    kernel = _fused.kernel()
    parts = _on_cores(
        lambda start, stop: kernel(e, a, ei, ai, start, stop, rtol, atol, REL_EPS, floor, bufs[start]), ranges
    )
    f = {name: [p[i] for p in parts] for i, name in enumerate(_fused.FIELDS)}
    best = max(range(len(parts)), key=lambda k: (f["max_abs"][k], -k))  # ties: the lowest range
    rel = max(range(len(parts)), key=lambda k: (f["max_rel"][k], -k))
    finite = sum(f["finite"])
    nonfinite = sum(f["nonfinite_mismatch"])
    p99_abs = 0.0
    if p99:
        counts = dict(zip(caps, f["above_count"], strict=True))
        overflow = any(counts[start] > caps[start] for start in caps)
        kept = None if overflow else [bufs[start][: counts[start]] for start in caps]
        # float32 for the rare full pass: at most one output of memory
        p99_abs = _p99_from(
            kept, sum(counts.values()), sum(f["at_least"]), n, floor, lambda: _exact_p99(e, a, np.dtype(np.float32))
        )
    return PairStats(
        numel=n,
        max_abs=max(float(f["max_abs"][best]), 0.0),
        worst_index=int(f["worst_index"][best]),
        max_rel=max(float(f["max_rel"][rel]), 0.0),
        max_rel_index=int(f["max_rel_index"][rel]),
        mean_abs=sum(f["sum_abs"]) / finite if finite else 0.0,
        p99_abs=p99_abs,
        mismatched=sum(f["mismatched"]) + nonfinite,
        max_ulp=int(max(f["max_ulp"])),
        nonfinite_mismatch=nonfinite,
    )


def _sum_sq(v: np.ndarray) -> float:
    # Sum of squares without the BLAS: numpy's bundled OpenBLAS can hang in a threaded dot after the
    # process has forked (OpenMathLib/OpenBLAS#5520, numpy/numpy#30092), and torch.compile forks.
    return float(np.einsum("i,i->", v, v))


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
        raise ValueError(f"shapes differ: {x.shape} vs {reference.shape}")
    if rf.dtype == np.float64 and xf.dtype in (np.float32, np.float64) and xf.size >= 8 * CHUNK:
        kern = _fused.reference_kernel()
        if kern is not None:
            return _fused_reference_stats(kern, xf, rf)
    sq = mx = rsq = rmx = 0.0
    count = 0
    buf = np.empty(min(CHUNK, xf.size), np.float64)
    for s in range(0, xf.size, CHUNK):
        xc, rc = xf[s : s + CHUNK], rf[s : s + CHUNK]
        d = np.subtract(xc, rc, out=buf[: xc.size], dtype=np.float64)
        ok = None
        if not np.isfinite(d).all() or not np.isfinite(rc).all():
            ok = np.isfinite(d) & np.isfinite(rc)
            d, rc = d[ok], rc[ok]
        count += d.size
        if d.size:
            sq += _sum_sq(d)
            mx = max(mx, float(np.abs(d).max()))
            rsq += _sum_sq(rc)
            rmx = max(rmx, float(np.abs(rc).max()))
    if count == 0:
        return ReferenceStats(0.0, 0.0, 0.0, 0.0)
    return ReferenceStats(math.sqrt(sq / count), mx, math.sqrt(rsq / count), rmx)


def _fused_reference_stats(kern, xf: np.ndarray, rf: np.ndarray) -> ReferenceStats:
    # One compiled pass per core, like the fused pair_stats.
    parts = _on_cores(lambda start, stop: kern(xf, rf, start, stop), _ranges(xf.size))
    sq, mx, rsq, rmx, count = (
        sum(p[0] for p in parts),
        max(p[1] for p in parts),
        sum(p[2] for p in parts),
        max(p[3] for p in parts),
        sum(p[4] for p in parts),
    )
    if count == 0:
        return ReferenceStats(0.0, 0.0, 0.0, 0.0)
    return ReferenceStats(math.sqrt(sq / count), mx, math.sqrt(rsq / count), rmx)


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
        raise ValueError(f"ULP distance needs float16/32/64, got {e.dtype}")
    ie = _ordered_ints(e.reshape(-1), np.empty(e.size, np.int64))
    ia = _ordered_ints(a.reshape(-1), np.empty(a.size, np.int64))
    return _ulp_gap(ia, ie).reshape(e.shape)


@np.errstate(invalid="ignore", over="ignore", divide="ignore")
def rel_error(expected: np.ndarray, actual: np.ndarray) -> np.ndarray:
    """The seed's element-wise ``|a - e| / (|e| + 1e-6)``, in float64."""
    e = np.asarray(expected, np.float64)
    return np.abs(np.asarray(actual, np.float64) - e) / (np.abs(e) + REL_EPS)


@np.errstate(invalid="ignore", over="ignore", divide="ignore")
def error_histogram(
    expected: np.ndarray, actual: np.ndarray, edges: np.ndarray, *, relative: bool = False
) -> tuple[np.ndarray, int, int]:
    """Counts of element errors in ``edges`` (chunked), plus the exact zeros and the non-finite ones.

    ``relative=True`` histograms the seed's ``|a - e| / (|e| + 1e-6)``.
    Returns ``(counts, zeros, nonfinite)``; counts has ``len(edges) - 1`` bins,
    values above the last edge land in the last bin and non-zero values below
    the first in the first.
    """
    e = np.ascontiguousarray(expected).reshape(-1)
    a = np.ascontiguousarray(actual).reshape(-1)
    counts = np.zeros(len(edges) - 1, np.int64)
    zeros = nonfinite = 0
    lo, hi = float(edges[0]), float(edges[-1])
    for s in range(0, e.size, CHUNK):
        ec = e[s : s + CHUNK].astype(np.float64)
        d = np.abs(a[s : s + CHUNK].astype(np.float64) - ec)
        if relative:
            d /= np.abs(ec) + REL_EPS
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
