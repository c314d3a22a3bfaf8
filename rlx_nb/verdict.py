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
is ``docs/verdict.md``; the allowances for chance are :mod:`rlx_nb.chance`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from rlx_nb.chance import isolation, peak_mean, sample_allowance, slice_allowance, slice_lean
from rlx_nb.metrics import UNIT_ROUNDOFF
from rlx_nb.reference import ReferenceStats, SliceStats

ROUNDOFF = "round-off"
SUSPECT = "SUSPECT"
VERDICT_ERROR = "error"
VERDICT_SKIPPED = "skipped"
NONDETERMINISTIC = "nondeterministic"

RULES = ("budget", "fixed")
TOL_REL_FORWARD = 2e-3
TOL_REL_BACKWARD = 1e-2
RMSE_LIMIT = 4.0
MAX_LIMIT = 8.0
FLOOR_UNITS = 2.0
GRAD_FLOOR_UNITS = 4.0
BETTER_THAN_ORACLE = 0.5
CONCENTRATION_LIMIT = 3.0
CONCENTRATED_OVER_ORACLE = 10.0
ANCHOR_OF = {"bfloat16": 8, "float16": 11, "tf32": 11}
"""The precision anchor (``run.ANCHOR_BITS``) at a reduced-precision backend's own mantissa width: the model
with its matmuls and convolutions computed at that backend's precision, a legitimate run at its precision."""
FORMAT_BITS = {"fp32": 24, "tf32/fp16": 11, "bf16": 8}


@dataclasses.dataclass(frozen=True)
class SliceEvidence:
    """Per-slice error sums (:class:`~rlx_nb.reference.SliceStats`) of the backend and of the legitimate runs.

    ``legit``: the fp32 oracle and sequential run; ``at_precision``: the anchor at a reduced-precision
    backend's own width; ``profiles``: ``(whole-output RMSE, slice sums)`` of every precision anchor,
    whose error shows which slices amplify round-off.  All have the backend's axes.
    """

    backend: SliceStats
    legit: tuple[SliceStats, ...]
    at_precision: tuple[SliceStats, ...] = ()
    profiles: tuple[tuple[float, SliceStats], ...] = ()


@dataclasses.dataclass(frozen=True)
class Evidence:
    """Everything the budget verdict reads about one (backend, output): errors against the fp64 reference."""

    backend: str
    kind: str
    compute_dtype: str
    numel: int
    errors: ReferenceStats
    """The backend's output against fp64."""
    oracle: ReferenceStats
    sequential: ReferenceStats | None = None
    anchor: tuple[int, ReferenceStats] | None = None
    """``(bits, errors)`` of the anchor at the backend's own precision (reduced-precision backends only)."""
    slices: SliceEvidence | None = None
    nonfinite_mismatch: int = 0
    reduction_length: int = 1


@dataclasses.dataclass(frozen=True)
class Judgement:
    """The budget verdict on one (backend, output) and the figures behind it."""

    verdict: str
    budget_rmse: float
    budget_max: float
    ratio_rmse: float
    ratio_max: float
    excess: float
    slice_ratio: float = math.nan
    slice_at: str = ""
    concentration: float = math.nan
    concentrated: bool = False
    notes: tuple[str, ...] = ()


def fixed_verdict(max_rel: float, tol_rel: float, nonfinite_mismatch: int) -> str:
    """The seed's rule: SUSPECT when ``max_rel`` exceeds ``tol_rel`` (or NaN/Inf patterns differ)."""
    return SUSPECT if (max_rel > tol_rel or nonfinite_mismatch) else ROUNDOFF


def default_tol_rel(kind: str) -> float:
    """The fixed rule's threshold for a forward output or a gradient."""
    return TOL_REL_BACKWARD if kind == "grad" else TOL_REL_FORWARD


