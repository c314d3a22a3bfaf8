"""One step judged on its own: from the oracle's exact state at that step, the backend's step against float64's.

A trajectory that drifts says nothing of where the drift is born: round-off amplified by chaos grows as fast as a
bug's error does.  A *local step* starts the backend from the oracle's state at step ``t`` (parameters, buffers,
the optimizer's state, the step's random numbers and batch) and runs one step; the oracle runs it in float32 and the
reference in float64 from the same state.  What each produced is compared as a report's outputs are, on the
verdict's one scale: the loss (forward), the buffers (what the forward updates: BatchNorm's running statistics), each
parameter's gradient (backward) and each parameter after the update (the optimizer).  The first of those phases with
an output past the line is where the step's error is born; a step within round-off everywhere is round-off, however
far its trajectory has drifted.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from rlx_nb.backends.base import ORACLE, REFERENCE
from rlx_nb.backends.eager import float64_default
from rlx_nb.backends.float64_kernels import float64_kernels
from rlx_nb.comparison.compare import compare
from rlx_nb.errors import describe_error, still_interrupted
from rlx_nb.execution.prepare import trim
from rlx_nb.execution.results import ERROR, OK, BackendRun, RunResults, to_leaf
from rlx_nb.report.report import DivergenceReport
from rlx_nb.training.backends import TrainBackend
from rlx_nb.training.reference import PiecewiseUpdate
from rlx_nb.training.step import Spec, State, grad_norm, to_dtype
from rlx_nb.verdict.types import SUSPECT

PHASES = ("forward", "buffers", "backward", "optimizer")
"""The phases of a step in the order they run, and the outputs each gives: ``loss``, ``buffer:<name>``,
``grad:<name>``, ``param:<name>``."""
_PREFIX = {"loss": "forward", "buffer:": "buffers", "grad:": "backward", "param:": "optimizer"}


def phase_of(output: str | None) -> str:
    """The phase a local step's output belongs to (module docstring)."""
    for prefix, phase in _PREFIX.items():
        if (output or "").startswith(prefix):
            return phase
    return "forward"


class GradsWritten(Exception):
    """A step's optimizer wrote into the gradients it was given: the gradients a step kept without copying them are
    not the backward's any more (:func:`one_step` ``copy_grads``).  ``loss`` and ``norm``: the step's own figures."""

    def __init__(self, step: int, loss: float, norm: float) -> None:
        super().__init__(f"step {step}: the optimizer wrote into the gradients")
        self.loss, self.norm = loss, norm


