"""Divergence metrics on numpy arrays, computed in chunks, one range per core.

Nothing here imports torch, pandas or matplotlib.  Float32 pairs (the common
case) go through one fused numba pass (:mod:`rlx_nb.numerics.fused`); everything else,
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

from rlx_nb.errors import InputError
from rlx_nb.numerics import formats
from rlx_nb.numerics import fused as _fused
from rlx_nb.numerics.similarity import cosine, nmse, pcc, sqnr_db

CHUNK = 1 << 16
REL_EPS = 1e-6
"""The seed's guard in ``max_rel = |a - b| / (|a| + 1e-6)``."""

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
    # Sums over the pairs where both sides are finite (float64), for the metrics other toolchains speak.
    sum_x: float = 0.0
    sum_y: float = 0.0
    sum_xx: float = 0.0
    sum_yy: float = 0.0
    sum_xy: float = 0.0
    sum_dd: float = 0.0
    finite: int = 0

    @property
    def cosine(self) -> float:
        """Cosine similarity of the oracle and the backend (1 when both are all zero)."""
        return cosine(self.sum_xx, self.sum_yy, self.sum_xy)

    @property
    def pcc(self) -> float:
        """Pearson correlation (PCC); see :func:`pcc` for the constant cases."""
        return pcc(
            self.finite, self.sum_x, self.sum_y, sxx=self.sum_xx, syy=self.sum_yy, sxy=self.sum_xy, sdd=self.sum_dd
        )

    @property
    def sqnr_db(self) -> float:
        """Signal to quantisation-noise ratio, ``10 log10(sum o^2 / sum (b - o)^2)``, in dB."""
        return sqnr_db(self.sum_xx, self.sum_dd)

    @property
    def nmse(self) -> float:
        """Normalised mean squared error, ``sum (b - o)^2 / sum o^2``."""
        return nmse(self.sum_xx, self.sum_dd)


def default_tolerance(dtype_name: str) -> tuple[float, float]:
    """``(rtol, atol)`` that ``torch.testing.assert_close`` uses for ``dtype_name`` (float32's for another)."""
    f = formats.FORMATS.get(dtype_name)
    return f.tolerance if f is not None and f.tolerance is not None else formats.FORMATS["float32"].tolerance


