"""What the verdict reads besides the backend's own error: the legitimate runs' errors against fp64.

The oracle, the sequential run and the precision anchors are the same for every candidate: their errors
(with per-slice sums) are computed once per output and kept in the comparison's ``cache``.  The anchors are
read only where they measure rounding (:func:`anchors_left_out`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from rlx_nb import verdict
from rlx_nb.reference import ReferenceStats, SliceStats, error_stats, reference_stats
from rlx_nb.results import OK, Leaf, RunResults
from rlx_nb.verdict import Evidence, SliceEvidence


def likeness(o: np.ndarray, got: Leaf, r: np.ndarray, profiles: dict[int, Leaf | None], fmt: str) -> float:
    # Correlation, element by element, of the backend's |error| with the anchor's at the format's bits.
    leaf = profiles.get(verdict.FORMAT_BITS.get(fmt, 0))
    a = comparable(leaf, o, r)
    if a is None or got.value is None or got.value.shape != o.shape:
        return math.nan
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        x, y = np.abs(got.value - r).ravel(), np.abs(a - r).ravel()
        ok = np.isfinite(x) & np.isfinite(y)
        if ok.sum() < 3 or x[ok].std() == 0 or y[ok].std() == 0:
            return math.nan
        return float(np.corrcoef(x[ok], y[ok])[0, 1])


def error_pattern(b: np.ndarray, r: np.ndarray) -> tuple[float, float]:
    """``(bias, correlation)`` of a run's error against fp64: its mean over its RMS, and its correlation with
    the fp64 values.  Noise has neither (:func:`rlx_nb.verdict.noise_like`)."""
    if b.shape != r.shape or b.dtype.kind != "f" or r.dtype.kind != "f":
        return math.nan, math.nan
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        e = (b.astype(np.float64) - r).reshape(-1)
        v = r.reshape(-1).astype(np.float64)
        ok = np.isfinite(e) & np.isfinite(v)
        e, v = e[ok], v[ok]
        if e.size < 2:
            return math.nan, math.nan
        rms = float(np.sqrt(np.mean(e * e)))
        bias = float(np.mean(e)) / rms if rms > 0 else 0.0
        ec, vc = e - e.mean(), v - v.mean()
        den = float(np.sqrt(np.sum(ec * ec) * np.sum(vc * vc)))
        corr = float(np.sum(ec * vc)) / den if den > 0 else 0.0
    return bias, corr


def evidence(
    ident: tuple,
    fields: dict,
    o: np.ndarray,
    eo: np.ndarray,
    r: np.ndarray,
    errors: ReferenceStats,
    own: SliceStats | None,
    sequential: Leaf | None,
    anchor: tuple[int, Leaf | None] | None,
    profiles: dict[int, Leaf | None],
    cache: dict,
) -> Evidence:
    # What the verdict reads: the backend's and the legitimate runs' errors against fp64 (cached per output;
    # ``eo`` is the oracle's output in ``r``'s layout, interleaved for complex outputs).
    backend, output, _, kind, compute_dtype = ident
    oracle, oracle_slices = legit_errors(eo, r, output, "oracle", cache)
    legit_slices = [oracle_slices]
    seq = comparable(sequential, o, r)
    seq_stats = None
    if seq is not None:
        seq_stats, seq_slices = legit_errors(seq, r, output, "sequential", cache)
        legit_slices.append(seq_slices)
    own_anchor = at_precision = None
    if anchor is not None and (a := comparable(anchor[1], o, r)) is not None:
        stats, at_precision = legit_errors(a, r, output, f"anchor:{anchor[0]}", cache)
        own_anchor = (anchor[0], stats)
    slices = None
    if own is not None and all(st is not None and st.axes == own.axes for st in legit_slices):
        shapes = []
        for bits, leaf in profiles.items():
            if (p := comparable(leaf, o, r)) is not None:
                whole, st = legit_errors(p, r, output, f"anchor:{bits}", cache)
                if st is not None and st.axes == own.axes and whole.rmse > 0:
                    shapes.append((whole.rmse, st))
        precision = (at_precision,) if at_precision is not None and at_precision.axes == own.axes else ()
        slices = SliceEvidence(own, tuple(legit_slices), precision, tuple(shapes))
    return Evidence(
        backend,
        kind,
        compute_dtype,
        fields["numel"],
        errors,
        oracle,
        seq_stats,
        own_anchor,
        slices,
        fields["nonfinite_mismatch"],
        fields["reduction_length"],
    )


def anchors_left_out(results: RunResults, output: str, cache: dict) -> str:
    # Why the precision anchors cannot be read on this output ("" when they can).  An anchor is the model
    # with its matmuls rounded to fewer bits: its error is rounding only if it shrinks as the bits grow.
    # Two anchors closer to each other than the wider one is to fp64 (while the oracle is close to fp64)
    # share a difference that is not rounding: their run took another code path than the oracle's (the
    # torch-function mode that rounds turns PyTorch's fused inference fast paths off).
    key = ("anchors-left-out", output)
    if key in cache:
        return cache[key]
    cache[key] = why = ""
    if len(results.anchors) < 2 or results.reference.status != OK:
        return why
    narrow, wide = min(results.anchors), max(results.anchors)
    o, r = results.oracle.outputs.get(output), results.reference.outputs.get(output)
    lo, hi = results.anchors[narrow].outputs.get(output), results.anchors[wide].outputs.get(output)
    if o is None or r is None or not o.is_array or not r.is_array or o.value.dtype.kind != "f":
        return why
    a, b = comparable(lo, o.value, r.value), comparable(hi, o.value, r.value)
    if a is None or b is None or r.value.shape != o.value.shape:
        return why
    oracle = legit_errors(o.value, r.value, output, "oracle", cache)[0]
    wide_err = legit_errors(b, r.value, output, f"anchor:{wide}", cache)[0]
    apart = reference_stats(a, b).rmse
    floor = verdict.FLOOR_UNITS * verdict.UNIT_ROUNDOFF["float32"] * oracle.ref_rms
    if verdict.anchors_took_another_path(oracle.rmse, floor, wide_err.rmse, apart):
        why = (
            f"precision anchors left out on this output: the {narrow}- and {wide}-bit runs differ from each other by "
            f"{apart:.3g} (RMS) but from fp64 by {wide_err.rmse:.3g}, so what they share is not rounding — they took "
            "another code path than the oracle (rounding runs under a torch-function mode, which turns PyTorch's "
            "fused inference fast paths off)"
        )
    cache[key] = why
    return why


def anchor_rmse(o: np.ndarray, r: np.ndarray, output: str, profiles: dict[int, Leaf | None], cache: dict) -> dict:
    # Each precision anchor's RMSE against fp64 on this output: the effective-precision scale.
    out = {}
    for bits, leaf in profiles.items():
        if (a := comparable(leaf, o, r, complex_ok=True)) is not None:
            out[bits] = legit_errors(a, r, output, f"anchor:{bits}", cache)[0].rmse
    return out


def legit_errors(x: np.ndarray, r: np.ndarray, output: str, what: str, cache: dict) -> tuple[ReferenceStats, Any]:
    # A legitimate run's error against fp64 is the same for every candidate: computed once per output,
    # with its slice sums (SliceStats) in the same pass for outputs of two or more dimensions.
    key = (f"{what}-vs-fp64", output)
    if key not in cache:
        sliced = x.ndim >= 2 and x.dtype.kind == "f" and x.shape == r.shape  # not complex's interleaved view
        cache[key] = error_stats(x, r) if sliced else (reference_stats(x, r), None)
    return cache[key]


def comparable(leaf: Leaf | None, o: np.ndarray, r: np.ndarray, *, complex_ok: bool = False) -> np.ndarray | None:
    # A helper run's (sequential, anchor) output where it can be compared like the oracle's, else None
    # (complex outputs as interleaved floats, where ``r`` is already that view).
    if leaf is None or not leaf.is_array or leaf.value.shape != o.shape or leaf.value.dtype != o.dtype:
        return None
    v = leaf.value
    if np.iscomplexobj(v):
        return np.ascontiguousarray(v).view(v.real.dtype).reshape(r.shape) if complex_ok else None
    return v if v.dtype.kind == "f" and r.shape == o.shape else None