def one_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, spec: Spec, step: int, batch: Any, *,
    backend: TrainBackend | None = None, tensor_step: bool = False, keep: bool = True, copy_grads: bool = False,
) -> tuple[float, float, dict[str, torch.Tensor]]:  # fmt: skip
    """One training step, in place: ``(loss, gradient norm, outputs)`` where the outputs are the loss, the buffers
    after the forward, the gradients and the parameters after the update (the names :data:`PHASES` gives them).
    ``tensor_step``: the optimizer is :func:`tensor_scalars`'s (its update runs with the parameters' ``requires_grad``
    off, as that implementation's in-place update needs outside autograd).  ``keep=False``: the loss and the gradient
    norm only (a trajectory's step: no copy of the buffers, gradients and parameters).  With ``keep``, ``model`` must be
    one the caller lets go after the step (the judge's copy) or steps no further before it is done with them: the
    parameters and gradients returned are its own.  The gradients are taken, not copied, unless ``copy_grads``; an
    optimizer that writes into them raises :class:`GradsWritten` after its step (run the step again with
    ``copy_grads``)."""
    if backend is not None and backend.ranks:
        from rlx_nb.training.ddp import ranks_step

        return ranks_step(backend.name, model, optimizer, spec, step=step, batch=batch, keep=keep)
    spec.seeded(step)
    model.train()
    plain = getattr(model, "_orig_mod", model)  # (a compiled model's names are its original's)
    optimizer.zero_grad(set_to_none=True)
    outputs: dict[str, torch.Tensor] = {}
    with backend.around() if backend is not None else _nothing():
        loss = backend.loss(model, spec, batch) if backend is not None else spec.loss(model, batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise TypeError(f"the loss must be one number (a 0-d tensor); loss_fn gave {got}")
        outputs["loss"] = loss.detach().reshape(())
        for name, b in plain.named_buffers() if keep else ():
            if b.is_floating_point():
                outputs[f"buffer:{name}"] = b.detach().clone()
        loss.backward()
        norm = grad_norm(plain)
        taken = []  # (each gradient and its version: an optimizer that writes into it is seen after its step)
        for name, p in plain.named_parameters() if keep else ():
            if p.grad is not None:
                g = p.grad.detach()
                outputs[f"grad:{name}"] = g.clone() if copy_grads else g
                taken.append((g, g._version))
        if backend is not None:
            backend.optimizer_step(optimizer)
        elif tensor_step:
            trained = [p for p in plain.parameters() if p.requires_grad]
            try:
                for p in trained:
                    p.requires_grad_(False)
                optimizer.step()
            finally:
                for p in trained:
                    p.requires_grad_(True)
        else:
            optimizer.step()
    # (the parameters after the update are taken, not copied: a kept step's model is the judge's own copy, let go
    # once the step is done -- a copy held the parameters twice, the float64 reference's 8 bytes an element)
    for name, p in plain.named_parameters() if keep else ():
        outputs[f"param:{name}"] = p.detach()
    if not copy_grads and any(g._version != v for g, v in taken):
        raise GradsWritten(step, float(outputs["loss"]), norm)
    return float(outputs["loss"]), norm, outputs


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _run(name: str, go: Any, dtype: str) -> BackendRun:
    trim()  # (what the runs and steps before let go goes back to the system before this one's state is made)
    start = time.perf_counter()
    try:
        outputs = go()
    except Exception as exc:
        still_interrupted(exc)
        return BackendRun(name, ERROR, {}, describe_error(exc), time.perf_counter() - start, compute_dtype=dtype)
    # (the outputs are the step's own copies (:func:`one_step`): the leaves share them, no second copy)
    leaves = {
        k: to_leaf(v.float() if v.dtype == torch.float64 and name != REFERENCE else v) for k, v in outputs.items()
    }
    return BackendRun(name, OK, leaves, "", time.perf_counter() - start, grad_status=OK, compute_dtype=dtype)


def judge_step(state: State, spec: Spec, step: int, batch: Any, *, backends: list[TrainBackend], label: str,
               oracle: Callable[[], dict[str, torch.Tensor]] | None = None) -> DivergenceReport:  # fmt: skip
    """The local step ``step`` of each backend from ``state`` (module docstring), as one report whose candidates are
    the backends and whose outputs are the step's loss, buffers, gradients and updated parameters.

    ``oracle``: the oracle's own step from ``state`` (a live model's: the trajectory's step itself, no copy of it),
    run last, once every other run has started from ``state``; by default the oracle's step from a copy."""

    def own() -> dict[str, torch.Tensor]:
        return _retried(lambda copy_grads: one_step(*state.start(spec), spec, step, batch, copy_grads=copy_grads))

    def reference() -> dict[str, torch.Tensor]:
        def go(copy_grads: bool) -> tuple:
            with float64_default(), float64_kernels():
                model, opt = state.start(spec, dtype=torch.float64, load=not spec.elementwise)
                opt = for_loop(opt)
                if spec.elementwise:  # (each parameter's state converted as the update comes to it)
                    opt = PiecewiseUpdate(opt, state.optimizer)
                return one_step(model, opt, spec, step, to_dtype(batch, torch.float64), copy_grads=copy_grads)

        return _retried(go)

    def on(b: TrainBackend) -> dict[str, torch.Tensor]:
        def go(copy_grads: bool) -> tuple:
            model, opt = state.start(spec, make=lambda params: b.make_optimizer(spec.optimizer, params))
            return one_step(b.prepared(model), opt, spec, step, batch, backend=b, copy_grads=copy_grads)

        return _retried(go)

    def alternative() -> dict[str, torch.Tensor]:
        from rlx_nb.backends.sequential import SequentialSums

        def go(copy_grads: bool) -> tuple:
            model, opt = state.start(spec)
            with SequentialSums():
                return one_step(model, opt, spec, step, batch, tensor_step=tensor_scalars(opt), copy_grads=copy_grads)

        return _retried(go)

    # Each run holds the outputs of the runs before it, so the largest runs go first.  The float64 reference's is the
    # largest, unless its update runs a piece at a time: then the float32 runs' (their whole optimizer state and the
    # update's temporaries) are, and it comes after them.  The oracle's own step is always last.
    exact = None if spec.elementwise else _run(REFERENCE, reference, "float64")
    candidates = {b.name: _run(b.name, lambda b=b: on(b), b.compute_dtype) for b in backends}
    second = _run("sequential", alternative, "float32")
    if exact is None:
        exact = _run(REFERENCE, reference, "float64")
    base = _run(ORACLE, oracle or own, "float32")
    results = RunResults(label=f"{label}, step {step}", oracle=base, reference=exact, candidates=candidates,
                         backward=False, environment={"training_step": step},
                         sequential=second if second.status == OK else None)  # fmt: skip
    return DivergenceReport(results, compare(results, progress=False), rule="budget", tol_rel=None)


def _retried(go: Callable[[bool], tuple]) -> dict[str, torch.Tensor]:
    # A step from a copy of the state keeps its gradients without copying them, and runs again copying them where its
    # optimizer wrote into them (:class:`GradsWritten`).
    try:
        return go(False)[2]
    except GradsWritten:
        return go(True)[2]


def for_loop(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``optimizer`` switched, in place, to its for-loop implementation where it has one: the float64 reference's
    update (the same arithmetic, one parameter's temporaries at a time instead of every parameter's at once)."""
    for g in optimizer.param_groups:
        if "foreach" in g:
            g["foreach"] = False
        if g.get("fused"):
            g["fused"] = None
    return optimizer


def tensor_scalars(optimizer: torch.optim.Optimizer) -> bool:
    """``optimizer`` switched, in place, to its implementation that computes its scalars from the step as float32
    tensors (``differentiable``: the arithmetic of ``capturable`` and of a compiled step, where ``1 - beta2 ** t`` in
    float32 is off by float32's unit round-off over ``1 - beta2 ** t``, 1e-5 of Adam's update at its first steps,
    while the eager for-loop computes it in Python's float64).  False: it has no such implementation.  With the step's
    sums in another order, the local step's second legitimate run."""
    groups = optimizer.param_groups
    if not groups or any("differentiable" not in g for g in groups):
        return False
    for g in groups:
        g["differentiable"] = True
        if "foreach" in g:
            g["foreach"] = False
        if "fused" in g:
            g["fused"] = None
    return True


def verdict_of(report: DivergenceReport, backend: str) -> dict[str, Any]:
    """A local step's reading for ``backend``: its verdict, its worst output's place on the line, the phase the step's
    error is born in (the first with an output past the line, else the worst's), and why."""
    exact = report.results.reference
    if exact is None or exact.status != OK:  # (judged without it, a step would read against a tolerance: no verdict)
        why = exact.message if exact is not None else "did not run"
        return {"verdict": "error", "line": math.nan, "phase": "", "output": "",
                "reason": f"the step's float64 reference failed: {why}"}  # fmt: skip
    recs = [r for r in report.records if r.backend == backend]
    if not recs or all(r.output is None for r in recs):
        why = recs[0].reason if recs else "did not run"
        return {"verdict": "error", "line": math.nan, "phase": "", "output": "", "reason": why}
    worst = max((r for r in recs if r.output is not None), key=lambda r: (r.verdict == SUSPECT, r.judgement.line))
    suspects = [r for r in recs if r.verdict == SUSPECT and r.output is not None]
    born = min(suspects, key=lambda r: PHASES.index(phase_of(r.output))) if suspects else worst
    return {"verdict": worst.verdict, "line": float(worst.judgement.line), "phase": phase_of(born.output),
            "output": born.output or "", "reason": born.reason}  # fmt: skip


__all__ = ["PHASES", "GradsWritten", "for_loop", "judge_step", "one_step", "phase_of", "tensor_scalars", "verdict_of"]
