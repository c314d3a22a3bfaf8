"""The words of a verdict: the reason sentence of a record, the few words for a table cell.

:mod:`rlx_nb.verdict` decides (pure functions over statistics); this module only says what was decided and why,
from a record's fields (an :class:`~rlx_nb.compare.OutputRecord`).
"""

from __future__ import annotations

import math
from typing import Any

from rlx_nb.verdict import (
    FORMAT_BITS,
    NONDETERMINISTIC,
    PRECISION_ALIKE,
    PRECISION_UNLIKE,
    RMSE_LIMIT,
    SUSPECT,
    VERDICT_ERROR,
    VERDICT_SKIPPED,
    looks_like_reduced_precision,
    whole_excess,
)


def _less_accurate_reason(r: Any, worst: float, ops: dict[str, int] | None) -> str:
    where = op_hint(ops)
    return (
        f"uniformly less accurate: ~{r.effective_bits:.1f} effective bits of fp32's 24 ({worst:.3g}x the fp32 "
        "round-off budget), its error spread over the whole output and noise-like (no bias, not following the "
        f"values){f'; {where}' if where else ''} — the mark of a less accurate algorithm rather than a kernel bug, "
        "though a small systematic error can look alike on one output: localize the backend to see which op; "
        "SUSPECT as the fp32 it claims to be"
    )


def op_hint(ops: dict[str, int] | None) -> str:
    """Where such arithmetic usually is, from the model's matrix work by class (``{"convolution": 53, ...}``)."""
    if not isinstance(ops, dict):
        return ""
    counts = {
        k: v for k, v in ops.items() if isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v > 0
    }
    convolutions = counts.get("convolution", 0)
    if convolutions:
        return (
            f"this model's {convolutions} convolution call(s) are the usual place (a fast algorithm such as Winograd "
            "or FFT: NNPACK, some cuDNN and oneDNN choices)"
        )
    if counts:
        return "this model's matrix products are the usual place (a split or reduced-precision accumulation)"
    return ""


def _precision_reason(r: Any, worst: float) -> str:
    # A SUSPECT forward output of a backend claiming fp32, at about a narrower format's bits: a precision
    # mode, or a kernel error of that size.  How its error follows the anchor's tells them apart, if it does.
    bits, fmt, like = r.effective_bits, r.closest_format, r.anchor_likeness
    size = f"about {bits:.0f} effective bits while it claims fp32 (error {worst:.3g}x the fp32 budget)"
    anchor = (
        f"correlation {like:.2f} with the {FORMAT_BITS[fmt]}-bit anchor" if like == like else "no anchor to compare"
    )
    if like >= PRECISION_ALIKE:
        return (
            f"behaves like {fmt}: {size}, and its error follows the pattern {fmt} arithmetic leaves on this model "
            f"({anchor}) — a reduced-precision mode such as TF32, autocast or a runtime precision hint is likely on"
        )
    if like <= PRECISION_UNLIKE:
        return (
            f"error of {size}, but it does not follow the pattern a reduced-precision mode leaves on this model "
            f"({anchor}) — likely a systematic kernel error, not a precision setting"
        )
    return (
        f"{size}: either a reduced-precision mode (TF32, autocast, a runtime precision hint) or a systematic kernel "
        f"error of that size — its error's pattern does not tell them apart ({anchor})"
    )


