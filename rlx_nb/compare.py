"""RunResults -> one divergence record per (backend, output), with both verdicts.

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
    budget_rmse = scale * max(rmse(o - r), rmse(s - r), floor_rmse)
    budget_max  = scale * max(max|o - r|, max|s - r|, floor_max)
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
import functools
import itertools
import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from rlx_nb import device_metrics
from rlx_nb.metrics import UNIT_ROUNDOFF, ReferenceStats, SliceStats, error_stats, pair_stats, reference_stats
from rlx_nb.progress import bar
from rlx_nb.run import GRAD_PREFIX, OK, OPAQUE, SKIPPED, BackendRun, Leaf, RunResults

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
SAMPLE_ALPHA = 1e-2
"""Level of :func:`sample_allowance`: how often the legitimate runs' measured error falls short of it."""
SLICE_ALPHA = 1e-2
"""Family-wise level of :func:`slice_allowance`: how often a legitimate run exactly as noisy as the
oracle would see one of an output's slice means reach the allowance (the RMSE limit then multiplies it)."""
# The precision anchor (run.ANCHOR_BITS) at a reduced-precision backend's own mantissa width: the model
# with its matmul/convolution operands rounded like that backend's, a legitimate run at its precision.
ANCHOR_OF = {"bfloat16": 8, "float16": 11, "tf32": 11}


@dataclasses.dataclass
class OutputRecord:
    """How one backend's output compares with the oracle's and the fp64 reference."""

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
    note: str = ""

    @property
    def suspect(self) -> bool:
        return self.verdict == SUSPECT


def compare(
    results: RunResults, *, tol_rel: float | None = None, rule: str = "budget", progress: bool = True
) -> list[OutputRecord]:
    """Compare every candidate's outputs with the oracle's; one record per (backend, output).

    A backend that failed gives one ``error`` record (``output`` is None); a
    backend that cannot differentiate gives ``skipped`` records for the
    ``grad:`` outputs.  ``progress=False`` keeps its progress bar off.
    """
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    records: list[OutputRecord] = []
    unstable = results.environment.get("nondeterministic") or {}
    total = len(results.candidates) * len(results.oracle.outputs)
    cache: dict = {}
    with bar("rlx_nb compare", total=total, unit="output", enabled=progress) as shown:
        for run in results.candidates.values():
            for rec in _compare_run(results, run, tol_rel, rule, shown, cache):
                if rec.output in unstable and rec.verdict not in (VERDICT_ERROR, VERDICT_SKIPPED):
                    rec.verdict = NONDETERMINISTIC
                    rec.reason = (
                        f"the model itself is nondeterministic: two oracle runs differ by up to "
                        f"{unstable[rec.output]:.3g} on this output, so no backend can be judged on it; put the "
                        "model in eval mode (dropout), seed any RNG used inside forward, or enable "
                        "torch.use_deterministic_algorithms"
                    )
                records.append(rec)
    return records


