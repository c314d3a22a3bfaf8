"""LiteRT (TensorFlow Lite), an optional extra: ``litert_torch.convert`` -> a ``.tflite`` file -> LiteRT's interpreter.

``litert`` runs the file as a device would: its XNNPACK delegate takes what it can, the rest runs on the builtin
kernels.  ``litert-reference`` runs the same file on LiteRT's reference kernels (no delegate, no optimized
kernel).  One conversion serves both, so a delegate bug (only ``litert`` SUSPECT) is told from a converter bug
(both).  int64 inputs and outputs, which the converter cuts to int32, are said in the row.  Forward only; each
module of a localization is converted alone.  ``pip install 'rlx_nb[litert]'``.
"""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlx_nb._support import meter as phases
from rlx_nb._support.decomp_tables import cia_ops_kept
from rlx_nb._support.quiet import quiet, quiet_first
from rlx_nb.backends.base import Backend
from rlx_nb.backends.notes import add_note
from rlx_nb.backends.onnx import _FlatOutputs, _weights_key, attempt
from rlx_nb.errors import still_interrupted, with_root_cause

PIP = "pip install 'rlx_nb[litert]'"


def litert_reason() -> str | None:
    """None when the converter and the interpreter are importable, else why not and the pip line."""
    missing = [m for m in ("litert_torch", "ai_edge_litert") if importlib.util.find_spec(m) is None]
    if missing:
        return f"not installed: {' '.join(missing).replace('_', '-')} ({PIP})"
    return None


class Converted:
    """A ``.tflite`` file in a temporary directory, deleted after the run."""

    def __init__(self, directory: tempfile.TemporaryDirectory) -> None:
        self.directory = directory
        self.path = Path(directory.name) / "model.tflite"


_CONVERTED: dict[tuple, Converted] = {}


def forget_conversions() -> None:
    """Delete the run's ``.tflite`` files (at the end of every run)."""
    while _CONVERTED:
        _, found = _CONVERTED.popitem()
        found.directory.cleanup()


def converted(wrapper: _FlatOutputs, inputs: tuple) -> Converted:
    """The model converted once per run: ``litert`` and ``litert-reference`` read the same file."""
    key = _weights_key(wrapper.model, inputs)
    if key in _CONVERTED:
        return _CONVERTED[key]
    with quiet():  # (its import loads jax and TensorFlow's kernels, which log from C++)
        import litert_torch

    directory = tempfile.TemporaryDirectory(prefix="rlx_nb-litert-")
    try:
        with quiet(), torch.no_grad(), phases.step("litert: conversion"), cia_ops_kept():
            model = attempt(wrapper, lambda w: litert_torch.convert(w.eval(), inputs))
            model.export(str(Path(directory.name) / "model.tflite"))
    except Exception as exc:
        still_interrupted(exc)
        directory.cleanup()
        raise RuntimeError(f"LiteRT conversion failed: {with_root_cause(exc)}") from None
    done = Converted(directory)
    _CONVERTED[key] = done
    return done


def _prepare(model: Any, inputs: tuple, *, reference: bool) -> Any:
    label = "litert-reference" if reference else "litert"
    for i, x in enumerate(inputs):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"LiteRT conversion needs tensor inputs; input {i} is {type(x).__name__}")
    with quiet():
        from ai_edge_litert.interpreter import Interpreter, OpResolverType
    wrapper = _FlatOutputs(model)
    wrapper.record(tuple(inputs))
    found = converted(wrapper, tuple(inputs))
    kind = OpResolverType.BUILTIN_REF if reference else OpResolverType.AUTO
    with quiet(), phases.step("litert: interpreter"):
        interpreter = Interpreter(model_path=str(found.path), experimental_op_resolver_type=kind, num_threads=None)
        signature = interpreter.get_signature_runner()
    names = list(signature.get_input_details())
    wanted = {n: d["dtype"] for n, d in signature.get_input_details().items()}
    if len(names) != len(inputs):
        raise RuntimeError(f"the converted model takes {len(names)} input(s) where the model takes {len(inputs)}")
    outputs = sorted(signature.get_output_details(), key=_output_order)
    unflatten = wrapper.rebuild(len(outputs), f"{label}'s converted model")
    narrowed = [f"input {i}" for i, (x, n) in enumerate(zip(inputs, names, strict=True))
                if x.dtype == torch.int64 and wanted[n] != np.int64]  # fmt: skip
    if narrowed:
        add_note(f"{label}: the converter cut int64 to int32 for {', '.join(narrowed)} (values past 2^31 would wrap)")
    kept = (found, interpreter)  # the file and the interpreter live as long as the runner

    invoke = quiet_first(signature)  # (the delegate announces itself from C++ as it first runs)

    def runner(xs: tuple, _keep: tuple = kept) -> Any:
        feed = {n: x.detach().cpu().numpy().astype(wanted[n], copy=False) for n, x in zip(names, xs, strict=True)}
        result = invoke(**feed)
        return unflatten([torch.from_numpy(np.array(result[o])) for o in outputs])

    return runner


def _output_order(name: str) -> tuple[int, str]:
    # The converter names outputs output_0, output_1, ...: in the model's order.
    tail = name.rsplit("_", 1)[-1]
    return (int(tail), name) if tail.isdigit() else (1 << 30, name)


def prepare_litert(model: Any, inputs: tuple) -> Any:
    """Convert to ``.tflite`` and run on LiteRT's interpreter with its default XNNPACK delegate."""
    return _prepare(model, inputs, reference=False)


def prepare_litert_reference(model: Any, inputs: tuple) -> Any:
    """Convert to ``.tflite`` and run on LiteRT's reference kernels (no delegate)."""
    return _prepare(model, inputs, reference=True)


def run_litert(model: Any, inputs: tuple) -> Any:
    """LiteRT with its XNNPACK delegate, once; see :func:`prepare_litert`."""
    return prepare_litert(model, inputs)(inputs)


def run_litert_reference(model: Any, inputs: tuple) -> Any:
    """LiteRT on its reference kernels, once; see :func:`prepare_litert_reference`."""
    return prepare_litert_reference(model, inputs)(inputs)


BACKENDS = [
    Backend(
        "litert",
        run_litert,
        prepare=prepare_litert,
        differentiable=False,
        probe=litert_reason,
        default=False,
        builtin=True,
        description="litert_torch.convert + LiteRT interpreter, XNNPACK delegate (forward only)",
    ),
    Backend(
        "litert-reference",
        run_litert_reference,
        prepare=prepare_litert_reference,
        differentiable=False,
        probe=litert_reason,
        default=False,
        builtin=True,
        description="the same .tflite on LiteRT's reference kernels: tells a delegate bug from a converter bug",
    ),
]