def reason(r: Any, rule: str, ops: dict[str, int] | None = None) -> str:
    """The one-line reason of a record (an :class:`~rlx_nb.compare.OutputRecord`'s fields) under ``rule``;
    ``ops``: the model's matrix work by class, to say where a less accurate arithmetic usually is."""
    if r.nonfinite_mismatch:
        return f"{r.nonfinite_mismatch} NaN/Inf elements where the oracle has none (or the reverse)"
    if rule == "budget" and r.verdict_budget is not None:
        fmt = "fp32" if r.compute_dtype == "float32" else r.compute_dtype
        worst = max(r.ratio_rmse, r.ratio_max)
        if r.verdict != SUSPECT and r.max_abs == 0 and r.backend_rmse == r.oracle_rmse:
            return "bit for bit identical to the oracle"
        if r.verdict == SUSPECT:
            if r.zero_mismatch and r.excess_elsewhere <= 1.0:
                share = r.zero_mismatch / max(r.numel, 1)
                return (
                    f"differs where the model writes zeros: {r.zero_mismatch} element(s) ({share:.2%}) that the "
                    f"oracle and fp64 both give as exactly 0 are nonzero here (up to {r.zero_mismatch_max:.3g}) — "
                    "positions the eager model sets rather than computes, such as padding a fused inference fast "
                    f"path skips or a mask; everywhere else it is {fmt} round-off ({r.excess_elsewhere:.2g} of the "
                    "budget's limit)"
                )
            if looks_like_reduced_precision(r):
                return _precision_reason(r, worst)
            if getattr(r, "less_accurate", False):
                return _less_accurate_reason(r, worst, ops)
            if r.slice_ratio > RMSE_LIMIT and whole_excess(r.ratio_rmse, r.ratio_max) <= 1.0:
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
        if getattr(r, "discrete_events", 0):
            return (
                f"within {worst:.3g}x the {fmt} round-off budget once {r.discrete_events} discrete event(s) are "
                "accounted for: inputs within round-off of a ReLU's threshold flipped (see the note)"
            )
        return f"within {worst:.3g}x the {fmt} round-off budget"
    if r.verdict == SUSPECT:
        return f"max_rel {r.max_rel:.3e} > tol_rel {r.tol_rel:.1e} — relative error too large for round-off"
    return f"max_rel {r.max_rel:.3e} <= tol_rel {r.tol_rel:.1e}"


def short_reason(r: Any) -> str:
    """A few words for a table cell: what decided the record (the whole sentence is ``reason``)."""
    if r.verdict in (VERDICT_ERROR, VERDICT_SKIPPED):
        text = r.reason.split(" (at ")[0]
        return f"{r.verdict}: {text[:70]}{'…' if len(text) > 70 else ''}"
    if r.verdict == NONDETERMINISTIC:
        return "the model is nondeterministic"
    if r.nonfinite_mismatch:
        return f"{r.nonfinite_mismatch} NaN/Inf mismatches"
    if r.verdict_budget is None or r.ratio_rmse != r.ratio_rmse:
        return r.reason[:70]
    worst = max(r.ratio_rmse, r.ratio_max)
    if r.verdict != SUSPECT:
        return "identical" if r.max_abs == 0 else f"round-off ({worst:.2g}x budget)"
    if r.zero_mismatch and r.excess_elsewhere <= 1.0:
        return f"{r.zero_mismatch} zeroed positions computed"
    if looks_like_reduced_precision(r):
        like = r.anchor_likeness
        verdict = "precision mode" if like >= PRECISION_ALIKE else "kernel error" if like <= PRECISION_UNLIKE else "?"
        return f"~{r.effective_bits:.0f} bits, like {r.closest_format} ({verdict})"
    if getattr(r, "less_accurate", False):
        return f"less accurate (~{r.effective_bits:.1f} bits, noise-like)"
    if r.slice_ratio > RMSE_LIMIT and whole_excess(r.ratio_rmse, r.ratio_max) <= 1.0:
        return f"slice {r.slice_at} off {r.slice_ratio:.3g}x"
    if r.concentrated and r.excess <= 1.0:
        return "concentrated on few elements"
    return f"{worst:.3g}x budget"


def nondeterministic_reason(difference: float) -> str:
    """Why an output of a model whose two oracle runs differ is not judged."""
    return (
        f"the model itself is nondeterministic: two oracle runs differ by up to {difference:.3g} on this output, "
        "so no backend can be judged on it; put the model in eval mode (dropout), seed any RNG used inside "
        "forward, or enable torch.use_deterministic_algorithms"
    )