def _compare_run(
    results: RunResults, run: BackendRun, tol_rel: float | None, rule: str, shown: Any = None, cache: dict | None = None
) -> list[OutputRecord]:
    if run.status != OK:
        return [
            OutputRecord(
                run.backend, None, -1, "forward", VERDICT_ERROR, VERDICT_ERROR, None, run.message, run.compute_dtype
            )
        ]
    out = []
    for index, (name, leaf) in enumerate(results.oracle.outputs.items()):
        if shown is not None:
            shown.update()
        kind = "grad" if name.startswith(GRAD_PREFIX) else "forward"
        tol = tol_rel if tol_rel is not None else (TOL_REL_BACKWARD if kind == "grad" else TOL_REL_FORWARD)
        base = dict(
            backend=run.backend,
            output=name,
            output_index=index,
            kind=kind,
            compute_dtype=run.compute_dtype,
            tol_rel=tol,
        )
        length = results.oracle.reduction_lengths.get(name, 1)
        anchor_leaves = {b: a.outputs.get(name) for b, a in results.anchors.items()}
        if kind == "grad" and run.grad_status != OK:
            # No gradients at all (a forward-only backend, or its backward failed): one record for all of
            # them, so the backend's judged outputs are its forward outputs, counted once.
            if not any(r.kind == "grad" for r in out):
                verdict = VERDICT_SKIPPED if run.grad_status == SKIPPED else VERDICT_ERROR
                grads = sum(1 for n in results.oracle.outputs if n.startswith(GRAD_PREFIX))
                base["output"] = GRAD_PREFIX + "*"
                out.append(
                    OutputRecord(
                        verdict=verdict,
                        verdict_fixed=verdict,
                        verdict_budget=None,
                        reason=f"{run.grad_message}: its {grads} gradient output(s) are not compared",
                        **base,
                    )
                )
            continue
        got = run.outputs.get(name)
        ref = results.reference.outputs.get(name) if results.reference.status == OK else None
        seq = results.sequential.outputs.get(name) if results.sequential is not None else None
        own = results.anchors.get(ANCHOR_OF.get(run.compute_dtype, 0))
        anchor = (ANCHOR_OF[run.compute_dtype], own.outputs.get(name)) if own is not None else None
        rec = compare_leaf(
            leaf,
            got,
            ref,
            rule=rule,
            reduction_length=length,
            cache=cache,
            sequential=seq,
            anchor=anchor,
            profiles=list(anchor_leaves.values()),
            **base,
        )
        if ref is not None and rec.backend_rmse == rec.backend_rmse:
            _effective_precision(rec, anchor_leaves, ref)
            if rec.verdict == SUSPECT and not rec.nonfinite_mismatch:
                rec.reason = _reason(rec, rule)
        out.append(rec)
    extra = [n for n in run.outputs if n not in results.oracle.outputs]
    if extra:
        out.append(
            OutputRecord(
                run.backend,
                extra[0],
                len(results.oracle.outputs),
                "forward",
                SUSPECT,
                SUSPECT,
                SUSPECT,
                f"outputs the oracle does not have: {', '.join(extra[:5])}",
                run.compute_dtype,
            )
        )
    return out


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
    profiles: Sequence[Leaf | None] = (),
) -> OutputRecord:
    """One (backend, output) record from the oracle's, the backend's and the reference's leaf.

    ``sequential`` is the output of the plain-sequential-reductions run (:mod:`rlx_nb.reassoc`),
    a second legitimate error for the budget.  ``anchor`` is ``(bits, leaf)`` of the precision
    anchor at a reduced-precision backend's own mantissa width (:data:`ANCHOR_OF`), a legitimate
    error at that precision.  ``profiles`` are the precision anchors' outputs: the same model with more
    round-off, whose error shows which slices of the output amplify round-off (the slice clause's
    sensitivity profile).  ``cache`` (shared across the candidates of one
    comparison) keeps what does not depend on the candidate: the oracle's and the sequential
    run's errors against fp64, and uploads of the oracle and reference to devices.
    """
    rec = OutputRecord(
        backend,
        output,
        output_index,
        kind,
        ROUNDOFF,
        ROUNDOFF,
        None,
        "",
        compute_dtype,
        shape=oracle.shape,
        dtype=oracle.dtype,
        tol_rel=tol_rel,
        reduction_length=reduction_length,
    )
    if got is None:
        return _suspect(rec, "output missing: the backend's outputs have a different structure")
    if OPAQUE in (oracle.dtype, got.dtype):
        rec.verdict = rec.verdict_fixed = VERDICT_SKIPPED
        kind = oracle.value if oracle.dtype == OPAQUE else got.value
        rec.reason = f"not compared: a {kind} object that holds no tensors (only tensors and plain values are compared)"
        return rec
    if not oracle.is_array or not got.is_array:
        same = (not oracle.is_array and not got.is_array) and _equal(oracle.value, got.value)
        return rec if same else _suspect(rec, f"value {got.value!r:.60} differs from the oracle's {oracle.value!r:.60}")
    o = oracle.value
    rec.numel = int(o.size)
    if tuple(o.shape) != tuple(got.shape):
        return _suspect(rec, f"shape {tuple(got.shape)} differs from the oracle's {o.shape}")
    if got.dtype != oracle.dtype:
        rec.note = f"dtype {got.dtype} differs from the oracle's {oracle.dtype}"
    cache = {} if cache is None else cache
    if on_device(o, got):
        # The candidate's output stays on its device: the oracle (and the fp64 reference) go there
        # once per output and device, and only the statistics and the worst element come back.
        eo, eb = _on(o, got.tensor.device, output, "oracle", cache), got.tensor.reshape(-1)
        r = ref.value if ref is not None and ref.is_array and _is_float(ref.value) else None
        r = r if r is not None and r.shape == o.shape and not np.iscomplexobj(r) else None
        slices = None
        if r is not None and o.ndim >= 2:

            def slices() -> tuple[SliceStats, list[SliceStats], list[tuple[float, SliceStats]]]:
                dev = device_metrics.slice_stats(eb, _on(r, eb.device, output, "reference", cache), o.shape)
                return dev, *_legit_slices(o, r, sequential, profiles, output or "", cache)

        return _judge(
            rec,
            o,
            o,
            eb,
            r,
            device_metrics.pair_stats(eo, eb),
            lambda: device_metrics.reference_stats(eb, _on(r, eb.device, output, "reference", cache)),
            rule,
            cache,
            sequential,
            slices,
            anchor,
        )
    b = got.value
    if not (_is_float(o) and _is_float(b)):
        return _compare_exact(rec, o, b)
    eo, eb, shape = _float_views(o, b)
    r = None
    if ref is not None and ref.is_array and ref.value.shape == o.shape and _is_float(ref.value):
        r = ref.value.view(np.float64).reshape(shape) if np.iscomplexobj(ref.value) else ref.value
    slices, versus = None, lambda: reference_stats(eb, r)
    if r is not None and o.ndim >= 2 and not np.iscomplexobj(o) and eb.shape == o.shape:
        whole, own = error_stats(eb, r)  # one pass for both
        slices = lambda: (own, *_legit_slices(o, r, sequential, profiles, output or "", cache))  # noqa: E731
        versus = lambda: whole  # noqa: E731
    return _judge(rec, o, eo, eb, r, pair_stats(eo, eb), versus, rule, cache, sequential, slices, anchor)


