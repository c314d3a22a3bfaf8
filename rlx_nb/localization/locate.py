"""Localize: from a suspect output down to the module and the operator that introduced the error.

How
---
1. Run the model eagerly on the oracle with hooks and capture every module's
   inputs (first call), in execution order.
2. **Local error**: run one module alone on the candidate backend, fed the
   oracle's captured inputs, and judge its outputs with the engine's verdict
   (oracle vs backend vs a float64 run of the same module on the same
   inputs).  It is what this module introduces.
3. **Hierarchical descent**: check the top-level children first and descend
   only into those beyond budget, so the number of backend preparations
   (compiles, exports) grows with depth, not with the number of modules.
4. **Culprit**: the first suspect module (in execution order) none of whose
   children is suspect.  Below it, the torch functions its forward calls
   are recorded and each is checked alone the same way, so ``F.softmax``
   inside an attention block can be named.
5. **Propagated error**: where the backend runs the model eagerly (hooks
   fire), each module's output in the full run is compared too; the
   amplification is propagated over local.
6. ``backward=True`` judges each module's backward instead (gradients of its
   parameters and inputs for a fixed random cotangent).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Any

import torch

from rlx_nb._support import switches
from rlx_nb._support.progress import bar
from rlx_nb.backends.base import ORACLE, REFERENCE
from rlx_nb.backends.registry import get_backend, lent
from rlx_nb.errors import InputError
from rlx_nb.execution.prepare import normalize_inputs, prepare_model
from rlx_nb.execution.source import WeakSource
from rlx_nb.localization.capture import capture_calls
from rlx_nb.localization.result import Found, Localization
from rlx_nb.localization.search import State, descend, user_name
from rlx_nb.verdict.types import SUSPECT, VERDICT_ERROR


def localize(
    model: Any,
    inputs: Any,
    *,
    backend: str,
    params: dict[str, torch.Tensor] | None = None,
    backward: bool = False,
    ops: bool = True,
    propagated: bool = True,
    keep_arrays: str = "auto",
) -> Localization:
    """Find the module (and the torch function) where ``backend``'s error is born.

    Parameters
    ----------
    model, inputs, params
        As for :func:`rlx_nb.backend_divergence`.
    backend : str
        The candidate backend to localize (registered, compiled or eager).
    backward : bool
        Judge each module's backward instead of its forward.
    ops : bool
        Below the culprit module, check each torch function it calls.
    propagated : bool
        Also compare each module's output in a full run on the backend, where
        the backend runs eagerly (hooks fire); ignored otherwise.
    keep_arrays : {"auto", "all"}
        Which checked modules keep their (oracle, backend, fp64) arrays for
        :meth:`Localization.arrays` and heatmaps: ``"all"``, or ``"auto"``
        (default): every SUSPECT one, and round-off ones whose arrays take at
        most :data:`KEEP_ARRAYS_BYTES` (so localizing LLM-sized activations does
        not hold every module's outputs three times over).

    Examples
    --------
    >>> from rlx_nb import localize
    >>> from rlx_nb.models import demo
    >>> model, inputs = demo.layered(fault_layer=1)
    >>> loc = localize(model, inputs, backend="fault:softmax-row")
    >>> loc.culprit
    'blocks.1.attn :: F.softmax'
    """
    if keep_arrays not in ("auto", "all"):
        raise InputError(f"keep_arrays must be 'auto' or 'all', got {keep_arrays!r}")
    cand = get_backend(backend)
    if backend in (ORACLE, REFERENCE):
        raise InputError(f"{backend!r} is the {'oracle' if backend == ORACLE else 'reference'}; localize a candidate")
    reason = cand.unavailable_reason()
    if reason:
        raise InputError(f"backend {backend!r} is not available here: {reason}")
    if backward and not cand.differentiable:
        raise InputError(f"backend {backend!r} cannot differentiate, so its backward cannot be localized")
    # One rlx_nb run at a time, every switch restored (rlx_nb._support.switches): the search runs the backend directly.
    with switches.exclusive():
        args, keys = normalize_inputs(inputs)
        base = prepare_model(model, params, keys)
        calls = capture_calls(base, args)
        named = dict(base.named_modules())
        state = State(backend, backward, calls, named)
        state.keep_arrays = keep_arrays
        state.shown = bar(f"rlx_nb localize {backend}", unit="check")
        try:
            culprit, culprit_op, repro = descend(state, calls, ops, base, args)
            if propagated and not backward and not state.full_run:
                state.shown.set_postfix_str("propagated error (full run)")
                state.propagate(base, args)
        finally:
            state.shown.close()
    modules = [row for row in state.rows if row["kind"] == "module" and row["verdict"] != VERDICT_ERROR]
    everywhere = len(modules) >= 2 and all(row["verdict"] == SUSPECT for row in modules)
    if everywhere:  # no one module is where the error is born: naming the first would mislead
        culprit = culprit_op = repro = None
    found = Found(
        state.rows,
        user_name(culprit, keys) if culprit is not None else None,
        culprit_op,
        state.preparations,
        culprit=repro,
        checks=state.checks,
        full_run=state.full_run,
        everywhere=everywhere,
        source=WeakSource(model, inputs, params),
    )
    loc = Localization(backend, backward, found)
    failed = loc.errors
    if len(failed):
        warnings.warn(
            f"rlx_nb.localize: {len(failed)} of {len(loc.frame)} checks of {backend!r} failed to run "
            f"({failed.reason.iloc[0]}); they are not judged -- see loc.errors",
            RuntimeWarning,
            stacklevel=2,
        )
    if state.full_run:
        warnings.warn(
            f"rlx_nb.localize: {backend!r} cannot run the model's modules alone ({state.full_run}); the search "
            "watched full runs instead, so errors are propagated ones, not each module's own",
            RuntimeWarning,
            stacklevel=2,
        )
    return loc


def localize_report(
    report: Any,
    backend: str | None = None,
    *,
    model: Any = None,
    inputs: Any = None,
    params: Any = None,
    backward: bool | None = None,
    **kwargs: Any,
) -> Localization:
    """:func:`localize` the model a report was made from (``report.localize``): ``backend`` defaults to the
    report's first suspect; ``model``, ``inputs`` and ``params`` to those the report holds weakly; ``backward``
    to whether the backend's worst output is a gradient."""
    if model is None or inputs is None:
        held = report.source.get() if report.source is not None else None
        if held is None:
            why = "it was loaded or merged" if report.source is None else "they are no longer alive"
            raise InputError(
                f"this report does not hold its model and inputs ({why}): "
                "pass them, report.localize(backend, model=model, inputs=inputs)"
            )
        model, inputs, params = held if params is None else (*held[:2], params)
    if backend is None:
        if not report.suspects:
            ran = report.worst  # (the backends that produced outputs, worst first)
            example = f"report.localize({ran[0]!r})" if ran else "report.localize(backend), a backend that ran"
            raise InputError(f"no SUSPECT backend to localize (every backend that ran is round-off); name one to "
                             f"localize anyway: {example}")  # fmt: skip
        backend = report.suspects[0]
    if backward is None:
        backward = (report.record(backend).output or "").startswith("grad:")
    given = getattr(report, "backend_objects", {}).get(backend)
    with lent(given) if given is not None else contextlib.nullcontext():  # (a Backend object passed unregistered)
        loc = localize(model, inputs, backend=backend, params=params, backward=backward, **kwargs)
    loc.report = weakref.ref(report)  # (its repro is kept on the report too: report.issue reuses it)
    return loc


__all__ = ["localize", "localize_report"]
