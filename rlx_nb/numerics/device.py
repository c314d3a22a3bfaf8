"""The metrics of :mod:`rlx_nb.numerics.pairs`, computed with torch where a candidate's output lives.

A candidate that runs on a GPU leaves its outputs there (see :class:`rlx_nb.execution.run.Leaf`); the
oracle's output and the fp64 reference are uploaded once per device and output, the statistics
are computed on the device in chunks of :data:`CHUNK` elements, and only scalars (and, for
:func:`top_k`, ``k`` values) come back to the host.  The definitions are those of the numpy
path: errors in float64, NaN/Inf agreement rules, the exact p99 (rank ``ceil(0.99 n) - 1``),
mismatches at ``assert_close``'s tolerances, ULP distance in the oracle's float type.

Device dtypes: float32 and float16 outputs (bfloat16 is compared as float32, as on the host);
the device needs float64, so MPS outputs are compared on the host instead.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from rlx_nb.errors import InputError
from rlx_nb.numerics.pairs import REL_EPS, SUM_FIELDS, PairStats, _p99_rank, default_tolerance
from rlx_nb.numerics.reference import ReferenceStats, SliceStats, slice_axes, slices_from_rows

CHUNK = 1 << 24
"""Elements per device chunk: bounds the float64 temporaries to a few hundred MB."""

_INT = {torch.float16: torch.int16, torch.float32: torch.int32}


def _ordered(x: torch.Tensor) -> torch.Tensor:
    # Float bits as int64 keys ordered like the floats; -0.0 and +0.0 both at 0.
    bits = x.view(_INT[x.dtype]).to(torch.int64)
    lowest = torch.iinfo(_INT[x.dtype]).min
    return torch.where(bits < 0, lowest - bits, bits)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the same bits (NaN payloads and signed zeros included), shape and dtype included: the
    tensor form of :func:`rlx_nb.numerics.pairs.same_bits` (bfloat16 too, which numpy has not).

    >>> same_bits(torch.tensor([0.0, 1.0]), torch.tensor([-0.0, 1.0]))
    False
    """
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))


