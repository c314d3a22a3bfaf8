"""Each module's own torch function calls (``ops=True``): recorded in a snapshot's run, judged in a diff.

An op is named as :func:`rlx_nb.localize` names one, ``"<module> :: F.softmax"`` (``#2``, ``#3`` ... for the same
function called again by the same module), and stored as its function's public name (``F.softmax``,
``torch.matmul``, ``Tensor.__add__``), which is resolved back to the function on load: nothing is unpickled, and an
op whose function has no public name is recorded as one that cannot run alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from rlx_nb.errors import InputError
from rlx_nb.localization.capture import _SKIP_OPS

NAMESPACES: tuple[tuple[str, Any], ...] = (
    ("F", torch.nn.functional),
    ("torch.special", torch.special),
    ("torch.linalg", torch.linalg),
    ("torch.fft", torch.fft),
    ("torch", torch),
    ("Tensor", torch.Tensor),
)
"""Where an op's function is looked up by its public name, in this order."""

SEPARATOR = " :: "


def op_name(func: Callable) -> str | None:
    """``func``'s public name (``F.softmax``), or None when no namespace holds it under its own name."""
    name = getattr(func, "__name__", None)
    if not isinstance(name, str):
        return None
    for prefix, space in NAMESPACES:
        if getattr(space, name, None) is func:
            return f"{prefix}.{name}"
    return None


def resolve(label: str) -> Callable:
    """The function an op's public name names (an :class:`InputError` for one this torch does not have)."""
    prefix, _, name = label.rpartition(".")
    space = dict(NAMESPACES).get(prefix)
    func = getattr(space, name, None) if space is not None else None
    if func is None or op_name(func) != label:
        raise InputError(f"op {label!r}: this torch has no such function")
    return func


def is_op(name: str) -> bool:
    return SEPARATOR in name


def module_of(name: str) -> str:
    return name.split(SEPARATOR, 1)[0]


@dataclasses.dataclass
class OpCall:
    """One op a module called: its row's name (``"<module> :: F.softmax"``), its public name, the function, the call
    and its output."""

    name: str
    label: str
    func: Callable
    args: tuple
    kwargs: dict
    out: torch.Tensor

    @property
    def module(self) -> str:
        return module_of(self.name)


class OpCalls(TorchFunctionMode):
    """While a model runs (inside :meth:`attached`): each module's own torch function calls
    with a floating tensor result, during that module's first call only (data movement and in-place ops skipped),
    passed to ``seen`` as an :class:`OpCall` in the order the module makes them."""

    def __init__(self, seen: Callable[[OpCall], None]) -> None:
        super().__init__()
        self.seen = seen
        self.stack: list[tuple[str, bool]] = []  # (module, in its first call)
        self.called: set[str] = set()
        self.counts: dict[tuple[str, str], int] = {}
        self._paused = 0

    @contextlib.contextmanager
    def attached(self, base: torch.nn.Module) -> Iterator[None]:
        """Watch ``base``'s runs inside this block.  The mode is entered as the model's forward begins (in its
        root's pre-hook), above any mode the backend entered around it (a fault's substitution, the float64
        reference's weights): it sees the calls the model's code makes, which then reach the backend's mode."""
        handles = []
        for name, module in base.named_modules():
            handles.append(module.register_forward_pre_hook(self._push(name, root=module is base)))
            handles.append(module.register_forward_hook(self._pop(root=module is base), always_call=True))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _push(self, name: str, *, root: bool):
        def hook(module, args):
            self.stack.append((name, name not in self.called))
            self.called.add(name)
            if root:
                self.__enter__()

        return hook

    def _pop(self, *, root: bool):
        def hook(module, args, out):
            if self.stack:
                self.stack.pop()
            if root:
                self.__exit__(None, None, None)

        return hook

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """What runs inside (a hook's own tensor work) is not the model's."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._paused or not self.stack or not self.stack[-1][1]:
            return out
        name = getattr(func, "__name__", "")
        if (
            isinstance(out, torch.Tensor)
            and out.is_floating_point()
            and name not in _SKIP_OPS
            and not name.endswith("_")
        ):
            module = self.stack[-1][0]
            label = op_name(func) or f"<{name or type(func).__name__}>"
            n = self.counts[(module, label)] = self.counts.get((module, label), 0) + 1
            self._paused += 1
            try:
                self.seen(
                    OpCall(f"{module}{SEPARATOR}{label}" + (f"#{n}" if n > 1 else ""), label, func, args, kwargs, out)
                )
            finally:
                self._paused -= 1
        return out


__all__ = ["NAMESPACES", "OpCall", "OpCalls", "is_op", "module_of", "op_name", "resolve"]
