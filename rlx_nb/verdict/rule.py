"""The verdict: whether one backend's output is round-off or a bug, as pure functions over statistics.

Nothing here reads arrays or runs models: :mod:`rlx_nb.compare` measures the statistics and builds
the records; this module decides.  The two rules:

- ``fixed`` (the seed's): SUSPECT when ``max_rel = max |b - o| / (|o| + 1e-6)`` exceeds ``tol_rel``
  (2e-3 for forward outputs, 1e-2 for gradients).
- ``budget`` (the default, :func:`judge`): the backend's error against the float64 reference over
  the round-off the legitimate fp32 runs show (the oracle, and a run whose reductions sum with one
  sequential accumulator), scaled to the backend's format; SUSPECT beyond ``RMSE_LIMIT`` (RMSE),
  ``MAX_LIMIT`` (largest error) or ``RMSE_LIMIT`` on one slice's mean (:func:`slice_ratio`), when the
  error is concentrated on a few elements, or when NaN/Inf patterns or shapes differ.

The rule in full -- every clause, its constants, the reasoning for each and what was measured --
is ``docs/verdict.md``; the allowances for chance are :mod:`rlx_nb.verdict.chance`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from rlx_nb.backends.sequential import SEQUENTIAL_BLOCK
from rlx_nb.errors import InputError
from rlx_nb.numerics import formats
from rlx_nb.numerics.reference import SliceStats
from rlx_nb.verdict.chance import isolation, peak_mean, sample_allowance, slice_allowance, slice_lean, slice_share
from rlx_nb.verdict.readings import (
    effective_bits,
    looks_like_reduced_precision,
    spread_like_a_format,
)
from rlx_nb.verdict.types import (
    MAX_LIMIT,
    RMSE_LIMIT,
    ROUNDOFF,
    SUSPECT,
    Evidence,
    Judgement,
    replaced,
    whole_excess,
)
from rlx_nb.verdict.words import Cause

RULES = ("budget", "fixed")
TOL_REL_FORWARD = 2e-3
TOL_REL_BACKWARD = 1e-2
FLOOR_UNITS = 2.0
GRAD_FLOOR_UNITS = 4.0
BETTER_THAN_ORACLE = 0.5
CONCENTRATION_LIMIT = 3.0
CONCENTRATED_OVER_ORACLE = 10.0
BIAS_SHARE = 0.25
"""int8: an output's mean error is held to this share of its RMS budget (or the legitimate runs' largest mean):
rounding to nearest, and the trials' rounding, leave no bias (their mean error is their RMS over the root of the
elements), where a kernel that truncates, or applies a zero point off, moves every element one way."""
SEQUENTIAL_FAR = 8.0  # a sequential-sums run this many times the oracle's error (or the floor) is said in the notes
FP32_U = formats.unit_roundoff("float32")


def check_rule(rule: Any) -> str:
    """``rule`` if it is one of :data:`RULES`, else an :class:`~rlx_nb.InputError` naming them."""
    if rule not in RULES:
        raise InputError(f"rule must be one of {', '.join(RULES)}; got {rule!r}")
    return rule


def fixed_verdict(max_rel: float, tol_rel: float, nonfinite_mismatch: int) -> str:
    """The seed's rule: SUSPECT when ``max_rel`` exceeds ``tol_rel`` (or NaN/Inf patterns differ)."""
    return SUSPECT if (max_rel > tol_rel or nonfinite_mismatch) else ROUNDOFF


def default_tol_rel(kind: str) -> float:
    """The fixed rule's threshold for a forward output or a gradient."""
    return TOL_REL_BACKWARD if kind == "grad" else TOL_REL_FORWARD


def scale_of(compute_dtype: str) -> float:
    """The compute format's unit round-off over float32's (1 for fp32, 2**13 for fp16/tf32, 2**16 for bf16)."""
    return formats.scale_of(compute_dtype)