def as_device(x: np.ndarray | torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x`` flattened on ``device`` (a host array is uploaded; a device tensor is used in place)."""
    t = torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x
    t = t.reshape(-1).to(device)
    return t.to(dtype) if dtype is not None and t.dtype != dtype else t


@torch.no_grad()
def pair_stats(expected: torch.Tensor, actual: torch.Tensor, *, p99: bool = True) -> PairStats:
    """:func:`rlx_nb.numerics.pairs.pair_stats` for two flat tensors on one device (float16/float32)."""
    if expected.shape != actual.shape:
        raise InputError(f"shapes differ: {tuple(expected.shape)} vs {tuple(actual.shape)}")
    if expected.dtype not in _INT or actual.dtype != expected.dtype:
        raise InputError(f"device metrics need matching float16/float32 tensors, got {expected.dtype}, {actual.dtype}")
    rtol, atol = default_tolerance(str(expected.dtype).removeprefix("torch."))
    n = expected.numel()
    if n == 0:
        return PairStats(0, 0.0, -1, 0.0, -1, 0.0, 0.0, 0, 0, 0)
    floor = _floor(expected, actual) if p99 else math.inf
    max_abs, worst, max_rel, rel_at = -1.0, -1, -1.0, -1
    total, finite, mism, max_ulp, nonfinite = 0.0, 0, 0, 0, 0
    above, at_least = [], 0
    sums = [0.0] * 6  # x, y, xx, yy, xy, dd over finite pairs
    for s in range(0, n, CHUNK):
        ec, ac = expected[s : s + CHUNK], actual[s : s + CHUNK]
        e64, a64 = ec.double(), ac.double()
        both = torch.isfinite(e64) & torch.isfinite(a64)
        agree = (e64 == a64) | (torch.isnan(e64) & torch.isnan(a64))
        nonfinite += int((~both & ~agree).sum())
        finite += int(both.sum())
        d = torch.where(both, (a64 - e64).abs(), 0.0)
        ax = torch.where(both, e64.abs(), 0.0)
        x, y = torch.where(both, e64, 0.0), torch.where(both, a64, 0.0)
        for k, v in enumerate((x.sum(), y.sum(), (x * x).sum(), (y * y).sum(), (x * y).sum(), (d * d).sum())):
            sums[k] += float(v)
        total += float(d.sum())
        m, i = torch.max(d, 0)  # the first index of the maximum
        if float(m) > max_abs:
            max_abs, worst = float(m), s + int(i)
        mism += int((d > atol + rtol * ax).sum())
        rel = d / (ax + REL_EPS)
        m, i = torch.max(rel, 0)
        if float(m) > max_rel:
            max_rel, rel_at = float(m), s + int(i)
        gap = torch.where(both, (_ordered(ac) - _ordered(ec)).abs(), 0)
        max_ulp = max(max_ulp, int(gap.max()))
        if p99:
            above.append(d[d > floor])
            at_least += int((d >= floor).sum())
    p99_abs = 0.0
    if p99:
        need = n - _p99_rank(n)
        cand = torch.cat(above)
        if need <= cand.numel():
            p99_abs = float(torch.kthvalue(cand, cand.numel() - need + 1).values)
        elif need <= at_least:
            p99_abs = float(floor)
        else:  # the sampled floor was too high: the whole error vector, once
            d = torch.cat([_errors(expected[s : s + CHUNK], actual[s : s + CHUNK]) for s in range(0, n, CHUNK)])
            p99_abs = float(torch.kthvalue(d, _p99_rank(n) + 1).values)
    return PairStats(
        numel=n,
        max_abs=max(max_abs, 0.0),
        worst_index=worst,
        max_rel=max(max_rel, 0.0),
        max_rel_index=rel_at,
        mean_abs=total / finite if finite else 0.0,
        p99_abs=p99_abs,
        mismatched=mism + nonfinite,
        max_ulp=max_ulp,
        nonfinite_mismatch=nonfinite,
        **dict(zip(SUM_FIELDS, sums, strict=True)),
        finite=finite,
    )


def _errors(ec: torch.Tensor, ac: torch.Tensor) -> torch.Tensor:
    e64, a64 = ec.double(), ac.double()
    both = torch.isfinite(e64) & torch.isfinite(a64)
    return torch.where(both, (a64 - e64).abs(), 0.0)


def _floor(expected: torch.Tensor, actual: torch.Tensor) -> float:
    # The 97th percentile of a strided sample: below the p99 with overwhelming probability.
    step = max(1, expected.numel() // 65536)
    d = _errors(expected[::step], actual[::step])
    if d.numel() < 100:
        return -math.inf
    return float(torch.kthvalue(d, int(0.97 * d.numel()) + 1).values)


@torch.no_grad()
def reference_stats(x: torch.Tensor, reference: torch.Tensor) -> ReferenceStats:
    """:func:`rlx_nb.numerics.reference.reference_stats` for a flat tensor and a flat float64 reference on one device."""
    if x.shape != reference.shape:
        raise InputError(f"shapes differ: {tuple(x.shape)} vs {tuple(reference.shape)}")
    sq = mx = rsq = rmx = se = sr = ser = 0.0
    count = 0
    for s in range(0, x.numel(), CHUNK):
        r = reference[s : s + CHUNK].double()
        d = x[s : s + CHUNK].double() - r
        ok = torch.isfinite(d) & torch.isfinite(r)
        d, r = torch.where(ok, d, 0.0), torch.where(ok, r, 0.0)
        count += int(ok.sum())
        sq += float((d * d).sum())
        rsq += float((r * r).sum())
        se, sr, ser = se + float(d.sum()), sr + float(r.sum()), ser + float((d * r).sum())
        mx = max(mx, float(d.abs().max())) if d.numel() else mx
        rmx = max(rmx, float(r.abs().max())) if r.numel() else rmx
    return ReferenceStats.of_sums((sq, mx, rsq, rmx, count, se, sr, ser))


@torch.no_grad()
def slice_stats(x: torch.Tensor, reference: torch.Tensor, shape: tuple[int, ...]) -> SliceStats:
    """:func:`rlx_nb.numerics.reference.slice_stats` for a flat tensor and a flat float64 reference of ``shape``
    on one device; only the per-slice sums (a few vectors) come to the host."""
    if x.shape != reference.shape or x.numel() != math.prod(shape):
        raise InputError(f"shapes differ: {tuple(x.shape)}, {tuple(reference.shape)}, {shape}")
    axes = slice_axes(shape)
    if not axes:
        return SliceStats((), (), (), ())
    cols = shape[-1]
    xr, rr = x.reshape(-1, cols), reference.reshape(-1, cols)
    rows = xr.shape[0]
    keep_rows = any(k < len(shape) - 1 for k in axes)
    col = [torch.zeros(cols, dtype=torch.float64, device=x.device) for _ in range(3)]
    row: list[list[torch.Tensor]] = [[], [], []]
    step = max(1, CHUNK // cols)
    for a in range(0, rows, step):
        e = xr[a : a + step].double() - rr[a : a + step].double()
        ok = torch.isfinite(e)
        e = torch.where(ok, e, 0.0)
        for i, v in enumerate((e, e * e, ok.double())):
            col[i] += v.sum(dim=0)
            if keep_rows:
                row[i].append(v.sum(dim=1))
    col_np = [c.cpu().numpy() for c in col]
    row_np = [torch.cat(r).cpu().numpy() for r in row] if keep_rows else []
    return slices_from_rows(shape, axes, col_np, row_np)


@torch.no_grad()
def top_k(expected: torch.Tensor, actual: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Flat indices and absolute errors of the ``k`` worst elements, worst first (ties: lower index).

    Like :func:`rlx_nb.numerics.elements.top_k`: NaN/Inf disagreements rank above every finite error.  Only
    ``2k`` numbers per chunk leave the device.
    """
    best_i, best_v = np.empty(0, np.int64), np.empty(0, np.float64)
    for s in range(0, expected.numel(), CHUNK):
        ec, ac = expected[s : s + CHUNK].double(), actual[s : s + CHUNK].double()
        both = torch.isfinite(ec) & torch.isfinite(ac)
        agree = (ec == ac) | (torch.isnan(ec) & torch.isnan(ac))
        d = torch.where(both, (ac - ec).abs(), torch.where(agree, 0.0, math.inf))
        kk = min(k, d.numel())
        # The chunk's kk largest, ties at the threshold taken from the lowest indices; the host
        # merge then orders by (-error, index).
        threshold = torch.topk(d, kk).values[-1]
        ties = torch.nonzero(d == threshold).reshape(-1)[:kk]
        strict = torch.nonzero(d > threshold).reshape(-1)
        idx = torch.cat([strict, ties])[:kk]
        best_i = np.concatenate([best_i, idx.cpu().numpy() + s])
        best_v = np.concatenate([best_v, d[idx].cpu().numpy()])
        order = np.lexsort((best_i, -best_v))[:k]
        best_i, best_v = best_i[order], best_v[order]
    return best_i, best_v


def worst_columns(oracle: np.ndarray, backend: torch.Tensor, reference: np.ndarray | None, k: int) -> dict:
    """:func:`rlx_nb.numerics.elements.element_columns` of the ``k`` worst elements of a backend's output left on its
    device: the top-k found there, only those ``k`` elements brought to the host."""
    from rlx_nb.numerics.elements import element_columns

    eb = backend.reshape(-1)
    idx, err = top_k(as_device(oracle, eb.device), eb, k)
    bf = eb[torch.from_numpy(idx).to(eb.device)].cpu().numpy()
    return element_columns(oracle.shape, reference, idx, err, (oracle.reshape(-1)[idx], bf))