def scale_of(compute_dtype: str) -> float:
    """The compute format's unit round-off over float32's (1 for fp32, 2**13 for fp16/tf32, 2**16 for bf16)."""
    return max(1.0, UNIT_ROUNDOFF.get(compute_dtype, UNIT_ROUNDOFF["float32"]) / UNIT_ROUNDOFF["float32"])


def judge(e: Evidence) -> Judgement:
    """The budget verdict (module docstring) from the errors of the backend and the legitimate runs.

    Examples
    --------
    >>> from rlx_nb.reference import ReferenceStats
    >>> oracle = ReferenceStats(rmse=1e-7, max_err=3e-7, ref_rms=1.0, ref_max=3.0)
    >>> judge(Evidence("b", "forward", "float32", 1000, oracle, oracle)).verdict
    'round-off'
    >>> judge(Evidence("b", "forward", "float32", 1000, ReferenceStats(1e-5, 3e-5, 1.0, 3.0), oracle)).verdict
    'SUSPECT'
    """
    notes: list[str] = []
    scale = scale_of(e.compute_dtype)
    so, sb, ss = e.oracle, e.errors, e.sequential
    legit = [so] if ss is None else [so, ss]
    if ss is None and e.kind == "grad":  # no sequential run to measure reordering: the length guess
        units = GRAD_FLOOR_UNITS * math.sqrt(max(1, e.reduction_length))
        notes.append("no sequential run for this output: the gradient floor is guessed from the sum's length")
    else:
        units = FLOOR_UNITS
    floor = units * UNIT_ROUNDOFF["float32"]
    legit_rmse, legit_max = max(s.rmse for s in legit), max(s.max_err for s in legit)
    samples = len({(s.rmse, s.max_err) for s in legit})  # (a sequential run equal to the oracle adds none)
    short = sample_allowance(e.numel, samples)
    if short > 1.05:
        notes.append(f"{e.numel} element(s): the measured round-off is widened {short:.2g}x for chance")
    budget_rmse = scale * max(short * legit_rmse, floor * so.ref_rms)
    budget_max = scale * max(short * legit_max, floor * so.ref_max)
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
            floor * so.ref_rms,
            e.slices.at_precision,
            pooled_rmse=legit_rmse,
            pooled_at_precision=anchor.rmse if anchor is not None and e.slices.at_precision else 0.0,
            profiles=e.slices.profiles,
        )
        excess = max(excess, ratio_slice / RMSE_LIMIT)
    if so.rmse > floor * so.ref_rms and sb.rmse < BETTER_THAN_ORACLE * so.rmse:
        notes.append(
            f"the fp32 oracle is further from fp64 than {e.backend} (RMSE {so.rmse:.2e} vs {sb.rmse:.2e}): "
            "the gap is the oracle's round-off, not the backend's"
        )
    legit_all = legit + ([anchor] if anchor is not None else [])
    concentration = isolation(sb, e.numel) / max(max(isolation(s, e.numel) for s in legit_all), 1.0)
    far = CONCENTRATED_OVER_ORACLE * max(
        scale * max(legit_max, FLOOR_UNITS * UNIT_ROUNDOFF["float32"] * so.ref_max),
        anchor.max_err if anchor is not None else 0.0,
    )
    concentrated = bool(e.numel >= 2 and sb.max_err > far and concentration > CONCENTRATION_LIMIT)
    verdict = SUSPECT if excess > 1.0 or concentrated or e.nonfinite_mismatch else ROUNDOFF
    return Judgement(
        verdict,
        budget_rmse,
        budget_max,
        ratio_rmse,
        ratio_max,
        excess,
        ratio_slice,
        slice_at,
        concentration,
        concentrated,
        tuple(notes),
    )


def whole_excess(ratio_rmse: float, ratio_max: float) -> float:
    """How far an error's RMSE and max ratios to their budgets go past the limits (> 1: SUSPECT).

    Examples
    --------
    >>> whole_excess(2.0, 16.0)
    2.0
    """
    return max(ratio_rmse / RMSE_LIMIT, ratio_max / MAX_LIMIT)