def judge(e: Evidence) -> Judgement:
    """The budget verdict (module docstring) from the errors of the backend and the legitimate runs.

    Returns the whole :class:`Judgement` of the budget rule: its verdict, the clause that decided it, the
    SUSPECT-line number and the figures; :func:`decide` then applies the rule in charge.

    Examples
    --------
    >>> from rlx_nb.numerics.reference import ReferenceStats
    >>> oracle = ReferenceStats(rmse=1e-7, max_err=3e-7, ref_rms=1.0, ref_max=3.0)
    >>> judge(Evidence("b", "forward", "float32", 1000, oracle, oracle)).verdict
    'round-off'
    >>> j = judge(Evidence("b", "forward", "float32", 1000, ReferenceStats(1e-5, 3e-5, 1.0, 3.0), oracle))
    >>> j.verdict, j.cause, round(j.line, 1)
    ('SUSPECT', 'whole output', 21.0)
    """
    notes: list[str] = []
    scale = scale_of(e.compute_dtype)
    so, sb, ss = e.oracle, e.errors, e.sequential
    legit = [so, *([ss] if ss is not None else []), *e.legit]  # (e.legit: an int8 model's requantization trials)
    if ss is None and e.kind == "grad":  # no sequential run to measure reordering: the length guess
        units = GRAD_FLOOR_UNITS * math.sqrt(max(1, e.reduction_length))
        notes.append("no sequential run for this output: the gradient floor is guessed from the sum's length")
    else:
        units = FLOOR_UNITS
    floor = units * FP32_U
    legit_rmse, legit_max = max(s.rmse for s in legit), max(s.max_err for s in legit)
    if ss is not None and ss.rmse > SEQUENTIAL_FAR * max(so.rmse, floor * so.ref_rms):
        notes.append(
            f"the budget rests on the sequential-sums run, {ss.rmse / max(so.rmse, 1e-300):.3g}x further from fp64 than "
            f"the oracle here: another legitimate summation order (one accumulator per {SEQUENTIAL_BLOCK:,} terms, the "
            "blocks added pairwise) is that far off, so a backend that sums differently may be too"
        )
    samples = len({(s.rmse, s.max_err) for s in legit})  # (a sequential run equal to the oracle adds none)
    short = sample_allowance(e.numel, samples)
    if short > 1.05:
        notes.append(f"{e.numel} element(s): the measured round-off is widened {short:.2g}x for chance")
    budget_rmse = scale * max(short * legit_rmse, floor * so.ref_rms)
    budget_max = scale * max(short * legit_max, floor * so.ref_max)
    if e.quantum == e.quantum:  # int8: never less than one element one quantum off
        budget_rmse, budget_max = max(budget_rmse, e.quantum / math.sqrt(max(e.numel, 1))), max(budget_max, e.quantum)
    anchor = e.anchor[1] if e.anchor is not None else None
    if anchor is not None and (anchor.rmse > budget_rmse or anchor.max_err > budget_max):
        budget_rmse, budget_max = max(budget_rmse, anchor.rmse), max(budget_max, anchor.max_err)
        notes.append(
            f"the budget is the {e.anchor[0]}-bit anchor's error (matmuls and convolutions computed at "
            f"{e.compute_dtype}'s precision: operands, results and gradients rounded, as autocast does), "
            "larger here than the scaled fp32 round-off"
        )
    ratio_rmse, ratio_max = _ratio(sb.rmse, budget_rmse), _ratio(sb.max_err, budget_max)
    excess = whole_excess(ratio_rmse, ratio_max)
    ratio_slice, slice_at = math.nan, ""
    if e.slices is not None and e.slices.legit:
        ratio_slice, slice_at = slice_ratio(
            e.slices.backend,
            e.slices.legit,
            scale,
            budget_rmse if e.legit else floor * so.ref_rms,  # (int8: a slice is held to the whole output's budget)
            at_precision=e.slices.at_precision,
            pooled_rmse=legit_rmse,
            pooled_at_precision=anchor.rmse if anchor is not None and e.slices.at_precision else 0.0,
            profiles=e.slices.profiles,
            by_rms=bool(e.legit),
            quantum=e.quantum,
        )
        excess = max(excess, ratio_slice / RMSE_LIMIT)
        share, over, share_at = slice_share(e.slices.backend, e.slices.legit)
        if sb.rmse > 0 and sb.max_err**2 >= 0.5 * sb.rmse**2 * e.numel:  # (one element holds it: not a slice's)
            share, over, share_at = math.nan, math.nan, ""
    else:
        share, over, share_at = math.nan, math.nan, ""
    ratio_bias = _bias_ratio(sb, legit, budget_rmse) if e.legit else math.nan
    if ratio_bias == ratio_bias:
        excess = max(excess, ratio_bias / RMSE_LIMIT)
    if so.rmse > floor * so.ref_rms and sb.rmse < BETTER_THAN_ORACLE * so.rmse:
        notes.append(
            f"the fp32 oracle is further from fp64 than {e.backend} (RMSE {so.rmse:.2e} vs {sb.rmse:.2e}): "
            "the gap is the oracle's round-off, not the backend's"
        )
    legit_all = legit + ([anchor] if anchor is not None else [])
    concentration = isolation(sb, e.numel) / max(max(isolation(s, e.numel) for s in legit_all), 1.0)
    far = CONCENTRATED_OVER_ORACLE * max(
        scale * max(legit_max, FLOOR_UNITS * FP32_U * so.ref_max),
        anchor.max_err if anchor is not None else 0.0,
    )
    concentrated = bool(e.numel >= 2 and sb.max_err > far and concentration > CONCENTRATION_LIMIT)
    verdict = SUSPECT if excess > 1.0 or concentrated else ROUNDOFF
    apart = min(_ratio(sb.max_err, far), concentration / CONCENTRATION_LIMIT) if e.numel >= 2 else 0.0
    line = max(excess, apart if apart == apart else 0.0)
    if e.nonfinite_mismatch:
        verdict, cause, line = SUSPECT, Cause.NONFINITE, math.inf
    elif verdict == ROUNDOFF:
        if e.max_abs == 0 and sb.rmse == so.rmse and not e.oracle_outliers:
            # (bit for bit the oracle's output: no gap to place on the line, which the oracle's own error against
            # fp64 would put at a fraction of it beside "identical")
            cause, line = Cause.IDENTICAL, 0.0
        elif e.discrete_events:
            cause = Cause.DISCRETE
        elif e.oracle_outliers or _oracle_is_the_outlier(e, units):
            cause = Cause.ORACLE_OFF
        else:
            cause = Cause.WITHIN
    elif ratio_bias > RMSE_LIMIT and ratio_bias >= ratio_slice and whole_excess(ratio_rmse, ratio_max) <= 1.0:
        cause = Cause.BIAS
    elif ratio_slice > RMSE_LIMIT and whole_excess(ratio_rmse, ratio_max) <= 1.0:
        cause = Cause.SLICE
    elif concentrated and excess <= 1.0:
        cause = Cause.CONCENTRATED
    else:
        cause = Cause.WORST if ratio_max / MAX_LIMIT > ratio_rmse / RMSE_LIMIT else Cause.WHOLE
    # (an int8 model's error is in quanta, not in a float format's bits)
    bits, closest = effective_bits(sb.rmse, so.rmse, e.anchors_rmse) if not e.legit else (math.nan, "")
    j = Judgement.of(
        verdict,
        cause,
        line,
        verdict_budget=verdict,
        budget_rmse=budget_rmse,
        budget_max=budget_max,
        ratio_rmse=ratio_rmse,
        ratio_max=ratio_max,
        excess=excess,
        slice_ratio=ratio_slice,
        slice_at=slice_at,
        slice_share=share,
        slice_share_over=over,
        slice_share_at=share_at,
        bias_ratio=ratio_bias,
        concentration=concentration,
        concentrated=concentrated,
        oracle_rmse=so.rmse,
        backend_rmse=sb.rmse,
        oracle_max_err=so.max_err,
        backend_max_err=sb.max_err,
        sequential_rmse=ss.rmse if ss is not None else math.nan,
        sequential_max_err=ss.max_err if ss is not None else math.nan,
        effective_bits=bits,
        closest_format=closest,
        discrete_events=e.discrete_events,
        nonfinite_unexplained=e.nonfinite_mismatch,
        oracle_outliers=e.oracle_outliers,
        notes=tuple(notes),
    )
    # (a narrower format only where the error is spread as a format's is: a one-position bug is like none)
    return j if closest == formats.LABELS[0] or spread_like_a_format(j) else j.but(closest_format="")


