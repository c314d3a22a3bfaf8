"""One fused pass over a float32 pair for :func:`rlx_nb.numerics.pairs.pair_stats` (numba).

The numpy path in :mod:`rlx_nb.numerics.pairs` makes ~20 passes over each chunk; this
kernel reads every element once, in blocks that stay in L1: a vectorised loop
forms each error (in float64, so the worst index needs no refinement and the
tolerances apply exactly like the float64 reference in the tests) and updates
the sums, counts and ULP maximum, and counts the elements that beat the running
largest absolute and relative errors (a comparison with a multiplication, no
division: float max reductions and divisions do not vectorise well).  Only
blocks that hold a new maximum, a non-finite value, or p99 candidates are
looked at again, one element at a time.  The kernel releases the GIL, so
:func:`pair_stats` runs one range per core in threads.

The passes against the float64 reference (:func:`_reference_range`, :func:`_slice_rows`, :func:`_zero_range`)
take their largest magnitudes the same way, without a float maximum: each block's values go to a buffer, and the
largest is an integer maximum of their bits (:data:`MAGNITUDE`).

:func:`kernel` imports numba and loads the compiled kernel (cached on disk by
numba) on first use, so ``import rlx_nb`` does not pay for it.  It returns
``None`` when numba is missing or ``RLX_NB_NO_NUMBA=1``; the numpy path is
then used and gives the same statistics.
"""

from __future__ import annotations

import functools
import math
import os

import numpy as np

BLOCK = 2048
"""Elements per block; ``above`` needs this much room past its capacity."""

# Fields of the tuple returned by the kernel, in order.
FIELDS = (
    "max_abs",
    "worst_index",
    "max_rel",
    "max_rel_index",
    "sum_abs",
    "finite",
    "mismatched",
    "max_ulp",
    "nonfinite_mismatch",
    "above_count",
    "at_least",
    "sum_x",
    "sum_s",
    "sum_xx",
    "sum_xs",
    "sum_dd",
)
"""The sums are over finite pairs, with ``s = y - x`` the signed error: ``sum_y``, ``sum_xy`` and ``sum_yy``
follow exactly (:func:`rlx_nb.numerics.pairs._fused_pair_stats`), in fewer operations per element."""


