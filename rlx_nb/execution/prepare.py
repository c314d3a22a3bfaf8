"""Private copies of what the user gave: the model (eval mode, float32, CPU, uncompiled) and the inputs.

Every backend runs on copies, never on the user's own model or tensors; this module makes them,
and names parameters as the user's model does.
"""

from __future__ import annotations

import functools
import gc
import re
import sys
import threading
import warnings
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from rlx_nb._support.copies import module_copy, shared_copy
from rlx_nb._support.hugepages import private_copy, raw_bytes
from rlx_nb._support.tree import flatten, map_tensors
from rlx_nb.errors import InputError
from rlx_nb.execution.results import OK, BackendRun


class CallableModule(torch.nn.Module):
    # Lets a plain callable travel through the same copy/eval/float path as a Module.
    def __init__(self, fn: Callable) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)


class KeywordModule(torch.nn.Module):
    # Dict inputs become positional, so every backend sees fn(model, tuple).
    def __init__(self, model: torch.nn.Module, keys: list[str]) -> None:
        super().__init__()
        self.model = model
        self.keys = keys

    def forward(self, *args: Any) -> Any:
        return self.model(**dict(zip(self.keys, args, strict=False)))


def normalize_inputs(inputs: Any) -> tuple[tuple, list[str] | None]:
    """``(positional tuple, keyword names or None)`` from a tensor, tuple/list or dict."""
    if isinstance(inputs, torch.Tensor):
        return (inputs,), None
    if isinstance(inputs, Mapping):
        bad = [k for k in inputs if not isinstance(k, str)]
        if bad:
            raise InputError(f"dict inputs need string keys (argument names); got {bad[0]!r}")
        return tuple(inputs.values()), list(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), None
    raise InputError(
        f"inputs must be a tensor, a tuple/list of arguments or a dict of keyword arguments; "
        f"got {type(inputs).__name__}"
    )


def prepare_model(model: Any, params: Mapping[str, torch.Tensor] | None, keys: list[str] | None) -> torch.nn.Module:
    """A private copy of ``model``: eval mode, floating params/buffers in float32, on the CPU, params loaded.

    The copy is eager: ``torch.compile`` wrappers (a compiled model, compiled submodules, a compiled
    function) are taken off, with a warning, because the oracle and the fp64 reference are the eager
    model; ``cpu-inductor`` is the backend that compiles it.  (``Module.compile()`` needs nothing:
    a deep copy drops it.)
    """
    compiled_fn = None
    if isinstance(model, torch.nn.Module):
        base = module_copy(model, {})  # (copy.deepcopy(model), faster: rlx_nb._support.copies)
    elif callable(model):
        compiled_fn = getattr(model, "_torchdynamo_orig_callable", None)  # torch.compile(fn)
        base = CallableModule(compiled_fn or model)
    else:
        raise InputError(f"model must be a torch.nn.Module or a callable; got {type(model).__name__}")
    base, compiled_modules = _uncompiled(base)
    if compiled_modules:
        params = {_COMPILED_SEGMENT.sub("", name): value for name, value in (params or {}).items()}
    if compiled_fn is not None or compiled_modules:
        warnings.warn(
            "rlx_nb: the model is compiled with torch.compile; the oracle and the fp64 reference run it eagerly "
            "(its parameter names lose '_orig_mod.'). Add the backend 'cpu-inductor' to check the compiled "
            "code (with torch.compile's default options).",
            UserWarning,
            stacklevel=3,
        )
    _no_meta(base, set(params or ()))
    base = base.to("cpu")
    for t in list(base.parameters()) + list(base.buffers()):
        if t.is_floating_point() and t.dtype != torch.float32:
            t.data = t.data.float()
    base.eval()
    if params:
        _load_params(base, params)
    if keys is not None:
        base = KeywordModule(base, keys)
    return base


def _no_meta(model: torch.nn.Module, given: set[str]) -> None:
    # A tensor on the meta device has a shape and no values: nothing can run on it (torch's own error is a
    # NotImplementedError about copying out of it, from deep inside the copy).
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in named:
            if t.is_meta and name not in given:
                raise InputError(
                    f"the model's {kind} {name!r} is on the meta device: it has a shape but no values to run "
                    "(materialize the model first, e.g. model.to_empty(device='cpu') and load its weights)"
                )