def _bias_ratio(sb: Any, legit: list, budget_rmse: float) -> float:
    # An int8 output's mean error over what unbiased rounding leaves (:data:`BIAS_SHARE`); NaN without the sums.
    if not sb.count or not math.isfinite(sb.sum_err):
        return math.nan
    means = [abs(s.sum_err) / s.count for s in legit if s.count and math.isfinite(s.sum_err)]
    return _ratio(abs(sb.sum_err) / sb.count, max([*means, BIAS_SHARE * budget_rmse]))


def _oracle_is_the_outlier(e: Evidence, units: float) -> bool:
    # The budget the other way round: the oracle's error against fp64 judged with the backend's as the
    # legitimate one.  Past the limits, the oracle is what is off (a backend merely more accurate is not).
    scale = scale_of(e.compute_dtype)
    so, sb = e.oracle, e.errors
    budget_rmse = scale * max(sb.rmse, units * FP32_U * so.ref_rms)
    budget_max = scale * max(sb.max_err, units * FP32_U * so.ref_max)
    return excess_within(so.rmse, so.max_err, budget_rmse, budget_max) > 1.0


def decide(j: Judgement, rule: str, fixed: Judgement) -> Judgement:
    """The rule in charge applied: ``j`` (the budget's, or None without a reference) or the seed's ``fixed``."""
    if j is None:
        return fixed
    if rule == "fixed":
        return replaced(j, verdict=fixed.verdict, cause=Cause.FIXED, line=fixed.line,
                        verdict_fixed=fixed.verdict, tol_rel=fixed.tol_rel)  # fmt: skip
    return replaced(j, verdict_fixed=fixed.verdict, tol_rel=fixed.tol_rel)


