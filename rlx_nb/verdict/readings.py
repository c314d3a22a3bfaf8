"""What a SUSPECT error reads as: its effective precision, a reduced-precision mode, a uniformly less
accurate arithmetic -- pure functions over a :class:`~rlx_nb.verdict.types.Judgement`'s figures."""

from __future__ import annotations

import itertools
import math

from rlx_nb.numerics import formats
from rlx_nb.verdict.types import SUSPECT, Judgement


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
    closest = formats.closest_label(bits) if bits == bits else ""
    return bits, closest


LOCALIZED_SHARE = 0.5
"""An error is *localized* when one slice (a row, a position, a channel) holds at least this share of its square ...
(a softmax fault on one row: 57-90% at the output of six transformers; NNPACK's convolutions at batch 32, whose
error leans on the samples with the largest activations: 8-19%)"""
LOCALIZED_OVER = 4.0
"""... and at least this many times the share round-off leaves there (the legitimate runs', or the slice's share of
the elements): a precision mode follows the values, as round-off does (1-2x; NNPACK 2.4-5.4x on one sample); a bug
on one position of a 16-token sequence holds 12-16x (the README's), on one row of many far more."""


def localized(j: Judgement) -> bool:
    """Whether the error sits on one slice: a bug on one row, position or channel (:data:`LOCALIZED_SHARE`)."""
    return j.where.slice_share >= LOCALIZED_SHARE and j.where.slice_share_over >= LOCALIZED_OVER


def localized_slice(j: Judgement) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """``(axes, indices)`` of the slice a :func:`localized` error sits on (``[:, :, 3]`` -> ``((2,), (3,))``,
    ``[0, 3]`` -> ``((0, 1), (0, 3))``), else None.

    >>> from rlx_nb.verdict.types import Judgement
    >>> localized_slice(Judgement.of("SUSPECT", "whole output", slice_share=0.9, slice_share_over=12, slice_share_at="[0, :, 3]"))
    ((0, 2), (0, 3))
    """
    if not localized(j):
        return None
    parts = [p.strip() for p in j.where.slice_share_at.strip("[]").split(",")]
    if not all(p == ":" or p.isdigit() for p in parts) or not any(p.isdigit() for p in parts):
        return None
    axes = tuple(a for a, p in enumerate(parts) if p != ":")
    return axes, tuple(int(parts[a]) for a in axes)


def looks_like_reduced_precision(j: Judgement, compute_dtype: str, kind: str) -> bool:
    """Whether a SUSPECT judgement's error looks like a reduced-precision mode rather than a bug.

    A precision mode shows in the forward outputs, spread over every element (not concentrated like a
    one-row bug, leaning on no slice more than on the whole output -- its error is round-off at a
    coarser unit, which averages out over a row -- and not :func:`localized` on one), at about a standard
    narrower format's bits.
    """
    narrower = (formats.label_bits(label) for label in formats.LABELS[1:])
    near = min(abs(j.reading.effective_bits - b) for b in narrower) <= 1.0
    return compute_dtype == "float32" and kind == "forward" and spread_like_a_format(j) and near


def spread_like_a_format(j: Judgement) -> bool:
    """Whether an error is spread as a number format's round-off is: its largest element within 8x its RMS's
    share of the budget, leaning on no slice more than on the whole output, not :func:`localized` on one.  Only
    such an error has a format to be like (``closest_format``): a bug on one row or position has none, however
    many bits its RMS error happens to come to."""
    return (
        j.budget.ratio_max <= 8 * max(j.budget.ratio_rmse, 1e-300)
        and not j.where.slice_ratio >= j.budget.ratio_rmse
        and not localized(j)
    )


NOISE_LIMIT = 0.25
"""An error is *noise-like* when its mean is within this fraction of its RMS and its correlation with the
fp64 values within this (plus 3/sqrt(n) for chance): round-off has neither a bias nor a shape; a kernel
bug usually has one (a scale or an offset: LayerNorm's eps, a dropped term, a mean off by one)."""


def noise_like(j: Judgement, numel: int) -> bool:
    """Whether an error against fp64 (``error_bias``, ``error_value_corr``) is noise, not systematic."""
    chance = 3.0 / math.sqrt(max(numel, 1))
    return abs(j.reading.error_bias) <= NOISE_LIMIT + chance and abs(j.reading.error_value_corr) <= NOISE_LIMIT + chance


MILD_BITS = 19.0
"""An fp32 backend's uniform, noise-like error at this many effective bits or more (at most ~5 bits lost) reads as
a less accurate arithmetic: fast fp32 algorithms (Winograd or FFT convolutions, split accumulations) lose a bit
or a few; the catalogue's real faults that were this mild and this noise-like were all on gradients."""


def looks_less_accurate(j: Judgement, compute_dtype: str, kind: str, numel: int) -> bool:
    """Whether a SUSPECT fp32 record's error reads as a uniformly less accurate arithmetic, not a kernel bug.

    Spread over the output (not concentrated on a few elements, leaning on no slice), noise-like
    (:func:`noise_like`: no bias, not following the values), not at a standard narrower format's bits
    (:func:`looks_like_reduced_precision`), and mild: :data:`MILD_BITS` effective bits or more.  The report
    reads a backend so only when every SUSPECT output of it does (:func:`read_less_accurate`): a bug
    that shows its shape on one output is a bug on all.  NNPACK's fast convolutions, which eager CPU kernels
    use from batch 16 with oneDNN off, read this way (ResNet's logits at batch 32: 4.4x the budget, 21.4 bits).
    """
    spread = not j.where.concentrated and not j.where.slice_ratio >= j.budget.ratio_rmse and not localized(j)
    return (
        j.verdict == SUSPECT
        and compute_dtype == "float32"
        and spread
        and j.reading.error_bias == j.reading.error_bias
        and noise_like(j, numel)
        and not looks_like_reduced_precision(j, compute_dtype, kind)
        and j.reading.effective_bits == j.reading.effective_bits
        and MILD_BITS <= j.reading.effective_bits < 24
    )


PRECISION_ALIKE = 0.25
"""Correlation of a backend's |error| with the precision anchor's, element by element, from which its
error follows the pattern a reduced-precision mode leaves on the model (on the demo MLP, transformer
and conv net: autocast bf16/fp16 0.83-1.0, TF32 operand rounding 0.29-0.53 against the anchor's
autocast-style rounding)."""
PRECISION_UNLIKE = 0.15
"""... and below which it does not (a LayerNorm eps off by 10x and a dropped bias channel: -0.1-0.12).
In between, the reason says it cannot tell."""
