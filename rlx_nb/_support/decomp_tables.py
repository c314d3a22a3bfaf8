"""torch.export's table of the ops it may keep whole, worked out once while the registrations stay the same.

Each ``ExportedProgram.run_decompositions`` asks ``torch._export.utils._collect_all_valid_cia_ops`` for every
CompositeImplicitAutograd op it could preserve, and that walks the C++ dispatcher's registrations once per op
namespace (39 here): 0.12 s a call, five calls an ExecuTorch lowering, and a localization lowers a module at a
time.  torch does not cache it because a library may register ops at any time; :func:`cia_ops_kept` keeps it
while the registrations and the namespaces are the ones it was worked out from, and works it out again when they
change.  It is torch's own function either way: only how often it runs changes.

The same call overrides each of those ops (500 and more) for its duration, through ``OperatorBase.py_impl``, whose
inner function is annotated ``Callable[_P, _T]``: Python builds the two subscripts anew at every call, a
``collections.abc`` generic alias that checks its parameters each time, for a fifth of a small module's ExecuTorch
lowering (0.70 s against 0.55 s for a Linear).  Inside :func:`cia_ops_kept`, ``torch._ops.Callable`` makes each
subscript once: the same alias objects, and ``isinstance`` and ``issubclass`` answer as the real one does.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

import torch

from rlx_nb._support.held import Held

_LOCK = threading.Lock()
_HELD = Held()
_KEPT: dict[str, Any] = {}  # "key" -> the registrations it was worked out from, "ops" -> the set
_USERS = ("torch.export.exported_program", "torch.export.decomp_utils")  # (they import the function by name)


class _SubscriptsKept(type):
    # The class of the stand-in for torch._ops.Callable: subscripts made once by the real one, the rest answered by it.
    def __getitem__(cls, params: Any) -> Any:
        try:
            return cls._made(params)
        except TypeError:  # (unhashable parameters, such as an argument list: made afresh, as torch makes them)
            return cls._real[params]

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, cls._real)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, cls._real)


@functools.cache
def subscripts_kept(real: Any) -> type:
    """A stand-in for ``real`` (``collections.abc.Callable``) that makes each subscript once (module docstring).

    Examples
    --------
    >>> from collections.abc import Callable
    >>> from typing import TypeVar
    >>> T = TypeVar("T")
    >>> kept = subscripts_kept(Callable)
    >>> kept[[int], T] is kept[[int], T], kept[..., T] is kept[..., T], kept[..., T] == Callable[..., T]
    (False, True, True)
    >>> isinstance(len, kept), isinstance(3, kept)
    (True, False)
    """
    made = functools.lru_cache(maxsize=None)(lambda params: real[params])
    return _SubscriptsKept("Callable", (), {"_real": real, "_made": staticmethod(made), "__module__": __name__})


def _registrations() -> tuple:
    return (
        tuple(torch.ops._dir),
        tuple(torch._C._dispatch_get_registrations_for_dispatch_key("CompositeImplicitAutograd")),
    )


@contextlib.contextmanager
def cia_ops_kept() -> Iterator[None]:
    """Inside, torch.export works its preservable-op table out once per set of registrations, and torch._ops makes
    each ``Callable`` subscript once (module docstring)."""
    import importlib

    try:
        from torch._export import utils as export_utils

        modules = [importlib.import_module(name) for name in _USERS]
        original = export_utils._collect_all_valid_cia_ops
    except (ImportError, AttributeError):  # (another torch: left as it is)
        yield
        return

    def kept() -> set:
        key = _registrations()
        with _LOCK:
            if _KEPT.get("key") == key:
                return set(_KEPT["ops"])
        ops = original()
        with _LOCK:
            _KEPT.update(key=key, ops=frozenset(ops))
        return set(ops)

    real = torch._ops.__dict__.get("Callable")
    ours = [(m, "_collect_all_valid_cia_ops", kept, original) for m in modules]
    ours += [] if real is None else [(torch._ops, "Callable", subscripts_kept(real), real)]
    # (each where it is still torch's own)
    with _HELD.replaced(lambda: [(m, name, new) for m, name, new, old in ours if m.__dict__.get(name) is old]):
        with kernels_kept(kept()):
            yield


@contextlib.contextmanager
def kernels_kept(ops: set) -> Iterator[None]:
    """The Python kernels of ``ops`` (the ops torch.export may keep whole) as they were, after a block that raised.

    ``run_decompositions`` overrides each such op's CompositeImplicitAutograd kernel for its duration and puts them
    back in a ``finally``, but sets them up before it: a Ctrl-C there left ``aten.conv2d`` kept whole for good, and
    every later export in the process failed ("aten.conv2d.default is not in Core ATen opset").  Ends that do not
    raise leave them as torch left them."""
    saved = {op: dict(op.py_kernels) for op in ops if hasattr(op, "py_kernels")}
    try:
        yield
    except BaseException:
        for op, kernels in saved.items():
            if op.py_kernels != kernels:
                op.py_kernels.clear()
                op.py_kernels.update(kernels)
                op._dispatch_cache.clear()
        raise