def fixed_judgement(max_rel: float, tol_rel: float, nonfinite_mismatch: int) -> Judgement:
    """The seed's rule as a :class:`Judgement`: SUSPECT when ``max_rel > tol_rel`` or NaN/Inf patterns differ."""
    verdict = fixed_verdict(max_rel, tol_rel, nonfinite_mismatch)
    line = math.inf if nonfinite_mismatch else _ratio(max_rel, tol_rel)
    return Judgement.of(verdict, Cause.FIXED, line, verdict_fixed=verdict, tol_rel=tol_rel)


def read_suspect(j: Judgement, compute_dtype: str, kind: str, **readings: Any) -> Judgement:
    """A SUSPECT judgement with what was read of its error (``zero_mismatch``, ``anchor_likeness``, ``error_bias``
    ...), and the reading that explains it as its cause: positions the model zeroes (where the rest is round-off),
    then a precision likeness (:func:`looks_like_reduced_precision`); else the clause stays the cause."""
    j = replaced(j, **readings)
    if j.verdict != SUSPECT or j.cause in (Cause.NONFINITE, Cause.FIXED):
        return j
    if j.reading.zero_mismatch and j.reading.excess_elsewhere <= 1.0:
        return replaced(j, cause=Cause.ZEROS)
    if looks_like_reduced_precision(j, compute_dtype, kind):
        return replaced(j, cause=Cause.PRECISION)
    return j


def read_less_accurate(j: Judgement) -> Judgement:
    """A SUSPECT judgement of a backend every SUSPECT output of which reads as less accurate arithmetic."""
    if j.verdict != SUSPECT:
        return j
    keep = j.cause in (Cause.NONFINITE, Cause.FIXED, Cause.ZEROS, Cause.PRECISION)
    return replaced(j, less_accurate=True, cause=j.cause if keep else Cause.LESS_ACCURATE)


def excess_within(err_rmse: float, err_max: float, budget_rmse: float, budget_max: float) -> float:
    """:func:`whole_excess` of an error (RMSE and max) against a budget."""
    return whole_excess(_ratio(err_rmse, budget_rmse), _ratio(err_max, budget_max))


