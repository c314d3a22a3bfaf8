"""RunResults -> one frozen record per (backend, output), with both verdicts.

This module walks the outputs and measures: the pair statistics of backend against oracle, and every
run's errors against the float64 reference (:mod:`rlx_nb.metrics` on the host,
:mod:`rlx_nb.device_metrics` where a candidate's output stays on its device).  It decides nothing
itself: the rules are :mod:`rlx_nb.verdict` (the budget verdict, the seed's fixed rule, effective
precision, the reason text), and each record is built once from what was measured and judged.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from rlx_nb import device_metrics, discrete, evidence, reasons, verdict
from rlx_nb.discrete import flips_of
from rlx_nb.elements import rel_error
from rlx_nb.errors import InputError
from rlx_nb.metrics import PairStats, pair_stats
from rlx_nb.progress import bar
from rlx_nb.reference import error_stats, reference_stats
from rlx_nb.results import GRAD_PREFIX, OK, OPAQUE, SKIPPED, BackendRun, Leaf, RunResults
from rlx_nb.verdict import (
    ANCHOR_OF,
    NONDETERMINISTIC,
    ROUNDOFF,
    RULES,
    SUSPECT,
    VERDICT_ERROR,
    VERDICT_SKIPPED,
)
from rlx_nb.zeros import zero_split


@dataclasses.dataclass(frozen=True)
class OutputRecord:
    """How one backend's output compares with the oracle's and the fp64 reference (see :mod:`rlx_nb.verdict`)."""

    backend: str
    output: str | None
    output_index: int
    kind: str
    verdict: str
    verdict_fixed: str
    verdict_budget: str | None
    reason: str
    compute_dtype: str
    shape: tuple[int, ...] | None = None
    dtype: str = ""
    numel: int = 0
    max_abs: float = math.nan
    max_rel: float = math.nan
    worst_index: tuple[int, ...] | None = None
    oracle_value: float = math.nan
    backend_value: float = math.nan
    reference_value: float = math.nan
    mismatched: int = 0
    mismatched_frac: float = math.nan
    mean_abs: float = math.nan
    p99_abs: float = math.nan
    cosine: float = math.nan
    pcc: float = math.nan
    sqnr_db: float = math.nan
    nmse: float = math.nan
    max_ulp: int = 0
    nonfinite_mismatch: int = 0
    oracle_rmse: float = math.nan
    backend_rmse: float = math.nan
    oracle_max_err: float = math.nan
    backend_max_err: float = math.nan
    sequential_rmse: float = math.nan
    sequential_max_err: float = math.nan
    ratio_rmse: float = math.nan
    ratio_max: float = math.nan
    budget_rmse: float = math.nan
    budget_max: float = math.nan
    excess: float = math.nan
    concentration: float = math.nan
    concentrated: bool = False
    slice_ratio: float = math.nan
    slice_at: str = ""
    tol_rel: float = math.nan
    reduction_length: int = 1
    effective_bits: float = math.nan
    closest_format: str = ""
    anchor_likeness: float = math.nan
    """For a SUSPECT reading near a narrower format: correlation of |error| with that format's anchor."""
    zero_mismatch: int = 0
    """For a SUSPECT output: elements where the oracle and fp64 are exactly 0 and the backend is not (:mod:`rlx_nb.zeros`)."""
    zero_mismatch_max: float = math.nan
    excess_elsewhere: float = math.nan
    """... and the budget excess (as ``excess``, RMSE and max) over every other element."""
    error_bias: float = math.nan
    """For a SUSPECT output: the mean of its error against fp64 over the error's RMS (noise: ~0)."""
    error_value_corr: float = math.nan
    """... and the error's correlation with the fp64 values (noise: ~0; a scale bug: ~1)."""
    less_accurate: bool = False
    """Every SUSPECT output of this backend reads as a uniformly less accurate arithmetic, this one included
    (:func:`rlx_nb.verdict.looks_less_accurate`): named so, not "likely a kernel bug"."""
    discrete_events: int = 0
    """ReLU inputs within round-off of a threshold that flipped in this backend's run, whose effect on this
    gradient was taken out before the budget judged it (:mod:`rlx_nb.discrete`)."""
    note: str = ""

    @property
    def suspect(self) -> bool:
        return self.verdict == SUSPECT


