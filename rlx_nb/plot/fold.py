"""Per-element error maps folded to 2-D and max-pooled to a pixel budget (numpy; numba for float32 abs/rel).

Folding rule
------------
A 2-D output is drawn as it is.  An N-D output is folded to 2-D by grouping
its axes into rows and columns: ``fold=((0, 1, 2), (3,))`` puts axes 0, 1, 2
(e.g. batch, head, query) on the rows and axis 3 (key) on the columns; axes
may be reordered (``((0, 2), (1, 3))``).  The default puts every axis but the
last on the rows.  ``select={axis: i}`` first fixes some axes to one index
(``select={0: 3}`` draws batch element 3 only).  A 1-D output of length n is
wrapped into rows of ``ceil(sqrt(n))``; a 0-d output is one pixel.

Pooling
-------
Maps larger than the pixel budget are reduced block by block with ``max``,
so a single-element outlier always survives as the value of its block: a
plain ``imshow`` of a 4096x4096 map averages such outliers away.  Pooling
works on row bands, so the full-size error map is never built.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from rlx_nb.errors import InputError
from rlx_nb.numerics import fused as _fused
from rlx_nb.numerics.elements import ulp_distance
from rlx_nb.numerics.pairs import REL_EPS

METRICS = ("line", "abs", "rel", "ulp", "budget", "quanta")
BAND_ELEMENTS = 1 << 20


@dataclasses.dataclass(frozen=True)
class Fold:
    """How an N-D output maps onto a 2-D grid and back.

    ``rows`` and ``cols`` are the axes (of the selected view) on each side;
    ``select`` the axes fixed to one index first.
    """

    shape: tuple[int, ...]
    rows: tuple[int, ...]
    cols: tuple[int, ...]
    select: tuple[tuple[int, int], ...] = ()
    wrap: int = 0  # > 0: a 1-D output wrapped into rows of this width

    @property
    def view_shape(self) -> tuple[int, ...]:
        fixed = dict(self.select)
        return tuple(n for ax, n in enumerate(self.shape) if ax not in fixed)

    @property
    def grid(self) -> tuple[int, int]:
        if self.wrap:
            n = self.shape[0] if self.shape else 1
            return math.ceil(n / self.wrap), self.wrap
        vs = self.view_shape
        return math.prod(vs[a] for a in self.rows), math.prod(vs[a] for a in self.cols)

    def to_2d(self, x: np.ndarray) -> np.ndarray:
        """The 2-D view (or copy, when axes are reordered) of ``x``; padded with NaN when wrapped."""
        if self.wrap:
            flat = x.reshape(-1)
            h, w = self.grid
            if flat.size == h * w:
                return flat.reshape(h, w)
            out = np.full(h * w, np.nan, dtype=np.result_type(flat.dtype, np.float32))
            out[: flat.size] = flat
            return out.reshape(h, w)
        fixed = dict(self.select)
        view = x[tuple(fixed.get(ax, slice(None)) for ax in range(x.ndim))]
        if view.ndim == 0:
            return view.reshape(1, 1)
        return np.transpose(view, self.rows + self.cols).reshape(self.grid)

    def index(self, row: int, col: int) -> tuple[int, ...]:
        """The original multi-dimensional index of grid cell ``(row, col)``."""
        if self.wrap:
            return (row * self.wrap + col,)
        vs = self.view_shape
        r = np.unravel_index(row, [vs[a] for a in self.rows]) if self.rows else ()
        c = np.unravel_index(col, [vs[a] for a in self.cols]) if self.cols else ()
        view_index = dict(zip(self.rows + self.cols, (*r, *c), strict=True))
        fixed = dict(self.select)
        it = iter(view_index[a] for a in range(len(vs)))
        return tuple(int(fixed[ax]) if ax in fixed else int(next(it)) for ax in range(len(self.shape)))

    def cell(self, index: Sequence[int]) -> tuple[int, int] | None:
        """The grid cell of an original index, or None when ``select`` excludes it."""
        index = tuple(int(i) for i in index)
        if self.wrap:
            return divmod(index[0], self.wrap)
        fixed = dict(self.select)
        if any(index[ax] != i for ax, i in fixed.items()):
            return None
        vi = [i for ax, i in enumerate(index) if ax not in fixed]
        vs = self.view_shape
        if not vs:
            return (0, 0)
        r = int(np.ravel_multi_index([vi[a] for a in self.rows], [vs[a] for a in self.rows])) if self.rows else 0
        c = int(np.ravel_multi_index([vi[a] for a in self.cols], [vs[a] for a in self.cols])) if self.cols else 0
        return r, c

    def side_label(self, side: str) -> str:
        """What one side of the grid holds, in the output's own axes: ``axes 0 x 1 (4 x 128 = 512)``."""
        if self.wrap:
            h, w = self.grid
            return f"elements {w} per row" if side == "cols" else f"{h} rows of {w} elements"
        view_axes = [ax for ax in range(len(self.shape)) if ax not in dict(self.select)]
        axes = [view_axes[a] for a in (self.rows if side == "rows" else self.cols)]
        if not axes:
            return "1"
        dims = [self.shape[a] for a in axes]
        total = math.prod(dims)
        if len(axes) == 1:
            return f"axis {axes[0]} ({total})"
        return f"axes {' x '.join(map(str, axes))} ({' x '.join(map(str, dims))} = {total})"

    def describe(self) -> str:
        """E.g. ``rows = axes (0, 1, 2), cols = axis (3,)``."""
        if self.wrap:
            return f"1-D wrapped into rows of {self.wrap}"
        sel = f"; fixed {dict(self.select)}" if self.select else ""
        return f"rows = axes {self.rows}, cols = axes {self.cols} of the view{sel}"


