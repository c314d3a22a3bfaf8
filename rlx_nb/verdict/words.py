"""The causes of a verdict and their words, one table (:data:`WORDS`): the reason sentence of a record, the few
words for a table cell.

:mod:`rlx_nb.verdict.rule` decides, and its :class:`~rlx_nb.verdict.rule.Judgement` names the clause that decided
(``cause``); this module only says it, from a record's judgement, pair statistics and identity (an
:class:`~rlx_nb.verdict.records.OutputRecord`).  One sentence per cause; nothing here works out again why.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from rlx_nb.numerics import formats
from rlx_nb.verdict.readings import PRECISION_ALIKE, PRECISION_UNLIKE, localized
from rlx_nb.verdict.records import OutputRecord, worst_record
from rlx_nb.verdict.types import (
    MAX_LIMIT,
    NONDETERMINISTIC,
    RMSE_LIMIT,
    SUSPECT,
    VERDICT_ERROR,
    VERDICT_SKIPPED,
    Judgement,
    whole_excess,
)


class Cause:
    """What decided a :class:`Judgement`: the clause of the rule, or the reading of a SUSPECT output."""

    IDENTICAL = "identical"
    """Bit for bit the oracle's output."""
    WITHIN = "within budget"
    """The error against fp64 is within the round-off the legitimate runs show."""
    DISCRETE = "discrete events"
    """... once ReLU inputs within round-off of their thresholds that flipped are taken out."""
    ORACLE_OFF = "oracle off the reference"
    """The backend is within its budget and the oracle is the outlier: judged the other way round, against the
    backend's error, the oracle's would be SUSPECT (or its NaN/Inf pattern differs from fp64's where the backend's
    does not)."""
    WHOLE = "whole output"
    """SUSPECT: the error's RMSE over the budget past its limit."""
    WORST = "worst element"
    """SUSPECT: the largest error over the budget past its limit (further past than the RMSE)."""
    SLICE = "slice"
    """SUSPECT: one slice's mean error past what round-off allows there, the whole output within."""
    BIAS = "bias"
    """SUSPECT (int8): the error's mean past what rounding, which is unbiased, leaves; the whole output within."""
    CONCENTRATED = "concentration"
    """SUSPECT: the worst element stands out as round-off never does, the whole output within."""
    NONFINITE = "NaN/Inf pattern"
    """SUSPECT: NaN/Inf where neither the oracle nor fp64 has one (or the reverse)."""
    ZEROS = "positions the model zeroes"
    """SUSPECT reading: nonzero where the oracle and fp64 are exactly 0, round-off elsewhere."""
    PRECISION = "precision likeness"
    """SUSPECT reading: at about a narrower format's bits, spread: a precision mode, or a kernel error that size."""
    LESS_ACCURATE = "less accurate"
    """SUSPECT reading: a uniformly less accurate arithmetic (every SUSPECT output of the backend reads so)."""
    FIXED = "fixed rule"
    """The seed's ``max_rel > tol_rel`` decided (``rule="fixed"``, or no fp64 reference)."""
    STRUCTURE = "structure"
    """SUSPECT: an output missing, extra, of another shape, or a plain value that differs."""
    EXACT = "exact match"
    """An integer or boolean output: equal, or not."""
    NOT_COMPARED = "not compared"
    """An object that holds no tensor."""
    NONDETERMINISTIC = "nondeterministic"
    """The model's own two oracle runs differ on this output."""
    ERROR = "error"
    SKIPPED = "skipped"


