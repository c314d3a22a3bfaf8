"""torch's process-wide state that rlx_nb's calls enter, put back as it was however a call ends (Ctrl-C included).

A mode entered with ``with`` leaves on any exception; one entered from a module hook (the op recorder enters as the
model's forward begins) does not when a ``KeyboardInterrupt`` arrives inside the forward: torch runs a forward
hook marked ``always_call`` on an ``Exception`` only, so the mode would stay on torch's stack and every later torch
call would go through it.  :func:`modes_kept` takes the stacks back to what they were at its start.
:func:`inductor_tables_kept` does the same for Inductor's tables of decompositions, lowerings and fallbacks, which
a compile fills lazily and an attribution edits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


def _function_modes() -> list[Any]:
    return [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]


def _dispatch_modes() -> list[Any]:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return list(_get_current_dispatch_mode_stack())


def _restore_function_modes(saved: list[Any]) -> None:
    now = _function_modes()
    keep = 0
    while keep < min(len(now), len(saved)) and now[keep] is saved[keep]:
        keep += 1
    for _ in range(len(now) - keep):
        torch._C._pop_torch_function_stack()
    for mode in saved[keep:]:
        torch._C._push_on_torch_function_stack(mode)


def _restore_dispatch_modes(saved: list[Any]) -> None:
    from torch.utils._python_dispatch import _pop_mode, _push_mode

    now = _dispatch_modes()
    keep = 0
    while keep < min(len(now), len(saved)) and now[keep] is saved[keep]:
        keep += 1
    for _ in range(len(now) - keep):
        _pop_mode()
    for mode in saved[keep:]:
        _push_mode(mode)


_DISPATCH_FLAGS = (
    "_is_in_torch_dispatch_mode",
    "_is_in_non_infra_torch_dispatch_mode",
    "_is_in_any_mode_without_ignore_compile_internals",
)
"""The module-level flags a dispatch mode's ``__enter__`` sets before it pushes the mode (and its ``__exit__`` puts
back): an interrupt between the two leaves them set with no mode on the stack, and Dynamo reads them."""


def _dispatch_flags() -> dict[str, Any]:
    from torch.utils import _python_dispatch

    return {name: getattr(_python_dispatch, name) for name in _DISPATCH_FLAGS if hasattr(_python_dispatch, name)}


def _restore_dispatch_flags(saved: dict[str, Any]) -> None:
    from torch.utils import _python_dispatch

    if _dispatch_flags() == saved:
        return
    for name, value in saved.items():
        setattr(_python_dispatch, name, value)
    tell = getattr(_python_dispatch, "set_is_in_mode_without_ignore_compile_internals", None)
    if tell is not None and "_is_in_any_mode_without_ignore_compile_internals" in saved:
        tell(saved["_is_in_any_mode_without_ignore_compile_internals"])


@contextlib.contextmanager
def modes_kept() -> Iterator[None]:
    """torch's function-mode and dispatch-mode stacks (and the flags that say a dispatch mode is on) as they were when
    the block began, after it, however it ends: a mode the block left on a stack is taken off, one it took off is put
    back.

    Examples
    --------
    >>> from torch.overrides import TorchFunctionMode
    >>> class Left(TorchFunctionMode):
    ...     def __torch_function__(self, func, types, args=(), kwargs=None):
    ...         return func(*args, **(kwargs or {}))
    >>> try:
    ...     with modes_kept():
    ...         _ = Left().__enter__()  # (entered, never left: an interrupted hook)
    ...         raise KeyboardInterrupt
    ... except KeyboardInterrupt:
    ...     pass
    >>> torch._C._len_torch_function_stack()
    0
    """
    functions, dispatch, flags = _function_modes(), _dispatch_modes(), _dispatch_flags()
    try:
        yield
    finally:
        _restore_function_modes(functions)
        _restore_dispatch_modes(dispatch)
        _restore_dispatch_flags(flags)


@contextlib.contextmanager
def inductor_tables_kept() -> Iterator[None]:
    """Inductor's decompositions, lowerings and fallbacks as they were when the block began, after it (a compile
    adds a fallback for an op it has no lowering for; an attribution takes a decomposition out, adds a fallback)."""
    from torch._inductor import decomposition, lowering

    decompositions = dict(decomposition.decompositions)
    lowerings = dict(lowering.lowerings)
    fallbacks = set(lowering.fallbacks)
    try:
        yield
    finally:
        for table, saved in ((decomposition.decompositions, decompositions), (lowering.lowerings, lowerings)):
            if table != saved:
                table.clear()
                table.update(saved)
        if lowering.fallbacks != fallbacks:
            lowering.fallbacks.clear()
            lowering.fallbacks.update(fallbacks)
        cached = getattr(decomposition, "fast_random_decomps", None)  # (the cached copy Inductor reads)
        if cached is not None and hasattr(cached, "cache_clear"):
            cached.cache_clear()


__all__ = ["inductor_tables_kept", "modes_kept"]