def on_device(oracle: np.ndarray, got: Leaf) -> bool:
    """Whether ``got`` stays on its device and can be compared there with ``oracle`` (same float type)."""
    return got.tensor is not None and oracle.dtype in _TORCH_OF and got.tensor.dtype == _TORCH_OF[oracle.dtype]


def _judge(
    rec: OutputRecord,
    o: np.ndarray,
    eo: np.ndarray,
    eb: Any,
    r: np.ndarray | None,
    stats: Any,
    backend_vs_reference: Callable[[], ReferenceStats],
    rule: str,
    cache: dict,
    sequential: Leaf | None = None,
    slices: Callable[[], tuple[SliceStats, list[SliceStats], list[tuple[float, SliceStats]]]] | None = None,
    anchor: tuple[int, Leaf | None] | None = None,
) -> OutputRecord:
    # Shared by the host and device paths: ``o`` is the oracle's output, ``eo``/``eb`` the flat
    # float views compared (interleaved for complex; ``eb`` may be a device tensor), ``r`` the fp64
    # reference in ``eo``'s layout (None without one).
    _fill_stats(rec, stats)
    if stats.worst_index >= 0:
        flat = stats.worst_index
        rec.worst_index = tuple(int(i) for i in np.unravel_index(flat // (2 if np.iscomplexobj(o) else 1), o.shape))
        rec.oracle_value, rec.backend_value = float(eo.reshape(-1)[flat]), float(eb.reshape(-1)[flat])
        if r is not None:
            rec.reference_value = float(np.asarray(r).reshape(-1)[flat])
    rec.verdict_fixed = SUSPECT if (stats.max_rel > rec.tol_rel or stats.nonfinite_mismatch) else ROUNDOFF
    if r is not None:
        so = _oracle_stats(eo, r, rec.output or "", cache)
        rec.verdict_budget = _budget(
            rec,
            so,
            backend_vs_reference(),
            _sequential_stats(sequential, o, r, rec, cache),
            slices,
            _anchor_errors(anchor, o, r, rec.output or "", cache),
        )
    else:
        rec.note = _join(rec.note, "no fp64 reference for this output; the budget verdict is unavailable")
    rec.verdict = rec.verdict_fixed if rule == "fixed" or rec.verdict_budget is None else rec.verdict_budget
    rec.reason = _reason(rec, rule)
    return rec


def _errors(x: np.ndarray, r: np.ndarray, output: str, what: str, cache: dict) -> tuple[ReferenceStats, Any]:
    # A legitimate run's error against fp64 is the same for every candidate: computed once per output,
    # with its slice sums (SliceStats) in the same pass for outputs of two or more dimensions.
    key = (f"{what}-vs-fp64", output)
    if key not in cache:
        sliced = x.ndim >= 2 and x.dtype.kind == "f" and x.shape == r.shape  # not complex's interleaved view
        cache[key] = error_stats(x, r) if sliced else (reference_stats(x, r), None)
    return cache[key]


def _oracle_stats(o: np.ndarray, r: np.ndarray, output: str, cache: dict) -> ReferenceStats:
    return _errors(o, r, output, "oracle", cache)[0]


def _comparable_output(leaf: Leaf | None, o: np.ndarray, r: np.ndarray) -> np.ndarray | None:
    # A helper run's (sequential, anchor) output where it can be compared like the oracle's, else None.
    ok = leaf is not None and leaf.is_array and leaf.value.shape == o.shape and leaf.value.dtype == o.dtype
    return leaf.value if ok and o.dtype.kind == "f" and r.shape == o.shape else None


def _sequential_stats(
    leaf: Leaf | None, o: np.ndarray, r: np.ndarray, rec: OutputRecord, cache: dict
) -> ReferenceStats | None:
    # The plain-sequential run's error against fp64, once per output; None when it has no usable output.
    s = _comparable_output(leaf, o, r)
    return None if s is None else _errors(s, r, rec.output or "", "sequential", cache)[0]


def _anchor_errors(
    anchor: tuple[int, Leaf | None] | None, o: np.ndarray, r: np.ndarray, output: str, cache: dict
) -> tuple[int, ReferenceStats, Any] | None:
    # The anchor's error against fp64 (and its slice sums), once per output and width; None without one.
    if anchor is None:
        return None
    bits, leaf = anchor
    a = _comparable_output(leaf, o, r)
    return None if a is None else (bits, *_errors(a, r, output, f"anchor:{bits}", cache))


def _legit_slices(
    o: np.ndarray, r: np.ndarray, sequential: Leaf | None, profiles: Sequence[Leaf | None], output: str, cache: dict
) -> tuple[list[SliceStats], list[tuple[float, SliceStats]]]:
    # The legitimate runs' (oracle, sequential) slice sums against fp64, from the same cached pass, and the
    # precision anchors' (whole-output RMSE, slice sums): their sensitivity profiles.
    legit = [_errors(o, r, output, "oracle", cache)[1]]
    s = _comparable_output(sequential, o, r)
    if s is not None:
        legit.append(_errors(s, r, output, "sequential", cache)[1])
    shapes = []
    for i, leaf in enumerate(profiles):
        a = _comparable_output(leaf, o, r)
        if a is not None:
            whole, st = _errors(a, r, output, f"profile:{i}", cache)
            if st is not None and whole.rmse > 0:
                shapes.append((whole.rmse, st))
    return [st for st in legit if st is not None], shapes


def _on(x: np.ndarray, device: Any, output: str, what: str, cache: dict) -> Any:
    # The oracle's (or reference's) output uploaded once per device and output.
    key = ("device", output, str(device), what)
    if key not in cache:
        cache[key] = device_metrics.as_device(x, device)
    return cache[key]


def _fill_stats(rec: OutputRecord, stats: Any) -> None:
    rec.max_abs, rec.max_rel, rec.mean_abs, rec.p99_abs = stats.max_abs, stats.max_rel, stats.mean_abs, stats.p99_abs
    rec.mismatched, rec.max_ulp, rec.nonfinite_mismatch = stats.mismatched, stats.max_ulp, stats.nonfinite_mismatch
    rec.mismatched_frac = stats.mismatched / max(1, stats.numel)


def _budget(
    rec: OutputRecord,
    so: ReferenceStats,
    sb: ReferenceStats,
    ss: ReferenceStats | None = None,
    slices: Callable[[], tuple[SliceStats, list[SliceStats], list[tuple[float, SliceStats]]]] | None = None,
    anchor: tuple[int, ReferenceStats, SliceStats | None] | None = None,
) -> str:
    # ``anchor``: a legitimate run at the backend's own precision (bits, errors, slice sums); its
    # errors enter the budget as they are, where the fp32 runs' are scaled by the unit round-off.
    scale = UNIT_ROUNDOFF.get(rec.compute_dtype, UNIT_ROUNDOFF["float32"]) / UNIT_ROUNDOFF["float32"]
    scale = max(scale, 1.0)
    legit = [so] if ss is None else [so, ss]
    if ss is None and rec.kind == "grad":  # no sequential run to measure reordering: the length guess
        units = GRAD_FLOOR_UNITS * math.sqrt(max(1, rec.reduction_length))
        rec.note = _join(
            rec.note, "no sequential run for this output: the gradient floor is guessed from the sum's length"
        )
    else:
        units = FLOOR_UNITS
    floor = units * UNIT_ROUNDOFF["float32"]
    legit_rmse, legit_max = max(s.rmse for s in legit), max(s.max_err for s in legit)
    # Few elements measure the legitimate error poorly: widen what they measured (not the floor) by how
    # far it can fall short by chance; 1 for large outputs.
    samples = len({(s.rmse, s.max_err) for s in legit})  # (a sequential run equal to the oracle adds none)
    short = sample_allowance(rec.numel, samples)
    if short > 1.05:
        rec.note = _join(rec.note, f"{rec.numel} element(s): the measured round-off is widened {short:.2g}x for chance")
    budget_rmse = scale * max(short * legit_rmse, floor * so.ref_rms)
    budget_max = scale * max(short * legit_max, floor * so.ref_max)
    if anchor is not None and (anchor[1].rmse > budget_rmse or anchor[1].max_err > budget_max):
        budget_rmse, budget_max = max(budget_rmse, anchor[1].rmse), max(budget_max, anchor[1].max_err)
        rec.note = _join(
            rec.note,
            f"the budget is the {anchor[0]}-bit anchor's error (matmuls and convolutions computed at "
            f"{rec.compute_dtype}'s precision: operands, results and gradients rounded, as autocast does), "
            "larger here than the scaled fp32 round-off",
        )
    rec.oracle_rmse, rec.backend_rmse = so.rmse, sb.rmse
    rec.oracle_max_err, rec.backend_max_err = so.max_err, sb.max_err
    if ss is not None:
        rec.sequential_rmse, rec.sequential_max_err = ss.rmse, ss.max_err
    rec.budget_rmse, rec.budget_max = budget_rmse, budget_max
    rec.ratio_rmse = _ratio(sb.rmse, budget_rmse)
    rec.ratio_max = _ratio(sb.max_err, budget_max)
    rec.excess = max(rec.ratio_rmse / RMSE_LIMIT, rec.ratio_max / MAX_LIMIT)
    own, legit_slices, profiles = slices() if slices is not None else (None, [], [])
    at_precision = [anchor[2]] if anchor is not None and anchor[2] is not None else []
    profiles = [(rmse, st) for rmse, st in profiles if st.axes == (own.axes if own is not None else None)]
    if own is not None and legit_slices and all(st.axes == own.axes for st in legit_slices + at_precision):
        rec.slice_ratio, rec.slice_at = _slice_ratio(
            own,
            legit_slices,
            scale,
            floor * so.ref_rms,
            at_precision,
            pooled_rmse=legit_rmse,
            pooled_at_precision=anchor[1].rmse if at_precision else 0.0,
            profiles=profiles,
        )
        rec.excess = max(rec.excess, rec.slice_ratio / RMSE_LIMIT)
    if so.rmse > floor * so.ref_rms and sb.rmse < BETTER_THAN_ORACLE * so.rmse:
        rec.note = _join(
            rec.note,
            f"the fp32 oracle is further from fp64 than {rec.backend} (RMSE {so.rmse:.2e} vs {sb.rmse:.2e}): "
            "the gap is the oracle's round-off, not the backend's",
        )
    legit += [anchor[1]] if anchor is not None else []
    rec.concentration = _isolation(sb, rec.numel) / max(max(_isolation(s, rec.numel) for s in legit), 1.0)
    far = CONCENTRATED_OVER_ORACLE * max(
        scale * max(legit_max, FLOOR_UNITS * UNIT_ROUNDOFF["float32"] * so.ref_max),
        anchor[1].max_err if anchor is not None else 0.0,
    )
    rec.concentrated = bool(rec.numel >= 2 and sb.max_err > far and rec.concentration > CONCENTRATION_LIMIT)
    return SUSPECT if rec.excess > 1.0 or rec.concentrated or rec.nonfinite_mismatch else ROUNDOFF


def slice_lean(legit: Sequence[SliceStats], i: int) -> float:
    """How much legitimate round-off leans one way within the slices of axis ``i``: ``E[mean^2] / E[e^2]``.

    ``sum_j S_j^2 / n_j  /  sum_j Q_j`` over the slices (``S_j`` and ``Q_j`` the sum of a run's errors and of
    their squares on slice ``j`` of ``n_j`` elements), the largest over the legitimate runs: about ``1 / n``
    when errors are independent, 1 when every slice's errors share one value.  1 when there are no errors.
    """
    lean = 0.0
    for st in legit:
        q = float(np.sum(st.squares[i]))
        if q <= 0:
            return 1.0
        lean = max(lean, float(np.sum(st.sums[i] ** 2 / np.maximum(st.counts[i], 1))) / q)
    return min(1.0, lean) if legit else 1.0


def slice_allowance(counts: np.ndarray, slices: int, lean: float = 0.0) -> np.ndarray:
    """How far a slice's mean error may stray by chance, in units of the legitimate error scale there.

    ``max(1, c * sqrt(max(lean, 1 / n_j)))`` for slice ``j`` of ``counts[j]`` elements, ``slices`` slices judged
    in all and round-off that leans ``lean`` (:func:`slice_lean`), with ``c`` the two-sided normal quantile at
    family-wise level :data:`SLICE_ALPHA` over the slices.  Round-off of scale sigma averages over a slice to
    about ``sigma sqrt(lean)`` (``sigma / sqrt(n)`` for independent errors, ``sigma`` for errors that all
    lean together), and the largest of ``slices`` such means reaches ``c`` times that; a mean never exceeds
    the RMS it came from, hence at least 1.
    """
    c = statistics.NormalDist().inv_cdf(1.0 - SLICE_ALPHA / (2.0 * max(1, slices)))
    return np.maximum(1.0, c * np.sqrt(np.maximum(lean, 1.0 / np.maximum(counts, 1))))


def _slice_ratio(
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
            peaks = [scale * _peak_mean(st, i) for st in legit] + [_peak_mean(st, i) for st in at_precision]
            budget = np.maximum(budget, max(peaks, default=0.0))
        ratio = np.where(budget > 0, mean / np.where(budget > 0, budget, 1.0), np.where(mean > 0, np.inf, 0.0))
        j = int(np.argmax(ratio))
        if ratio[j] > worst:
            worst, at = float(ratio[j]), "[" + ", ".join([":"] * axis + [str(j)]) + "]"
    return worst, at


def sample_allowance(n: int, samples: int = 1) -> float:
    """How far the legitimate runs' error, measured on ``n`` elements by ``samples`` runs, may fall short of
    its true size by chance: ``sqrt(n / x)`` with ``x`` the ``SAMPLE_ALPHA ** (1 / samples)`` quantile of a
    chi-square with ``n`` degrees of freedom (an RMS over ``n`` independent errors).

    About 8 for a scalar measured by two runs, 1.5 for 8 elements, 1.12 for 64, 1.03 for 1,000.

    Examples
    --------
    >>> round(sample_allowance(1, 2), 1), round(sample_allowance(1000, 2), 2)
    (8.0, 1.03)
    """
    if n <= 0:
        return 1.0
    p = SAMPLE_ALPHA ** (1.0 / max(1, samples))
    return math.sqrt(n / _chi2_quantile(n, p))


@functools.lru_cache(maxsize=4096)
def _chi2_quantile(dof: int, p: float) -> float:
    # Bisection on the regularized lower incomplete gamma function P(dof/2, x/2).
    lo, hi = 0.0, max(10.0, 4.0 * dof)
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if _gamma_p(0.5 * dof, 0.5 * mid) < p:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _gamma_p(a: float, x: float) -> float:
    # Regularized lower incomplete gamma P(a, x): the series below a + 1, the continued fraction above.
    if x <= 0:
        return 0.0
    log_front = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        k = a
        while abs(term) > abs(total) * 1e-15:
            k += 1
            term *= x / k
            total += term
        return min(1.0, total * math.exp(log_front))
    b, c, d = x + 1 - a, 1e300, 1.0 / (x + 1 - a)
    h = d
    for i in range(1, 1000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1e-300 if abs(d) < 1e-300 else d
        c = b + an / c
        c = 1e-300 if abs(c) < 1e-300 else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-15:
            break
    return max(0.0, 1.0 - math.exp(log_front) * h)


def _peak_mean(st: SliceStats, i: int) -> float:
    # The largest |mean error| over the slices of axis ``i``.
    return float(np.max(np.abs(st.sums[i]) / np.maximum(st.counts[i], 1), initial=0.0))


def _isolation(st: ReferenceStats, n: int) -> float:
    # How far the worst error stands out from the rest: ~1 for errors spread like noise.
    return st.max_err / (st.rmse * math.sqrt(2 * math.log(max(n, 3)))) if st.rmse > 0 else 0.0


_TORCH_OF = {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16}

FORMAT_BITS = {"fp32": 24, "tf32/fp16": 11, "bf16": 8}


def _effective_precision(rec: OutputRecord, anchors: dict, ref: Leaf) -> None:
    # Effective mantissa bits, read on a per-output scale calibrated on this model: the oracle is 24
    # bits, and runs with matmul/conv operands rounded to 11 and 8 bits mark those points, so the
    # output's own accumulation length and conditioning do not shift the reading.
    points = [(24.0, rec.oracle_rmse)]
    for bits, leaf in sorted(anchors.items(), reverse=True):
        if leaf is None or not leaf.is_array or leaf.value.shape != ref.value.shape:
            continue
        a, r = (
            np.ascontiguousarray(v).view(v.real.dtype) if np.iscomplexobj(v) else v for v in (leaf.value, ref.value)
        )
        if a.dtype.kind != "f" or r.dtype.kind != "f":
            continue
        points.append((float(bits), reference_stats(a, r).rmse))
    logs = [(b, math.log2(e)) for b, e in points if e > 0]
    err = rec.backend_rmse
    if not logs or logs[0][0] != 24.0 or err <= rec.oracle_rmse or err <= 0:
        rec.effective_bits = 24.0 if err <= rec.oracle_rmse else math.nan
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
        rec.effective_bits = max(0.0, min(24.0, bits))
    if rec.effective_bits == rec.effective_bits:
        rec.closest_format = min(FORMAT_BITS, key=lambda f: abs(FORMAT_BITS[f] - rec.effective_bits))


def _looks_like_reduced_precision(rec: OutputRecord) -> bool:
    # A precision mode shows in the forward outputs, spread over every element (not concentrated like a
    # one-row bug), at about a standard narrower format's bits; a gradient-only or off-format drift is a bug.
    spread = rec.ratio_max <= 8 * max(rec.ratio_rmse, 1e-300)
    # ... and no slice leaning more than the output as a whole: a precision mode's error is round-off at a
    # coarser unit, which averages out over a row; a bug on one row does not.
    spread = spread and not rec.slice_ratio >= rec.ratio_rmse
    near = min(abs(rec.effective_bits - b) for b in (FORMAT_BITS["tf32/fp16"], FORMAT_BITS["bf16"])) <= 1.0
    return rec.compute_dtype == "float32" and rec.kind == "forward" and spread and near


def _reason(rec: OutputRecord, rule: str) -> str:
    if rec.nonfinite_mismatch:
        return f"{rec.nonfinite_mismatch} NaN/Inf elements where the oracle has none (or the reverse)"
    if rule == "budget" and rec.verdict_budget is not None:
        fmt = "fp32" if rec.compute_dtype == "float32" else rec.compute_dtype
        worst = max(rec.ratio_rmse, rec.ratio_max)
        if rec.verdict == SUSPECT:
            if _looks_like_reduced_precision(rec):
                return (
                    f"behaves like {rec.closest_format}: about {rec.effective_bits:.0f} effective bits while it "
                    f"claims fp32 (error {worst:.3g}x the fp32 budget, spread over the output); a reduced-precision "
                    "mode such as TF32, autocast or a runtime precision hint is likely on — or a systematic "
                    "kernel error of that size"
                )
            if rec.slice_ratio > RMSE_LIMIT and max(rec.ratio_rmse / RMSE_LIMIT, rec.ratio_max / MAX_LIMIT) <= 1.0:
                return (
                    f"systematic error on one slice: {rec.output}{rec.slice_at} is off by {rec.slice_ratio:.3g}x, on average, "
                    f"the legitimate runs' RMS error there, while the output as a whole is within {worst:.3g}x the "
                    f"{fmt} budget — round-off averages out over a slice, a bug on one row or channel does not"
                )
            if rec.concentrated and rec.excess <= 1.0:
                over = rec.backend_max_err / rec.oracle_max_err if rec.oracle_max_err > 0 else math.inf
                return (
                    f"concentrated error: the worst element is {over:.3g}x the oracle's worst and stands out "
                    f"{rec.concentration:.2g}x more than round-off does, while the output as a whole is within "
                    f"{worst:.3g}x the {fmt} budget — likely a bug on one row or channel"
                )
            return f"error {worst:.3g}x the {fmt} round-off budget — likely a kernel bug"
        return f"within {worst:.3g}x the {fmt} round-off budget"
    if rec.verdict == SUSPECT:
        return f"max_rel {rec.max_rel:.3e} > tol_rel {rec.tol_rel:.1e} — relative error too large for round-off"
    return f"max_rel {rec.max_rel:.3e} <= tol_rel {rec.tol_rel:.1e}"


def _compare_exact(rec: OutputRecord, o: np.ndarray, b: np.ndarray) -> OutputRecord:
    diff = o != b
    rec.mismatched = int(np.count_nonzero(diff))
    rec.mismatched_frac = rec.mismatched / max(1, o.size)
    if o.size and np.issubdtype(o.dtype, np.number) and np.issubdtype(b.dtype, np.number):
        d = np.abs(o.astype(np.float64) - b.astype(np.float64))
        rec.max_abs = float(d.max())
        rec.max_rel = float((d / (np.abs(o.astype(np.float64)) + 1e-6)).max())
    if rec.mismatched:
        flat = int(np.flatnonzero(diff.reshape(-1))[0])
        rec.worst_index = tuple(int(i) for i in np.unravel_index(flat, o.shape))
        return _suspect(
            rec, f"{rec.mismatched} of {o.size} elements of a {o.dtype} output differ (exact match expected)"
        )
    rec.reason = "exact match"
    return rec


def _suspect(rec: OutputRecord, reason: str) -> OutputRecord:
    rec.verdict = rec.verdict_fixed = rec.verdict_budget = SUSPECT
    rec.reason = reason
    return rec


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


def _ratio(num: float, den: float) -> float:
    if den > 0:
        return num / den
    return 0.0 if num == 0 else math.inf


def _join(a: str, b: str) -> str:
    return f"{a}; {b}" if a else b