def compare(
    results: RunResults, *, tol_rel: float | None = None, rule: str = "budget", progress: bool = True
) -> list[OutputRecord]:
    """Compare every candidate's outputs with the oracle's; one record per (backend, output).

    A backend that failed gives one ``error`` record (``output`` is None); a backend without
    gradients (forward only, or its backward failed) gives one ``grad:*`` record for all of them.
    ``progress=False`` keeps its progress bar off.

    Examples
    --------
    >>> import torch, rlx_nb
    >>> results = rlx_nb.run(torch.nn.Linear(4, 2), torch.ones(3, 4), backends=["cpu-nomkldnn"])
    >>> [r.verdict for r in compare(results, progress=False)]
    ['round-off']
    """
    if rule not in RULES:
        raise InputError(f"rule must be one of {', '.join(RULES)}; got {rule!r}")
    records: list[OutputRecord] = []
    unstable = results.environment.get("nondeterministic") or {}
    total = len(results.candidates) * len(results.oracle.outputs)
    cache: dict = {}
    with bar("rlx_nb compare", total=total, unit="output", enabled=progress) as shown:
        for run in results.candidates.values():
            for rec in _compare_run(results, run, tol_rel, rule, shown, cache):
                if rec.output in unstable and rec.verdict not in (VERDICT_ERROR, VERDICT_SKIPPED):
                    reason = reasons.nondeterministic_reason(unstable[rec.output])
                    rec = dataclasses.replace(rec, verdict=NONDETERMINISTIC, reason=reason)
                records.append(rec)
    return records


def _compare_run(
    results: RunResults, run: BackendRun, tol_rel: float | None, rule: str, shown: Any, cache: dict
) -> list[OutputRecord]:
    if run.status != OK:  # (skipped: the run did not fit in memory)
        status = VERDICT_SKIPPED if run.status == SKIPPED else VERDICT_ERROR
        return [_record(run.backend, None, -1, "forward", run.compute_dtype, status, run.message)]
    out: list[OutputRecord] = []
    for index, (name, leaf) in enumerate(results.oracle.outputs.items()):
        shown.update()
        kind = "grad" if name.startswith(GRAD_PREFIX) else "forward"
        if kind == "grad" and run.grad_status != OK:
            # No gradients at all (a forward-only backend, or its backward failed): one record for all of
            # them, so the backend's judged outputs are its forward outputs, counted once.
            if not any(r.kind == "grad" for r in out):
                grads = sum(1 for n in results.oracle.outputs if n.startswith(GRAD_PREFIX))
                why = f"{run.grad_message}: its {grads} gradient output(s) are not compared"
                status = VERDICT_SKIPPED if run.grad_status == SKIPPED else VERDICT_ERROR
                out.append(_record(run.backend, GRAD_PREFIX + "*", index, kind, run.compute_dtype, status, why))
            continue
        bits = ANCHOR_OF.get(run.compute_dtype)
        left_out = evidence.anchors_left_out(results, name, cache)
        anchors = {} if left_out else results.anchors
        own = anchors.get(bits) if bits is not None else None
        rec = compare_leaf(
            leaf,
            run.outputs.get(name),
            results.reference.outputs.get(name) if results.reference.status == OK else None,
            rule=rule,
            backend=run.backend,
            output=name,
            output_index=index,
            kind=kind,
            compute_dtype=run.compute_dtype,
            tol_rel=tol_rel if tol_rel is not None else verdict.default_tol_rel(kind),
            reduction_length=results.oracle.reduction_lengths.get(name, 1),
            cache=cache,
            sequential=results.sequential.outputs.get(name) if results.sequential is not None else None,
            anchor=(bits, own.outputs.get(name)) if own is not None else None,
            profiles={b: a.outputs.get(name) for b, a in anchors.items()},
            flips=flips_of(results, run.backend, name) if results.discrete else None,
            ops=results.environment.get("matmul_ops"),
        )
        if left_out and rec.verdict_budget is not None:
            rec = dataclasses.replace(rec, note="; ".join(n for n in (rec.note, left_out) if n))
        if results.reference.status != OK and rec.verdict_budget is None and rec.note:
            why = f"the fp64 reference did not run ({results.reference.message}), so the fixed rule decides"
            rec = dataclasses.replace(rec, note=f"{rec.note}; {why}")
        out.append(rec)
    suspects = [r for r in out if r.verdict == SUSPECT]
    if suspects and all(verdict.looks_less_accurate(r) for r in suspects):  # the backend reads so on every output
        ops = results.environment.get("matmul_ops")
        out = [
            dataclasses.replace(
                r, less_accurate=True, reason=reasons.reason(dataclasses.replace(r, less_accurate=True), rule, ops)
            )
            if r.verdict == SUSPECT
            else r
            for r in out
        ]
    extra = [n for n in run.outputs if n not in results.oracle.outputs]
    if extra:
        why = f"outputs the oracle does not have: {', '.join(extra[:5])}"
        out.append(
            _record(run.backend, extra[0], len(results.oracle.outputs), "forward", run.compute_dtype, SUSPECT, why)
        )
    return out


