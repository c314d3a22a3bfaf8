"""OpenVINO (CPU plugin), an optional extra: ``openvino`` with the f32 precision hint, ``openvino-default``
with the plugin's own defaults — which on CPUs with bfloat16 support run bfloat16 (measured on this
kind of machine: max_abs 3.1e-3, ~9,400x the fp32 round-off on an MLP).
"""

from __future__ import annotations

import contextlib
import importlib.util
import re
from collections.abc import Iterator
from typing import Any

import torch

from rlx_nb._support import meter as phases
from rlx_nb._support.copies import release_private_weights
from rlx_nb._support.held import Held
from rlx_nb._support.quiet import quiet
from rlx_nb.backends.base import Backend
from rlx_nb.backends.notes import add_note
from rlx_nb.backends.onnx import _FlatOutputs, attempt, exported
from rlx_nb.errors import InputError, still_interrupted
from rlx_nb.numerics import formats


def openvino_reason() -> str | None:
    if importlib.util.find_spec("openvino") is None:
        return "not installed: openvino (pip install 'rlx_nb[openvino]')"
    return None


_TELEMETRY = Held()


@contextlib.contextmanager
def telemetry_declined() -> Iterator[None]:
    """OpenVINO's usage telemetry sends nothing while this runs; it is as OpenVINO has it before and after.

    By default (no consent file: ``opt_in_out --opt_out`` never run) each ``convert_model`` sends events to Google
    Analytics, and on Linux each event forks the whole process to post it: 1.6 s of CPU a conversion with a 2 GB
    process, measured, where the conversion itself took 0.08 s.  rlx_nb converts a model per backend, and a module
    at a time when it localizes: those conversions are its own, not the user's, and send nothing.  (The sender is
    held back, not the consent: OpenVINO checks that once a process, and a conversion the user makes outside
    rlx_nb sends what it would have.)"""
    try:
        from openvino_telemetry.utils.sender import TelemetrySender
    except ImportError:  # (no telemetry package: OpenVINO uses its stub, which sends nothing)
        yield
        return
    with _TELEMETRY.replaced(lambda: [(TelemetrySender, "send", lambda self, backend, message: None)]):
        yield


def openvino_module() -> Any:
    """``import openvino``, its import's telemetry event held back (:func:`telemetry_declined`)."""
    with telemetry_declined():
        import openvino

    return openvino


def convert_model(ov: Any, model: Any, **kwargs: Any) -> Any:
    """``ov.convert_model(model, **kwargs)``, sending none of OpenVINO's telemetry (:func:`telemetry_declined`)."""
    with telemetry_declined():
        return ov.convert_model(model, **kwargs)


def _prepare(model: Any, inputs: tuple, config: dict[str, str]) -> Any:
    ov = openvino_module()

    for i, x in enumerate(inputs):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"OpenVINO conversion needs tensor inputs; input {i} is {type(x).__name__}")
    wrapper = _FlatOutputs(model)
    wrapper.record(tuple(inputs))
    with torch.no_grad():
        converted = _convert(ov, wrapper, inputs)
    with phases.step("openvino: compile"):
        compiled = ov.Core().compile_model(converted, "CPU", config)
    del converted  # (a model read from the ONNX file maps its weights: unmapped now, the compiled model has its own)
    unflatten = wrapper.rebuild(len(compiled.outputs), "OpenVINO's converted model")

    def runner(xs: tuple) -> Any:
        result = compiled([x.detach().cpu().numpy() for x in xs])
        return unflatten([torch.from_numpy(result[out].copy()) for out in compiled.outputs])

    return runner


