"""The backend registry: names, liveness probes and how each backend runs a model.

A backend is a function ``fn(model, inputs) -> outputs``.  It receives a
private deep copy of the model (eval mode, float32, on the CPU) and the inputs
as a tuple of fresh copies, and returns outputs shaped like the model's.
Built-in backends are registered on first use and probed lazily: a backend
that is not live on this node (no CUDA, no ONNX Runtime, no C compiler) is a
value with a reason, never an import-time crash.
"""

from __future__ import annotations

from rlx_nb.backends.registry import (
    ORACLE,
    REFERENCE,
    Backend,
    available_backends,
    backend_table,
    get_backend,
    register_backend,
    resolve_backends,
    unregister_backend,
)

__all__ = [
    "ORACLE",
    "REFERENCE",
    "Backend",
    "available_backends",
    "backend_table",
    "get_backend",
    "register_backend",
    "resolve_backends",
    "unregister_backend",
]