def make_fold(
    shape: Sequence[int],
    fold: tuple[Sequence[int], Sequence[int]] | None = None,
    select: dict[int, int] | None = None,
) -> Fold:
    """Validate a folding rule for ``shape`` (see the module docstring)."""
    shape = tuple(int(n) for n in shape)
    select = dict(select or {})
    for ax, i in select.items():
        if not (0 <= ax < len(shape)) or not (0 <= i < shape[ax]):
            raise InputError(f"select {{{ax}: {i}}} is out of range for shape {shape}")
    nview = len(shape) - len(select)
    if fold is None:
        if len(shape) == 1 and not select:
            return Fold(shape, (), (), wrap=max(1, math.ceil(math.sqrt(shape[0]))))
        rows, cols = (tuple(range(nview - 1)), (nview - 1,)) if nview else ((), ())
    else:
        try:
            rows, cols = (tuple(int(a) for a in fold[0]), tuple(int(a) for a in fold[1]))
        except (TypeError, ValueError, IndexError):
            raise InputError(f"fold must be (row_axes, col_axes), e.g. ((0, 1), (2,)); got {fold!r}") from None
        if sorted(rows + cols) != list(range(nview)):
            raise InputError(
                f"fold {fold!r} must use each of the {nview} axes {tuple(range(nview))} once "
                f"(shape {shape}, select {select or {}})"
            )
    return Fold(shape, rows, cols, tuple(sorted(select.items())))


def pool_factors(grid: tuple[int, int], max_pixels: int) -> tuple[int, int]:
    """Block sizes so the pooled map is at most ``max_pixels`` on each side."""
    return max(1, math.ceil(grid[0] / max_pixels)), max(1, math.ceil(grid[1] / max_pixels))


def _element_error(o: np.ndarray, b: np.ndarray, r: np.ndarray | None, metric: str, budget: float) -> np.ndarray:
    if metric == "ulp":
        return ulp_distance(o, b.astype(o.dtype)).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        if metric in ("budget", "line"):
            return np.abs(b.astype(np.float64) - r) / budget
        if metric == "quanta":  # (an int8 output: its error against the Q/DQ simulation, in quanta of it)
            return np.abs(b.astype(np.float64) - o) / budget
        # abs/rel in the outputs' own precision (float32 for float32): half the memory traffic.
        work = np.float64 if np.float64 in (o.dtype, b.dtype) else np.float32
        d = np.subtract(b, o, dtype=work)
        np.abs(d, out=d)
        if metric == "rel":
            d /= np.abs(o, dtype=work) + work(REL_EPS)
    return d


