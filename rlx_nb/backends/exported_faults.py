"""Faults carried into an exported runtime: the model wrapped so that an exporter traces the faulty ops.

A catalogue fault (:mod:`rlx_nb.backends.faults`) swaps torch functions while the model runs eagerly; wrapped in
:class:`Faulty`, the swap happens inside the ``forward`` an exporter traces, so the converted graph holds the
faulty op and the runtime runs it: a fault caught *through* ExecuTorch, LiteRT or ONNX Runtime, as a bug in
their converters or kernels would be.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rlx_nb.backends.base import Backend
from rlx_nb.backends.faults import Fault, fault_backend


class Faulty(torch.nn.Module):
    """``model`` with a fault injected while it runs: what an exporter traces, so the fault is in its graph.

    The fault's torch functions are swapped inside ``forward`` (a :class:`SubstituteFunctions` mode entered
    there), so an exporter that runs the Python of ``forward`` (``torch.export``'s non-strict mode, the ONNX
    exporters, LiteRT's converter) records the faulty version of each op.  Module-output faults are not
    carried (their hooks are not entered while tracing a graph)."""

    def __init__(self, model: torch.nn.Module, run: Callable[[Any, tuple], Any], name: str) -> None:
        super().__init__()
        self.model, self.run = model, run
        self.export_key = name  # one export per fault (an exporter's cache keys the weights, shared here)

    def forward(self, *args: Any) -> Any:
        return self.run(self.model, args)


def fault_through(kind: str | Fault, runtime: Backend, severity: float | None = None) -> Backend:
    """A backend that converts and runs the model on ``runtime`` with fault ``kind`` in it (named
    ``<runtime>+<fault>``): a fault caught through an exported runtime, as a bug in a converter would be.

    Examples
    --------
    >>> from rlx_nb.backends.registry import get_backend
    >>> fault_through("fault:softmax-row", get_backend("onnxruntime")).name
    'onnxruntime+softmax-row'
    """
    inner = fault_backend(kind, severity)

    def fn(model: Any, inputs: tuple) -> Any:
        return runtime.fn(Faulty(model, inner.fn, inner.name), inputs)

    return Backend(
        f"{runtime.name}+{inner.name.removeprefix('fault:')}",
        fn,
        default=False,
        differentiable=False,
        probe=runtime.probe,
        description=f"{inner.description}, exported through {runtime.name}",
        carries=inner,
    )
