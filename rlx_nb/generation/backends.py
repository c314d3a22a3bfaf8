"""Backends for a decode (:class:`rlx_nb.generation.decode.Decode`): which run it as they are, and which need its step.

Eager backends -- oneDNN off, reduced precision, faults, a user's registered backend, a device -- run the
whole decode as they run any model: the step loop runs under them, every step with their arithmetic.

A compiled backend must not compile the loop (it would unroll every step into one graph, a program nobody
runs): :func:`compiled_decode` compiles the model's step once, with dynamic shapes, and runs every step
through it.  Every step must run compiled code, or the run is an error (never silently eager).  As a user's
own ``torch.compile(model)`` does, a later call on a model of the same code reuses the compiled step when
dynamo's guards pass (one shared Inductor backend); a call whose first step runs no compiled code (a
recompile limit reached) compiles again in a fresh cache region.

Exported backends (ONNX Runtime, OpenVINO) run the prefill and the decode step exported with the cache as
inputs and outputs (:mod:`rlx_nb.generation.export`); a model whose cache or code does not export is a
``skipped`` row saying what stopped it.
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from typing import Any

import torch

from rlx_nb._support import meter as phases
from rlx_nb.backends.base import Backend
from rlx_nb.backends.compiled import (
    _ACCUMULATED_LIMIT,
    CountingInductor,
    NotCompiledError,
    _dynamo_counts,
    compile_isolated,
)
from rlx_nb.backends.eager import on_device
from rlx_nb.backends.notes import add_note
from rlx_nb.errors import NotApplicable
from rlx_nb.generation.decode import map_cache
from rlx_nb.generation.export import exported_decode

EXPORTED = ("onnxruntime", "openvino", "openvino-default")
"""Exported runtimes that decode the exported prefill and step (:mod:`rlx_nb.generation.export`)."""


def for_generation(backend: Backend) -> Backend:
    """The form of ``backend`` that runs a :class:`~rlx_nb.generation.decode.Decode`."""
    if backend.name in ("cpu-inductor", "cuda-inductor"):
        device = "cuda" if backend.name.startswith("cuda") else "cpu"
        return dataclasses.replace(backend, fn=compiled_decode(device), prepare=None)
    if backend.name in EXPORTED:
        return dataclasses.replace(backend, fn=exported_decode(backend.name), prepare=None)
    if backend.name.startswith(("onnxruntime", "openvino")):
        return dataclasses.replace(backend, fn=_not_exported, prepare=None)
    return dataclasses.replace(backend, prepare=None)  # (a prepared runner would be kept for a single input)


def _not_exported(model: Any, inputs: tuple) -> Any:
    raise NotApplicable(
        "this backend has no decode export in rlx_nb yet (onnxruntime, openvino and openvino-default do); judge the "
        "prompt's forward pass with backend_divergence(model, prompt)"
    )


def compiled_decode(device: str = "cpu"):
    """``fn(decode, inputs)``: compile ``decode.model``'s step once (Inductor, dynamic shapes) and run every step
    of the decode through it; a step that runs no compiled code raises :class:`NotCompiledError`."""

    def fn(decode: Any, inputs: tuple) -> Any:
        if device != "cpu":
            decode.to(device)
            inputs = tuple(x.to(device) for x in inputs)
        breaks_before, _ = _dynamo_counts()
        try:  # the compiled step dynamo already holds for this model's code, when its guards pass
            out, graphs, calls, reused = _decode_compiled(decode, inputs, device, isolated=False)
        except NotCompiledError:  # (e.g. a recompile limit reached): once more in a fresh cache region
            out, graphs, calls, reused = _decode_compiled(decode, inputs, device, isolated=True)
        breaks = _dynamo_counts()[0] - breaks_before
        what = (
            f"{graphs} graph(s) compiled"
            if graphs
            else f"reused the {reused} graph(s) compiled earlier in this process"
        )
        note = (f"torch.compile: {what} with dynamic shapes for {len(calls)} steps (the prefill and the decode "
                f"step), {sum(calls)} compiled call(s) ran")  # fmt: skip
        if breaks:
            note += f"; {breaks} graph break(s): the code between graphs ran eagerly, as it does in real use"
        add_note(note)
        return out

    return fn


SHARED_RECOMPILE_LIMIT = 64
"""Compiled variants of one function dynamo keeps for rlx_nb's decode compiles (its default: 8)."""
_SHARED: list[CountingInductor] = []
"""One Inductor backend for every decode compile outside an isolated region: dynamo reuses a compiled step
only under the backend that compiled it, as it does for a user's repeated ``torch.compile(model)``."""


def _decode_compiled(decode: Any, inputs: tuple, device: str, *, isolated: bool) -> tuple:
    # (outputs, graphs compiled now, compiled calls per step, graphs held before); NotCompiledError when a step
    # ran no compiled code.
    if isolated:
        compiled, counter = compile_isolated(decode.model, dynamic=True)
    else:
        if not _SHARED:
            _SHARED.append(CountingInductor())
        counter = _SHARED[0]
        compiled = torch.compile(decode.model, backend=counter, dynamic=True)
    graphs_before, calls = counter.graphs, []

    # Every Hugging Face model's forward enters through one shared wrapper function, so a process that checks
    # several models (or batch sizes) recompiles that one function for each: more than dynamo's default 8.
    limits = {"accumulated_recompile_limit": _ACCUMULATED_LIMIT, "recompile_limit": SHARED_RECOMPILE_LIMIT}

    def run_step(ids: torch.Tensor, cache: Any, mask: Any) -> tuple:
        before = counter.calls
        # Every step gets its cache in one layout: the prefill leaves a transposed view where a later step's
        # concatenation leaves a contiguous tensor, and dynamo compiled the step a second time for that stride
        # alone (a third graph: about a third of a cold generation's Inductor time).  The values are the same.
        cache = map_cache(cache, lambda t: t.contiguous())
        first = ("compiling the prefill", "compiling the decode step")[len(calls)] if len(calls) < 2 else ""
        with (
            torch._dynamo.config.patch(**limits),
            phases.step(f"{device}-inductor: {first}") if first else nullcontext(),
        ):
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
        out = on_device("cuda")(decode, inputs) if device == "cuda" else decode(*inputs)
    finally:
        decode.run_step = None
    return out, counter.graphs - graphs_before, calls, graphs_before