def error_map(
    oracle: np.ndarray,
    backend: np.ndarray,
    reference: np.ndarray | None = None,
    *,
    metric: str = "abs",
    budget: float | None = None,
    fold: Fold | None = None,
    max_pixels: int = 512,
) -> tuple[np.ndarray, tuple[int, int], Fold]:
    """Per-element error on the folded grid, max-pooled to ``max_pixels`` per side.

    ``metric`` is ``abs`` (|b - o|), ``rel`` (the seed's |b - o| / (|o| + 1e-6)),
    ``ulp`` (ULP distance in the oracle's dtype), ``budget`` (|b - r| over the
    output's round-off budget, so 1 is the oracle's own error) or ``line`` (|b - r| in units of the
    SUSPECT line, ``budget`` the error at which one element alone makes the output SUSPECT: 1 is the line);
    ``budget`` and ``line`` need the fp64 ``reference`` and ``budget``; ``quanta`` (an int8 output: |b - o| in quanta
    of the output, ``budget`` the quantum) needs ``budget``.  Returns ``(map, (fy, fx), fold)`` where
    ``(fy, fx)`` are the pooling block sizes.  NaN/Inf disagreements are +inf.
    """
    if metric not in METRICS:
        raise InputError(f"metric must be one of {METRICS}, got {metric!r}")
    if metric in ("budget", "line") and (reference is None or not budget):
        raise InputError(f"the {metric!r} metric needs the fp64 reference and the output's budget")
    if metric == "quanta" and not budget:
        raise InputError("the 'quanta' metric needs the output's quantum (an int8 report's: report.int8['quanta'])")
    if oracle.shape != backend.shape:
        raise InputError(f"shapes differ: {oracle.shape} vs {backend.shape}")
    fold = fold or make_fold(oracle.shape)
    o2, b2 = fold.to_2d(oracle), fold.to_2d(backend)
    r2 = fold.to_2d(reference) if reference is not None else None
    h, w = o2.shape
    fy, fx = pool_factors((h, w), max_pixels)
    ph, pw = math.ceil(h / fy), math.ceil(w / fx)
    pooled = np.zeros((ph, pw), np.float64)
    band = max(fy, (max(1, BAND_ELEMENTS // max(1, w)) // fy) * fy)

    fused = _fused.pool_kernel() if metric in ("abs", "rel") and o2.dtype == b2.dtype == np.float32 else None

    def pool_band(r0: int) -> None:
        if fused is not None:  # one compiled pass (errors formed in float64), no temporaries
            fused(o2, b2, r0, min(h, r0 + band), fy, fx, metric == "rel", REL_EPS, pooled)
            return
        sl = slice(r0, min(h, r0 + band))
        e = _element_error(o2[sl], b2[sl], r2[sl] if r2 is not None else None, metric, budget or 1.0)
        if not np.isfinite(e.max()):  # NaN propagates through max: one cheap check per band
            e = _nonfinite_as_inf(e, o2[sl], b2[sl])
        # Columns first (np.maximum.reduceat handles the ragged last block), then rows.
        cols = np.maximum.reduceat(e, np.arange(0, w, fx), axis=1)
        pooled[r0 // fy : r0 // fy + math.ceil(cols.shape[0] / fy)] = np.maximum.reduceat(
            cols, np.arange(0, cols.shape[0], fy), axis=0
        )

    starts = range(0, h, band)
    workers = min(os.cpu_count() or 1, len(starts))
    if workers > 1:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(pool_band, starts))
    else:
        for r0 in starts:
            pool_band(r0)
    return pooled, (fy, fx), fold


def _nonfinite_as_inf(e: np.ndarray, o: np.ndarray, b: np.ndarray) -> np.ndarray:
    bad = ~np.isfinite(e)
    if bad.any():
        agree = (o == b) | (np.isnan(o) & np.isnan(b))
        e = np.where(bad, np.where(agree, 0.0, np.inf), e)
    return e


def block_argmax(
    oracle: np.ndarray,
    backend: np.ndarray,
    fold: Fold,
    block: tuple[int, int],
    factors: tuple[int, int],
) -> tuple[int, ...]:
    """The original index of the worst element (by abs error) inside one pooled block."""
    fy, fx = factors
    o2, b2 = fold.to_2d(oracle), fold.to_2d(backend)
    r0, c0 = block[0] * fy, block[1] * fx
    with np.errstate(invalid="ignore"):
        d = np.abs(b2[r0 : r0 + fy, c0 : c0 + fx].astype(np.float64) - o2[r0 : r0 + fy, c0 : c0 + fx])
    d = np.where(np.isfinite(d), d, np.inf)
    i, j = np.unravel_index(int(np.argmax(d)), d.shape)
    return fold.index(r0 + i, c0 + j)


def scatter_sample(
    oracle: np.ndarray, backend: np.ndarray, *, max_points: int = 20_000, worst: int = 200, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """``(|oracle|, |backend - oracle|)`` for a uniform sample plus the ``worst`` elements."""
    from rlx_nb.numerics.elements import top_k

    o, b = oracle.reshape(-1), backend.reshape(-1)
    rng = np.random.default_rng(seed)
    idx = rng.choice(o.size, size=min(o.size, max_points), replace=False) if o.size > max_points else np.arange(o.size)
    if o.size and worst:
        idx = np.union1d(idx, top_k(o, b, min(worst, o.size))[0])
    of = o[idx].astype(np.float64)
    return np.abs(of), np.abs(b[idx].astype(np.float64) - of)


def error_window(
    oracle: np.ndarray, backend: np.ndarray, fold: Fold, index: Sequence[int], radius: int = 2
) -> np.ndarray:
    """``|backend - oracle|`` on the ``(2 radius + 1)``-square window of the folded grid around ``index``
    (NaN outside), computed on the window only."""
    o, _, _ = neighbourhood(oracle, fold, index, radius)
    b, _, _ = neighbourhood(backend, fold, index, radius)
    with np.errstate(invalid="ignore", over="ignore"):
        return np.abs(b - o)


def neighbourhood(x: np.ndarray, fold: Fold, index: Sequence[int], radius: int = 2) -> tuple[np.ndarray, int, int]:
    """A ``(2 radius + 1)``-square window of the folded grid around ``index`` (NaN outside)."""
    cell = fold.cell(index)
    if cell is None:
        raise InputError(f"index {tuple(index)} is not in the selected slice {dict(fold.select)}")
    g = fold.to_2d(x)
    r, c = cell
    out = np.full((2 * radius + 1, 2 * radius + 1), np.nan)
    r0, r1 = max(0, r - radius), min(g.shape[0], r + radius + 1)
    c0, c1 = max(0, c - radius), min(g.shape[1], c + radius + 1)
    out[r0 - r + radius : r1 - r + radius, c0 - c + radius : c1 - c + radius] = g[r0:r1, c0:c1].astype(np.float64)
    return out, r, c