def ordered_ints(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    # Map float bit patterns onto int64s ordered like the floats, with -0.0
    # and +0.0 both at 0, so ULP distance is a plain difference.
    bits = x.view(_INT_OF_FLOAT[x.dtype])
    np.copyto(out, bits, casting="unsafe")
    lowest = np.int64(np.iinfo(bits.dtype).min)
    np.copyto(out, lowest - out, where=out < 0)
    return out


def ulp_gap(ia: np.ndarray, ie: np.ndarray) -> np.ndarray:
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
    gap = ulp_gap(ordered_ints(ac, np.empty(m, np.int64)), ordered_ints(ec, np.empty(m, np.int64)))
    if excluded is not None:
        gap[excluded] = 0
    return int(gap.max())


SUM_FIELDS = ("sum_x", "sum_y", "sum_xx", "sum_yy", "sum_xy", "sum_dd")


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
    sums: list = dataclasses.field(default_factory=lambda: [0.0] * 6)  # x, y, xx, yy, xy, dd


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
    *,
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
        _add_sums(part.sums, ec, ac, excluded)
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


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays hold the same bytes (shape and dtype included): compared in 4 MB slices, without
    copies of contiguous arrays, stopping at the first slice that differs (a pair that differs anywhere near the
    start costs one slice, not a pass).

    >>> same_bits(np.float32([0.0, 1.0]), np.float32([-0.0, 1.0]))
    False
    """
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    x = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    y = np.ascontiguousarray(b).reshape(-1).view(np.uint8)
    whole = x.size // 8 * 8  # compared as 8-byte words (a 200 MB pair: 0.024 s, against 0.039 s byte by byte)
    if not np.array_equal(x[whole:], y[whole:]):
        return False
    xw, yw = x[:whole].view(np.uint64), y[:whole].view(np.uint64)
    step = 1 << 19
    return all(np.array_equal(xw[s : s + step], yw[s : s + step]) for s in range(0, xw.size, step))


def dot(u: np.ndarray, v: np.ndarray) -> float:
    """``sum(u * v)`` of two 1-D arrays in their dtype, without the BLAS: numpy's bundled OpenBLAS can
    hang in a threaded dot after the process has forked (OpenMathLib/OpenBLAS#5520, numpy/numpy#30092),
    and torch.compile forks."""
    return float(np.einsum("i,i->", u, v))


def _add_sums(sums: list, ec: np.ndarray, ac: np.ndarray, excluded: np.ndarray | None) -> None:
    # The six float64 sums of a chunk's finite pairs (the numpy path's extra pass).
    x, y = ec.astype(np.float64), ac.astype(np.float64)
    if excluded is not None:
        x[excluded] = 0.0
        y[excluded] = 0.0
    d = y - x
    sums[0] += float(x.sum())
    sums[1] += float(y.sum())
    sums[2] += dot(x, x)
    sums[3] += dot(y, y)
    sums[4] += dot(x, y)
    sums[5] += dot(d, d)


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


def workers(n: int) -> int:
    per = n // (8 * CHUNK)
    return 1 if per <= 1 else min(os.cpu_count() or 1, per)  # (a small output asks the OS nothing: 18 us a call)


def ranges(n: int, align: int = 1) -> list[tuple[int, int]]:
    """One contiguous ``(start, stop)`` per worker, starts aligned to ``align`` elements."""
    count = workers(n)
    return list(itertools.pairwise([k * n // count // align * align for k in range(count)] + [n]))


def on_cores(fn: Callable[[int, int], Any], ranges: list[tuple[int, int]]) -> list:
    # fn(start, stop) for each range, one thread each (numpy and the compiled kernels release the GIL).
    if len(ranges) == 1:
        return [fn(*ranges[0])]
    with ThreadPoolExecutor(len(ranges)) as pool:
        return list(pool.map(lambda r: fn(*r), ranges))


def _p99_from(
    candidates: list[np.ndarray] | None, above: int, at_least: int, n: int, *, floor: float, exact: Callable[[], float]
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
        raise InputError(f"shapes differ: {expected.shape} vs {actual.shape}")
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
        return _fused_pair_stats(e, a, rtol, atol, p99=p99)
    floor = _p99_floor(e, a, work) if p99 else None
    cap = max(1, n // 20)  # keep at most 5% of the errors as p99 candidates
    parts = on_cores(
        lambda start, stop: _pair_range(e, a, start, stop, rtol=rtol, atol=atol, floor=floor, work_dtype=work, cap=cap),
        ranges(n, CHUNK),
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
        total.sums = [t + q for t, q in zip(total.sums, p.sums, strict=True)]
    if work != np.float64 and total.max_abs > 0:
        total.max_abs, total.worst_index = _exact_worst(e, a, total)
    p99_abs = 0.0
    if p99:
        kept = total.above if total.above_count <= cap else None
        p99_abs = _p99_from(
            kept, total.above_count, total.at_least, n, floor=floor, exact=lambda: _exact_p99(e, a, work)
        )
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
        **dict(zip(SUM_FIELDS, total.sums, strict=True)),
        finite=total.finite,
    )


def _sums_from_signed(sx: float, ss: float, sxx: float, sxs: float, sdd: float) -> dict[str, float]:
    # y = x + s for each finite pair: the six sums from the kernel's five.
    return {
        "sum_x": sx,
        "sum_y": sx + ss,
        "sum_xx": sxx,
        "sum_yy": sxx + 2.0 * sxs + sdd,
        "sum_xy": sxx + sxs,
        "sum_dd": sdd,
    }


def _fused_pair_stats(
    e: np.ndarray, a: np.ndarray, rtol: float, atol: float, *, p99: bool, sums: bool = True
) -> PairStats:
    # One compiled pass per core (numba, GIL released); same statistics as the numpy path.
    # sums=False leaves the similarity sums at 0: only bench/extra_metrics_cost.py asks for it.
    n = e.size
    floor = _p99_floor(e, a, np.dtype(np.float32)) if p99 else math.inf
    if floor < 0:
        floor = -math.inf  # too few finite samples for a floor: keep every error as a candidate
    spans = ranges(n)
    # Each range keeps its errors above the floor, up to 5% of its elements (pages are only
    # touched as they are written, so the usual ~3% costs ~3% of n float64s).
    caps = {start: max(1, (stop - start) // 20) if p99 else 0 for start, stop in spans}
    bufs = {start: np.empty(cap + _fused.BLOCK, np.float64) for start, cap in caps.items()}
    ei, ai = e.view(np.int32), a.view(np.int32)
    kernel = _fused.kernel()
    parts = on_cores(
        lambda start, stop: kernel(e, a, ei, ai, start, stop, rtol, atol, REL_EPS, floor, bufs[start], sums), spans
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
        exact = lambda: _exact_p99(e, a, np.dtype(np.float32))  # noqa: E731
        p99_abs = _p99_from(kept, sum(counts.values()), sum(f["at_least"]), n, floor=floor, exact=exact)
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
        **_sums_from_signed(*(float(sum(f[name])) for name in ("sum_x", "sum_s", "sum_xx", "sum_xs", "sum_dd"))),
        finite=int(finite),
    )
