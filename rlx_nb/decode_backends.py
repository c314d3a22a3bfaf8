"""Backends for a decode (:class:`rlx_nb.decode.Decode`): which run it as they are, and which need its step.

Eager backends -- oneDNN off, reduced precision, faults, a user's registered backend, a device -- run the
whole decode as they run any model: the step loop runs under them, every step with their arithmetic.

A compiled backend must not compile the loop (it would unroll every step into one graph, a program nobody
runs): :func:`compiled_decode` compiles the model's step once, with dynamic shapes, and runs every step
through it.  Every step must run compiled code, or the run is an error (never silently eager).

Exported backends (ONNX Runtime, OpenVINO) need the step exported with the cache as inputs and outputs;
rlx_nb does not build that export yet, so they are ``skipped`` rows saying so (judge the prompt's forward
pass with :func:`rlx_nb.backend_divergence`, which exports the model as it is).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from rlx_nb.backends.base import Backend
from rlx_nb.backends.compiled import _ACCUMULATED_LIMIT, _ISOLATES, CountingInductor, NotCompiledError, _dynamo_counts
from rlx_nb.backends.eager import on_device
from rlx_nb.backends.notes import add_note
from rlx_nb.errors import NotApplicable

EXPORTED = ("onnxruntime", "openvino", "onnxruntime-cuda")
"""Backends that run an exported graph: no decode-step export with cache inputs and outputs yet."""


def for_generation(backend: Backend) -> Backend:
    """The form of ``backend`` that runs a :class:`~rlx_nb.decode.Decode`."""
    if backend.name in ("cpu-inductor", "cuda-inductor"):
        device = "cuda" if backend.name.startswith("cuda") else "cpu"
        return dataclasses.replace(backend, fn=compiled_decode(device), prepare=None)
    if backend.name in EXPORTED or backend.name.startswith("openvino"):
        return dataclasses.replace(backend, fn=_not_exported, prepare=None)
    return dataclasses.replace(backend, prepare=None)  # (a prepared runner would be kept for a single input)


def _not_exported(model: Any, inputs: tuple) -> Any:
    raise NotApplicable(
        "a decode needs its step exported with the cache as inputs and outputs, which rlx_nb does not build yet; "
        "judge the prompt's forward pass with backend_divergence(model, prompt), which exports the model as it is"
    )


def compiled_decode(device: str = "cpu"):
    """``fn(decode, inputs)``: compile ``decode.model``'s step once (Inductor, dynamic shapes, an isolated cache
    region) and run every step of the decode through it; a step that runs no compiled code raises."""

    def fn(decode: Any, inputs: tuple) -> Any:
        if device != "cpu":
            decode.to(device)
            inputs = tuple(x.to(device) for x in inputs)
        counter = CountingInductor()
        options: dict[str, Any] = {"backend": counter, "dynamic": True}
        if _ISOLATES:
            options["isolate_recompiles"] = True
        else:
            torch._dynamo.reset()
        compiled = torch.compile(decode.model, **options)
        calls: list[int] = []
        breaks_before, _ = _dynamo_counts()

        def run_step(ids: torch.Tensor, cache: Any, mask: Any) -> tuple:
            before = counter.calls
            with torch._dynamo.config.patch(accumulated_recompile_limit=_ACCUMULATED_LIMIT):
                out = decode.call_model(compiled, ids, cache, mask)
            if counter.calls == before:
                raise NotCompiledError(
                    f"torch.compile ran no compiled code for decode step {len(calls)} ({counter.graphs} graph(s) "
                    "compiled): that step was eager, so the run is not reported as a compiled backend"
                )
            calls.append(counter.calls - before)
            return out

        decode.run_step = run_step
        try:
            if device == "cuda":
                out = on_device("cuda")(decode, inputs)
            else:
                out = decode(*inputs)
        finally:
            decode.run_step = None
        breaks = _dynamo_counts()[0] - breaks_before
        note = (f"torch.compile: {counter.graphs} graph(s) compiled with dynamic shapes for {len(calls)} steps "
                f"(the prefill and the decode step), {sum(calls)} compiled call(s) ran")  # fmt: skip
        if breaks:
            note += f"; {breaks} graph break(s): the code between graphs ran eagerly, as it does in real use"
        add_note(note)
        return out

    return fn