def slice_ratio(
    b: SliceStats,
    legit: list[SliceStats],
    scale: float,
    floor_rmse: float,
    *,
    at_precision: Sequence[SliceStats] = (),
    pooled_rmse: float = 0.0,
    pooled_at_precision: float = 0.0,
    profiles: Sequence[tuple[float, SliceStats]] = (),
    by_rms: bool = False,
    quantum: float = math.nan,
) -> tuple[float, str]:
    # The largest mean error of a slice over what round-off allows there (see "Systematic error on a
    # slice" in the module docstring): the legitimate error scale of the slice -- the legitimate runs' RMS
    # error on it, or the whole output's (``pooled_rmse``) shared out over the slices as the precision
    # anchors' error is (``profiles``), whichever is larger -- the fp32 runs' scaled to the backend's unit
    # round-off and ``at_precision`` runs' as they are, times :func:`slice_allowance` for the slice's size,
    # the number of slices and the lean; never below the largest slice mean of a legitimate run.  ``by_rms``: each
    # slice's RMS error instead of its mean (an int8 model's: its trials measure each slice's RMS directly, and a
    # wrong weight moves a channel both ways).  ``quantum`` (an int8 output's): no slice is held to less than one
    # element one quantum off.
    worst, at = 0.0, ""
    total = sum(len(c) for c in b.counts)
    for i, axis in enumerate(b.axes):
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = np.abs(b.sums[i]) / np.maximum(b.counts[i], 1)
            if by_rms:
                mean = np.sqrt(b.squares[i] / np.maximum(b.counts[i], 1))
            rms = np.sqrt(np.maximum.reduce([s.squares[i] / np.maximum(s.counts[i], 1) for s in legit]))
            shape = np.ones_like(rms)
            for whole, st in profiles:  # how much more than the output as a whole each slice amplifies
                shape = np.maximum(shape, np.sqrt(st.squares[i] / np.maximum(st.counts[i], 1)) / whole)
            budget = scale * np.maximum(np.maximum(rms, pooled_rmse * shape), floor_rmse)
            for s in at_precision:
                own = np.sqrt(s.squares[i] / np.maximum(s.counts[i], 1))
                budget = np.maximum(budget, np.maximum(own, pooled_at_precision))
            if quantum == quantum:
                budget = np.maximum(budget, quantum / np.sqrt(np.maximum(b.counts[i], 1)))
            budget = budget * slice_allowance(b.counts[i], total, slice_lean([*legit, *at_precision], i))
            # ... and never below the largest slice mean a legitimate run itself shows on this axis: round-off
            # with rare large events (an activation that flips at reduced precision moves a whole channel)
            # is its own measure of how far one slice may lean.
            # (Not the anchors' peaks: rounding weights moves whole output channels of the anchor runs, a
            # lean that fp32 round-off does not have -- the very shape of a one-channel bug.)
            peaks = [scale * peak_mean(st, i) for st in legit] + [peak_mean(st, i) for st in at_precision]
            budget = np.maximum(budget, max(peaks, default=0.0))
        ratio = np.where(budget > 0, mean / np.where(budget > 0, budget, 1.0), np.where(mean > 0, np.inf, 0.0))
        j = int(np.argmax(ratio))
        if ratio[j] > worst:
            worst, at = float(ratio[j]), "[" + ", ".join([":"] * axis + [str(j)]) + "]"
    return worst, at


ANCHORS_APART = 0.5
"""Two precision anchors that differ from each other by less than this times the wider one's error against
fp64 share a difference that is not rounding (rounding at 8 bits puts them ~8x that apart: 3.1-9.4x on 19
architectures; 0.015x where the anchored runs left nn.TransformerEncoder's fast path and its zeroed padding)."""
ANCHORS_MATTER = 4.0
"""... checked only where the wider anchor's error is this many times the oracle's own (or the floor): below
that the anchors repeat the oracle, their matmuls a small part of its error."""


def anchors_took_another_path(oracle_rmse: float, floor: float, wide_rmse: float, apart_rmse: float) -> bool:
    """Whether two precision anchors' errors are a code-path difference rather than rounding.

    Examples
    --------
    >>> anchors_took_another_path(1e-7, 1e-7, 1e-3, 8e-3)   # rounding: 8 bits is ~8x further than 11
    False
    >>> anchors_took_another_path(1e-7, 1e-7, 0.25, 0.004)  # both far from fp64, close to each other
    True
    """
    return wide_rmse > ANCHORS_MATTER * max(oracle_rmse, floor) and apart_rmse < ANCHORS_APART * wide_rmse


def _ratio(num: float, den: float) -> float:
    if den > 0:
        return num / den
    return 0.0 if num == 0 else math.inf


__all__ = ["decide", "fixed_judgement", "judge", "read_less_accurate", "read_suspect"]