def no_meta_inputs(args: tuple, names: Sequence[str]) -> None:
    """An :class:`~rlx_nb.InputError` naming an input on the meta device (a shape, no values)."""
    for at, leaf in flatten(dict(zip(names, args, strict=False))):
        if isinstance(leaf, torch.Tensor) and leaf.is_meta:
            raise InputError(f"input {at!r} is on the meta device: it has a shape but no values to run on")


_COMPILED_SEGMENT = re.compile(r"(?<![^.])_orig_mod\.")  # a compiled module's name segment


def _uncompiled(module: torch.nn.Module) -> tuple[torch.nn.Module, bool]:
    # ``module`` (a private copy) without torch.compile wrappers, and whether it had any.
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None:  # nothing was ever compiled in this process
        return module, False
    wrapper, found = eval_frame.OptimizedModule, False
    while isinstance(module, wrapper):
        module, found = module._orig_mod, True
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            while isinstance(child, wrapper):
                child, found = child._orig_mod, True
                setattr(parent, name, child)
    return module, found


def _load_params(module: torch.nn.Module, params: Mapping[str, torch.Tensor]) -> None:
    state = dict(module.named_parameters())
    state.update(dict(module.named_buffers()))
    for name, value in params.items():
        if name not in state:
            known = ", ".join(list(state)[:12]) + (" ..." if len(state) > 12 else "")
            raise InputError(f"params: unknown name {name!r}; the model has: {known}")
        if not isinstance(value, (torch.Tensor, np.ndarray)):
            raise InputError(f"params[{name!r}] must be a tensor or numpy array, got {type(value).__name__}")
        value = torch.as_tensor(value)
        target = state[name]
        if tuple(value.shape) != tuple(target.shape):
            raise InputError(
                f"params[{name!r}] has shape {tuple(value.shape)}; the model's {name} has {tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(value.to(target.dtype))


def _clone_inputs(args: tuple, narrow: bool = False) -> tuple:
    # Copies with the user's layout (rlx_nb._support.hugepages); ``narrow``: float64 tensors become float32.
    def copy(t: torch.Tensor) -> torch.Tensor:
        dtype = torch.float32 if narrow and t.dtype == torch.float64 else None
        return private_copy(t, dtype).requires_grad_(t.requires_grad)

    return map_tensors(copy, args)


def fresh_leaves(args: tuple) -> tuple:
    # New leaf tensors over the same storage: each run gets its own .grad without a copy.
    return map_tensors(lambda t: t.detach().requires_grad_(t.requires_grad), args)


class PrivateInputs:
    """One private copy of the user's inputs, shared by the runs and renewed only when a run changed it.

    Copying large inputs for every run costs a copy's time and memory each; instead the runs share
    one copy and tensor version counters (bumped by every in-place op, also through detached views)
    tell when a model wrote into its inputs, and the next run then gets a new copy.  The user's own
    tensors are never handed to a model.  The copies keep the user's memory layout (strides,
    channels-last, a view's alignment) and are ordinary tensors even when the user's were made under
    ``torch.inference_mode``.
    """

    def __init__(self, user_args: tuple, *, cast: str = "") -> None:
        self.user_args = user_args
        self.narrow = bool(cast)  # float64 inputs become float32 (a float64 default dtype: rlx_nb.run)
        self._renew()

    def _renew(self) -> None:
        self.args = _clone_inputs(self.user_args, self.narrow)
        self.versions = self._versions()

    def _versions(self) -> list[int]:
        return [t._version for _, t in flatten(self.args) if isinstance(t, torch.Tensor)]

    def after(self, run: BackendRun) -> None:
        # A run that failed or timed out (its thread may still be running) also gets a new copy, and so
        # does every run when the inputs hold objects (a cache), which a model may change without a version.
        if run.status != OK or self._objects or self._versions() != self.versions:
            self._renew()

    @functools.cached_property
    def _objects(self) -> bool:
        return _holds_objects(self.user_args)


def _holds_objects(obj: Any) -> bool:
    # Whether a nested input holds objects other than tensors, containers and plain values.
    if isinstance(obj, Mapping):
        return any(_holds_objects(v) for v in obj.values())
    if isinstance(obj, (tuple, list)):
        return any(_holds_objects(v) for v in obj)
    return not isinstance(obj, (torch.Tensor, bool, int, float, complex, str, type(None), torch.dtype, torch.device))


def user_name(model: torch.nn.Module, name: str) -> str:
    # Strip our wrappers' prefixes so names match the user's model.
    if isinstance(model, KeywordModule) and name.startswith("model."):
        return name[len("model.") :]
    if isinstance(model, CallableModule) and name.startswith("fn."):
        return name[len("fn.") :]
    return name


def named_params(model: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    for name, p in model.named_parameters():
        yield user_name(model, name), p


def tensors_crc(model: torch.nn.Module) -> int:
    """crc32s over the bytes of every CPU parameter and buffer of ``model``, as one number (~7 GB/s per core,
    without the GIL: the tensors are split in two halves by bytes, one summed in a second thread)."""
    tensors: list[torch.Tensor] = []
    seen: set[int] = set()
    for t in (*model.parameters(), *model.buffers()):
        if id(t) in seen or t.device.type != "cpu" or t.numel() == 0 or t.layout != torch.strided:
            continue
        seen.add(id(t))
        d = t.detach()
        tensors.append(d if d.is_contiguous() else d.contiguous())
    total = sum(d.numel() * d.element_size() for d in tensors)
    if total < CRC_SPLIT_BYTES:
        return _crc(tensors)
    cut, size = 0, 0
    while cut < len(tensors) and size < total // 2:
        size += tensors[cut].numel() * tensors[cut].element_size()
        cut += 1
    other: list[int] = []
    helper = threading.Thread(target=lambda: other.append(_crc(tensors[cut:])), name="rlx_nb:crc", daemon=True)
    helper.start()
    first = _crc(tensors[:cut])
    helper.join()
    return first | other[0] << 32


CRC_SPLIT_BYTES = 32 << 20
"""Models with more bytes than this have their crc computed in two threads."""


def _crc(tensors: list[torch.Tensor]) -> int:
    crc = 0
    for d in tensors:
        crc = zlib.crc32(raw_bytes(d), crc)
    return crc


class PrivateModel:
    """The run's one private copy of the user's model, and the copy each run gets of it.

    A whole copy of the weights per backend made a 124M-parameter model need 17x its size.  Here every run
    gets a :func:`shared_copy` (its weights are the private model's storage), and after each run the
    storage is checked (:func:`tensors_crc`): a run that wrote to its model's tensors (a backend fusing
    BatchNorm into a convolution in place; a model writing a cache buffer in its forward) gets a note, gets
    whole copies from then on (every run does, when the model itself writes: the oracle is the model), and
    the private model is rebuilt from the user's for the runs after it.  The user's own model is never
    shared with anything.

    The fp64 reference :meth:`lend` s the storage instead: its copy becomes the weights' only holder while it
    casts them to float64 one by one, so the float32 and float64 weights are never all held at once, and
    :meth:`reclaim` casts them back (float32 -> float64 -> float32 is exact: bit for bit the same weights).
    """

    WRITERS: ClassVar[set[str]] = set()
    """Backends seen writing to their model's tensors in this process: they get whole copies."""

    def __init__(self, build: Callable[[], torch.nn.Module]) -> None:
        self._build = build
        self.model = build()
        self._crc = tensors_crc(self.model)
        self.whole = False  # every run gets a whole copy (the model itself writes its tensors)
        self.written: list[str] = []  # the tensors the model writes when it runs (the oracle's run found them)
        self.released = False  # the weights were freed while a backend worked from a file (release)

    def copy_for(self, name: str) -> torch.nn.Module:
        """The model a run of backend ``name`` gets: a copy sharing the private model's weights; a whole copy for
        a backend that writes them, and, where the model itself writes its tensors, a whole copy each of whose
        calls starts from the state the oracle started from (:func:`starting_from`)."""
        if self.released:
            self.model, self.released = self._build(), False
            self._crc = tensors_crc(self.model)
        if self.whole:
            return starting_from(module_copy(self.model, {}), self.written)
        if name in self.WRITERS:
            return module_copy(self.model, {})
        return shared_copy(self.model)

    def after(self, name: str, *, oracle: bool = False) -> str:
        """Check the storage after a run of ``name``; a note ("" when nothing was written)."""
        if self.released or tensors_crc(self.model) == self._crc:
            return ""
        written, self.model = self.model, self._build()
        self._crc = tensors_crc(self.model)
        if oracle:
            self.whole = True
            fresh = dict(_named_tensors(self.model))
            self.written = [n for n, t in _named_tensors(written) if n in fresh and not torch.equal(t, fresh[n])]
            names = ", ".join(self.written[:4]) + (", ..." if len(self.written) > 4 else "")
            return (
                f"the model writes to its own state when it runs ({names or 'its parameters or buffers'}): every run "
                "gets a whole copy of it, each call of which starts from the state the oracle started from (a "
                "converted graph too: an exporter's own runs of the model no longer step it)"
            )
        self.WRITERS.add(name)
        return (
            f"{name} wrote to its model's parameters or buffers: the runs after it got a private model rebuilt "
            f"from yours, and {name} gets a whole copy of the model from now on"
        )

    def lend(self) -> tuple[torch.nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
        """A shared copy that holds the storage alone (the private model's tensors emptied meanwhile)."""
        lent = shared_copy(self.model) if not self.whole else module_copy(self.model, {})
        pairs = list(zip(_own_tensors(self.model), _own_tensors(lent), strict=True))
        if not self.whole:
            for mine, _ in pairs:
                mine.data = torch.empty(0, dtype=mine.dtype)
        return lent, pairs

    def reclaim(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], finished: bool) -> None:
        """Take the storage back from a lent copy: cast back where it was cast (exact), else as it is.

        ``finished=False`` (the lent copy's run may still be going, abandoned after a timeout): rebuild instead.
        """
        if self.whole:
            return
        if not finished:
            self.model = self._build()
            self._crc = tensors_crc(self.model)
            return
        for mine, theirs in pairs:
            data = theirs.detach()
            if data.dtype == mine.dtype:
                mine.data = data
            else:  # cast back one tensor at a time, each float64 copy freed at once (never both whole models)
                mine.data = data.to(mine.dtype)
                theirs.data = torch.empty(0, dtype=data.dtype)
            del data
        trim()

    def release(self, *holders: torch.nn.Module) -> bool:
        """Free the weights' memory while a backend works from a file (an ONNX export), if nothing kept pins it.

        The private model's tensors and those of ``holders`` (the backend's own shared copy) are emptied, so
        the storage they share is freed; the next :meth:`copy_for` rebuilds the private model from the
        user's.  Returns whether it released anything.
        """
        if self.whole or self.released:
            return False
        mine = _own_tensors(self.model)
        if self.pinned({t.untyped_storage().data_ptr() for t in mine}):
            return False
        for t in [*mine, *(t for m in holders for t in _own_tensors(m))]:
            t.data = torch.empty(0, dtype=t.dtype)
        self.released = True
        gc.collect()  # (a failed conversion's objects, in reference cycles, may still hold the storage)
        trim()
        return True

    @staticmethod
    def pinned(storages: set[int]) -> bool:
        """Whether a kept preparation (a compiled model sharing these weights) holds any of these storages."""
        from rlx_nb.execution import cache as preparations

        return preparations.holds_any(storages)


def trim() -> None:
    """Give memory the allocator keeps after large frees back to the system (glibc's ``malloc_trim``)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


@functools.cache
def _libc() -> Any:
    import ctypes
    import ctypes.util

    try:
        name = ctypes.util.find_library("c")
        libc = ctypes.CDLL(name) if name else None
        return libc if libc is not None and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def starting_from(model: torch.nn.Module, names: list[str]) -> torch.nn.Module:
    """``model``, each call of which first puts the tensors ``names`` (parameters or buffers it writes when it runs:
    a step counter, a running statistic) back to their values now.

    A model that steps its own state gave each backend another state: a converted backend's exporter runs the
    model once or twice while it traces (its copy stepped before the graph captured it), and a kept ExecuTorch
    program stepped its state at every run.  The restore is a forward pre-hook, so a tracer records it too: the
    converted graph starts from the same state on every run.

    Examples
    --------
    >>> class Count(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.register_buffer("n", torch.zeros(()))
    ...     def forward(self, x):
    ...         self.n += 1
    ...         return x * self.n
    >>> m = starting_from(Count(), ["n"])
    >>> [float(m(torch.ones(()))) for _ in range(3)]
    [1.0, 1.0, 1.0]
    """
    if not names:
        return model
    tensors = dict(_named_tensors(model))
    start = [(n, tensors[n].detach().clone()) for n in names if n in tensors]

    def restore(module: torch.nn.Module, args: Any) -> None:
        # (each tensor looked up by its name on the module: a tracer puts its own in their place while it traces)
        for name, value in start:
            owner, _, leaf = name.rpartition(".")
            t = getattr(module.get_submodule(owner) if owner else module, leaf)
            if t.requires_grad:
                with torch.no_grad():
                    t.copy_(value)
            else:
                t.copy_(value)

    model.register_forward_pre_hook(restore)
    return model


def _named_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*model.named_parameters(), *model.named_buffers()]


def _own_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    # Parameters and buffers in a fixed order, each once (tied weights once).
    return [*model.parameters(), *model.buffers()]
