"""Ctrl-C at any point of a call, and torch's process-wide state compared before and after (#62).

:func:`interrupt_at` raises ``KeyboardInterrupt`` at the n-th Python call made on the calling thread inside torch or
rlx_nb (``sys.settrace``: the place a real Ctrl-C reaches Python is the next bytecode of that thread, anywhere);
:func:`count_calls` gives the number of such calls a whole call makes, so a test can spread its interrupts over it.
:func:`torch_state` is every piece of torch's state rlx_nb's calls enter or edit, as comparable values.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch

_WATCHED = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + "/rlx_nb")


def _watched(frame: Any) -> bool:
    return frame.f_code.co_filename.startswith(_WATCHED)


def count_calls(fn: Callable[[], Any]) -> int:
    """How many Python calls inside torch or rlx_nb ``fn()`` makes on this thread."""
    n = 0

    def trace(frame, event, arg):
        nonlocal n
        if event == "call" and _watched(frame):
            n += 1

    sys.settrace(trace)
    try:
        fn()
    finally:
        sys.settrace(None)
    return n


def _traced(fn: Callable[[], Any], trace: Callable) -> None:
    # ``fn()`` with ``trace`` as the tracing function, taken off however it ends.
    sys.settrace(trace)
    try:
        fn()
    finally:
        sys.settrace(None)


def _interrupted(fn: Callable[[], Any], trace: Callable, reached: Callable[[], bool]) -> bool | None:
    # True when the interrupt ``trace`` raises came out of ``fn()``, False when it was raised and swallowed, None
    # when ``fn()`` ended before the point it was to be raised at.
    try:
        _traced(fn, trace)
    except KeyboardInterrupt:
        return True
    return False if reached() else None


def interrupt_at(fn: Callable[[], Any], n: int) -> bool | None:
    """Run ``fn()`` with a ``KeyboardInterrupt`` raised at its ``n``-th call inside torch or rlx_nb: True when the
    interrupt came out of it, False when it was raised and the call still returned (swallowed), None when the call
    ended before its ``n``-th call (a call's count varies a little from run to run: caches, retries)."""
    seen = 0

    def trace(frame, event, arg):
        nonlocal seen, n
        if event == "call" and _watched(frame):
            seen += 1
            if seen == n and _finalizer(frame):  # (CPython ignores what a finalizer raises, a real Ctrl-C too)
                n += 1
            elif seen == n:
                sys.settrace(None)
                RAISED_AT[:] = [f"{frame.f_code.co_filename.rsplit('site-packages/', 1)[-1]}:{frame.f_lineno} "
                                f"{frame.f_code.co_name}"]  # fmt: skip
                raise KeyboardInterrupt(f"test interrupt at call {n}")

    return _interrupted(fn, trace, reached=lambda: seen >= n)


def call_windows(fn: Callable[[], Any], name: str) -> list[tuple[int, int]]:
    """Each time ``fn()`` runs a function called ``name`` (of torch or rlx_nb) on this thread: the numbers (as
    :func:`interrupt_at` counts them) of the first and the last call made while it runs, so a test can interrupt it."""
    n = 0
    windows: list[list[int]] = []

    def inside(frame, event, arg):
        if event == "return":
            windows[-1][1] = n
        return inside

    def trace(frame, event, arg):
        nonlocal n
        if event == "call" and _watched(frame):
            n += 1
            if frame.f_code.co_name == name:
                windows.append([n, n])
                return inside
        return None

    _traced(fn, trace)
    return [(a, b) for a, b in windows]


def _finalizer(frame: Any) -> bool:
    # A function the garbage collector calls (a weak reference's callback, ``__del__``): CPython prints and ignores
    # any exception raised in one -- a real Ctrl-C landing there is lost by Python itself, not by rlx_nb -- so no
    # interrupt is raised entering one (torch's WeakIdKeyDictionary's ``remove``, run by a collection inside a repro).
    name = frame.f_code.co_filename
    return frame.f_code.co_name == "__del__" or name.endswith(("/weak.py", "/weakref.py", "/_weakrefset.py"))


RAISED_AT: list[str] = []
"""Where :func:`interrupt_at` last raised its interrupt (the function it was entering): said when one is swallowed."""


def _is_mode_entry(frame) -> bool:
    # A mode rlx_nb enters (its own classes): torch's own modes, entered by torch's code, are torch's to leave (an
    # export cut short exactly there leaves its tracer's state half set, which no caller can take back).
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    if frame.f_code.co_name != "__enter__":
        return False
    this = frame.f_locals.get("self")
    return isinstance(this, (TorchDispatchMode, TorchFunctionMode)) and type(this).__module__.startswith("rlx_nb")


def interrupt_entering_mode(fn: Callable[[], Any], n: int) -> bool | None:
    """Run ``fn()`` with a ``KeyboardInterrupt`` raised as the ``n``-th torch mode rlx_nb enters returns from ``__enter__``: the mode
    is on torch's stack and its flags set, but no ``with`` reached, so no ``__exit__`` runs.  True when the interrupt
    came out of the call, False when swallowed, None when the call entered fewer modes."""
    seen = 0

    def on_return(frame, event, arg):
        if event == "return":
            sys.settrace(None)
            raise KeyboardInterrupt(f"test interrupt as mode {n} is entered")
        return on_return

    def trace(frame, event, arg):
        nonlocal seen
        if event == "call" and _is_mode_entry(frame):
            seen += 1
            if seen == n:
                return on_return
        return None

    return _interrupted(fn, trace, reached=lambda: seen >= n)


def mode_entries(fn: Callable[[], Any]) -> list[tuple[str, str]]:
    """Each torch mode of rlx_nb's ``fn()`` enters, in order: the mode's class and where it is entered from (the
    caller's file and line), so a test can interrupt each place once (the n-th entry is ``mode_entries[n - 1]``)."""
    seen: list[tuple[str, str]] = []

    def trace(frame, event, arg):
        if event == "call" and _is_mode_entry(frame):
            caller = frame.f_back
            at = f"{caller.f_code.co_filename}:{caller.f_lineno}" if caller is not None else "?"
            seen.append((type(frame.f_locals["self"]).__qualname__, at))
        return None

    _traced(fn, trace)
    return seen


def first_of_each(entries: list[tuple[str, str]]) -> list[int]:
    """The entry numbers (1-based) of the first entry of each distinct mode and place."""
    firsts: dict[tuple[str, str], int] = {}
    for n, entry in enumerate(entries, 1):
        firsts.setdefault(entry, n)
    return sorted(firsts.values())


def _dispatch_flags() -> dict[str, Any]:
    from torch.utils import _python_dispatch

    return {k: v for k, v in vars(_python_dispatch).items() if k.startswith("_is_in_")}


def _ids(namespace: dict) -> dict[str, int]:
    return {k: id(v) for k, v in namespace.items()}


def _cia_kernels() -> dict[str, tuple]:
    # The Python kernels of the ops torch.export may keep whole (run_decompositions overrides them for its duration).
    from torch._export.utils import _collect_all_valid_cia_ops

    return {str(op): tuple(sorted(map(str, op.py_kernels))) for op in _collect_all_valid_cia_ops()}


def torch_state() -> dict[str, Any]:
    """torch's process-wide state that rlx_nb enters or edits, each part as a value that compares by content."""
    import torch._dynamo.config as dynamo_config
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor import compiler_bisector as cb
    from torch._inductor import decomposition, lowering
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    attributes = {}
    for owner in (torch, torch.nn.functional, torch._ops, torch.export, torch.onnx, torch.Tensor, torch.nn.Module):
        space = {k: v for c in owner.__mro__ for k, v in vars(c).items()} if isinstance(owner, type) else vars(owner)
        attributes[getattr(owner, "__name__", str(owner))] = _ids(space)
    module_hooks = torch.nn.modules.module
    return {
        "function modes": [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())],
        "dispatch modes": list(_get_current_dispatch_mode_stack()),
        "dispatch mode flags": _dispatch_flags(),
        "inductor config": inductor_config.get_config_copy(),
        "functorch config": functorch_config.get_config_copy(),
        "dynamo config": {
            k: v for k, v in dynamo_config.get_config_copy().items() if k != "traceable_tensor_subclasses"
        },
        "decompositions": _ids(decomposition.decompositions),
        "core decompositions": _ids(torch._decomp.decomposition_table),
        "lowerings": _ids(lowering.lowerings),
        "op kernels": _cia_kernels(),
        "fallbacks": set(lowering.fallbacks),
        "bisector": (
            cb.CompilerBisector.bisection_enabled,
            cb.CompilerBisector.in_process_cache,
            [s.name for s in cb.BACKENDS["inductor"]],
        ),
        "environ": dict(os.environ),
        "switches": {
            "grad": torch.is_grad_enabled(),
            "inference": torch.is_inference_mode_enabled(),
            "default dtype": torch.get_default_dtype(),
            "threads": torch.get_num_threads(),
            "mkldnn": torch.backends.mkldnn.enabled,
            "nnpack": torch._C._get_nnpack_enabled(),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "matmul precision": torch.get_float32_matmul_precision(),
            "autocast": (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")),
            "anomaly": torch.is_anomaly_enabled(),
        },
        "global hooks": [
            len(getattr(module_hooks, n))
            for n in dir(module_hooks)
            if n.startswith("_global_") and isinstance(getattr(module_hooks, n), dict)
        ],
        "attributes": attributes,
    }


def differences(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What changed between two :func:`torch_state` values (attributes: only the ones replaced, not those a lazy
    import added)."""
    out = {}
    for key, was in before.items():
        now = after[key]
        if key == "attributes":
            replaced = {f"{o}.{k}" for o, names in was.items() for k, v in names.items()
                        if k in now[o] and now[o][k] != v}  # fmt: skip
            if replaced:
                out[key] = sorted(replaced)
        elif isinstance(was, dict) and isinstance(now, dict) and key != "switches":
            changed = {k for k in set(was) | set(now) if was.get(k, "<absent>") != now.get(k, "<absent>")}
            if changed:
                out[key] = sorted(map(str, changed))[:10]
        elif was != now:
            out[key] = (was, now)
    return out


__all__ = ["count_calls", "differences", "interrupt_at", "torch_state"]