def _record(
    backend: str, output: str | None, index: int, kind: str, compute_dtype: str, status: str, reason: str, **fields: Any
) -> OutputRecord:
    # A record whose verdict is decided without statistics: error, skipped, or SUSPECT for structure.
    budget = SUSPECT if status == SUSPECT else None
    return OutputRecord(backend, output, index, kind, status, status, budget, reason, compute_dtype, **fields)


def compare_leaf(
    oracle: Leaf,
    got: Leaf | None,
    ref: Leaf | None,
    *,
    rule: str,
    backend: str,
    output: str,
    output_index: int,
    kind: str,
    compute_dtype: str,
    tol_rel: float,
    reduction_length: int = 1,
    cache: dict | None = None,
    sequential: Leaf | None = None,
    anchor: tuple[int, Leaf | None] | None = None,
    profiles: dict[int, Leaf | None] | None = None,
    flips: discrete.Flips | None = None,
    ops: dict[str, int] | None = None,
) -> OutputRecord:
    """One (backend, output) record from the oracle's, the backend's and the reference's leaf.

    ``sequential`` is the output of the plain-sequential-reductions run (:mod:`rlx_nb.reassoc`),
    a second legitimate error for the budget.  ``anchor`` is ``(bits, leaf)`` of the precision
    anchor at a reduced-precision backend's own mantissa width (:data:`~rlx_nb.verdict.ANCHOR_OF`).
    ``profiles`` are every precision anchor's output by width: they calibrate the effective
    precision, and their errors show which slices amplify round-off.  ``cache`` (shared across the
    candidates of one comparison) keeps what does not depend on the candidate: the legitimate runs'
    errors against fp64, and uploads of the oracle and reference to devices.  ``flips``: what ReLU inputs
    within round-off of their thresholds, flipped, explain of this output in the backend's, the oracle's
    and the sequential run's gradients (:mod:`rlx_nb.discrete`), taken out before the budget judges them.
    """
    base = dict(shape=oracle.shape, dtype=oracle.dtype, tol_rel=tol_rel, reduction_length=reduction_length)
    ident = (backend, output, output_index, kind, compute_dtype)
    if got is None:
        return _record(*ident, SUSPECT, "output missing: the backend's outputs have a different structure", **base)
    if OPAQUE in (oracle.dtype, got.dtype):
        if oracle.dtype == OPAQUE:
            why = f"not compared: a {oracle.value} object that holds no tensors (only tensors and plain values are compared)"
        else:
            why = f"not compared: the backend gives <{got.value}> where the oracle has a {oracle.dtype} output"
        return _record(*ident, VERDICT_SKIPPED, why, **base)
    if not oracle.is_array or not got.is_array:
        if not oracle.is_array and not got.is_array and _equal(oracle.value, got.value):
            return _record(*ident, ROUNDOFF, "equal", **base)
        why = f"value {got.value!r:.60} differs from the oracle's {oracle.value!r:.60}"
        return _record(*ident, SUSPECT, why, **base)
    o = oracle.value
    base["numel"] = int(o.size)
    if tuple(o.shape) != tuple(got.shape):
        return _record(*ident, SUSPECT, f"shape {tuple(got.shape)} differs from the oracle's {o.shape}", **base)
    notes = [f"dtype {got.dtype} differs from the oracle's {oracle.dtype}"] if got.dtype != oracle.dtype else []
    cache = {} if cache is None else cache
    measured = _measure(o, got, ref, output, cache)
    if measured is None:
        return _compare_exact(ident, base, o, got.value)
    stats, eo, eb, r, errors, own_slices = measured
    fields = {**base, **_pair_fields(stats, o, eo, eb, r)}
    legit_o, eb_judged = eo, eb
    if flips is not None and r is not None and not on_device(o, got):
        eo_, eb_ = flips.apply(eo, eb)  # (the legitimate runs' and the backend's errors without their flips)
        if eb_ is not eb:
            eb_judged = eb_
            errors, own_slices = _reference_errors(eb_, r, o)
            fields["discrete_events"] = flips.count
            notes.append(flips.note)
        legit_o, sequential = eo_, flips.sequential_leaf(sequential)
    fixed = verdict.fixed_verdict(stats.max_rel, tol_rel, stats.nonfinite_mismatch)
    budget = None
    if r is None:
        notes.append("no fp64 reference for this output; the budget verdict is unavailable")
    else:
        read = evidence.evidence(
            ident, fields, o, legit_o, r, errors, own_slices, sequential, anchor, profiles or {}, cache
        )
        judged = verdict.judge(read)
        budget = judged.verdict
        fields.update(
            oracle_rmse=read.oracle.rmse,
            backend_rmse=errors.rmse,
            oracle_max_err=read.oracle.max_err,
            backend_max_err=errors.max_err,
            sequential_rmse=read.sequential.rmse if read.sequential is not None else math.nan,
            sequential_max_err=read.sequential.max_err if read.sequential is not None else math.nan,
            **{
                f.name: getattr(judged, f.name)
                for f in dataclasses.fields(judged)
                if f.name not in ("verdict", "notes")
            },
        )
        notes += judged.notes
        bits = evidence.anchor_rmse(o, r, output, profiles or {}, cache)
        fields["effective_bits"], fields["closest_format"] = verdict.effective_bits(errors.rmse, read.oracle.rmse, bits)
    decided = fixed if rule == "fixed" or budget is None else budget
    rec = OutputRecord(*ident[:4], decided, fixed, budget, "", compute_dtype, note="; ".join(notes), **fields)
    if budget == SUSPECT and r is not None and not on_device(o, got):
        rec = _zero_positions(rec, o, got.value, r)
    if rec.verdict == SUSPECT and verdict.looks_like_reduced_precision(rec):
        rec = dataclasses.replace(rec, anchor_likeness=evidence.likeness(o, got, r, profiles or {}, rec.closest_format))
    if rec.verdict == SUSPECT and r is not None and not on_device(o, got):
        bias, corr = evidence.error_pattern(eb_judged, r)
        rec = dataclasses.replace(rec, error_bias=bias, error_value_corr=corr)
    return dataclasses.replace(rec, reason=reasons.reason(rec, rule, ops))


