"""Nested outputs: flatten to named leaves with an id path, map over tensors.

Names follow ``torch.testing``'s id paths, shortened for tables: a lone
tensor is ``out``, a top-level sequence gives ``out[0]``, ``out[1]``, a
top-level mapping gives its keys (``logits``), and nesting appends ``[i]``
or ``.key`` (``hidden[2].attn``).

Any object a model returns is walked for the tensors it holds, whatever its type:
mappings (a Hugging Face ``ModelOutput``) by key, sequences by index, named tuples and
dataclasses by field, and other objects (a Hugging Face ``DynamicCache``) by attribute
(``past_key_values.layers[0].keys``).  Inside an object only what leads to tensors is kept
(its flags, devices and back-references are its state, not its output).  A leaf that is
neither a tensor nor a plain value (number, string, bool, None, shape) becomes an
:class:`Opaque` leaf: named, never compared by identity or ``repr``.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch

PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.Size, enum.Enum)
MAX_DEPTH = 12


@dataclasses.dataclass(frozen=True)
class Opaque:
    """A leaf that holds no tensor and is not a plain value: only its type is kept, never compared."""

    type_name: str

    def __str__(self) -> str:
        return f"<{self.type_name}>"


def flatten(obj: Any) -> list[tuple[str, Any]]:
    """``[(name, leaf), ...]`` in a stable order; leaves are tensors, plain values or :class:`Opaque`.

    Examples
    --------
    >>> [n for n, _ in flatten({"logits": torch.zeros(1), "hidden": [torch.zeros(1), {"attn": 1}]})]
    ['logits', 'hidden[0]', 'hidden[1].attn']
    >>> class Cache:
    ...     def __init__(self):
    ...         self.keys, self.ready, self.device = [torch.zeros(2)], True, torch.device("cpu")
    >>> [n for n, _ in flatten({"logits": torch.zeros(1), "past": Cache()})]
    ['logits', 'past.keys[0]']
    """
    out: list[tuple[str, Any]] = []
    if isinstance(obj, Mapping) or _fields(obj) is not None:
        for k, v in _items(obj):
            _flatten(v, str(k), out, 1, set())
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            _flatten(v, f"out[{i}]", out, 1, set())
    else:
        _flatten(obj, "out", out, 0, set())
    return out


def _fields(obj: Any) -> list[str] | None:
    # Named fields of a named tuple or a dataclass instance (None for anything else).
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return list(obj._fields)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [f.name for f in dataclasses.fields(obj)]
    return None


def _items(obj: Any) -> list[tuple[Any, Any]]:
    if isinstance(obj, Mapping):
        return list(obj.items())
    return [(name, getattr(obj, name)) for name in _fields(obj) or []]


def _attributes(obj: Any) -> list[tuple[str, Any]]:
    # An object's own state: its __dict__ and __slots__, public names first as they were set.
    names = list(vars(obj)) if hasattr(obj, "__dict__") else []
    for cls in type(obj).__mro__:
        for slot in getattr(cls, "__slots__", ()):
            if slot not in names and slot not in ("__dict__", "__weakref__") and hasattr(obj, slot):
                names.append(slot)
    return [(n, getattr(obj, n)) for n in names]


def _walkable(obj: Any) -> bool:
    # Objects whose attributes are searched for tensors: not modules, functions, classes or ndarrays.
    return not isinstance(obj, (torch.nn.Module, type, torch.dtype, torch.device)) and not callable(obj)


def _flatten(obj: Any, prefix: str, out: list[tuple[str, Any]], depth: int, seen: set[int]) -> None:
    if isinstance(obj, (torch.Tensor, Opaque)) or isinstance(obj, PLAIN):
        out.append((prefix, obj))
        return
    if id(obj) in seen or depth > MAX_DEPTH:
        out.append((prefix, Opaque(type(obj).__name__)))
        return
    seen = seen | {id(obj)}
    if isinstance(obj, Mapping) or _fields(obj) is not None:
        for k, v in _items(obj):
            _flatten(v, f"{prefix}.{k}", out, depth + 1, seen)
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            _flatten(v, f"{prefix}[{i}]", out, depth + 1, seen)
    else:
        found = _tensor_leaves(obj, prefix, depth, seen)
        out.extend(found if found else [(prefix, Opaque(type(obj).__name__))])


def _tensor_leaves(obj: Any, prefix: str, depth: int, seen: set[int]) -> list[tuple[str, Any]]:
    # The tensors an arbitrary object holds, by attribute; its other state is left out.
    found: list[tuple[str, Any]] = []
    if not _walkable(obj):
        return found
    try:
        attributes = _attributes(obj)
    except Exception:  # properties that raise, C objects without introspection
        return found
    for name, value in attributes:
        leaves: list[tuple[str, Any]] = []
        _flatten(value, f"{prefix}.{name}", leaves, depth + 1, seen)
        found.extend((n, v) for n, v in leaves if isinstance(v, torch.Tensor))
    return found


def map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """Apply ``fn`` to every tensor in a nested tuple/list/dict, keeping the structure.

    Mappings of other types (e.g. a Hugging Face ``ModelOutput``) come back as
    plain dicts with the same keys, which flatten to the same names.  Other
    objects that hold tensors (a cache passed as an input) come back as deep
    copies holding ``fn`` of each tensor; objects without tensors as they are.
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, PLAIN):
        return obj
    if isinstance(obj, Mapping):
        items = [(k, map_tensors(fn, v)) for k, v in obj.items()]
        return type(obj)(items) if type(obj) in (dict, OrderedDict) else dict(items)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(fn, v) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(fn, v) for v in obj)
    tensors = [t for _, t in _tensor_leaves(obj, "", 0, set())]
    if not tensors:
        return obj
    # A deep copy whose memo already maps each tensor it holds to fn(tensor): the object's own
    # structure is rebuilt around the new tensors, whatever its class.
    memo: dict[int, Any] = {id(t): fn(t) for t in tensors}
    memo[id(memo)] = tensors  # deepcopy's keep-alive list
    return copy.deepcopy(obj, memo)
