"""The verdict: whether one backend's output is round-off or a bug, as pure functions over statistics.

Nothing here reads arrays or runs models: :mod:`rlx_nb.compare` measures the statistics
(:mod:`rlx_nb.metrics`) and builds the records; this module decides.

The two rules
-------------
``fixed`` (the seed's): SUSPECT when ``max_rel = max |b - o| / (|o| + 1e-6)``
exceeds ``tol_rel`` (2e-3 for forward outputs, 1e-2 for gradients).

``budget`` (the default): measure the fp32 oracle's own error against the
float64 reference, and that of a second legitimate fp32 run whose reductions sum
with one sequential accumulator (:mod:`rlx_nb.reassoc`), and judge the backend by
how many times that round-off it shows.  For each output, with ``r`` the fp64
reference, ``o`` the oracle, ``s`` the sequential run and ``b`` the backend::

    floor = FLOOR_UNITS * u32
    floor_rmse = floor * rms(r)                    floor_max = floor * max|r|
    q = sample_allowance(n, runs)                  (chance shortfall of an error measured on n elements)
    budget_rmse = scale * max(q * rmse(o - r), q * rmse(s - r), floor_rmse)
    budget_max  = scale * max(q * max|o - r|,  q * max|s - r|,  floor_max)
    ratio_rmse  = rmse(b - r) / budget_rmse        ratio_max = max|b - r| / budget_max
    SUSPECT  if ratio_rmse > RMSE_LIMIT or ratio_max > MAX_LIMIT
             or slice_ratio > RMSE_LIMIT (below)
             or the error is concentrated (below)
             or NaN/Inf where the oracle has none (or the reverse), or the shape differs

``u32 = 2**-24`` is float32's unit round-off; ``scale`` is the backend's
compute format's unit round-off over float32's (1 for fp32 backends, 2**13
for float16 and tf32, 2**16 for bfloat16).  The floor keeps outputs that the
oracle computes exactly (or nearly) from turning a single-ulp difference into
a huge ratio.  The sequential run is there because another summation order can
legitimately drift far beyond the oracle's error, by an amount that depends on
the terms: Inductor's BatchNorm-bias gradient on the benchmark's conv net is 36x
the oracle's error and bit for bit what one sequential accumulator gives.  The
model has no ``s`` when it has no reduction the run would change (``s`` would be
``o``); if that run failed, a parameter gradient's floor falls back to the old
guess ``GRAD_FLOOR_UNITS * u32 * sqrt(K)``, ``K`` about the terms summed per element.
For a reduced-precision backend the precision anchor at its own width (``ANCHOR_OF``: the model
with its matmuls computed at that precision) is one more legitimate error, taken as it is.

Few elements measure the legitimate error poorly: the RMS of ``n`` independent errors is below
``1/q`` of its true size with probability ``SAMPLE_ALPHA`` (for two legitimate runs, both are),
``q`` from the chi-square distribution with ``n`` degrees of freedom -- 8 for a scalar, 1.5 for 8
elements, 1.13 for 64, 1.03 for 1,000.  The measured errors are widened by ``q``, the floor is not.

Systematic error on a slice: a bug on one row, column or channel (a slice: every element with
index ``j`` along one axis) leans one way over the whole slice, while round-off errs either way, so
its mean over a slice is small.  How small depends on the slice's size, on how many slices there
are, and on how much round-off itself leans, and the clause must hold for any of them -- a pooler
output of 2 x 64 has 64 slices of two elements.  For slice ``j`` of axis ``k``, with ``n_j``
elements, ``M`` slices over all axes (outputs of two or more dimensions; axes with two or more
slices of two or more elements)::

    sigma_j  = scale * max(rms_j(o - r), rms_j(s - r), rmse_legit * profile_j, floor_rmse)
    lean_k   = max over legitimate runs of  sum_j S_j**2 / n_j  /  sum_j Q_j         (S, Q: sum and sum of
               squares of the run's errors on each slice; 1/n for independent errors, 1 for shared ones)
    allow_j  = max(1, c_M * sqrt(max(lean_k, 1 / n_j))),   c_M = z(1 - SLICE_ALPHA / (2 M))
    peak_k   = the largest |mean_j| any legitimate run shows on axis k
    slice_ratio = max over k, j of  |mean_j(b - r)| / max(sigma_j * allow_j, peak_k)       SUSPECT above RMSE_LIMIT

The reasoning, term by term:

- ``sigma_j``, the scale of round-off on the slice.  Measured on a slice's own few elements, a
  legitimate run's RMS error is itself noise: for two elements it is below a quarter of its true
  size one time in sixteen, and with a limit fixed at 4 the largest of 64 such chance ratios
  crossed it (the false positives on BERT's and ViT's pooler outputs).  So the whole output's
  legitimate RMSE (measured on every element) stands in when larger, shared out over the slices as
  the precision anchors' error is (``profile_j``: slice ``j``'s RMS error over the whole output's in
  the runs with matmul operands rounded to 8 and 11 bits, at least 1) -- the same model with more
  round-off shows which channels amplify it (a depthwise convolution's channel behind a sensitive
  activation).
- ``allow_j``, how far a mean of round-off strays by chance.  Errors of scale sigma that are
  independent average to about ``sigma / sqrt(n)`` over ``n`` elements; errors that share one value
  average to ``sigma``; in general to ``sigma * sqrt(lean)``, and the legitimate runs measure the
  lean.  The largest of ``M`` such means, each near normal, is about ``c_M`` times that, with
  ``c_M`` the two-sided normal quantile at family-wise level ``SLICE_ALPHA`` (1 %) over the ``M``
  slices.  A mean never exceeds the RMS it came from, hence at least 1.
- ``peak_k``: round-off with rare large events (an activation that flips at reduced precision
  moves a whole channel) is its own measure of how far a slice may lean.
- ``RMSE_LIMIT`` (4) on top, as for the whole output: a legitimate backend's error may be several
  times the oracle's.

So for a legitimate backend as noisy as the oracle the ratio exceeds 1 on about 1 % of outputs and
4 essentially never; ``tests/test_verdict.py`` checks this over slice sizes 2 to 4,096 and slice counts
2 to 342.  It finds what the whole-output RMSE dilutes: the conv net's logits (8 x 10) with one
class's bias off by 1e-5 of itself are 15x the oracle's error but within 4x Inductor's, and that
column's mean error is 12x what round-off allows there.  ``slice_at`` names the slice (``[:, 0]``).

Concentrated error: a bug on one row or channel leaves most of an output at
round-off and a few elements far off, which a budget sized for the whole output
can hide.  Round-off of any summation order is spread like the legitimate runs'
own error; so with ``isolation(e) = max|e| / (rms(e) * sqrt(2 ln n))`` (about 1
for errors spread like Gaussian noise)::

    concentration = isolation(b - r) / max(isolation(o - r), isolation(s - r), 1)
    SUSPECT  if concentration > CONCENTRATION_LIMIT and
             max|b - r| > CONCENTRATED_OVER_ORACLE * scale * max(max|o - r|, max|s - r|, FLOOR_UNITS * u32 * max|r|)

The detection benchmark's float32 outputs of legitimate backends stay well below
the limit (bench/results/detection.md gives the highest).
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
    excess = max(ratio_rmse / RMSE_LIMIT, ratio_max / MAX_LIMIT)
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


def reason(r: Any, rule: str) -> str:
    """The one-line reason of a record (an :class:`~rlx_nb.compare.OutputRecord`'s fields) under ``rule``."""
    if r.nonfinite_mismatch:
        return f"{r.nonfinite_mismatch} NaN/Inf elements where the oracle has none (or the reverse)"
    if rule == "budget" and r.verdict_budget is not None:
        fmt = "fp32" if r.compute_dtype == "float32" else r.compute_dtype
        worst = max(r.ratio_rmse, r.ratio_max)
        if r.verdict == SUSPECT:
            if looks_like_reduced_precision(r):
                return (
                    f"behaves like {r.closest_format}: about {r.effective_bits:.0f} effective bits while it "
                    f"claims fp32 (error {worst:.3g}x the fp32 budget, spread over the output); a reduced-precision "
                    "mode such as TF32, autocast or a runtime precision hint is likely on — or a systematic "
                    "kernel error of that size"
                )
            if r.slice_ratio > RMSE_LIMIT and max(r.ratio_rmse / RMSE_LIMIT, r.ratio_max / MAX_LIMIT) <= 1.0:
                return (
                    f"systematic error on one slice: the mean error of {r.output}{r.slice_at} is {r.slice_ratio:.3g}x "
                    f"what round-off allows there, while the output as a whole is within {worst:.3g}x the "
                    f"{fmt} budget — round-off averages out over a slice, a bug on one row or channel does not"
                )
            if r.concentrated and r.excess <= 1.0:
                over = r.backend_max_err / r.oracle_max_err if r.oracle_max_err > 0 else math.inf
                return (
                    f"concentrated error: the worst element is {over:.3g}x the oracle's worst and stands out "
                    f"{r.concentration:.2g}x more than round-off does, while the output as a whole is within "
                    f"{worst:.3g}x the {fmt} budget — likely a bug on one row or channel"
                )
            return f"error {worst:.3g}x the {fmt} round-off budget — likely a kernel bug"
        return f"within {worst:.3g}x the {fmt} round-off budget"
    if r.verdict == SUSPECT:
        return f"max_rel {r.max_rel:.3e} > tol_rel {r.tol_rel:.1e} — relative error too large for round-off"
    return f"max_rel {r.max_rel:.3e} <= tol_rel {r.tol_rel:.1e}"


def nondeterministic_reason(difference: float) -> str:
    """Why an output of a model whose two oracle runs differ is not judged."""
    return (
        f"the model itself is nondeterministic: two oracle runs differ by up to {difference:.3g} on this output, "
        "so no backend can be judged on it; put the model in eval mode (dropout), seed any RNG used inside "
        "forward, or enable torch.use_deterministic_algorithms"
    )


def _ratio(num: float, den: float) -> float:
    if den > 0:
        return num / den
    return 0.0 if num == 0 else math.inf