def excess_within(err_rmse: float, err_max: float, budget_rmse: float, budget_max: float) -> float:
    """:func:`whole_excess` of an error (RMSE and max) against a budget."""
    return whole_excess(_ratio(err_rmse, budget_rmse), _ratio(err_max, budget_max))


def slice_ratio(
    b: SliceStats,
    legit: list[SliceStats],
    scale: float,
    floor_rmse: float,
    at_precision: Sequence[SliceStats] = (),
    pooled_rmse: float = 0.0,
    pooled_at_precision: float = 0.0,
    profiles: Sequence[tuple[float, SliceStats]] = (),
) -> tuple[float, str]:
    # The largest mean error of a slice over what round-off allows there (see "Systematic error on a
    # slice" in the module docstring): the legitimate error scale of the slice -- the legitimate runs' RMS
    # error on it, or the whole output's (``pooled_rmse``) shared out over the slices as the precision
    # anchors' error is (``profiles``), whichever is larger -- the fp32 runs' scaled to the backend's unit
    # round-off and ``at_precision`` runs' as they are, times :func:`slice_allowance` for the slice's size,
    # the number of slices and the lean; never below the largest slice mean of a legitimate run.
    worst, at = 0.0, ""
    total = sum(len(c) for c in b.counts)
    for i, axis in enumerate(b.axes):
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = np.abs(b.sums[i]) / np.maximum(b.counts[i], 1)
            rms = np.sqrt(np.maximum.reduce([s.squares[i] / np.maximum(s.counts[i], 1) for s in legit]))
            shape = np.ones_like(rms)
            for whole, st in profiles:  # how much more than the output as a whole each slice amplifies
                shape = np.maximum(shape, np.sqrt(st.squares[i] / np.maximum(st.counts[i], 1)) / whole)
            budget = scale * np.maximum(np.maximum(rms, pooled_rmse * shape), floor_rmse)
            for s in at_precision:
                own = np.sqrt(s.squares[i] / np.maximum(s.counts[i], 1))
                budget = np.maximum(budget, np.maximum(own, pooled_at_precision))
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


def effective_bits(backend_rmse: float, oracle_rmse: float, anchors: dict[int, float]) -> tuple[float, str]:
    """Effective mantissa bits of a backend's error, and the closest standard format.

    Read on a per-output scale calibrated on the same model: the oracle's RMSE against fp64 is 24
    bits, and the precision anchors' (``{bits: rmse}``, the model's matmuls computed at 11 and 8 bits)
    mark those points (interpolated in log2 error), so the output's own accumulation length and
    conditioning do not shift the reading.

    Examples
    --------
    >>> effective_bits(2e-4, 1e-7, {11: 2e-4, 8: 1.6e-3})
    (11.0, 'tf32/fp16')
    """
    points = [(24.0, oracle_rmse)] + [(float(b), r) for b, r in sorted(anchors.items(), reverse=True)]
    logs = [(b, math.log2(err)) for b, err in points if err > 0]
    err = backend_rmse
    if not logs or logs[0][0] != 24.0 or err <= oracle_rmse or err <= 0:
        bits = 24.0 if err <= oracle_rmse else math.nan
    else:
        y = math.log2(err)
        monotone = all(logs[i][1] < logs[i + 1][1] for i in range(len(logs) - 1))
        bits = math.nan
        if monotone and len(logs) > 1:
            for (b1, y1), (b2, y2) in itertools.pairwise(logs):
                if y <= y2:
                    bits = b1 + (y - y1) * (b2 - b1) / (y2 - y1)
                    break
            else:
                (b1, y1), (b2, y2) = logs[-2], logs[-1]
                bits = b2 + (y - y2) * (b2 - b1) / (y2 - y1)
        else:  # no usable scale: one bit per doubling of the oracle's error
            bits = 24.0 - (y - logs[0][1])
        bits = max(0.0, min(24.0, bits))
    closest = min(FORMAT_BITS, key=lambda f: abs(FORMAT_BITS[f] - bits)) if bits == bits else ""
    return bits, closest