def _f32_range(e, a, ei, ai, start, stop, rtol, atol, rel_eps, floor, above, sums):  # pragma: no cover - compiled
    # e, a: float32; ei, ai: the same memory as int32; above: float64, room for capacity + BLOCK;
    # sums: whether to form the five similarity sums (False only to measure what they cost).
    dbuf = np.empty(BLOCK, np.float64)
    lowest = np.int64(-2147483648)
    cap = above.size - BLOCK
    max_abs = -1.0
    worst = -1
    max_rel = -1.0
    rel_at = -1
    total = 0.0
    bad = 0
    mism = 0
    max_ulp = np.int64(0)
    nonfinite = 0
    n_above = 0
    at_least = 0
    sx = 0.0
    ss = 0.0
    sxx = 0.0
    sxs = 0.0
    sdd = 0.0
    for s in range(start, stop, BLOCK):
        m = min(BLOCK, stop - s)
        # Thresholds for this block, a hair below the running maxima so that rounding in the
        # multiplication cannot hide an element whose exact ratio beats them.
        abs_bar = max_abs
        rel_bar = max_rel * (1.0 - 1e-12)
        b_sum = 0.0
        b_bad = 0
        b_mism = 0
        b_ulp = np.int64(0)
        b_above = 0
        b_at_least = 0
        b_abs_hit = 0
        b_rel_hit = 0
        # The block as views indexed from 0: numba then knows no index is negative, and the loop
        # vectorises (indexing e[s + j] costs a wraparound check per element, 2x on the whole pass).
        eb = e[s : s + m]
        ab = a[s : s + m]
        eib = ei[s : s + m]
        aib = ai[s : s + m]
        for j in range(m):  # vectorised: no branches, no division, only selects
            x = np.float64(eb[j])
            y = np.float64(ab[j])
            d = abs(y - x)
            ok = d < math.inf  # false when either side is NaN or infinite
            d = d if ok else 0.0
            ax = abs(x) if ok else 0.0
            b_bad += 0 if ok else 1
            dbuf[j] = d
            b_sum += d
            b_mism += 1 if d > atol + rtol * ax else 0
            b_above += 1 if d > floor else 0
            b_at_least += 1 if d >= floor else 0
            b_abs_hit += 1 if d > abs_bar else 0
            b_rel_hit += 1 if d > 0.0 and d >= rel_bar * (ax + rel_eps) else 0
            # ULP distance: float bits mapped to ordered integers, -0.0 and +0.0 both at 0.
            ke = np.int64(eib[j])
            ka = np.int64(aib[j])
            ke = lowest - ke if ke < 0 else ke
            ka = lowest - ka if ka < 0 else ka
            g = ka - ke
            g = g if g >= 0 else -g
            g = g if ok else 0
            b_ulp = g if g > b_ulp else b_ulp
        # The sums for cosine, PCC, SQNR and NMSE, over the block again while it is in L1: a plain
        # reduction the compiler vectorises (the guarded form, only for blocks with NaN/Inf, does not).
        b_sx = 0.0
        b_ss = 0.0
        b_sxx = 0.0
        b_sxs = 0.0
        b_sdd = 0.0
        if sums and b_bad == 0:
            for j in range(m):
                x = np.float64(eb[j])
                g = np.float64(ab[j]) - x  # the signed error: y = x + g, so the other sums follow exactly
                b_sx += x
                b_ss += g
                b_sxx += x * x
                b_sxs += x * g
                b_sdd += g * g
        elif sums:
            for j in range(m):
                x = np.float64(eb[j])
                g = np.float64(ab[j]) - x
                if abs(g) < math.inf:
                    b_sx += x
                    b_ss += g
                    b_sxx += x * x
                    b_sxs += x * g
                    b_sdd += g * g
        total += b_sum
        sx += b_sx
        ss += b_ss
        sxx += b_sxx
        sxs += b_sxs
        sdd += b_sdd
        mism += b_mism
        at_least += b_at_least
        max_ulp = b_ulp if b_ulp > max_ulp else max_ulp
        if b_abs_hit:  # a new largest error in this block (rare once the maximum has settled)
            for j in range(m):
                if dbuf[j] > max_abs:  # strictly greater: ties keep the lowest index
                    max_abs = dbuf[j]
                    worst = s + j
        if b_rel_hit:  # the seed's relative error, with the division done only here
            for j in range(m):
                x = np.float64(eb[j])
                r = dbuf[j] / (abs(x) + rel_eps)  # non-finite pairs have d == 0: r is 0 or NaN
                if r > max_rel:
                    max_rel = r
                    rel_at = s + j
        if b_above:
            if n_above <= cap:
                for j in range(m):  # a few percent are taken: cheaper than a branch-free compaction
                    if dbuf[j] > floor:
                        above[n_above] = dbuf[j]
                        n_above += 1
            else:
                n_above += b_above
        if b_bad:
            bad += b_bad
            for j in range(m):
                x = eb[j]
                y = ab[j]
                if not (np.isfinite(x) and np.isfinite(y)) and not (x == y or (np.isnan(x) and np.isnan(y))):
                    nonfinite += 1
    if rel_at < 0 and worst >= 0:  # every error is zero: like argmax, the first element
        max_rel, rel_at = 0.0, worst
    finite = (stop - start) - bad
    return (
        max_abs, worst, max_rel, rel_at, total, finite, mism, max_ulp, nonfinite, n_above, at_least,
        sx, ss, sxx, sxs, sdd,
    )  # fmt: skip