def _zero_positions(rec: OutputRecord, o: np.ndarray, b: np.ndarray, r: np.ndarray) -> OutputRecord:
    # A SUSPECT output split where the oracle and fp64 are exactly 0 (rlx_nb.zeros): how many of those the
    # backend computes as nonzero, and its budget excess over the other elements.
    if o.dtype.kind != "f" or b.dtype.kind != "f" or r.dtype.kind != "f" or not (o.shape == b.shape == r.shape):
        return rec
    split = zero_split(o, b, r)
    if split is None:
        return rec
    e = split.elsewhere
    excess = verdict.excess_within(e.rmse, e.max_err, rec.budget_rmse, rec.budget_max)
    return dataclasses.replace(
        rec, zero_mismatch=split.nonzero, zero_mismatch_max=split.largest, excess_elsewhere=excess
    )


def _measure(o: np.ndarray, got: Leaf, ref: Leaf | None, output: str, cache: dict) -> tuple | None:
    # (pair stats, flat oracle view, flat backend view, fp64 reference in that layout or None, the backend's
    # errors against it, its slice sums or None); None for outputs that must match exactly.
    if on_device(o, got):
        # The candidate's output stays on its device: the oracle (and the fp64 reference) go there
        # once per output and device, and only the statistics and the worst element come back.
        eo, eb = _on(o, got.tensor.device, output, "oracle", cache), got.tensor.reshape(-1)
        r = ref.value if ref is not None and ref.is_array and _is_float(ref.value) else None
        r = r if r is not None and r.shape == o.shape and not np.iscomplexobj(r) else None
        errors = own = None
        if r is not None:
            rd = _on(r, eb.device, output, "reference", cache)
            errors = device_metrics.reference_stats(eb, rd)
            own = device_metrics.slice_stats(eb, rd, o.shape) if o.ndim >= 2 else None
        return device_metrics.pair_stats(eo, eb), o, eb, r, errors, own
    b = got.value
    if not (_is_float(o) and _is_float(b)):
        return None
    eo, eb, shape = _float_views(o, b)
    r = None
    if ref is not None and ref.is_array and ref.value.shape == o.shape and _is_float(ref.value):
        r = ref.value.view(np.float64).reshape(shape) if np.iscomplexobj(ref.value) else ref.value
    errors = own = None
    if r is not None:
        errors, own = _reference_errors(eb, r, o)
    return pair_stats(eo, eb), eo, eb, r, errors, own


