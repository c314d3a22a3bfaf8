"""RunResults -> one record per (backend, output): the comparison, flowing one way.

For each output of the oracle, one :class:`~rlx_nb.comparison.context.OutputContext` (what every backend is judged
against, computed once); for each candidate and output, the comparator for the output's kind
(:mod:`rlx_nb.comparison.comparators`) measures the pair and asks :mod:`rlx_nb.verdict.rule` for the judgement; then what
only the backend's outputs together tell (a uniformly less accurate arithmetic), what only the oracle's two
runs tell (a nondeterministic model), and the words (:mod:`rlx_nb.verdict.words`), once per record.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from rlx_nb._support.progress import bar
from rlx_nb.comparison.comparators import Candidate, compare_output
from rlx_nb.comparison.context import OutputContext, contexts
from rlx_nb.comparison.flips import flips_of
from rlx_nb.execution.results import GRAD_PREFIX, OK, SKIPPED, BackendRun, Leaf, RunResults
from rlx_nb.verdict import rule as verdict
from rlx_nb.verdict import words as reasons
from rlx_nb.verdict.readings import looks_less_accurate
from rlx_nb.verdict.records import Finding, OutputRecord, PairFields
from rlx_nb.verdict.rule import check_rule
from rlx_nb.verdict.types import (
    NONDETERMINISTIC,
    SUSPECT,
    VERDICT_ERROR,
    VERDICT_SKIPPED,
    replaced,
    without_statistics,
)
from rlx_nb.verdict.words import Cause


def compare(
    results: RunResults,
    *,
    tol_rel: float | None = None,
    rule: str = "budget",
    progress: bool = True,
    outputs: list[OutputContext] | None = None,
) -> list[OutputRecord]:
    """Compare every candidate's outputs with the oracle's; one record per (backend, output).

    A backend that failed gives one ``error`` record (``output`` is None); a backend without
    gradients (forward only, or its backward failed) gives one ``grad:*`` record for all of them.
    ``progress=False`` keeps its progress bar off.  ``outputs``: the output contexts of ``results`` built
    earlier (:func:`~rlx_nb.comparison.context.contexts`), their statistics computed once for every backend judged on them.

    Examples
    --------
    >>> import torch, rlx_nb
    >>> results = rlx_nb.run(torch.nn.Linear(4, 2), torch.ones(3, 4), backends=["cpu-nomkldnn"])
    >>> [r.verdict for r in compare(results, progress=False)]
    ['round-off']
    """
    check_rule(rule)
    outputs = outputs if outputs is not None else list(contexts(results))
    records: list[OutputRecord] = []
    with bar("rlx_nb compare", total=len(results.candidates) * len(outputs), unit="output", enabled=progress) as shown:
        for run in results.candidates.values():
            found = _compare_run(results, run, outputs, tol_rel=tol_rel, rule=rule, shown=shown)
            records += _records(results, found, {ctx.name: ctx for ctx in outputs})
    return records


def _compare_run(
    results: RunResults, run: BackendRun, outputs: list[OutputContext], *, tol_rel: float | None, rule: str, shown: Any
) -> list[Finding]:
    # What the comparators find on every output of one backend.
    if run.status != OK:  # (skipped: the run did not fit in memory)
        status = VERDICT_SKIPPED if run.status == SKIPPED else VERDICT_ERROR
        return [_plain(run, (None, -1, "forward"), status, run.message)]
    out: list[Finding] = []
    for ctx in outputs:
        shown.update()
        if ctx.kind == "grad" and run.grad_status != OK:
            # No gradients at all (a forward-only backend, or its backward failed): one record for all of
            # them, so the backend's judged outputs are its forward outputs, counted once.
            if not any(r.kind == "grad" for r in out):
                grads = sum(1 for n in results.oracle.outputs if n.startswith(GRAD_PREFIX))
                why = f"{run.grad_message}: its {grads} gradient output(s) are not compared"
                status = VERDICT_SKIPPED if run.grad_status == SKIPPED else VERDICT_ERROR
                out.append(_plain(run, (GRAD_PREFIX + "*", ctx.index, "grad"), status, why))
            continue
        flips = flips_of(results, run.backend, ctx.name) if results.discrete else None
        out.append(compare_output(
            ctx, Candidate(run.backend, run.compute_dtype, run.outputs.get(ctx.name), rule, tol_rel, flips)
        ))  # fmt: skip
    extra = [n for n in run.outputs if n not in results.oracle.outputs]
    if extra:
        why = f"outputs the oracle does not have: {', '.join(extra[:5])}"
        out.append(_plain(run, (extra[0], len(results.oracle.outputs), "forward"), SUSPECT, why, Cause.STRUCTURE))
    return out


def _records(results: RunResults, found: list[Finding], contexts_: dict[str, OutputContext]) -> list[OutputRecord]:
    # Each record of one backend made once: what only all its outputs tell (a uniformly less accurate arithmetic),
    # then the model's own nondeterminism, then the call's notes and the words.
    unstable = results.environment.get("nondeterministic") or {}
    ops = results.environment.get("matmul_ops")
    less = _less_accurate(found, (ops or {}).get("convolution", 0))
    records = []
    for f in found:
        j, notes = f.judgement, []
        if less:
            j = verdict.read_less_accurate(j)
        if f.output in unstable and j.verdict not in (VERDICT_ERROR, VERDICT_SKIPPED):
            j = replaced(j, verdict=NONDETERMINISTIC, cause=Cause.NONDETERMINISTIC, nondeterminism=unstable[f.output])
        ctx = contexts_.get(f.output)
        if ctx is not None and ctx.anchors_left_out and j.rules.verdict_budget is not None:
            notes.append(ctx.anchors_left_out)
        if results.reference.status != OK and j.rules.verdict_budget is None and f.notes:
            notes.append(f"the fp64 reference did not run ({results.reference.message}), so the fixed rule decides")
        records.append(f.record(j, reasons.reason(dataclasses.replace(f, judgement=j), ops), notes))
    return records


def _less_accurate(found: list[Finding], convolutions: int) -> bool:
    # Whether a backend reads as a uniformly less accurate arithmetic: every SUSPECT output of it does.  That is a
    # fast convolution algorithm (Winograd, FFT: NNPACK): on a model without convolutions no legitimate fp32 kernel is
    # known to read so (a reduced precision reads as one).
    suspects = [f for f in found if f.judgement.verdict == SUSPECT]
    return bool(suspects and convolutions) and all(
        looks_less_accurate(f.judgement, f.compute_dtype, f.kind, f.numel) for f in suspects
    )


def judge_leaf(oracle: Leaf, got: Leaf | None, reference: Leaf | None, *, backend: str, output: str,
               compute_dtype: str = "float32") -> OutputRecord:  # fmt: skip
    """One forward output judged on its own (no sequential run, no anchors): a module's, in :mod:`rlx_nb.localize`."""
    ctx = OutputContext(output, 0, oracle, reference, None, {})
    found = compare_output(ctx, Candidate(backend, compute_dtype, got))
    return found.record(found.judgement, reasons.reason(found))


def failed(backend: str, why: str) -> OutputRecord:
    """The record of a backend that could not run (an ``error`` row saying why)."""
    j = without_statistics(VERDICT_ERROR, Cause.ERROR, why)
    return OutputRecord(backend, None, -1, "forward", "float32", j, PairFields(), reason=why)


def _plain(run: BackendRun, where: tuple[str | None, int, str], status: str, why: str, cause: str = "") -> Finding:
    # Found without statistics: the backend failed, was skipped, or gave outputs the oracle has not.
    # ``where``: (output, its index, kind).
    return Finding(run.backend, *where, run.compute_dtype, without_statistics(status, cause or status, why))


__all__: Sequence[str] = ["compare", "failed", "judge_leaf"]