MAGNITUDE = np.int64(0x7FFFFFFFFFFFFFFF)
"""A float64's bits with the sign cleared: for values that are not NaN, these integers order as the magnitudes do.

The kernels below take a largest magnitude as an integer maximum of these bits, over a block they wrote to a buffer:
a float maximum is a reduction the compiler does not vectorise (the pass over a row took 4x as long with it)."""


def _reference_range(x, ref, start, stop):  # pragma: no cover - compiled
    # Squared-error sum, largest error, the reference's squared sum and largest magnitude, the count,
    # and the error's, the reference's and their product's sums (the error's pattern), over elements
    # where both are finite (x: float32 or float64; ref: float64).
    sq = 0.0
    rsq = 0.0
    count = 0
    se = 0.0
    sr = 0.0
    ser = 0.0
    dbuf = np.empty(BLOCK, np.float64)
    rbuf = np.empty(BLOCK, np.float64)
    dbits = dbuf.view(np.int64)
    rbits = rbuf.view(np.int64)
    top = np.zeros(2, np.int64)  # the largest error's and reference's bits (see MAGNITUDE)
    for s in range(start, stop, BLOCK):
        m = min(BLOCK, stop - s)
        xs = x[s : s + m]  # views indexed from 0: see the block views in _f32_range
        rs = ref[s : s + m]
        for i in range(m):
            r = rs[i]
            d = np.float64(xs[i]) - r
            ok = abs(d) < math.inf and abs(r) < math.inf
            d = d if ok else 0.0
            r = r if ok else 0.0
            count += 1 if ok else 0
            sq += d * d
            rsq += r * r
            se += d
            sr += r
            ser += d * r
            dbuf[i] = d
            rbuf[i] = r
        mx = top[0]
        rmx = top[1]
        for i in range(m):
            v = dbits[i] & MAGNITUDE
            w = rbits[i] & MAGNITUDE
            mx = v if v > mx else mx
            rmx = w if w > rmx else rmx
        top[0] = mx
        top[1] = rmx
    most = top.view(np.float64)
    return sq, most[0], rsq, most[1], count, se, sr, ser


def _slice_rows(x, ref, r0, r1, row_s, row_q, row_n, col_s, col_q, col_n):  # pragma: no cover - compiled
    # Errors e = x - ref (float64) of rows r0..r1 of two 2-D arrays, where both are finite: per row
    # their sum, sum of squares and count (row_* of length 0: not kept), and per column the same,
    # added to col_* (one set per worker).  Returns the largest error, the reference's squared sum and
    # largest magnitude there, and the reference's and the error-times-reference sums: with the column
    # sums, what :func:`_reference_range` gives.
    keep_rows = row_s.size > 0
    rsq = 0.0
    sr = 0.0
    ser = 0.0
    cols = x.shape[1]
    ebuf = np.empty(cols, np.float64)  # a row's errors and reference values
    rbuf = np.empty(cols, np.float64)
    ebits = ebuf.view(np.int64)
    rbits = rbuf.view(np.int64)
    top = np.zeros(2, np.int64)  # the largest error's and reference's bits (see MAGNITUDE)
    for i in range(r0, r1):
        # A row's sums without a test per element first (a third less time): a non-finite x or reference
        # makes its error, and so the error's sum, non-finite, and then the row is summed again with the test.
        s = 0.0
        q = 0.0
        a = 0.0
        b = 0.0
        d = 0.0
        for j in range(cols):
            r = ref[i, j]
            e = np.float64(x[i, j]) - r
            s += e
            q += e * e
            a += r * r
            b += r
            d += e * r
            ebuf[j] = e
            rbuf[j] = r
        n = float(cols)
        if not (abs(s) < math.inf and abs(q) < math.inf and abs(a) < math.inf and abs(d) < math.inf):
            s = q = a = b = d = n = 0.0
            for j in range(cols):  # branch-free, so that it vectorises
                r = rbuf[j]
                e = ebuf[j]
                ok = abs(e) < math.inf and abs(r) < math.inf
                e = e if ok else 0.0
                r = r if ok else 0.0
                s += e
                q += e * e
                n += 1.0 if ok else 0.0
                a += r * r
                b += r
                d += e * r
                ebuf[j] = e
                rbuf[j] = r
                col_n[j] += 1.0 if ok else 0.0
        else:
            for j in range(cols):
                col_n[j] += 1.0
        mx = top[0]
        rmx = top[1]
        for j in range(cols):
            e = ebuf[j]
            col_s[j] += e
            col_q[j] += e * e
            v = ebits[j] & MAGNITUDE
            w = rbits[j] & MAGNITUDE
            mx = v if v > mx else mx
            rmx = w if w > rmx else rmx
        top[0] = mx
        top[1] = rmx
        rsq += a
        sr += b
        ser += d
        if keep_rows:
            row_s[i] = s
            row_q[i] = q
            row_n[i] = n
    most = top.view(np.float64)
    return most[0], rsq, most[1], sr, ser


