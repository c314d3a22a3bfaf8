"""ONNX Runtime: export with ``torch.onnx.export``, run on ORT's CPU provider (forward only)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import sys
import tempfile
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from rlx_nb.backends.base import Backend
from rlx_nb.tree import flatten


def onnxruntime_reason() -> str | None:
    missing = [m for m in ("onnxruntime", "onnx") if importlib.util.find_spec(m) is None]
    if missing:
        return f"not installed: {' '.join(missing)} (pip install 'rlx_nb[onnx]')"
    return None


class _FlatOutputs(torch.nn.Module):
    # Export needs a flat tuple of tensors; remember the names and the
    # non-tensor leaves so the structure can be rebuilt after ORT runs.
    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model
        self.leaves: list[tuple[str, Any]] = []

    def forward(self, *args: Any) -> tuple:
        self.leaves = flatten(self.model(*args))
        return tuple(v for _, v in self.leaves if isinstance(v, torch.Tensor))


def _unflatten(leaves: list[tuple[str, Any]], tensors: list[torch.Tensor]) -> dict[str, Any]:
    it = iter(tensors)
    return {name: next(it) if isinstance(v, torch.Tensor) else v for name, v in leaves}


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    # The exporters print graphs, progress and warnings from Python and C++;
    # send file descriptors 1 and 2 to a scratch file while they run.
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile() as sink:
        try:
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


def _export(wrapper: torch.nn.Module, inputs: tuple, names: list[str]) -> io.BytesIO:
    """TorchScript exporter first (fast), then the dynamo exporter; the first error is kept if both fail."""
    buf = io.BytesIO()
    with _quiet():
        try:
            torch.onnx.export(wrapper, inputs, buf, dynamo=False, input_names=names)
            return buf
        except Exception as first:
            legacy_error = first
        buf = io.BytesIO()
        try:
            torch.onnx.export(wrapper, inputs, buf, dynamo=True, input_names=names, verbose=False)
            return buf
        except Exception as second:
            raise RuntimeError(
                f"ONNX export failed: dynamo exporter: {type(second).__name__}: {str(second).splitlines()[0]}; "
                f"TorchScript exporter: {type(legacy_error).__name__}: {str(legacy_error).splitlines()[0]}"
            ) from None


def prepare_onnxruntime(model: Any, inputs: tuple) -> Any:
    """Export to ONNX (TorchScript exporter, falling back to the dynamo one) and open an ORT session.

    Returns ``runner(inputs)``, which runs the session on new inputs of the same shapes and returns a
    dict of named leaves in the same order and with the same names as the model's own outputs flatten
    to, so it compares one to one.
    """
    import onnxruntime as ort

    for i, x in enumerate(inputs):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"ONNX export needs tensor inputs; input {i} is {type(x).__name__}")
    wrapper = _FlatOutputs(model)
    names = [f"input_{i}" for i in range(len(inputs))]
    buf = _export(wrapper, tuple(inputs), names)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(buf.getvalue(), options, providers=["CPUExecutionProvider"])
    leaves = list(wrapper.leaves)
    wanted = [i.name for i in session.get_inputs()]

    def runner(xs: tuple) -> Any:
        by_name = dict(zip(names, xs, strict=True))
        results = session.run(None, {n: by_name[n].detach().cpu().numpy() for n in wanted})
        return _unflatten(leaves, [torch.from_numpy(r) for r in results])

    return runner


def run_onnxruntime(model: Any, inputs: tuple) -> Any:
    """Export to ONNX and run with ORT once; see :func:`prepare_onnxruntime`."""
    return prepare_onnxruntime(model, inputs)(inputs)


BACKENDS = [
    Backend(
        "onnxruntime",
        run_onnxruntime,
        prepare=prepare_onnxruntime,
        differentiable=False,
        probe=onnxruntime_reason,
        description="torch.onnx.export + ONNX Runtime CPU provider (forward only)",
        builtin=True,
    ),
]
