"""Each module's own torch function calls (``ops=True``): recorded in a snapshot's run, judged in a diff.

An op is named as :func:`rlx_nb.localize` names one, ``"<module> :: F.softmax"`` (``#2``, ``#3`` ... for the same
function called again by the same module), and stored as its function's public name (``F.softmax``,
``torch.matmul``, ``Tensor.__add__``), which is resolved back to the function on load only when it is one of
:data:`~rlx_nb.changes.pure_ops.PURE_OPS` (pure tensor computations): nothing is unpickled, a file never names a
function to call outside that list, and an op whose function has no public name or is not on it is recorded as one
that cannot run alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

from rlx_nb._support.kept import modes_kept
from rlx_nb.changes.pure_ops import PURE_OPS
from rlx_nb.errors import InputError
from rlx_nb.localization.capture import _SKIP_OPS, NAMESPACES, op_name

SEPARATOR = " :: "


def runnable(func: Callable) -> str | None:
    """Why an op a module called cannot be written to run alone from a file, or None when it can: its public name
    is on :data:`~rlx_nb.changes.pure_ops.PURE_OPS`."""
    label = op_name(func)
    if label is None:
        return f"{getattr(func, '__name__', func)!s} has no public name to call it by"
    if label not in PURE_OPS:
        return f"{label} is not on rlx_nb's list of pure tensor computations a file may name"
    return None


def resolve(label: str) -> Callable:
    """The function an op's public name names, when it is on :data:`~rlx_nb.changes.pure_ops.PURE_OPS` (an
    :class:`InputError` for any other name, before anything is looked up: a file never names what is called)."""
    if not isinstance(label, str) or label not in PURE_OPS:
        raise InputError(
            f"op {label!r} is not on rlx_nb's list of pure tensor computations (rlx_nb.changes.pure_ops.PURE_OPS); "
            "a snapshot file may name only those, and this one is refused"
        )
    prefix, _, name = label.rpartition(".")
    space = dict(NAMESPACES).get(prefix)
    func = getattr(space, name, None) if space is not None else None
    if func is None or op_name(func) != label:
        raise InputError(f"op {label!r}: this torch has no such function")
    return func


ROOT = "<root>"


def shown(name: str, keyword: bool) -> str:
    """A recorded module's or op's name as the user reads it: without the keyword adapter's ``model.`` level, the
    top-level module named ``<root>`` (its own ops ``"<root> :: F.silu"``, as :func:`rlx_nb.localize` names them).

    Examples
    --------
    >>> shown("", False), shown(" :: F.silu", False), shown("model.blocks.0 :: F.softmax", True)
    ('<root>', '<root> :: F.silu', 'blocks.0 :: F.softmax')
    """
    module, sep, op = name.partition(SEPARATOR)
    if keyword:
        module = module.removeprefix("model.")
    return f"{module or ROOT}{sep}{op}"


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
            with modes_kept():  # (torch runs always_call hooks on an Exception only: a Ctrl-C in the forward
                yield  # would leave this mode on torch's stack)
        finally:
            for h in handles:
                h.remove()
            self.stack.clear()

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


__all__ = ["ROOT", "SEPARATOR", "OpCall", "OpCalls", "is_op", "module_of", "resolve", "runnable", "shown"]
