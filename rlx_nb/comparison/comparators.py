"""One backend's output judged against its :class:`~rlx_nb.comparison.context.OutputContext`, by a comparator for its kind.

In the manner of ``torch.testing``'s pair classes: :func:`comparator_for` picks the comparator for what the
oracle and the backend gave -- :class:`Floating` (real floats, on the host or on the backend's device),
:class:`Complex` (compared as interleaved real and imaginary parts), :class:`Exact` (integers, booleans: equal
or not), :class:`Value` (plain values), :class:`Opaque` (objects that hold no tensor) -- or a structural
mismatch (an output missing, another shape).  Each measures the pair, asks :mod:`rlx_nb.verdict.rule` for the
:class:`~rlx_nb.verdict.rule.Judgement`, and returns what it found (:class:`~rlx_nb.verdict.records.Finding`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import torch

from rlx_nb.comparison.context import OutputContext
from rlx_nb.comparison.flips import Flips
from rlx_nb.execution.results import OPAQUE, Leaf
from rlx_nb.numerics import device as device_metrics
from rlx_nb.numerics import formats
from rlx_nb.numerics.elements import rel_error
from rlx_nb.numerics.pairs import PairStats, pair_stats
from rlx_nb.numerics.reference import ReferenceStats, error_stats, reference_stats
from rlx_nb.numerics.zeros import zero_split
from rlx_nb.verdict import rule as verdict
from rlx_nb.verdict.readings import looks_like_reduced_precision
from rlx_nb.verdict.records import Finding, PairFields
from rlx_nb.verdict.types import (
    ROUNDOFF,
    SUSPECT,
    VERDICT_SKIPPED,
    Evidence,
    Judgement,
    SliceEvidence,
    replaced,
    without_statistics,
)
from rlx_nb.verdict.words import Cause


@dataclasses.dataclass(frozen=True)
class Candidate:
    """What one backend gave for one output, and how it is to be judged."""

    backend: str
    compute_dtype: str
    leaf: Leaf | None
    rule: str = "budget"
    tol_rel: float | None = None
    flips: Flips | None = None
    """The discrete events accounted for on this output (its own and the legitimate runs'), or None."""


class Comparator:
    """Judges one candidate's output against one output's context (a subclass per kind of output)."""

    measured = True
    """Whether the comparator looked at the elements (the record then counts them in ``numel``)."""

    def __init__(self, ctx: OutputContext, cand: Candidate) -> None:
        self.ctx, self.cand = ctx, cand
        self.notes: list[str] = []

    @property
    def tol_rel(self) -> float:
        return self.cand.tol_rel if self.cand.tol_rel is not None else verdict.default_tol_rel(self.ctx.kind)

    def compare(self) -> Finding:
        raise NotImplementedError

    def record(self, judgement: Judgement, pair: PairFields | None = None) -> Finding:
        """What this comparator found (the record is made from it once the backend's every output is judged)."""
        o = self.ctx.oracle
        return Finding(
            self.cand.backend,
            self.ctx.name,
            self.ctx.index,
            self.ctx.kind,
            self.cand.compute_dtype,
            replaced(judgement, tol_rel=self.tol_rel),
            pair or PairFields(),
            shape=o.shape,
            dtype=o.dtype,
            numel=int(o.value.size) if o.is_array and self.measured else 0,
            reduction_length=self.ctx.reduction_length,
            notes=tuple(self.notes),
        )

    def plain(self, verdict_: str, cause: str, detail: str) -> Finding:
        return self.record(without_statistics(verdict_, cause, detail))


class Structure(Comparator):
    """A backend's output the oracle's does not match in structure: missing, or of another shape."""

    @property
    def measured(self) -> bool:
        return self.cand.leaf is not None

    def compare(self) -> Finding:
        got = self.cand.leaf
        if got is None:
            return self.plain(
                SUSPECT, Cause.STRUCTURE, "output missing: the backend's outputs have a different structure"
            )
        return self.plain(
            SUSPECT,
            Cause.STRUCTURE,
            f"shape {tuple(got.shape)} differs from the oracle's {self.ctx.oracle.value.shape}",
        )


class Opaque(Comparator):
    """An object that holds no tensor, on either side: not compared."""

    measured = False

    def compare(self) -> Finding:
        o, got = self.ctx.oracle, self.cand.leaf
        if o.dtype == OPAQUE:
            why = f"not compared: a {o.value} object that holds no tensors (only tensors and plain values are compared)"
        else:
            why = f"not compared: the backend gives <{got.value}> where the oracle has a {o.dtype} output"
        return self.plain(VERDICT_SKIPPED, Cause.NOT_COMPARED, why)


class Value(Comparator):
    """A plain value (a number, a string): equal, or SUSPECT."""

    measured = False

    def compare(self) -> Finding:
        o, got = self.ctx.oracle, self.cand.leaf
        if not o.is_array and not got.is_array and _equal(o.value, got.value):
            return self.plain(ROUNDOFF, Cause.EXACT, "equal")
        return self.plain(
            SUSPECT, Cause.STRUCTURE, f"value {got.value!r:.60} differs from the oracle's {o.value!r:.60}"
        )


class Exact(Comparator):
    """An integer or boolean output: it must match exactly."""

    def compare(self) -> Finding:
        o, b = self.ctx.oracle.value, self.cand.leaf.value
        diff = o != b
        mismatched = int(np.count_nonzero(diff))
        pair: dict[str, Any] = dict(mismatched=mismatched, mismatched_frac=mismatched / max(1, o.size))
        if o.size and np.issubdtype(o.dtype, np.number) and np.issubdtype(b.dtype, np.number):
            of, bf = o.astype(np.float64), b.astype(np.float64)
            pair["max_abs"], pair["max_rel"] = float(np.abs(of - bf).max()), float(rel_error(of, bf).max())
        if mismatched:
            flat = int(np.flatnonzero(diff.reshape(-1))[0])
            pair["worst_index"] = tuple(int(i) for i in np.unravel_index(flat, o.shape))
            why = f"{mismatched} of {o.size} elements of a {o.dtype} output differ (exact match expected)"
            return self.record(without_statistics(SUSPECT, Cause.EXACT, why), PairFields(**pair))
        return self.record(without_statistics(ROUNDOFF, Cause.EXACT, "exact match"), PairFields(**pair))


class Floating(Comparator):
    """A real floating output: the pair's statistics, the backend's error against fp64 and the budget verdict.

    On the host, or where the backend leaves its output on its device (:func:`on_device`): there the oracle
    and the reference go to the device once per output (the context keeps them), and only statistics come back.
    """

    def views(self) -> tuple[Any, Any]:
        """The oracle's and the backend's outputs as compared: flat views of one float type."""
        o, b = self.ctx.oracle.value, self.cand.leaf.value
        if o.dtype != b.dtype:
            wide = np.promote_types(o.dtype, b.dtype)
            return o.astype(wide), b.astype(wide)
        return o, b

    def compare(self) -> Finding:
        ctx, cand = self.ctx, self.cand
        o, got = ctx.oracle.value, cand.leaf
        if got.dtype != ctx.oracle.dtype:
            self.notes.append(f"dtype {got.dtype} differs from the oracle's {ctx.oracle.dtype}")
        device = on_device(o, got)
        r = ctx.r
        if device:
            eo, eb = o, got.tensor.reshape(-1)
            stats = device_metrics.pair_stats(ctx.on(eb.device, "oracle"), eb)
        else:
            eo, eb = self.views()
            stats = pair_stats(eo, eb)
        pair = _pair_fields(stats, o, eo, eb, r)
        fixed = verdict.fixed_judgement(stats.max_rel, self.tol_rel, stats.nonfinite_mismatch)
        if r is None:
            self.notes.append("no fp64 reference for this output; the budget verdict is unavailable")
            return self.record(verdict.decide(None, cand.rule, fixed), pair)
        judged_b, errors, own, events = eb, None, None, 0
        if device:
            rd = ctx.on(eb.device, "reference")
            errors = device_metrics.reference_stats(eb, rd)
            own = device_metrics.slice_stats(eb, rd, o.shape) if o.ndim >= 2 else None
        else:
            if cand.flips is not None:
                _, flipped = cand.flips.apply(eo, eb)
                if flipped is not eb:  # (the backend's error without its flips)
                    judged_b, events = flipped, cand.flips.count
                    self.notes.append(cand.flips.note)
            errors, own = self.backend_errors(judged_b, r)
        nonfinite, outliers = self.nonfinite(stats, eo, eb, r)
        j = verdict.judge(
            self.evidence(errors, own, nonfinite=nonfinite, outliers=outliers, max_abs=pair.max_abs, events=events)
        )
        self.notes += j.notes
        j = verdict.decide(j, cand.rule, fixed)
        if j.verdict == SUSPECT or j.rules.verdict_budget == SUSPECT:
            j = self.read(j, got, errors, r, device)
        return self.record(j, pair)

    def backend_errors(self, b: np.ndarray, r: np.ndarray) -> tuple[Any, Any]:
        # The backend's errors against fp64 and, for outputs of two or more dimensions, its slice sums (one pass).
        o = self.ctx.oracle.value
        if o.ndim >= 2 and b.shape == o.shape:
            return error_stats(b, r)
        return reference_stats(b, r), None

    def nonfinite(self, stats: PairStats, eo: Any, eb: Any, r: np.ndarray) -> tuple[int, int]:
        """``(mismatched, oracle outliers)``: elements whose NaN/Inf pattern the backend has and neither the oracle
        nor fp64 has (or the reverse), and those where the backend agrees with fp64 and the oracle does not."""
        if not stats.nonfinite_mismatch:
            return 0, 0
        b = self.views()[1] if isinstance(eb, torch.Tensor) else eb  # (a device output: its host copy)
        cb, co, cr = (_nonfinite_class(np.asarray(x).reshape(r.shape)) for x in (b, eo, r))
        off = cb != co
        return int(np.count_nonzero(off & (cb != cr))), int(np.count_nonzero(off & (cb == cr)))

    def evidence(
        self, errors: Any, own: Any, *, nonfinite: int, outliers: int, max_abs: float, events: int
    ) -> Evidence:
        # What the verdict reads: the backend's and the legitimate runs' errors against fp64.
        ctx, cand = self.ctx, self.cand
        oracle, seq = ctx.budget_oracle, ctx.sequential_errors
        legit_slices = (
            [oracle.slices] + ([seq.slices] if seq is not None else []) + [t.slices for t in ctx.trial_errors]
        )
        own_anchor = at_precision = None
        bits = formats.anchor_of(cand.compute_dtype)
        if bits is not None and bits in ctx.read_anchors and (ae := ctx.anchor_errors(bits)) is not None:
            own_anchor, at_precision = (bits, ae.stats), ae.slices
        slices = None
        if own is not None and all(st is not None and st.axes == own.axes for st in legit_slices):
            shapes = []
            for b in ctx.read_anchors:
                ae = ctx.anchor_errors(b)
                if ae is not None and ae.slices is not None and ae.slices.axes == own.axes and ae.stats.rmse > 0:
                    shapes.append((ae.stats.rmse, ae.slices))
            precision = (at_precision,) if at_precision is not None and at_precision.axes == own.axes else ()
            slices = SliceEvidence(own, tuple(legit_slices), precision, tuple(shapes))
        return Evidence(
            cand.backend,
            ctx.kind,
            cand.compute_dtype,
            int(ctx.oracle.value.size),
            errors,
            oracle.stats,
            seq.stats if seq is not None else None,
            own_anchor,
            slices,
            nonfinite,
            ctx.reduction_length,
            anchors_rmse=ctx.anchors_rmse,
            oracle_outliers=outliers,
            max_abs=max_abs,
            discrete_events=events,
            legit=tuple(t.stats for t in ctx.trial_errors),
            quantum=ctx.quantum,
        )

    def read(self, j: Judgement, got: Leaf, errors: ReferenceStats, r: np.ndarray, device: bool) -> Judgement:
        """What a SUSPECT output's error shows: positions the model zeroes, a precision likeness, its pattern
        (its bias and its correlation with the fp64 values, from the sums of the pass that measured ``errors``)."""
        o, readings = self.ctx.oracle.value, {}
        # (an int8 output's exact zeros are its zero point, every value within half a quantum of 0: not positions the
        # model sets)
        if j.rules.verdict_budget == SUSPECT and not device and self.cand.compute_dtype != formats.INT8:
            split = zero_split(o, got.value, r) if _real_alike(o, got.value, r) else None
            if split is not None:
                e = split.elsewhere
                readings.update(
                    zero_mismatch=split.nonzero,
                    zero_mismatch_max=split.largest,
                    excess_elsewhere=verdict.excess_within(
                        e.rmse, e.max_err, j.budget.budget_rmse, j.budget.budget_max
                    ),
                )
        if j.verdict == SUSPECT and looks_like_reduced_precision(j, self.cand.compute_dtype, self.ctx.kind):
            readings["anchor_likeness"] = self.likeness(got, r, j.reading.closest_format)
        if j.verdict == SUSPECT:
            readings["error_bias"], readings["error_value_corr"] = errors.pattern
        return verdict.read_suspect(j, self.cand.compute_dtype, self.ctx.kind, **readings)

    def likeness(self, got: Leaf, r: np.ndarray, fmt: str) -> float:
        # Correlation, element by element, of the backend's |error| with the anchor's at the format's bits.
        leaf = self.ctx.read_anchors.get(formats.label_bits(fmt) if fmt else 0)
        a = self.ctx.comparable(leaf)
        o = self.ctx.oracle.value
        if a is None or got.value is None or got.value.shape != o.shape:
            return math.nan
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            x, y = np.abs(got.value - r).ravel(), np.abs(a - r).ravel()
            ok = np.isfinite(x) & np.isfinite(y)
            if ok.sum() < 3 or x[ok].std() == 0 or y[ok].std() == 0:
                return math.nan
            return float(np.corrcoef(x[ok], y[ok])[0, 1])


class Complex(Floating):
    """A complex output: compared as interleaved (real, imaginary) floats; its slices are not summed."""

    def views(self) -> tuple[Any, Any]:
        o, b = self.ctx.oracle.value, self.cand.leaf.value
        o = np.ascontiguousarray(o.astype(np.complex128 if o.dtype == np.complex128 else np.complex64))
        b = np.ascontiguousarray(b.astype(o.dtype))
        shape = (*o.shape, 2)
        return o.view(o.real.dtype).reshape(shape), b.view(o.real.dtype).reshape(shape)

    def backend_errors(self, b: np.ndarray, r: np.ndarray) -> tuple[Any, Any]:
        return reference_stats(b, r), None


def comparator_for(ctx: OutputContext, cand: Candidate) -> Comparator:
    """The comparator for what the oracle and the backend gave on this output."""
    o, got = ctx.oracle, cand.leaf
    if got is None:
        return Structure(ctx, cand)
    if OPAQUE in (o.dtype, got.dtype):
        return Opaque(ctx, cand)
    if not o.is_array or not got.is_array:
        return Value(ctx, cand)
    if tuple(o.value.shape) != tuple(got.shape):
        return Structure(ctx, cand)
    if on_device(o.value, got):
        return Floating(ctx, cand)
    if not (_is_float(o.value) and _is_float(got.value)):
        return Exact(ctx, cand)
    if np.iscomplexobj(o.value) or np.iscomplexobj(got.value):
        return Complex(ctx, cand)
    return Floating(ctx, cand)


def compare_output(ctx: OutputContext, cand: Candidate) -> Finding:
    """One (backend, output) record: the comparator for its kind, judged against the output's context."""
    return comparator_for(ctx, cand).compare()


def on_device(oracle: np.ndarray, got: Leaf) -> bool:
    """Whether ``got`` stays on its device and can be compared there with ``oracle`` (same float type)."""
    return got.tensor is not None and oracle.dtype in _TORCH_OF and got.tensor.dtype == _TORCH_OF[oracle.dtype]


_TORCH_OF = {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16}


_STATS_NAMES = {f.name for f in dataclasses.fields(PairStats)} | {n for n in vars(PairStats) if not n.startswith("_")}
_FROM_STATS = tuple(f.name for f in dataclasses.fields(PairFields) if f.name in _STATS_NAMES - {"worst_index"})
"""The pair fields that :class:`~rlx_nb.numerics.pairs.PairStats` holds under the same name (fields or properties)."""


def _pair_fields(stats: PairStats, o: np.ndarray, eo: Any, eb: Any, r: np.ndarray | None) -> PairFields:
    # The backend-against-oracle statistics and the worst element (``eo``/``eb`` flat views, interleaved
    # for complex outputs; ``eb`` may be a device tensor).
    # Every statistic the pair fields name is read off the stats by its name (a new metric is a property of
    # PairStats and a field of PairFields, nothing here); the worst element's values are read below.
    fields: dict[str, Any] = {name: getattr(stats, name) for name in _FROM_STATS}
    fields["mismatched_frac"] = stats.mismatched / max(1, stats.numel)
    if stats.worst_index >= 0:
        flat = stats.worst_index
        fields["worst_index"] = tuple(
            int(i) for i in np.unravel_index(flat // (2 if np.iscomplexobj(o) else 1), o.shape)
        )
        fields["oracle_value"], fields["backend_value"] = float(eo.reshape(-1)[flat]), float(eb.reshape(-1)[flat])
        if r is not None:
            fields["reference_value"] = float(np.asarray(r).reshape(-1)[flat])
    return PairFields(**fields)


def _nonfinite_class(x: np.ndarray) -> np.ndarray:
    # 0 finite, 1 NaN, 2 +Inf, 3 -Inf
    return np.select([np.isnan(x), np.isposinf(x), np.isneginf(x)], [1, 2, 3], 0).astype(np.int8)


def _real_alike(o: np.ndarray, b: np.ndarray, r: np.ndarray) -> bool:
    return o.dtype.kind == "f" and b.dtype.kind == "f" and r.dtype.kind == "f" and o.shape == b.shape == r.shape


def _is_float(x: np.ndarray) -> bool:
    return np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.complexfloating)


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return False