def looks_like_reduced_precision(r: Any) -> bool:
    """Whether a SUSPECT record's error looks like a reduced-precision mode rather than a bug.

    A precision mode shows in the forward outputs, spread over every element (not concentrated like a
    one-row bug, and leaning on no slice more than on the whole output: its error is round-off at a
    coarser unit, which averages out over a row), at about a standard narrower format's bits.
    """
    spread = r.ratio_max <= 8 * max(r.ratio_rmse, 1e-300) and not r.slice_ratio >= r.ratio_rmse
    near = min(abs(r.effective_bits - b) for b in (FORMAT_BITS["tf32/fp16"], FORMAT_BITS["bf16"])) <= 1.0
    return r.compute_dtype == "float32" and r.kind == "forward" and spread and near


NOISE_LIMIT = 0.25
"""An error is *noise-like* when its mean is within this fraction of its RMS and its correlation with the
fp64 values within this (plus 3/sqrt(n) for chance): round-off has neither a bias nor a shape; a kernel
bug usually has one (a scale or an offset: LayerNorm's eps, a dropped term, a mean off by one)."""


def noise_like(r: Any) -> bool:
    """Whether a record's error against fp64 (``error_bias``, ``error_value_corr``) is noise, not systematic."""
    chance = 3.0 / math.sqrt(max(r.numel, 1))
    return abs(r.error_bias) <= NOISE_LIMIT + chance and abs(r.error_value_corr) <= NOISE_LIMIT + chance


MILD_BITS = 19.0
"""An fp32 backend's uniform, noise-like error at this many effective bits or more (at most ~5 bits lost) reads as
a less accurate arithmetic: fast fp32 algorithms (Winograd or FFT convolutions, split accumulations) lose a bit
or a few; the catalogue's real faults that were this mild and this noise-like were all on gradients."""


def looks_less_accurate(r: Any) -> bool:
    """Whether a SUSPECT fp32 record's error reads as a uniformly less accurate arithmetic, not a kernel bug.

    Spread over the output (not concentrated on a few elements, leaning on no slice), noise-like
    (:func:`noise_like`: no bias, not following the values), not at a standard narrower format's bits
    (:func:`looks_like_reduced_precision`), and mild: :data:`MILD_BITS` effective bits or more.  The report
    reads a backend so only when every SUSPECT output of it does (``OutputRecord.less_accurate``): a bug
    that shows its shape on one output is a bug on all.  NNPACK's fast convolutions, which eager CPU kernels
    use from batch 16 with oneDNN off, read this way (ResNet's logits at batch 32: 4.4x the budget, 21.4 bits).
    """
    spread = not r.concentrated and not r.slice_ratio >= r.ratio_rmse
    return (
        r.verdict == SUSPECT
        and r.compute_dtype == "float32"
        and spread
        and r.error_bias == r.error_bias
        and noise_like(r)
        and not looks_like_reduced_precision(r)
        and r.effective_bits == r.effective_bits
        and MILD_BITS <= r.effective_bits < 24
    )


PRECISION_ALIKE = 0.25
"""Correlation of a backend's |error| with the precision anchor's, element by element, from which its
error follows the pattern a reduced-precision mode leaves on the model (on the demo MLP, transformer
and conv net: autocast bf16/fp16 0.83-1.0, TF32 operand rounding 0.29-0.53 against the anchor's
autocast-style rounding)."""
PRECISION_UNLIKE = 0.15
"""... and below which it does not (a LayerNorm eps off by 10x and a dropped bias channel: -0.1-0.12).
In between, the reason says it cannot tell."""


def _ratio(num: float, den: float) -> float:
    if den > 0:
        return num / den
    return 0.0 if num == 0 else math.inf
