"""The culprit a localization found, alone: one op or one module on one backend, judged again at will.

Shrinking it, bisecting a compiler on it, telling which layer of a runtime gives its error and writing its
standalone repro each run it again, on other inputs or another backend, and ask the verdict: never a fixed
tolerance.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from rlx_nb.backends.base import Backend
from rlx_nb.comparison.compare import compare
from rlx_nb.errors import still_interrupted
from rlx_nb.execution.results import GRAD_PREFIX, RunResults
from rlx_nb.execution.run import run
from rlx_nb.localization.capture import inputs_requiring_grad
from rlx_nb.verdict.records import OutputRecord, worst_record
from rlx_nb.verdict.types import MAX_LIMIT, RMSE_LIMIT, SUSPECT


def judge_alone(
    adapter: torch.nn.Module, tensors: list[torch.Tensor], backend: str | Backend, backward: bool, **kw: Any
) -> tuple[OutputRecord, RunResults]:
    """Run one op or module (``adapter``, its tensors as inputs) on the oracle, fp64 and ``backend``, and judge it
    with the report's own verdict: the worst record (its gradients' with ``backward``, where it has any)."""
    inputs = tuple(inputs_requiring_grad(tensors)) if backward else tuple(tensors)
    results = run(adapter, inputs, backends=[backend], backward=backward, progress=False, **kw)
    records = compare(results, progress=False)
    if backward:
        grads = [r for r in records if (r.output or "").startswith(GRAD_PREFIX) or r.output is None]
        records = grads or records
    return worst_record(records), results


def crosses(record: OutputRecord) -> bool:
    """Whether the whole output's error is past the line on its own (its largest element or its RMS, or a NaN/Inf
    where fp64 has none), not only a slice's: what a standalone repro, which checks the whole output, can show."""
    j = record.judgement
    b = j.budget
    return b.ratio_max > MAX_LIMIT or b.ratio_rmse > RMSE_LIMIT or j.events.nonfinite_unexplained > 0


@dataclasses.dataclass(frozen=True)
class Culprit:
    """One op or module where a backend's error is born, with what it was fed in the oracle's run.

    ``adapter`` runs it with ``tensors`` as positional inputs (:class:`~rlx_nb.localization.capture.OpModule`,
    :class:`~rlx_nb.localization.capture.CallModule`); an op culprit also keeps its torch function and call
    template, so a repro can write the call as the model made it.
    """

    label: str
    backend: str
    backward: bool
    adapter: torch.nn.Module
    tensors: tuple[torch.Tensor, ...]
    func: Callable | None = None
    template: Any = None
    lent: Backend | None = None
    """The backend object the search judged through, kept: one a report was given unregistered runs it after."""
    root: str = ""
    """The model's class name: what ``<root>`` in the label stands for."""

    @property
    def kind(self) -> str:
        return "op" if self.func is not None else "module"

    @property
    def runs_on(self) -> str | Backend:
        return self.lent if self.lent is not None else self.backend

    def but(self, **changes: Any) -> Culprit:
        return dataclasses.replace(self, **changes)

    def judge(self, tensors: list[torch.Tensor] | None = None, backend: str | Backend | None = None) -> OutputRecord:
        """The verdict on the culprit alone (on ``tensors`` and ``backend`` if given)."""
        ts = list(self.tensors if tensors is None else tensors)
        return judge_alone(self.adapter, ts, backend or self.runs_on, self.backward, check_determinism=False)[0]

    def crossing(self, tensors: list[torch.Tensor] | None = None) -> OutputRecord | None:
        """Its record where it is SUSPECT with the whole output past the line (what a repro shows) on these inputs,
        else None."""
        try:
            record = self.judge(tensors)
        except Exception as _stop:  # (a shape the op refuses, a backend that cannot run this size: not a reproduction)
            still_interrupted(_stop)
            return None
        return record if record.verdict == SUSPECT and crosses(record) else None


__all__ = ["Culprit", "crosses", "judge_alone"]
