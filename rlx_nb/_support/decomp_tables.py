"""torch.export's table of the ops it may keep whole, worked out once while the registrations stay the same.

Each ``ExportedProgram.run_decompositions`` asks ``torch._export.utils._collect_all_valid_cia_ops`` for every
CompositeImplicitAutograd op it could preserve, and that walks the C++ dispatcher's registrations once per op
namespace (39 here): 0.12 s a call, five calls an ExecuTorch lowering, and a localization lowers a module at a
time.  torch does not cache it because a library may register ops at any time; :func:`cia_ops_kept` keeps it
while the registrations and the namespaces are the ones it was worked out from, and works it out again when they
change.  It is torch's own function either way: only how often it runs changes.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

from rlx_nb._support.held import Held

_LOCK = threading.Lock()
_HELD = Held()
_KEPT: dict[str, Any] = {}  # "key" -> the registrations it was worked out from, "ops" -> the set
_USERS = ("torch.export.exported_program", "torch.export.decomp_utils")  # (they import the function by name)


def _registrations() -> tuple:
    return (
        tuple(torch.ops._dir),
        tuple(torch._C._dispatch_get_registrations_for_dispatch_key("CompositeImplicitAutograd")),
    )


@contextlib.contextmanager
def cia_ops_kept() -> Iterator[None]:
    """Inside, torch.export works its preservable-op table out once per set of registrations (module docstring)."""
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

    ours = [(m, "_collect_all_valid_cia_ops", kept) for m in modules]  # (where it is still torch's own)
    with _HELD.replaced(lambda: [r for r in ours if r[0].__dict__.get(r[1]) is original]):
        yield
