"""``torch.compile`` backends (Inductor) on the CPU and on CUDA, which really compile or say why not.

``torch.compile`` falls back to eager without an error in two ways that would make a compiled
backend compare eager against eager: after ``torch._dynamo.config.recompile_limit`` (8)
recompilations of the same code — every compiled ``nn.Module`` enters through one shared
wrapper function, so nine checks at nine batch sizes in one process are enough — and when it
captures no graph at all.  So each preparation here

- compiles in its own isolated cache region (``isolate_recompiles=True``; on a torch without it,
  dynamo's in-memory caches are reset first), so earlier compiles never count against it;
- compiles through Inductor wrapped in a counter of compiled graphs and of their executions;
- checks after the run that compiled code ran.  If none did, the caches are reset and the run is
  tried once more; if still none ran, the backend raises :class:`NotCompiledError`, which becomes
  an ``error`` row: an eager run is never reported under a compiled backend's name.

Graph breaks (parts of the model that run eagerly between compiled graphs, as in real use) are
reported in the run's notes.
"""

from __future__ import annotations

import inspect
import os
import shutil
from collections.abc import Callable
from typing import Any

import torch

from rlx_nb.backends.base import Backend
from rlx_nb.backends.eager import device_reason, on_device
from rlx_nb.backends.notes import add_note

# Large enough never to bind for rlx_nb's own compiles, which each have their own isolated region.
_ACCUMULATED_LIMIT = 1 << 20


class NotCompiledError(RuntimeError):
    """``torch.compile`` ran no compiled code for the model: the run would have been eager."""


def compiler_reason() -> str | None:
    """Inductor's CPU code generation needs a C++ compiler on PATH."""
    names = [os.environ.get("CXX", ""), "g++", "clang++", "c++"]
    if any(n and shutil.which(n) for n in names):
        return None
    return "no C++ compiler on PATH (Inductor needs g++ or clang++; set CXX)"


class CountingInductor:
    """A ``torch.compile`` backend: Inductor, counting the graphs it compiles and their executions."""

    compiler_name = "inductor"

    def __init__(self) -> None:
        self.inductor = torch._TorchCompileInductorWrapper(None, None, False)
        self.graphs = 0
        self.calls = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        compiled = self.inductor(gm, example_inputs)
        self.graphs += 1

        def run(*args: Any) -> Any:
            self.calls += 1
            return compiled(*args)

        return run

    def reset(self) -> None:
        self.inductor.reset()


def _isolates() -> bool:
    try:
        return "isolate_recompiles" in inspect.signature(torch.compile).parameters
    except (TypeError, ValueError):
        return False


_ISOLATES = _isolates()


def _dynamo_counts() -> tuple[int, dict[str, int]]:
    # Graph breaks so far, and what dynamo could not trace (its reasons, with how often).
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values()), dict(counters["unimplemented"])


def _why_not(before: dict[str, int], after: dict[str, int]) -> str:
    # Dynamo's own words for what it could not trace during this run: the first line and its explanation.
    reasons = [r for r, n in after.items() if n > before.get(r, 0)]
    if not reasons:
        return ""
    lines = [ln.strip() for ln in reasons[0].splitlines() if ln.strip()]
    return "; dynamo: " + " — ".join(lines[:2]).replace("Explanation: ", "")


def compile_isolated(model: Any, *, dynamic: bool, reset: bool = False) -> tuple[Any, CountingInductor]:
    """``torch.compile(model)`` through a fresh :class:`CountingInductor` in its own cache region (on a torch
    without isolated regions, or with ``reset``, dynamo's caches are emptied first): (compiled, counter)."""
    if reset or not _ISOLATES:
        torch._dynamo.reset()  # a torch without isolated regions, or a retry: start from empty caches
    counter = CountingInductor()
    options: dict[str, Any] = {"backend": counter, "dynamic": dynamic}
    if _ISOLATES:
        options["isolate_recompiles"] = True
    return torch.compile(model, **options), counter