def _less_accurate_reason(j: Judgement, worst: float, ops: dict[str, int] | None) -> str:
    where = op_hint(ops)
    return (
        f"SUSPECT as the fp32 it claims to be, and uniformly less accurate: ~{j.reading.effective_bits:.1f} effective bits of "
        f"fp32's 24 ({worst:.3g}x the fp32 round-off budget), its error spread over the whole output and noise-like "
        "(no bias, not following the values) — what a less accurate algorithm leaves"
        f"{f' ({where})' if where else ''}, and what a small systematic error can leave too: localize the backend to "
        "see which op"
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


def _precision_reason(j: Judgement, worst: float) -> str:
    # A SUSPECT forward output of a backend claiming fp32, at about a narrower format's bits: a precision
    # mode, or a kernel error of that size.  How its error follows the anchor's tells them apart, if it does.
    bits, fmt, like = j.reading.effective_bits, j.reading.closest_format, j.reading.anchor_likeness
    size = f"about {bits:.0f} effective bits while it claims fp32 (error {worst:.3g}x the fp32 budget)"
    anchor = (
        f"correlation {like:.2f} with the {formats.label_bits(fmt)}-bit anchor"
        if like == like
        else "no anchor to compare"
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


def _oracle_off_reason(r: OutputRecord) -> str:
    # The backend within its budget, the oracle the outlier: say where, with the three values there.
    j, p, b = r.judgement, r.pair, r.backend
    at = ""
    if p.worst_index is not None:
        where = f"at {list(p.worst_index)}" if p.worst_index else "there"
        at = f"; {where} the oracle gives {p.oracle_value:.6g}, fp64 {p.reference_value:.6g}, {b} {p.backend_value:.6g}"
    if j.events.oracle_outliers:
        return (
            f"the oracle, not {b}, is off the fp64 reference: {j.events.oracle_outliers} element(s) where {b} has NaN/Inf "
            f"as fp64 does and the oracle does not (or the reverse){at}; everywhere else {b} is round-off"
        )
    return (
        f"the oracle, not {b}, is off the fp64 reference: the oracle's error against fp64 (RMSE {j.errors.oracle_rmse:.3g}, "
        f"largest {j.errors.oracle_max_err:.3g}) is past what {b}'s own (RMSE {j.errors.backend_rmse:.3g}, largest "
        f"{j.errors.backend_max_err:.3g}) allows{at} — judged the other way round the oracle would be SUSPECT; {b} is "
        "round-off"
    )


class Said:
    """What a cause's words read: the record (or finding), its judgement, the model's matrix work by class (``ops``)
    and the figures every sentence shares."""

    def __init__(self, r: Any, ops: dict[str, int] | None = None) -> None:
        self.r, self.j, self.ops = r, r.judgement, ops
        self.fmt = formats.short(r.compute_dtype) if r.compute_dtype == "float32" else r.compute_dtype
        self.worst = max(self.j.budget.ratio_rmse, self.j.budget.ratio_max)
        self.at = on_line(self.j.line)


@dataclasses.dataclass(frozen=True)
class Words:
    """One cause's words: ``long`` its reason sentence, ``short`` what a SUSPECT table cell adds after its place on
    the line (a whole sentence; None: the cause never decides a SUSPECT on the budget's scale)."""

    long: Callable[[Said], str]
    short: Callable[[Said], str] | None = None


def _detail(s: Said) -> str:
    return s.j.detail


def _nonfinite(s: Said) -> str:
    n = s.j.events.nonfinite_unexplained if s.j.cause == Cause.NONFINITE else s.r.pair.nonfinite_mismatch
    return f"{n} NaN/Inf elements where the oracle has none (or the reverse)"


def _fixed(s: Said) -> str:  # (the seed's rule: its own line, max_rel at tol_rel)
    if s.r.pair.nonfinite_mismatch:
        return _nonfinite(s)
    if s.j.verdict == SUSPECT:
        return (
            f"max_rel {s.r.pair.max_rel:.3e} > tol_rel {s.j.rules.tol_rel:.1e} — relative error too large for round-off"
        )
    return f"max_rel {s.r.pair.max_rel:.3e} <= tol_rel {s.j.rules.tol_rel:.1e}"


def _zeros(s: Said) -> str:
    j = s.j
    share = j.reading.zero_mismatch / max(s.r.numel, 1)
    return (
        f"{s.at}: differs where the model writes zeros: {j.reading.zero_mismatch} element(s) ({share:.2%}) that the "
        f"oracle and fp64 both give as exactly 0 are nonzero here (up to {j.reading.zero_mismatch_max:.3g}) — "
        "positions the eager model sets rather than computes, such as padding a fused inference fast "
        f"path skips or a mask; everywhere else it is {s.fmt} round-off ({j.reading.excess_elsewhere:.2g} of the line)"
    )


def _precision_short(s: Said) -> str:
    like = s.j.reading.anchor_likeness
    what = (
        "likely a precision mode"
        if like >= PRECISION_ALIKE
        else "a kernel error, not a precision mode"
        if like <= PRECISION_UNLIKE
        else "a precision mode or a kernel error"
    )
    return f"~{s.j.reading.effective_bits:.0f} bits, like {s.j.reading.closest_format}: {what}."


def _slice(s: Said) -> str:
    j = s.j
    return (
        f"{s.at} on one slice: the {'RMS' if s.r.compute_dtype == formats.INT8 else 'mean'} error of {s.r.output}{j.where.slice_at} is {j.where.slice_ratio:.3g}x what round-off "
        f"allows there (the line is at {RMSE_LIMIT:g}x), while the output as a whole is at "
        f"{whole_excess(j.budget.ratio_rmse, j.budget.ratio_max):.2g} of the line — round-off averages out over a slice, a bug on one "
        "row or channel does not"
    )


def _bias(s: Said) -> str:
    j = s.j
    return (
        f"{s.at} by its bias: the mean error of {s.r.output} is {j.where.bias_ratio:.3g}x what rounding leaves (the "
        f"line is at {RMSE_LIMIT:g}x), while the output as a whole is at {whole_excess(j.budget.ratio_rmse, j.budget.ratio_max):.2g} "
        "of the line — rounding to nearest moves elements both ways; a kernel that truncates, or applies a zero point "
        "off, moves them one way"
    )


def _concentrated(s: Said) -> str:
    j = s.j
    over = j.errors.backend_max_err / j.errors.oracle_max_err if j.errors.oracle_max_err > 0 else math.inf
    return (
        f"{s.at} by concentration: the worst element is {over:.3g}x the oracle's worst and stands out "
        f"{j.where.concentration:.2g}x more than round-off does, while the output as a whole is at {j.budget.excess:.2g} of "
        "the line — likely a bug on one row or channel"
    )


def _past(what: str, ratio: str, limit: float) -> Callable[[Said], str]:
    # The whole output's (or its worst element's) error past the line: where it sits when it is localized.
    def say(s: Said) -> str:
        j = s.j
        where = (
            f"; {j.where.slice_share:.0%} of it sits on {s.r.output}{j.where.slice_share_at} ({j.where.slice_share_over:.2g}x the share "
            "round-off leaves there) — likely a kernel bug on that one row, position or channel"
            if localized(j)
            else " — likely a kernel bug"
        )
        return (f"{s.at}: {what} is {getattr(j, ratio):.3g}x the {s.fmt} round-off budget (the line is at "
                f"{limit:g}x){where}")  # fmt: skip

    return say


def _discrete(s: Said) -> str:
    n = s.j.events.discrete_events
    what = (
        "values within a correct kernel's reach of a rounding boundary, rounded the other way"
        if s.fmt == "int8"
        else "inputs within round-off of a ReLU's threshold flipped"
    )
    return (
        f"round-off, {s.at} once {n} discrete event(s) are accounted for: {what} (see the note); its error "
        f"{s.worst:.3g}x the {s.fmt} round-off budget"
    )


WORDS: dict[str, Words] = {
    Cause.IDENTICAL: Words(lambda s: "bit for bit identical to the oracle"),
    Cause.WITHIN: Words(lambda s: f"round-off, {s.at}: its error {s.worst:.3g}x the {s.fmt} round-off budget"),
    Cause.DISCRETE: Words(_discrete),
    Cause.ORACLE_OFF: Words(lambda s: f"round-off, {s.at}: {_oracle_off_reason(s.r)}"),
    Cause.WHOLE: Words(_past("its RMS error", "ratio_rmse", RMSE_LIMIT),
                       lambda s: f"its RMS error is {s.j.budget.ratio_rmse:.3g}x round-off."),
    Cause.WORST: Words(_past("its largest error", "ratio_max", MAX_LIMIT),
                       lambda s: f"its largest error is {s.j.budget.ratio_max:.3g}x round-off."),
    Cause.SLICE: Words(_slice, lambda s: f"the slice {s.j.where.slice_at} is off by more than round-off."),
    Cause.CONCENTRATED: Words(_concentrated, lambda s: "a few elements are far off."),
    Cause.BIAS: Words(_bias, lambda s: "its mean error leans one way: not rounding."),
    Cause.NONFINITE: Words(_nonfinite),
    Cause.ZEROS: Words(_zeros, lambda s: f"{s.j.reading.zero_mismatch} positions the model zeroes are computed."),
    Cause.PRECISION: Words(lambda s: f"{s.at}: {_precision_reason(s.j, s.worst)}", _precision_short),
    Cause.LESS_ACCURATE: Words(lambda s: f"{s.at}: {_less_accurate_reason(s.j, s.worst, s.ops)}",
                               lambda s: f"uniformly less accurate, ~{s.j.reading.effective_bits:.1f} bits of 24."),
    Cause.FIXED: Words(_fixed),
    Cause.STRUCTURE: Words(_detail),
    Cause.EXACT: Words(_detail),
    Cause.NOT_COMPARED: Words(_detail),
    Cause.NONDETERMINISTIC: Words(lambda s: nondeterministic_reason(s.j.events.nondeterminism)),
    Cause.ERROR: Words(_detail),
    Cause.SKIPPED: Words(_detail),
}  # fmt: skip
"""Every cause and its words, one row each: a new cause is a constant of :class:`Cause` and its row here, and the
clause that decides it in :mod:`rlx_nb.verdict.rule`."""


def reason(r: Any, ops: dict[str, int] | None = None) -> str:
    """The one-line reason of a record (or finding): its judgement's cause, in words.  ``ops``: the model's matrix
    work by class, to say where a less accurate arithmetic usually is."""
    words = WORDS.get(r.judgement.cause)
    return words.long(Said(r, ops)) if words is not None else r.judgement.detail


def on_line(line: float) -> str:
    """A place on the SUSPECT line in words: ``0.31 of the SUSPECT line``, ``15.3x the SUSPECT line``."""
    if line != line:
        return "off the SUSPECT line's scale"
    if math.isinf(line):
        return "far past the SUSPECT line"
    return f"{line:.3g}x the SUSPECT line" if line >= 1 else f"{line:.2g} of the SUSPECT line"


def short_reason(r: OutputRecord) -> str:
    """A few words for a table cell, a whole sentence: the record's place on the SUSPECT line and what decided it
    (the whole sentence is ``reason``)."""
    j = r.judgement
    if r.verdict in (VERDICT_ERROR, VERDICT_SKIPPED):
        text = r.reason.split(" (at ")[0]
        return f"{r.verdict}: {text[:70]}{'…' if len(text) > 70 else ''}"
    if j.cause == Cause.NONDETERMINISTIC:
        return "the model is nondeterministic"
    if j.cause == Cause.NONFINITE or (j.cause == Cause.FIXED and r.pair.nonfinite_mismatch):
        n = j.events.nonfinite_unexplained if j.cause == Cause.NONFINITE else r.pair.nonfinite_mismatch
        return f"{n} NaN/Inf mismatches"
    if j.cause == Cause.FIXED:
        return f"{j.line:.2g}x the seed's line (max_rel {r.pair.max_rel:.2e})"
    if j.rules.verdict_budget is None or j.line != j.line:
        return r.reason[:70]
    if j.cause == Cause.IDENTICAL:
        return "identical"
    if j.cause == Cause.ORACLE_OFF:
        return f"round-off, {j.line:.2g} of the line; the oracle is off fp64"
    if j.verdict != SUSPECT:
        return f"round-off, {j.line:.2g} of the line"
    head = f"{j.line:.3g}x the line"
    if localized(j) and j.cause in (Cause.WORST, Cause.WHOLE, Cause.CONCENTRATED):
        return f"{head}: {j.where.slice_share:.0%} of its error sits on {j.where.slice_share_at}."
    words = WORDS.get(j.cause)
    return f"{head}: {words.short(Said(r))}" if words is not None and words.short is not None else f"{head}."


def nondeterministic_reason(difference: float) -> str:
    """Why an output of a model whose two oracle runs differ is not judged."""
    return (
        f"the model itself is nondeterministic: two oracle runs differ by up to {difference:.3g} on this output, "
        "so no backend can be judged on it; put the model in eval mode (dropout), seed any RNG used inside "
        "forward, or enable torch.use_deterministic_algorithms"
    )


def seed_line(label: str, name: str, recs: list[OutputRecord], quanta: dict[str, float] | None = None) -> str:
    """The seed's line for one backend: ``[label] name vs cpu: max_abs=... max_rel=... (output #i name) — verdict``;
    an int8 report's (``quanta``: each output's quantum) reads ``max_quanta=`` where a float one reads ``max_rel=``
    (the seed's relative error reads a one-quantum gap as thousands)."""
    worst = worst_record(recs)
    if worst.verdict in (VERDICT_ERROR, VERDICT_SKIPPED) and worst.output is None:
        return f"[{label}] {name:>6} vs cpu: {worst.verdict.upper()} — {worst.reason}"
    arrays = [r for r in recs if r.pair.max_rel == r.pair.max_rel]
    max_abs = max((r.pair.max_abs for r in arrays), default=math.nan)
    rel = max(arrays, key=lambda r: r.pair.max_rel) if arrays else worst
    where = f"(output #{rel.output_index} {rel.output})"
    if worst.verdict == SUSPECT:
        tail = f"SUSPECT ({worst.reason})"
        if worst.output != rel.output:
            tail = f"SUSPECT (output #{worst.output_index} {worst.output}: {worst.reason})"
    else:
        skipped = [r for r in recs if r.verdict in (VERDICT_SKIPPED, VERDICT_ERROR, NONDETERMINISTIC)]
        off = [r for r in recs if r.cause == Cause.ORACLE_OFF]
        line = max((r.judgement.line for r in recs if r.judgement.line == r.judgement.line), default=math.nan)
        # The seed's words stay whole ("round-off (explainable)", which CI logs are grepped for); the one
        # number on the SUSPECT-line scale follows them.
        same = bool(arrays) and all(r.judgement.cause == Cause.IDENTICAL for r in arrays)
        tail = "round-off (explainable)" + (", bit for bit identical" if same else f", {on_line(line)}" if line == line
                                            else "")  # fmt: skip
        if off:
            tail += f"; the oracle itself is off the fp64 reference on {off[0].output}" + (
                f" and {len(off) - 1} more output(s)" if len(off) > 1 else "")  # fmt: skip
        if skipped:
            count = f"{len(skipped)} output(s) " if len(skipped) > 1 else ""
            tail += f"; {count}{skipped[0].verdict}: {skipped[0].reason}"
    if quanta:
        worst_q = max(((r.pair.max_abs / quanta[r.output], r) for r in arrays if quanta.get(r.output)),
                      default=(math.nan, worst), key=lambda qr: qr[0] if qr[0] == qr[0] else -1.0)  # fmt: skip
        where = f"(output #{worst_q[1].output_index} {worst_q[1].output})"
        return f"[{label}] {name:>6} vs cpu: max_abs={max_abs:.3e} max_quanta={worst_q[0]:.3g} {where} — {tail}"
    return f"[{label}] {name:>6} vs cpu: max_abs={max_abs:.3e} max_rel={rel.pair.max_rel:.3e} {where} — {tail}"