def _reference_errors(eb: np.ndarray, r: np.ndarray, o: np.ndarray) -> tuple[Any, Any]:
    # A run's errors against fp64 and, for outputs of two or more dimensions, its slice sums (one pass).
    if o.ndim >= 2 and not np.iscomplexobj(o) and eb.shape == o.shape:
        return error_stats(eb, r)
    return reference_stats(eb, r), None


def _pair_fields(stats: PairStats, o: np.ndarray, eo: np.ndarray, eb: Any, r: np.ndarray | None) -> dict[str, Any]:
    # The backend-against-oracle statistics and the worst element (``eo``/``eb`` flat views, interleaved
    # for complex outputs; ``eb`` may be a device tensor).
    fields = dict(
        max_abs=stats.max_abs,
        max_rel=stats.max_rel,
        mean_abs=stats.mean_abs,
        p99_abs=stats.p99_abs,
        cosine=stats.cosine,
        pcc=stats.pcc,
        sqnr_db=stats.sqnr_db,
        nmse=stats.nmse,
        mismatched=stats.mismatched,
        max_ulp=stats.max_ulp,
        nonfinite_mismatch=stats.nonfinite_mismatch,
        mismatched_frac=stats.mismatched / max(1, stats.numel),
    )
    if stats.worst_index >= 0:
        flat = stats.worst_index
        fields["worst_index"] = tuple(
            int(i) for i in np.unravel_index(flat // (2 if np.iscomplexobj(o) else 1), o.shape)
        )
        fields["oracle_value"], fields["backend_value"] = float(eo.reshape(-1)[flat]), float(eb.reshape(-1)[flat])
        if r is not None:
            fields["reference_value"] = float(np.asarray(r).reshape(-1)[flat])
    return fields


def on_device(oracle: np.ndarray, got: Leaf) -> bool:
    """Whether ``got`` stays on its device and can be compared there with ``oracle`` (same float type)."""
    return got.tensor is not None and oracle.dtype in _TORCH_OF and got.tensor.dtype == _TORCH_OF[oracle.dtype]


_TORCH_OF = {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16}


def _on(x: np.ndarray, device: Any, output: str, what: str, cache: dict) -> Any:
    # The oracle's (or reference's) output uploaded once per device and output.
    key = ("device", output, str(device), what)
    if key not in cache:
        cache[key] = device_metrics.as_device(x, device)
    return cache[key]


def _compare_exact(ident: tuple, base: dict, o: np.ndarray, b: np.ndarray) -> OutputRecord:
    diff = o != b
    fields = dict(base, mismatched=int(np.count_nonzero(diff)))
    fields["mismatched_frac"] = fields["mismatched"] / max(1, o.size)
    if o.size and np.issubdtype(o.dtype, np.number) and np.issubdtype(b.dtype, np.number):
        of, bf = o.astype(np.float64), b.astype(np.float64)
        fields["max_abs"], fields["max_rel"] = float(np.abs(of - bf).max()), float(rel_error(of, bf).max())
    if fields["mismatched"]:
        flat = int(np.flatnonzero(diff.reshape(-1))[0])
        fields["worst_index"] = tuple(int(i) for i in np.unravel_index(flat, o.shape))
        why = f"{fields['mismatched']} of {o.size} elements of a {o.dtype} output differ (exact match expected)"
        return _record(*ident, SUSPECT, why, **fields)
    return _record(*ident, ROUNDOFF, "exact match", **fields)


def _float_views(o: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    # Complex outputs compare as interleaved (real, imag) floats.
    if np.iscomplexobj(o) or np.iscomplexobj(b):
        o = np.ascontiguousarray(o.astype(np.complex128 if o.dtype == np.complex128 else np.complex64))
        b = np.ascontiguousarray(b.astype(o.dtype))
        return o.view(o.real.dtype), b.view(o.real.dtype), (*o.shape, 2)
    if o.dtype != b.dtype:
        wide = np.promote_types(o.dtype, b.dtype)
        return o.astype(wide), b.astype(wide), o.shape
    return o, b, o.shape


def _is_float(x: np.ndarray) -> bool:
    return np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.complexfloating)


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return False


__all__: Sequence[str] = ["OutputRecord", "compare", "compare_leaf", "on_device"]