def _zero_range(o, b, ref, start, stop):  # pragma: no cover - compiled
    # Over elements start..stop of three flat arrays: where the oracle and the reference are both exactly 0,
    # their count, how many of the backend's are not 0 there and its largest finite magnitude; elsewhere the
    # sums of :func:`_reference_range` of ``b`` against ``ref`` (for rlx_nb.numerics.zeros.zero_split).
    zeroed = 0
    nonzero = 0
    sq = 0.0
    rsq = 0.0
    count = 0
    se = 0.0
    sr = 0.0
    ser = 0.0
    lbuf = np.empty(BLOCK, np.float64)  # the backend's magnitude where zeroed, the error and reference elsewhere
    dbuf = np.empty(BLOCK, np.float64)
    rbuf = np.empty(BLOCK, np.float64)
    lbits = lbuf.view(np.int64)
    dbits = dbuf.view(np.int64)
    rbits = rbuf.view(np.int64)
    top = np.zeros(3, np.int64)  # the largest of each, as bits (see MAGNITUDE)
    for s in range(start, stop, BLOCK):
        m = min(BLOCK, stop - s)
        os_ = o[s : s + m]  # views indexed from 0: see the block views in _f32_range
        bs = b[s : s + m]
        rs = ref[s : s + m]
        for i in range(m):  # branch-free, so that it vectorises
            r = rs[i]
            x = np.float64(bs[i])
            z = os_[i] == 0 and r == 0
            moved = z and x != 0
            zeroed += 1 if z else 0
            nonzero += 1 if moved else 0
            lbuf[i] = abs(x) if moved and abs(x) < math.inf else 0.0
            d = x - r
            ok = not z and abs(d) < math.inf and abs(r) < math.inf
            d = d if ok else 0.0
            r = r if ok else 0.0
            count += 1 if ok else 0
            sq += d * d
            rsq += r * r
            se += d
            sr += r
            ser += d * r
            dbuf[i] = d
            rbuf[i] = r
        lm = top[0]
        mx = top[1]
        rmx = top[2]
        for i in range(m):
            u = lbits[i]
            v = dbits[i] & MAGNITUDE
            w = rbits[i] & MAGNITUDE
            lm = u if u > lm else lm
            mx = v if v > mx else mx
            rmx = w if w > rmx else rmx
        top[0] = lm
        top[1] = mx
        top[2] = rmx
    most = top.view(np.float64)
    return zeroed, nonzero, most[0], sq, most[1], rsq, most[2], count, se, sr, ser  # (the last 8: _reference_range's)


