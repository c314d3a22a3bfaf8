"""How far round-off strays by chance: the room the verdict leaves for measuring it on few elements.

Pure math over statistics (:class:`~rlx_nb.numerics.reference.ReferenceStats`, :class:`~rlx_nb.numerics.reference.SliceStats`):
the shortfall of an RMS measured on ``n`` elements (a chi-square quantile), how much round-off leans
within slices, how far the largest of many slice means strays, and how far a worst element stands out.
:mod:`rlx_nb.verdict.rule` applies them; ``docs/verdict.md`` gives the reasoning.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Sequence

import numpy as np

from rlx_nb.numerics.reference import ReferenceStats, SliceStats

SAMPLE_ALPHA = 1e-2
"""Level of :func:`sample_allowance`: how often the legitimate runs' measured error falls short of it."""
SLICE_ALPHA = 1e-2
"""Family-wise level of :func:`slice_allowance`: how often a legitimate run exactly as noisy as the
oracle would see one of an output's slice means reach the allowance (the RMSE limit then multiplies it)."""


def slice_lean(legit: Sequence[SliceStats], i: int) -> float:
    """How much legitimate round-off leans one way within the slices of axis ``i``: ``E[mean^2] / E[e^2]``.

    ``sum_j S_j^2 / n_j  /  sum_j Q_j`` over the slices (``S_j`` and ``Q_j`` the sum of a run's errors and of
    their squares on slice ``j`` of ``n_j`` elements), the largest over the legitimate runs: about ``1 / n``
    when errors are independent, 1 when every slice's errors share one value.  1 when there are no errors.
    """
    lean = 0.0
    for st in legit:
        q = float(np.sum(st.squares[i]))
        if q <= 0:
            return 1.0
        lean = max(lean, float(np.sum(st.sums[i] ** 2 / np.maximum(st.counts[i], 1))) / q)
    return min(1.0, lean) if legit else 1.0


def slice_allowance(counts: np.ndarray, slices: int, lean: float = 0.0) -> np.ndarray:
    """How far a slice's mean error may stray by chance, in units of the legitimate error scale there.

    ``max(1, c * sqrt(max(lean, 1 / n_j)))`` for slice ``j`` of ``counts[j]`` elements, ``slices`` slices judged
    in all and round-off that leans ``lean`` (:func:`slice_lean`), with ``c`` the two-sided normal quantile at
    family-wise level :data:`SLICE_ALPHA` over the slices.  Round-off of scale sigma averages over a slice to
    about ``sigma sqrt(lean)`` (``sigma / sqrt(n)`` for independent errors, ``sigma`` for errors that all
    lean together), and the largest of ``slices`` such means reaches ``c`` times that; a mean never exceeds
    the RMS it came from, hence at least 1.
    """
    c = statistics.NormalDist().inv_cdf(1.0 - SLICE_ALPHA / (2.0 * max(1, slices)))
    return np.maximum(1.0, c * np.sqrt(np.maximum(lean, 1.0 / np.maximum(counts, 1))))


def sample_allowance(n: int, samples: int = 1) -> float:
    """How far the legitimate runs' error, measured on ``n`` elements by ``samples`` runs, may fall short of
    its true size by chance: ``sqrt(n / x)`` with ``x`` the ``SAMPLE_ALPHA ** (1 / samples)`` quantile of a
    chi-square with ``n`` degrees of freedom (an RMS over ``n`` independent errors).

    About 8 for a scalar measured by two runs, 1.5 for 8 elements, 1.12 for 64, 1.03 for 1,000.

    Examples
    --------
    >>> round(sample_allowance(1, 2), 1), round(sample_allowance(1000, 2), 2)
    (8.0, 1.03)
    """
    if n <= 0:
        return 1.0
    p = SAMPLE_ALPHA ** (1.0 / max(1, samples))
    return math.sqrt(n / _chi2_quantile(n, p))


WILSON_HILFERTY_DOF = 1000
"""Above this many degrees of freedom the chi-square quantile comes from the Wilson-Hilferty cube-root
normal approximation (relative error under 2e-6 there, 1e-6 in the allowance): the exact series needs
about sqrt(dof) terms per step, which took 3.6 s at 5e7 elements on a first call."""


