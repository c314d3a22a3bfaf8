"""Backend records, the registry, and name resolution with clear errors."""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Callable, Iterable
from typing import Any

from rlx_nb.backends.base import ORACLE, REFERENCE, Backend, BackendFn
from rlx_nb.errors import BackendError, InputError, did_you_mean
from rlx_nb.numerics import formats

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:+/@-]*$")


_REGISTRY: dict[str, Backend] = {}
_LOCK = threading.Lock()
_BUILTINS_LOADED = False


def _ensure_builtins() -> None:
    global _BUILTINS_LOADED
    if _BUILTINS_LOADED:
        return
    with _LOCK:
        if _BUILTINS_LOADED:
            return
        _BUILTINS_LOADED = True
        from rlx_nb.backends import (
            compiled,
            eager,
            emulated,
            executorch_runtime,
            faults,
            litert_runtime,
            onnx,
            openvino,
            precision,
        )

        for module in (
            eager,
            compiled,
            onnx,
            openvino,
            executorch_runtime,
            litert_runtime,
            precision,
            emulated,
            faults,
        ):
            for backend in module.BACKENDS:
                _REGISTRY.setdefault(backend.name, backend)


def register_backend(
    name: str,
    fn: BackendFn,
    *,
    device: str = "cpu",
    replace: bool = False,
    compute_dtype: str = "float32",
    default: bool = True,
    differentiable: bool = True,
    probe: Callable[[], str | None] | None = None,
    description: str = "",
    hookable: bool = False,
    compare_on_device: bool | None = None,
) -> Backend:
    """Register a backend under ``name``.

    ``fn(model, inputs) -> outputs`` gets a private deep copy of the model
    (eval mode, float32, on the CPU) and the inputs as a tuple, and returns
    outputs shaped like the model's.

    Parameters
    ----------
    name : str
        Letters, digits and ``_ . : + / @ -``; no spaces or commas.
    fn : callable
        The runner.
    device : str
        Where it runs; a ``cuda``/``mps``/``xpu`` backend is live only when
        that device is present (unless ``probe`` says otherwise).
    replace : bool
        Allow replacing an existing registration.  Registering the same code again under the same
        name (a notebook cell run twice) replaces it without asking.
    compute_dtype : str
        Format it computes in, for the round-off budget: one of
        ``float32``, ``tf32``, ``float16``, ``bfloat16``, ``float64``.
    default : bool
        Include it when ``backend_divergence(..., backends=None)``.
    differentiable : bool
        Whether gradients flow through its outputs.
    probe : callable, optional
        ``probe() -> None | str``: ``None`` when live, else the reason.
    description : str
        One line shown by ``rlx-nb backends``.
    hookable : bool
        Set it when ``fn`` runs the model's own ``forward`` eagerly, so
        :func:`rlx_nb.localize` can also compare full-run activations.
    compare_on_device : bool, optional
        Keep the outputs on the backend's device and compare them there (default: for ``cuda``
        and ``xpu`` backends); see :attr:`Backend.compare_on_device`.

    Examples
    --------
    >>> import rlx_nb
    >>> b = rlx_nb.register_backend("doc-eager", lambda m, xs: m(*xs), replace=True)
    >>> b.name
    'doc-eager'
    """
    _ensure_builtins()
    if not isinstance(name, str) or not _NAME.match(name) or "," in name:
        raise BackendError(
            f"invalid backend name {name!r}: use letters, digits and _ . : + / @ - (no spaces or commas)"
        )
    if not callable(fn):
        raise BackendError(f"backend {name!r}: fn must be callable fn(model, inputs), got {type(fn).__name__}")
    try:  # (an alias -- "bf16", "torch.float16" -- is the format it names)
        compute_dtype = formats.get(compute_dtype).name
    except InputError as exc:
        raise BackendError(f"backend {name!r}: compute_dtype {exc}") from None
    if name in (ORACLE, REFERENCE):
        raise BackendError(f"{name!r} is the {'oracle' if name == ORACLE else 'fp64 reference'} and cannot be replaced")
    if name in _REGISTRY and not replace and not _same_definition(_REGISTRY[name], fn):
        raise BackendError(f"backend {name!r} is already registered; pass replace=True to replace it")
    if probe is None and device != "cpu":
        probe = device_probe(device)
    backend = Backend(
        name=name,
        fn=fn,
        device=device,
        compute_dtype=compute_dtype,
        default=default,
        differentiable=differentiable,
        probe=probe,
        description=description,
        hookable=hookable,
        compare_on_device=compare_on_device,
    )
    with _LOCK:
        _REGISTRY[name] = backend
    return backend


