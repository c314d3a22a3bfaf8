"""Where the oracle and the fp64 reference are both exactly 0: positions a model zeroes, not computes.

An element that comes out exactly 0 in float32 *and* float64 is set, not rounded: a padded position an
inference fast path writes as 0 (``nn.TransformerEncoder`` with nested tensors), a masked or cropped
output.  A backend that computes such positions instead (``torch.compile``, an ONNX export and OpenVINO
all leave that fast path) differs from the oracle by the values it computes there, which no rounding
explains, and the rest of its output can still be round-off.  For a SUSPECT output, :func:`zero_split`
counts those elements and measures the backend's error over the others, so the reason can say which of
the two it is.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from rlx_nb.numerics import fused as _fused
from rlx_nb.numerics.pairs import CHUNK, dot, on_cores, ranges
from rlx_nb.numerics.reference import ReferenceStats


@dataclasses.dataclass(frozen=True)
class ZeroSplit:
    """A backend's output split at the elements where the oracle and fp64 are both exactly 0."""

    zeroed: int
    """Elements where the oracle and fp64 are both exactly 0."""
    nonzero: int
    """... of which the backend's is not 0 (or not finite)."""
    largest: float
    """The backend's largest magnitude there."""
    elsewhere: ReferenceStats
    """The backend's error against fp64 over every other element."""


@np.errstate(invalid="ignore", over="ignore")
def zero_split(oracle: np.ndarray, backend: np.ndarray, reference: np.ndarray) -> ZeroSplit | None:
    """:class:`ZeroSplit` of three real float arrays of one shape, in chunks; None when the backend is 0
    wherever the oracle and fp64 are.

    Examples
    --------
    >>> o, r = np.float32([0, 0, 1, 2]), np.float64([0, 0, 1, 2])
    >>> s = zero_split(o, np.float32([0, 3, 1, 2]), r)
    >>> s.zeroed, s.nonzero, s.largest, s.elsewhere.max_err
    (2, 1, 3.0, 0.0)
    >>> zero_split(o, o, r) is None
    True
    """
    o, b, r = (np.ascontiguousarray(a).reshape(-1) for a in (oracle, backend, reference))
    floats = (np.float32, np.float64)
    if o.dtype in floats and b.dtype in floats and r.dtype == np.float64 and (kern := _fused.zero_kernel()):
        parts = on_cores(lambda start, stop: kern(o, b, r, start, stop), ranges(o.size))
        zeroed, nonzero, largest, *sums = ((max if k in (2, 4, 6) else sum)(p[k] for p in parts) for k in range(11))
        return ZeroSplit(zeroed, nonzero, largest, ReferenceStats.of_sums(tuple(sums))) if nonzero else None
    zeroed = nonzero = count = 0
    largest = sq = mx = rsq = rmx = 0.0
    for s in range(0, o.size, CHUNK):
        oc, bc, rc = o[s : s + CHUNK], b[s : s + CHUNK], r[s : s + CHUNK]
        z = (oc == 0) & (rc == 0)
        there = bc[z]
        zeroed += int(there.size)
        moved = there[there != 0]
        nonzero += int(moved.size)
        largest = max(largest, float(np.abs(moved[np.isfinite(moved)]).max(initial=0.0)))
        rest = rc[~z]
        d = bc[~z].astype(np.float64) - rest
        ok = np.isfinite(d) & np.isfinite(rest)
        d, rest = d[ok], rest[ok]
        count += int(d.size)
        if d.size:
            sq, rsq = sq + dot(d, d), rsq + dot(rest, rest)
            mx, rmx = max(mx, float(np.abs(d).max())), max(rmx, float(np.abs(rest).max()))
    if nonzero == 0:
        return None
    return ZeroSplit(
        zeroed, nonzero, largest, ReferenceStats.of_sums((sq, mx, rsq, rmx, count, math.nan, math.nan, math.nan))
    )
