"""What a report was made from, held weakly: the model, inputs and params, for localizing it later."""

from __future__ import annotations

import weakref
from typing import Any


class WeakSource:
    """A report's model, inputs and params held by weak reference: the report can localize its model while the
    caller keeps them, and keeps nothing alive itself (plain values, which cannot be weakly referenced, are held)."""

    def __init__(self, model: Any, inputs: Any, params: Any) -> None:
        self._refs = _weak((model, inputs, params))

    def get(self) -> tuple[Any, Any, Any] | None:
        """``(model, inputs, params)``, or None when any of them has been freed."""
        try:
            return _strong(self._refs)
        except LookupError:
            return None


def _weak(obj: Any) -> Any:
    if isinstance(obj, (tuple, list)):
        return type(obj)(_weak(v) for v in obj) if not hasattr(obj, "_fields") else obj
    if isinstance(obj, dict):
        return {k: _weak(v) for k, v in obj.items()}
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


def _strong(refs: Any) -> Any:
    if isinstance(refs, (tuple, list)) and not hasattr(refs, "_fields"):
        return type(refs)(_strong(v) for v in refs)
    if isinstance(refs, dict):
        return {k: _strong(v) for k, v in refs.items()}
    if callable(refs):
        obj = refs()
        if obj is None and isinstance(refs, weakref.ref):
            raise LookupError("freed")
        return obj
    return refs