def _convert(ov: Any, wrapper: _FlatOutputs, inputs: tuple) -> Any:
    # Two routes: OpenVINO's own PyTorch frontend, and, where it cannot convert the model, the ONNX
    # export read by OpenVINO's ONNX frontend.  The run's notes say which one ran.
    from rlx_nb.errors import describe_error

    converted, first = _direct(ov, wrapper, inputs)
    if converted is not None:
        add_note("OpenVINO: converted directly from PyTorch (ov.convert_model)")
        return converted
    try:
        names = [f"input_{i}" for i in range(len(inputs))]
        onnx_file = exported(wrapper, tuple(inputs), names)  # (the run's ONNX export, if ONNX Runtime made one)
        # From here OpenVINO works from the file: the weights in torch are not needed while it converts and
        # compiles (at 1.1B parameters that is 4.4 GB of the peak); the run rebuilds them if it needs them again.
        release_private_weights(wrapper.model)
        with quiet(), phases.step("openvino: conversion of the ONNX export"):
            # read_model maps the weights from the file rather than copying them (convert_model held two
            # copies of a 1.1B model's weights here): the same ONNX frontend, the weights' pages shared.
            converted = ov.Core().read_model(str(onnx_file.path))
    except Exception as second:
        still_interrupted(second)
        raise RuntimeError(
            f"OpenVINO could not convert the model by either route: directly: {first}; "
            f"through the ONNX export: {describe_error(second)}"
        ) from None
    add_note(
        f"OpenVINO: converted through the ONNX export (core.read_model), because the direct conversion failed: {first}"
    )
    return converted


def _direct(ov: Any, wrapper: _FlatOutputs, inputs: tuple) -> tuple[Any, str]:
    # (the converted model, "") or (None, why not).  A function of its own, so nothing of a failed attempt
    # (its traceback's frames) still holds the weights when the ONNX route starts.
    from rlx_nb.errors import describe_error

    try:
        with quiet(), phases.step("openvino: direct conversion"):
            return attempt(wrapper, lambda w: convert_model(ov, w, example_input=tuple(inputs))), ""
    except Exception as exc:
        still_interrupted(exc)
        return None, describe_error(exc)


def prepare_openvino_f32(model: Any, inputs: tuple) -> Any:
    """Convert and compile for the OpenVINO CPU plugin with ``INFERENCE_PRECISION_HINT=f32``."""
    return _prepare(model, inputs, {"INFERENCE_PRECISION_HINT": "f32"})


def prepare_openvino_default(model: Any, inputs: tuple) -> Any:
    """Convert and compile for the OpenVINO CPU plugin with its own default settings."""
    return _prepare(model, inputs, {})


def run_openvino_f32(model: Any, inputs: tuple) -> Any:
    """OpenVINO CPU plugin with ``INFERENCE_PRECISION_HINT=f32``: a true fp32 backend."""
    return prepare_openvino_f32(model, inputs)(inputs)


def run_openvino_default(model: Any, inputs: tuple) -> Any:
    """OpenVINO CPU plugin with its own default settings (whatever precision it picks on this CPU)."""
    return prepare_openvino_default(model, inputs)(inputs)


BACKENDS = [
    Backend(
        "openvino",
        run_openvino_f32,
        prepare=prepare_openvino_f32,
        differentiable=False,
        probe=openvino_reason,
        builtin=True,
        description="OpenVINO CPU plugin, INFERENCE_PRECISION_HINT=f32 (forward only)",
    ),
    Backend(
        "openvino-default",
        run_openvino_default,
        prepare=prepare_openvino_default,
        differentiable=False,
        probe=openvino_reason,
        default=False,
        builtin=True,
        description="OpenVINO CPU plugin with its default settings, judged as the fp32 it claims",
    ),
]


def openvino_default_precision() -> str:
    """The inference precision the CPU plugin picks by default on this machine (``f32``, ``bf16``, ...)."""
    ov = openvino_module()

    model = torch.nn.Linear(4, 4).eval()
    with quiet():
        converted = convert_model(ov, model, example_input=(torch.zeros(1, 4),))
    compiled = ov.Core().compile_model(converted, "CPU", {})
    name = str(compiled.get_property("INFERENCE_PRECISION_HINT")).lower().replace("<type: '", "").rstrip("'>")
    # OpenVINO names its element types both ways ("bf16" in hints, "bfloat16" in a Type's str): its short way.
    try:
        f = formats.get(name)
    except InputError:
        return name
    return next((a for a in (f.short, *f.aliases) if re.fullmatch(r"b?f\d+", a)), f.short)