def _same_definition(old: Backend, fn: BackendFn) -> bool:
    # A notebook cell run again registers the same code under the same name: that replaces, silently.
    if old.builtin:
        return False
    a, b = old.fn, fn
    same_name = getattr(a, "__qualname__", None) == getattr(b, "__qualname__", 0) and getattr(
        a, "__module__", None
    ) == getattr(b, "__module__", 0)
    code_a, code_b = getattr(a, "__code__", None), getattr(b, "__code__", None)
    return (
        same_name
        and code_a is not None
        and code_b is not None
        and (code_a.co_code, code_a.co_firstlineno) == (code_b.co_code, code_b.co_firstlineno)
    )


def unregister_backend(name: str) -> None:
    """Remove a user-registered backend (built-ins cannot be removed)."""
    backend = get_backend(name)
    if backend.builtin:
        raise BackendError(f"{name!r} is built in and cannot be unregistered")
    with _LOCK:
        _REGISTRY.pop(name, None)


def device_probe(device: str) -> Callable[[], str | None] | None:
    """The liveness probe of a backend on ``device`` (None for the CPU, which is always live)."""
    if device == "cpu":
        return None

    def probe() -> str | None:
        from rlx_nb.backends.eager import device_reason

        return device_reason(device)

    return probe


@contextlib.contextmanager
def lent(backend: Backend):
    """``backend`` known by name inside the block (an unregistered Backend object a report ran, for a tool that
    looks backends up by name); a registered one of that name is left as it is."""
    _ensure_builtins()
    with _LOCK:
        added = backend.name not in _REGISTRY
        if added:
            _REGISTRY[backend.name] = backend
    try:
        yield backend
    finally:
        if added:
            with _LOCK:
                _REGISTRY.pop(backend.name, None)


def get_backend(name: str) -> Backend:
    """The registered backend called ``name``; a clear error listing the known ones otherwise."""
    _ensure_builtins()
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        known = ", ".join(sorted(_REGISTRY))
        hint = did_you_mean(name, _REGISTRY)
        raise BackendError(f"unknown backend {name!r}{hint}; registered backends: {known}") from None


def available_backends(*, include_optin: bool = False) -> list[str]:
    """Backends live on this node, the oracle ``cpu`` first.

    The fp64 reference ``cpu-f64`` is not a candidate and is not listed.
    Opt-in backends (reduced precision, fault injection) are listed only with
    ``include_optin=True``.

    Examples
    --------
    >>> import rlx_nb
    >>> rlx_nb.available_backends()[0]
    'cpu'
    """
    _ensure_builtins()
    names = [
        b.name for b in list(_REGISTRY.values()) if b.name != REFERENCE and (b.default or include_optin) and b.live
    ]
    return [ORACLE] + [n for n in names if n != ORACLE]


def backend_table() -> list[dict[str, Any]]:
    """Every registered backend as plain records (``frames.backend_table_frame`` makes a DataFrame)."""
    _ensure_builtins()
    rows = []
    for b in list(_REGISTRY.values()):
        reason = b.unavailable_reason()
        rows.append(
            {
                "backend": b.name,
                "live": reason is None,
                "default": b.default,
                "device": b.device,
                "compute_dtype": b.compute_dtype,
                "differentiable": b.differentiable,
                "description": b.description,
                "reason": reason or "",
            }
        )
    return rows


def resolve_backends(backends: str | Iterable[str | Backend] | None) -> list[Backend]:
    """Turn the user's ``backends=`` argument into candidate backends (never the oracle or reference).

    ``None`` means every live default backend; :class:`Backend` objects in the list run as they are,
    without being registered.  A name that is unknown raises
    :class:`BackendError` listing the live ones; a known name that is not live
    here is kept so that its run reports the reason as an error row.
    """
    _ensure_builtins()
    if backends is None:
        return [get_backend(n) for n in available_backends() if n != ORACLE]
    if isinstance(backends, str):
        names = [n.strip() for n in backends.split(",") if n.strip()]
    else:
        try:
            names = list(backends)
        except TypeError:
            raise BackendError(
                f"backends must be None, a name, a comma-separated string or a list of names; got {backends!r}"
            ) from None
    if not names:
        raise BackendError(
            f"the backend list is empty; pass None for every live backend, or some of: "
            f"{', '.join(available_backends(include_optin=True))}"
        )
    out: list[Backend] = []
    for n in names:
        if isinstance(n, Backend):  # an unregistered backend object (a precision sweep's settings)
            if n.name in (ORACLE, REFERENCE) or n.name in [b.name for b in out]:
                raise BackendError(f"backend {n.name!r} is named twice or after the oracle or reference")
            out.append(n)
            continue
        if not isinstance(n, str):
            raise BackendError(f"backend names must be strings or Backend objects, got {n!r}")
        if n not in _REGISTRY:
            live = available_backends(include_optin=True)
            raise BackendError(
                f"unknown backend {n!r}{did_you_mean(n, [*live, *_REGISTRY])}; live here: {', '.join(live)}"
            )
        if n in (ORACLE, REFERENCE):
            continue  # always run as oracle / reference, never as a candidate
        if n not in [b.name for b in out]:
            out.append(_REGISTRY[n])
    return out
