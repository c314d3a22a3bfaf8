"""Preparations kept across calls: a compile, an ONNX export, an OpenVINO conversion is made once.

A backend with a ``prepare`` step (``Backend.prepare(model, inputs) -> runner``; the built-in
``cpu-inductor``, ``cuda-inductor``, ``onnxruntime``, ``openvino`` and ``openvino-default`` have one)
pays its compile or export on the first call only.  A later call — a re-run cell, a check on new
input values, every check ``localize`` makes of the same module — reuses the preparation when all of
these are the same:

- the backend (its registration) and the global settings that change what it computes (float32
  matmul precision, TF32 and oneDNN switches, deterministic algorithms, thread count);
- the model's structure: every module's class and name, its plain attributes (an ``eps``, a flag), its
  hooks; every parameter's, buffer's and tensor attribute's name, dtype, shape **and values** (a hash);
- the inputs' structure, shapes, dtypes, devices and which require gradients (not their values);
- forward only, or forward and backward.

Anything else a model's forward reads (a global, a closure of a plain callable) is not seen: call
:func:`clear_preparations` after changing such state.  A reused compile is still checked on every
call: compiled code must run (:mod:`rlx_nb.backends.compiled`), or the run is an error row, never an
eager run under a compiled name.  The run's notes say when a preparation was reused.  At most
:data:`MAX_ENTRIES` are kept, and together they hold at most half of the memory that was free when the
run began (what making each added to the process), least recently used first out; a phase that needs
the room drops them first.  A forward-only backend's preparation (an ONNX Runtime session, an OpenVINO
compiled model) holds the converted model only, not a copy of the weights.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import gc
import threading
import time
import types
import weakref
import zlib
from collections.abc import Callable
from typing import Any

import torch

from rlx_nb._support.hugepages import raw_bytes
from rlx_nb._support.tree import flatten
from rlx_nb.backends.notes import add_note
from rlx_nb.errors import still_interrupted
from rlx_nb.execution.fingerprints import fingerprint

MAX_ENTRIES = 8
"""Preparations kept at once; each holds a copy of the model and its compiled or exported form."""

_PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)
_SKIP_ATTRS = {"_parameters", "_buffers", "_modules", "training", "_compiled_call_impl"}


@dataclasses.dataclass
class Preparation:
    """One kept preparation: the model copy it was made for and the runner that runs it."""

    backend: str
    model: Any
    runner: Callable[[tuple], Any]
    notes: list[str]
    seconds: float
    made_at: float
    held_bytes: int = 0
    """Memory the preparation holds (what making it added to the process's resident memory)."""
    uses: int = 0


_CACHE: collections.OrderedDict[tuple, Preparation] = collections.OrderedDict()
_LOCK = threading.Lock()


def _tensor_key(t: torch.Tensor) -> tuple:
    # dtype, shape and a crc32 of the bytes (~7 GB/s: the key of a 1.1B-parameter model is hashed in 0.6 s,
    # where sha256 took 2.2 s); with the structure around it, two models that share a key differ nowhere
    # (a collision needs another model of the same structure whose every tensor's crc32 agrees).
    if t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized:
        return (str(t.device), t.requires_grad, fingerprint(t))
    d = t.detach()
    d = d if d.is_contiguous() else d.contiguous()
    crc = zlib.crc32(raw_bytes(d)) if d.numel() else 0
    return (str(t.device), t.requires_grad, str(t.dtype), tuple(t.shape), crc)


class _Same:
    """A key part that is equal only to the same object, which it holds (so its id cannot be reused while the key
    lives): what a deep copy shares (a function, a class, a Tensor method) and what no value key can read."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __repr__(self) -> str:
        return f"<the same {type(self.obj).__name__} at {id(self.obj):#x}>"


def _value_key(v: Any, depth: int = 0) -> Any:
    # Equal for equal values, also across deep copies: plain values and tensors by value, containers item by item,
    # functions, classes and every other callable by identity (a deep copy keeps them; two distinct ones never
    # share a key: Tensor.abs and Tensor.neg were both "a method_descriptor"), other objects by their attributes (a
    # few levels deep, then by identity).
    if isinstance(v, _PLAIN):
        return (type(v), v)
    if isinstance(v, torch.Tensor):
        return _tensor_key(v)
    if isinstance(v, functools.partial):
        return (functools.partial, *(_value_key(x, depth + 1) for x in (v.func, v.args, v.keywords)))
    if isinstance(v, (type, types.ModuleType, types.FunctionType, types.MethodType)) or (
        callable(v) and not getattr(v, "__dict__", None)  # (a builtin, a method descriptor, a wrapper: no state)
    ):
        return (type(v), _Same(v))
    if depth > 3:
        return (type(v), _Same(v))
    if isinstance(v, (tuple, list)):
        return (type(v), tuple(_value_key(x, depth + 1) for x in v))
    if isinstance(v, (set, frozenset)):
        return (type(v), tuple(sorted((_value_key(x, depth + 1) for x in v), key=repr)))
    if isinstance(v, dict):
        return (dict, tuple(sorted(((repr(k), _value_key(x, depth + 1)) for k, x in v.items()), key=repr)))
    if hasattr(v, "__dict__"):
        return (type(v), _value_key(vars(v), depth + 1))
    return (type(v), _Same(v))


def _graph_key(module: torch.fx.GraphModule) -> tuple:
    # A graph computes what its code says with the tensors it holds: its code, its input and output specs, its
    # tensor attributes by value and its hooks.  (fx makes a class per instance and keeps tracer state and meta
    # with object ids: a copy of the same graph, or the same cut made again, would never match by its attributes.)
    codegen = getattr(module.graph, "_codegen", None)
    info = getattr(codegen, "pytree_info", None)
    tensors = tuple(sorted((k, _tensor_key(v)) for k, v in vars(module).items() if isinstance(v, torch.Tensor)))
    hooks = tuple(
        (k, tuple(id(h) for h in v.values()))
        for k, v in vars(module).items()
        if k.endswith("_hooks") and isinstance(v, dict) and v
    )
    return (module.code, str(info), tensors, hooks)


def model_key(model: Any) -> tuple:
    """What a preparation depends on in ``model``: structure, plain attributes, hooks, tensor values."""
    if not isinstance(model, torch.nn.Module):
        return (type(model), _Same(model))
    parts: list[Any] = []
    for name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, torch.fx.GraphModule):
            parts.append((name, torch.fx.GraphModule, _graph_key(module)))
            continue
        attrs = tuple(
            sorted(
                (k, _value_key(v))
                for k, v in vars(module).items()
                if k not in _SKIP_ATTRS and not (k.startswith("_") and k.endswith("_hooks"))
            )
        )
        hooks = tuple(
            (k, tuple(id(h) for h in v.values()))
            for k, v in vars(module).items()
            if k.endswith("_hooks") and isinstance(v, dict) and v
        )
        parts.append((name, type(module), attrs, hooks))
    for name, t in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)):
        parts.append((name, _tensor_key(t)))
    return tuple(parts)


def inputs_key(args: tuple) -> tuple:
    """The inputs' structure, shapes, dtypes, devices and gradient flags (not their values)."""
    key = []
    for name, leaf in flatten(args):
        if isinstance(leaf, torch.Tensor):
            key.append((name, str(leaf.dtype), tuple(leaf.shape), str(leaf.device), leaf.requires_grad))
        else:
            key.append((name, _value_key(leaf)))
    return tuple(key)


def global_settings() -> dict[str, Any]:
    """The global switches that change what a model computes, compiled, exported or eager."""
    return {
        "torch": torch.__version__,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cuda_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "mkldnn_enabled": torch.backends.mkldnn.enabled,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "threads": torch.get_num_threads(),
    }


def settings_key() -> tuple:
    """:func:`global_settings` as a cache-key part."""
    return tuple(global_settings().items())


_MODEL_KEYS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def key(backend: Any, model: Any, args: tuple, backward: bool) -> tuple:
    """The cache key of one preparation.

    ``model`` is a run's private copy, which no run changes (each runs a deep copy of it): its key, a
    hash of every weight, is computed once per run, not once per backend.
    """
    try:
        mkey = _MODEL_KEYS[model]
    except (KeyError, TypeError):
        mkey = model_key(model)
        if isinstance(model, torch.nn.Module):
            _MODEL_KEYS[model] = mkey
    return (backend, settings_key(), mkey, inputs_key(args), bool(backward))


def lookup(k: tuple) -> Preparation | None:
    with _LOCK:
        found = _CACHE.get(k)
        if found is not None:
            _CACHE.move_to_end(k)
            found.uses += 1
        return found


def store(k: tuple, prep: Preparation) -> None:
    with _LOCK:
        _CACHE[k] = prep
        _CACHE.move_to_end(k)
        while len(_CACHE) > MAX_ENTRIES:
            _CACHE.popitem(last=False)


def fit(budget: int | None) -> None:
    """Drop the least recently used preparations until what they hold is within ``budget`` bytes (a run's
    share of the memory that was free when it began, :class:`rlx_nb.execution.run.Memory`)."""
    dropped = False
    with _LOCK:
        while budget is not None and _CACHE and sum(p.held_bytes for p in _CACHE.values()) > budget:
            _CACHE.popitem(last=False)
            dropped = True
    if dropped:
        gc.collect()  # compiled graphs and sessions hold reference cycles


def drop_oldest(count: int = 1) -> bool:
    """Drop the ``count`` least recently used preparations (to make room for a phase), then collect what they held
    once; False when none is kept."""
    with _LOCK:
        if not _CACHE:
            return False
        for _ in range(min(count, len(_CACHE))):
            _CACHE.popitem(last=False)
    gc.collect()
    return True


def holds_any(storages: set[int]) -> bool:
    """Whether a kept preparation's model holds a tensor in one of these storages (by data pointer)."""
    with _LOCK:
        models = [p.model for p in _CACHE.values() if isinstance(p.model, torch.nn.Module)]
    return any(t.untyped_storage().data_ptr() in storages for m in models for t in (*m.parameters(), *m.buffers()))


def forget(k: tuple) -> None:
    with _LOCK:
        _CACHE.pop(k, None)


def run_kept(k: tuple, prep: Preparation, args: tuple) -> Any:
    """Run ``prep``, the preparation kept under ``k``, on ``args``: the notes its making left are said again, with
    one saying it was reused, and a preparation that fails is forgotten (never reused).  What a float run
    (:mod:`rlx_nb.execution.execute`) and an int8 runtime (:mod:`rlx_nb.int8.run`) both do with a kept one."""
    for note in prep.notes:
        add_note(note)
    add_note(
        f"reused the preparation an earlier call made {time.time() - prep.made_at:.0f} s ago "
        f"({prep.seconds:.2f} s to make); rlx_nb.clear_preparations() drops it"
    )
    try:
        return prep.runner(args)
    except Exception as _stop:
        still_interrupted(_stop)
        forget(k)
        raise


def clear_preparations() -> int:
    """Drop every kept preparation (compiles, exports, conversions); returns how many there were.

    Examples
    --------
    >>> import rlx_nb
    >>> rlx_nb.clear_preparations() >= 0
    True
    """
    with _LOCK:
        n = len(_CACHE)
        _CACHE.clear()
    return n


def kept_preparations() -> list[dict[str, Any]]:
    """The kept preparations, oldest first: backend, seconds it took, uses since, age in seconds, bytes held."""
    now = time.time()
    with _LOCK:
        return [
            {
                "backend": p.backend,
                "seconds": p.seconds,
                "reuses": p.uses,
                "age_s": now - p.made_at,
                "bytes": p.held_bytes,
            }
            for p in _CACHE.values()
        ]


__all__ = ["MAX_ENTRIES", "Preparation", "clear_preparations", "kept_preparations"]