@functools.lru_cache(maxsize=4096)
def _chi2_quantile(dof: int, p: float) -> float:
    if dof > WILSON_HILFERTY_DOF:
        z = statistics.NormalDist().inv_cdf(p)
        h = 2.0 / (9.0 * dof)
        return dof * (1.0 - h + z * math.sqrt(h)) ** 3
    # Bisection on the regularized lower incomplete gamma function P(dof/2, x/2); 100 halvings of the
    # bracket reach double precision.
    lo, hi = 0.0, max(10.0, 4.0 * dof)
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if _gamma_p(0.5 * dof, 0.5 * mid) < p:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _gamma_p(a: float, x: float) -> float:
    # Regularized lower incomplete gamma P(a, x): the series below a + 1, the continued fraction above.
    if x <= 0:
        return 0.0
    log_front = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        k = a
        while abs(term) > abs(total) * 1e-15:
            k += 1
            term *= x / k
            total += term
        return min(1.0, total * math.exp(log_front))
    b, c, d = x + 1 - a, 1e300, 1.0 / (x + 1 - a)
    h = d
    for i in range(1, 1000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1e-300 if abs(d) < 1e-300 else d
        c = b + an / c
        c = 1e-300 if abs(c) < 1e-300 else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-15:
            break
    return max(0.0, 1.0 - math.exp(log_front) * h)


JOINT_SHARE = 0.5
"""Besides the slice that stands furthest above round-off, another axis's slice is part of where the error sits when
it holds at least this share of the error's square ...
"""
JOINT_OVER = 2.0
"""... and at least this many times its round-off share: a bug at one position of one sequence is ``[0, 3]``, not
the position across a batch it leaves alone (round-off spread over a batch of 4 holds ~1x on each)."""


def slice_share(b: SliceStats, legit: Sequence[SliceStats]) -> tuple[float, float, str]:
    """Where an error's square sits: ``(share, over, at)`` of the slice whose share of the whole output's squared
    error stands furthest above what round-off leaves on it (the legitimate runs' largest share there, or the
    slice's share of the elements, whichever is larger), narrowed by the other axes whose own slice holds most of
    it too (:data:`JOINT_SHARE`).  ``at`` names it (``[:, :, 3]``, ``[0, 3]``); ``share`` is then at least the
    share of their intersection.

    Round-off (a precision mode too) follows the values, so each slice holds about its legitimate share; a bug on
    one row, position or channel holds nearly all of it on one slice.

    Examples
    --------
    >>> from rlx_nb.numerics.reference import slice_stats
    >>> o = np.ones((4, 8)); ref = o.astype(np.float64)
    >>> legit = slice_stats((o * (1 + 1e-7 * np.arange(32).reshape(4, 8) % 3)).astype(np.float32), ref)
    >>> bug = slice_stats(np.where(np.arange(4)[:, None] == 2, 1.001, 1.0).astype(np.float32) * o, ref)
    >>> share, over, at = slice_share(bug, [legit])
    >>> round(share, 2), at
    (1.0, '[2]')
    """
    tops: dict[int, tuple[float, float, int]] = {}  # axis -> (share, over, index) of its slice furthest above
    for i, axis in enumerate(b.axes):
        total = float(np.sum(b.squares[i]))
        if total <= 0:
            continue
        share = b.squares[i] / total
        expected = b.counts[i] / max(float(np.sum(b.counts[i])), 1.0)
        for st in legit:
            q = float(np.sum(st.squares[i]))
            if q > 0:
                expected = np.maximum(expected, st.squares[i] / q)
        over = share / np.where(expected > 0, expected, 1.0)
        j = int(np.argmax(over))
        tops[axis] = (float(share[j]), float(over[j]), j)
    if not tops:
        return 0.0, 0.0, ""
    best = max(tops, key=lambda a: tops[a][1])
    joint = {a: t for a, t in tops.items() if a == best or (t[0] >= JOINT_SHARE and t[1] >= JOINT_OVER)}
    at = [str(joint[a][2]) if a in joint else ":" for a in range(max(joint) + 1)]
    share = max(0.0, sum(t[0] for t in joint.values()) - (len(joint) - 1))
    return share, tops[best][1], "[" + ", ".join(at) + "]"


def peak_mean(st: SliceStats, i: int) -> float:
    # The largest |mean error| over the slices of axis ``i``.
    return float(np.max(np.abs(st.sums[i]) / np.maximum(st.counts[i], 1), initial=0.0))


def isolation(st: ReferenceStats, n: int) -> float:
    """How far the worst error stands out from the rest: ``max|e| / (rms(e) sqrt(2 ln n))``, ~1 for noise."""
    return st.max_err / (st.rmse * math.sqrt(2 * math.log(max(n, 3)))) if st.rmse > 0 else 0.0