def prepare_compiled(model: Any, inputs: tuple, *, call: Callable[[Any, tuple], Any] | None = None) -> Callable:
    """Compile ``model`` with Inductor (static shapes) in a fresh cache region; return ``runner(inputs)``.

    The runner checks on every call that compiled code ran (a reused compile included): on the first
    call, when none did, dynamo's caches are reset and the model compiled once more; if still none ran,
    or none runs on a later call, it raises :class:`NotCompiledError`.  ``call(compiled, inputs)`` runs
    the compiled model (default: ``compiled(*inputs)``).
    """
    call = call or (lambda compiled, xs: compiled(*xs))
    state: dict[str, Any] = {"first": True}

    def build(reset: bool) -> None:
        compiled, counter = compile_isolated(model, dynamic=False, reset=reset)
        state.update(counter=counter, compiled=compiled, reset=reset)

    def runner(xs: tuple) -> Any:
        attempts = 2 if state["first"] else 1
        for attempt in range(attempts):
            counter = state["counter"]
            graphs, calls = counter.graphs, counter.calls
            breaks, untraced = _dynamo_counts()
            with torch._dynamo.config.patch(accumulated_recompile_limit=_ACCUMULATED_LIMIT):
                out = call(state["compiled"], xs)
            after, untraced_after = _dynamo_counts()
            breaks = after - breaks
            if counter.calls > calls:
                state["first"] = False
                if counter.graphs > graphs:
                    note = f"torch.compile: {counter.graphs - graphs} graph(s) compiled"
                else:
                    note = f"torch.compile: reused {counter.graphs} compiled graph(s)"
                note += f", {counter.calls - calls} compiled call(s) ran"
                if breaks:
                    note += f"; {breaks} graph break(s): the code between graphs ran eagerly, as it does in real use"
                add_note(note + ("; dynamo's caches were reset to compile it" if state["reset"] else ""))
                return out
            if attempt + 1 < attempts:
                build(reset=True)
        raise NotCompiledError(
            f"torch.compile ran no compiled code for this model ({counter.graphs} graph(s) compiled, {breaks} "
            f"graph break(s)): the run was eager, so it is not reported as a compiled backend"
            f"{_why_not(untraced, untraced_after)}"
        )

    build(reset=False)
    return runner


def compile_and_run(model: Any, inputs: tuple, *, call: Callable[[Any, tuple], Any] | None = None) -> Any:
    """Compile ``model`` with Inductor in a fresh cache region, run it once, check it compiled.

    Raises :class:`NotCompiledError` when no compiled code ran, even after resetting dynamo's caches;
    see :func:`prepare_compiled`.
    """
    return prepare_compiled(model, inputs, call=call)(inputs)


def run_inductor(model: Any, inputs: tuple) -> Any:
    """Compile with Inductor (fixed shapes) in a fresh cache region and run once; see :func:`compile_and_run`.

    Compiled artefacts land in Inductor's on-disk cache, so a second run of
    the same model compiles in about a second instead of several.
    """
    return compile_and_run(model, inputs)


def _cuda(model: Any) -> Any:
    if isinstance(model, torch.nn.Module):
        model.to("cuda")
    return model


def prepare_cuda_inductor(model: Any, inputs: tuple) -> Callable:
    """Move to CUDA and compile with Inductor; the runner runs with TF32 off."""
    return prepare_compiled(_cuda(model), inputs, call=on_device("cuda"))


def run_cuda_inductor(model: Any, inputs: tuple) -> Any:
    """Move to CUDA, compile with Inductor, run with TF32 off."""
    return prepare_cuda_inductor(model, inputs)(inputs)


BACKENDS = [
    Backend(
        "cpu-inductor",
        run_inductor,
        probe=compiler_reason,
        prepare=prepare_compiled,
        description="torch.compile (Inductor) on the CPU",
        builtin=True,
        on_caller=True,
    ),
    Backend(
        "cuda-inductor",
        run_cuda_inductor,
        prepare=prepare_cuda_inductor,
        device="cuda",
        probe=lambda: device_reason("cuda"),
        description="torch.compile (Inductor) on CUDA, TF32 off",
        builtin=True,
    ),
]
