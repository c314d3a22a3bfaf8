"""The metrics other toolchains speak, from sums over a pair: cosine, Pearson (PCC), SQNR, NMSE.

Shown beside rlx_nb's own statistics (:class:`rlx_nb.numerics.pairs.PairStats` computes the sums in its
pass), never in charge of a verdict; conventions and blind spots: ``docs/verdict.md``.
"""

from __future__ import annotations

import math


def cosine(sxx: float, syy: float, sxy: float) -> float:
    """``sxy / sqrt(sxx syy)``; 1 when both vectors are zero, 0 when only one is."""
    if sxx == 0.0 or syy == 0.0:
        return 1.0 if sxx == syy else 0.0
    return max(-1.0, min(1.0, sxy / math.sqrt(sxx * syy)))


def pcc(n: int, sx: float, sy: float, *, sxx: float, syy: float, sxy: float, sdd: float) -> float:
    """Pearson correlation from the sums over ``n`` pairs, NaN-safe.

    Both sides constant: 1 when they are equal, else 0; one side constant: 0 (no linear relation).
    Computed from raw float64 sums, so an output whose mean is much larger than its spread loses
    digits (relative error about 1e-16 (mean / std)^2).
    """
    if n == 0:
        return 1.0
    vx = max(0.0, sxx - sx * sx / n)
    vy = max(0.0, syy - sy * sy / n)
    flat_x = vx <= 1e-13 * sxx or vx == 0.0  # constant, up to the sums' own rounding
    flat_y = vy <= 1e-13 * syy or vy == 0.0
    if flat_x or flat_y:
        return 1.0 if (flat_x and flat_y and sdd == 0.0) else 0.0
    return max(-1.0, min(1.0, (sxy - sx * sy / n) / math.sqrt(vx * vy)))


def sqnr_db(sxx: float, sdd: float) -> float:
    """``10 log10(sxx / sdd)``: inf for an exact match, -inf for a zero oracle with an error."""
    if sdd == 0.0:
        return math.inf
    if sxx == 0.0:
        return -math.inf
    return 10.0 * math.log10(sxx / sdd)


def nmse(sxx: float, sdd: float) -> float:
    """``sdd / sxx``: 0 for an exact match, inf for a zero oracle with an error."""
    if sdd == 0.0:
        return 0.0
    return sdd / sxx if sxx > 0.0 else math.inf


__all__ = ["cosine", "nmse", "pcc", "sqnr_db"]