def _pool_rows(o, b, r0, r1, fy, fx, rel, rel_eps, pooled):  # pragma: no cover - compiled
    # Max-pool |b - o| (or the seed's relative error) of rows r0..r1 (r0 a multiple of fy) of two
    # 2-D float32 arrays into pooled[row // fy, col // fx]; NaN/Inf disagreements are +inf,
    # agreeing NaN/Inf are 0.  Rows are first combined element-wise into one row per block of fy
    # (a vertical max: vectorised, no reduction), then that row is reduced per block of fx.
    w = o.shape[1]
    acc = np.empty(w, np.float64)
    for i0 in range(r0, r1, fy):
        acc[:] = 0.0
        for i in range(i0, min(r1, i0 + fy)):
            for j in range(w):
                x = np.float64(o[i, j])
                y = np.float64(b[i, j])
                d = abs(y - x)
                same = x == y or (x != x and y != y)
                d = d if d < math.inf else (0.0 if same else math.inf)
                d = d / (abs(x) + rel_eps) if rel and d < math.inf else d
                acc[j] = d if d > acc[j] else acc[j]
        pi = i0 // fy
        for c0 in range(0, w, fx):
            m = 0.0
            for j in range(c0, min(w, c0 + fx)):
                m = acc[j] if acc[j] > m else m
            pooled[pi, c0 // fx] = m


@functools.cache
def kernel():
    """The compiled :func:`_f32_range`, or ``None`` without numba (or with ``RLX_NB_NO_NUMBA=1``)."""
    if os.environ.get("RLX_NB_NO_NUMBA"):
        return None
    try:
        import numba  # noqa: F401
    except ImportError:  # pragma: no cover - numba is a dependency; this is for platforms it lacks
        return None
    return _compiled("_f32_range")


def reference_kernel():
    """The compiled :func:`_reference_range`, or ``None`` like :func:`kernel`."""
    return None if kernel() is None else _compiled("_reference_range")


def slice_kernel():
    """The compiled :func:`_slice_rows`, or ``None`` like :func:`kernel`."""
    return None if kernel() is None else _compiled("_slice_rows")


def zero_kernel():
    """The compiled :func:`_zero_range`, or ``None`` like :func:`kernel`."""
    return None if kernel() is None else _compiled("_zero_range")


def pool_kernel():
    """The compiled :func:`_pool_rows`, or ``None`` like :func:`kernel`."""
    return None if kernel() is None else _compiled("_pool_rows")


@functools.cache
def _compiled(name: str):
    # Each kernel compiled once per process (and cached on disk by numba across processes).
    import numba

    return numba.njit(nogil=True, cache=True, error_model="numpy", fastmath={"reassoc", "contract"})(globals()[name])


def _sequential_rows(x, out):  # pragma: no cover - compiled
    # out[i] = x[i, 0] + x[i, 1] + ... in float32, strictly left to right (no reassociation).
    for i in range(x.shape[0]):
        acc = np.float32(0.0)
        for k in range(x.shape[1]):
            acc = np.float32(acc + x[i, k])
        out[i] = acc


@functools.cache
def sequential_kernel():
    """:func:`_sequential_rows` compiled without fast-math (the order is the point), or ``None``."""
    if kernel() is None:
        return None
    import numba

    return numba.njit(nogil=True, cache=True)(_sequential_rows)


def _round_bits(src, dst, drop):  # pragma: no cover - compiled
    # float32 bit patterns (as uint32) rounded to 24 - drop bits, nearest even; NaN/Inf kept: the same
    # arithmetic as rlx_nb.backends.emulated._round, in one pass.
    half = np.uint32((1 << (drop - 1)) - 1)
    mask = ~np.uint32((1 << drop) - 1)
    for k in range(src.size):
        i = src[k]
        if (i & np.uint32(0x7F800000)) == np.uint32(0x7F800000):
            dst[k] = i
        else:
            lsb = (i >> np.uint32(drop)) & np.uint32(1)
            dst[k] = (i + half + lsb) & mask


@functools.cache
def round_kernel():
    """:func:`_round_bits` compiled (no fast-math: exact integer work), or ``None`` like :func:`kernel`."""
    if kernel() is None:
        return None
    import numba

    return numba.njit(nogil=True, cache=True)(_round_bits)
