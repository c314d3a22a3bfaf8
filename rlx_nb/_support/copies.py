"""A deep copy of a module tree, as ``copy.deepcopy`` makes it, without its generic machinery per module.

Every run of a call gets its own copy of the private model (:func:`rlx_nb._support.copies.shared_copy`: the modules
copied, the weights shared).  ``copy.deepcopy`` reduces each module to its state and copies that state item
by item: for a module that is ~20 dictionaries and flags, most of them empty hook tables, each copied by the
general path (``__reduce_ex__``, ``_reconstruct``, a dictionary copy).  On a small decoder that was ~2 ms a
copy and eight copies a call, more than the comparison of its 64 steps' logits.

:func:`module_copy` makes the same copy for the modules whose copy ``deepcopy`` would make the plain way
(``nn.Module``'s own ``__getstate__`` / ``__setstate__``, no ``__deepcopy__``, ``__reduce__``, slots or
``copyreg`` entry of their own): a new instance with the same state, where the empty tables, flags and
numbers are taken as they are or made new, the submodules copied the same way, and everything else (a
config, a tensor, a list) passed to ``copy.deepcopy`` with the shared memo.  Any other module is copied by
``copy.deepcopy`` itself.  Both share one memo, so an object held twice is copied once.
"""

from __future__ import annotations

import contextlib
import copy
import copyreg
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch

from rlx_nb._support.quiet import quiet

_AS_IS = (type(None), bool, int, float, complex, str, bytes, type)
"""What ``copy.deepcopy`` returns unchanged."""

_EMPTY_NEW = (dict, OrderedDict, set, list)
"""Containers ``copy.deepcopy`` copies to a new empty one of the same type when they are empty."""

_STATELESS = ("_compiled_call_impl",)
"""What ``nn.Module.__getstate__`` leaves out of a module's state."""


def module_copy(module: torch.nn.Module, memo: dict[int, Any]) -> torch.nn.Module:
    """``copy.deepcopy(module, memo)``, made faster for plain modules (see the module docstring).

    Examples
    --------
    >>> m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    >>> c = module_copy(m, {})
    >>> type(c[0]) is torch.nn.Linear and c[0].weight is not m[0].weight
    True
    >>> torch.equal(c[0].weight, m[0].weight)
    True
    """
    found = memo.get(id(module))
    if found is not None:
        return found
    cls = type(module)
    if not copies_plainly(cls) or "__deepcopy__" in module.__dict__:  # (deepcopy finds an instance's own too)
        if any(isinstance(m, torch.fx.GraphModule) for m in module.modules()):
            # (torch deep-copies an fx graph's pytree specs itself, and each LeafSpec warns "isinstance(treespec,
            # LeafSpec) is deprecated" from inside torch: noise a notebook cell showed in red; this thread's only)
            with quiet():
                return copy.deepcopy(module, memo)
        return copy.deepcopy(module, memo)
    new = cls.__new__(cls)
    memo[id(module)] = new
    state: dict[str, Any] = {}
    for key, value in module.__dict__.items():
        if key in _STATELESS:
            continue
        if key == "_modules" and type(value) is dict:
            state[key] = {n: module_copy(m, memo) if isinstance(m, torch.nn.Module) else _item(m, memo)
                          for n, m in value.items()}  # fmt: skip
        elif key in ("_parameters", "_buffers") and type(value) is dict:
            state[key] = {n: _item(t, memo) for n, t in value.items()}
        else:
            state[key] = _item(value, memo)
    new.__setstate__(state)
    memo.setdefault(id(memo), []).append(module)  # (as deepcopy keeps what its memo's ids name alive)
    return new


def copies_plainly(cls: type) -> bool:
    """Whether ``copy.deepcopy`` copies an instance of ``cls`` as a plain ``nn.Module``: its ``__dict__`` as
    ``nn.Module.__getstate__`` gives it, to a ``cls.__new__(cls)`` through ``nn.Module.__setstate__``."""
    module = torch.nn.Module
    return (
        cls.__reduce_ex__ is object.__reduce_ex__
        and cls.__reduce__ is object.__reduce__
        and getattr(cls, "__deepcopy__", None) is None
        and cls.__getstate__ is module.__getstate__
        and cls.__setstate__ is module.__setstate__
        and getattr(cls, "__getnewargs_ex__", None) is None
        and getattr(cls, "__getnewargs__", None) is None
        and cls not in copyreg.dispatch_table
        and type(cls) is type
        and not copyreg._slotnames(cls)
    )


def _item(value: Any, memo: dict[int, Any]) -> Any:
    kind = type(value)
    if kind in _AS_IS:
        return value
    if kind in _EMPTY_NEW and not value:  # (one copy of a container two modules share, as deepcopy makes)
        new = memo.get(id(value))
        if new is None:
            new = memo[id(value)] = kind()
            memo.setdefault(id(memo), []).append(value)
        return new
    return copy.deepcopy(value, memo)


def shared_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose parameters and buffers share its tensors' storage: only the modules and their
    plain state are copied, no weight.  Each parameter is a new ``Parameter`` (its own ``.grad``); tied
    weights stay tied.  Other tensors the modules hold are copied, as a deep copy would.

    Examples
    --------
    >>> m = torch.nn.Linear(2, 2)
    >>> c = shared_copy(m)
    >>> c.weight is not m.weight and c.weight.data_ptr() == m.weight.data_ptr()
    True
    """
    memo: dict[int, Any] = {}
    for t in (*model.parameters(), *model.buffers()):
        if type(t) is torch.nn.Parameter:
            memo[id(t)] = torch.nn.Parameter(t.detach(), requires_grad=t.requires_grad)
        elif type(t) is torch.Tensor:
            memo[id(t)] = t.detach()
    return module_copy(model, memo)  # (copy.deepcopy(model, memo), faster: rlx_nb._support.copies)


_RELEASE: dict[str, Callable[..., bool] | None] = {"release": None}


@contextlib.contextmanager
def releasing(release: Callable[..., bool]) -> Iterator[None]:
    """While a run lasts, ``release(*holders)`` frees its private model's weights (:func:`release_private_weights`)."""
    before, _RELEASE["release"] = _RELEASE["release"], release
    try:
        yield
    finally:
        _RELEASE["release"] = before


def release_private_weights(*holders: torch.nn.Module) -> bool:
    """Let the current run free its private model's weights while a backend works from a file (the run's
    ``PrivateModel.release``, :mod:`rlx_nb.execution.prepare`); a no-op outside a run."""
    release = _RELEASE["release"]
    return release(*holders) if release is not None else False
