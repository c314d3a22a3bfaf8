"""Nested outputs: flatten to named leaves with an id path, map over tensors.

Names follow ``torch.testing``'s id paths, shortened for tables: a lone
tensor is ``out``, a top-level sequence gives ``out[0]``, ``out[1]``, a
top-level mapping gives its keys (``logits``), and nesting appends ``[i]``
or ``.key`` (``hidden[2].attn``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch


def flatten(obj: Any) -> list[tuple[str, Any]]:
    """``[(name, leaf), ...]`` in a stable order; leaves are tensors or plain values.

    Examples
    --------
    >>> [n for n, _ in flatten({"logits": torch.zeros(1), "hidden": [torch.zeros(1), {"attn": 1}]})]
    ['logits', 'hidden[0]', 'hidden[1].attn']
    """
    out: list[tuple[str, Any]] = []
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            _flatten(v, str(k), out)
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            _flatten(v, f"out[{i}]", out)
    else:
        out.append(("out", obj))
    return out


def _flatten(obj: Any, prefix: str, out: list[tuple[str, Any]]) -> None:
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            _flatten(v, f"{prefix}.{k}", out)
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            _flatten(v, f"{prefix}[{i}]", out)
    else:
        out.append((prefix, obj))


def map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """Apply ``fn`` to every tensor in a nested tuple/list/dict, keeping the structure.

    Mappings of other types (e.g. a Hugging Face ``ModelOutput``) come back as
    plain dicts with the same keys, which flatten to the same names.
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        items = [(k, map_tensors(fn, v)) for k, v in obj.items()]
        return type(obj)(items) if type(obj) in (dict, OrderedDict) else dict(items)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(fn, v) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(fn, v) for v in obj)
    return obj
