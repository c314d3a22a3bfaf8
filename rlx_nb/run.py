"""Run one model on the oracle, the fp64 reference and candidate backends.

The result, :class:`RunResults`, holds only plain numpy outputs and
metadata, so it can be saved, loaded or gathered before any comparison runs.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import hashlib
import platform
import re
import sys
import threading
import time
import traceback
import warnings
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch

from rlx_nb._memory import private_copy
from rlx_nb.backends import ORACLE, REFERENCE, Backend, get_backend, resolve_backends
from rlx_nb.backends.eager import run_eager
from rlx_nb.backends.emulated import emulate
from rlx_nb.backends.notes import collecting
from rlx_nb.errors import InputError
from rlx_nb.progress import bar
from rlx_nb.reassoc import CountReductions, SequentialSums
from rlx_nb.tree import Opaque, flatten, map_tensors

OK, ERROR, SKIPPED = "ok", "error", "skipped"
ANCHOR_BITS = (8, 11)
GRAD_PREFIX = "grad:"


class Leaf:
    """One named output of one run: a numpy array (or a plain value) and the torch dtype it came as.

    ``value`` may be loaded lazily (a report read from disk reads an array on first access).  A
    backend that compares on its device (:attr:`Backend.keeps_outputs_on_device`) leaves the
    output there as ``tensor``; the host copy behind ``value`` is then made on first access only,
    and the metrics run on the device.
    """

    __slots__ = ("_loader", "_value", "dtype", "shape", "tensor")

    def __init__(
        self,
        value: Any = None,
        dtype: str = "",
        shape: tuple[int, ...] | None = None,
        loader: Callable[[], Any] | None = None,
        tensor: torch.Tensor | None = None,
    ) -> None:
        self._value, self._loader, self.dtype, self.shape, self.tensor = value, loader, dtype, shape, tensor

    @property
    def value(self) -> Any:
        if self._loader is not None:
            self._value, self._loader = self._loader(), None
        if self._value is None and self.tensor is not None:
            self._value = self.tensor.cpu().numpy()  # the host copy, on first use (the tensor is contiguous)
        return self._value

    @property
    def loaded(self) -> bool:
        return self._loader is None

    @property
    def on_device(self) -> bool:
        """True while the output exists only on its device (no host copy made yet)."""
        return self.tensor is not None and self._value is None

    @property
    def is_array(self) -> bool:
        return self.shape is not None

    @property
    def nbytes(self) -> int:
        """Bytes this output holds now (device tensor plus host copy), without making a host copy.

        0 for plain values and for arrays not read from disk yet.
        """
        size = self.tensor.numel() * self.tensor.element_size() if self.tensor is not None else 0
        if self._loader is None and self._value is not None and self.is_array:
            size += self._value.nbytes
        return size

    def __repr__(self) -> str:
        where = f", on {self.tensor.device}" if self.tensor is not None else ""
        return f"Leaf(dtype={self.dtype!r}, shape={self.shape!r}, loaded={self.loaded}{where})"


@dataclasses.dataclass
class BackendRun:
    """Everything one backend produced: named outputs (and ``grad:`` outputs), status, timing."""

    backend: str
    status: str
    outputs: dict[str, Leaf]
    message: str = ""
    seconds: float = 0.0
    grad_status: str | None = None
    grad_message: str = ""
    compute_dtype: str = "float32"
    reduction_lengths: dict[str, int] = dataclasses.field(default_factory=dict)
    """For ``grad:<param>`` outputs: about how many terms the backward sums into each element."""
    notes: list[str] = dataclasses.field(default_factory=list)
    """What the backend said about how it ran (:func:`rlx_nb.backends.notes.add_note`): a route, graph breaks."""
    detail: str = ""
    """A failed run's whole error (every line, chained causes, where it was raised); ``message`` is its gist."""


@dataclasses.dataclass
class RunResults:
    """The oracle, the fp64 reference and each candidate's outputs, plus the environment."""

    label: str
    oracle: BackendRun
    reference: BackendRun
    candidates: dict[str, BackendRun]
    backward: bool
    environment: dict[str, Any]
    fingerprints: dict[str, str] = dataclasses.field(default_factory=dict)
    """``inputs`` and ``model``: sha256 of the tensors' dtypes, shapes and bytes (nodes must agree on inputs)."""
    anchors: dict[int, BackendRun] = dataclasses.field(default_factory=dict)
    """Runs with matmul/conv operands rounded to 8 and 11 bits: the effective-precision scale."""
    sequential: BackendRun | None = None
    """The model in float32 with plain sequential reductions (:mod:`rlx_nb.reassoc`): a second
    legitimate error next to the oracle's.  ``None`` when the model has no reduction it changes
    (it would repeat the oracle) or the run failed; when only its backward failed, it holds the
    forward outputs.  A failure's reason is in ``environment["sequential_failed"]``."""

    @property
    def output_names(self) -> list[str]:
        return list(self.oracle.outputs)


class _CallableModule(torch.nn.Module):
    # Lets a plain callable travel through the same copy/eval/float path as a Module.
    def __init__(self, fn: Callable) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)


class _KeywordModule(torch.nn.Module):
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
        base = copy.deepcopy(model)
    elif callable(model):
        compiled_fn = getattr(model, "_torchdynamo_orig_callable", None)  # torch.compile(fn)
        base = _CallableModule(compiled_fn or model)
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
    base = base.to("cpu")
    for t in list(base.parameters()) + list(base.buffers()):
        if t.is_floating_point() and t.dtype != torch.float32:
            t.data = t.data.float()
    base.eval()
    if params:
        _load_params(base, params)
    if keys is not None:
        base = _KeywordModule(base, keys)
    return base


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


OPAQUE = "opaque"
"""The dtype of a leaf that is neither a tensor nor a plain value: it is named, never compared."""


def _to_leaf(value: Any, keep_on_device: bool = False) -> Leaf:
    if isinstance(value, Opaque):
        return Leaf(value.type_name, OPAQUE, None)
    if not isinstance(value, torch.Tensor):
        return Leaf(value, type(value).__name__, None)
    t = value.detach()
    dtype = str(t.dtype).removeprefix("torch.")
    if t.dtype == torch.bfloat16:
        t = t.float()  # numpy has no bfloat16 (nor do the device metrics); the dtype name keeps the truth
    if keep_on_device and t.dtype in (torch.float32, torch.float16):
        return Leaf(None, dtype, tuple(t.shape), tensor=t.contiguous())
    arr = t.to("cpu").resolve_conj().resolve_neg().numpy()
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)  # (not on 0-d outputs: it would make them 1-d)
    return Leaf(arr, dtype, tuple(arr.shape))


def _clone_inputs(args: tuple) -> tuple:
    return map_tensors(lambda t: private_copy(t).requires_grad_(t.requires_grad), args)


def _fresh_leaves(args: tuple) -> tuple:
    # New leaf tensors over the same storage: each run gets its own .grad without a copy.
    return map_tensors(lambda t: t.detach().requires_grad_(t.requires_grad), args)


class _PrivateInputs:
    """One private copy of the user's inputs, shared by the runs and renewed only when a run changed it.

    Copying large inputs for every run costs a copy's time and memory each; instead the runs share
    one copy and tensor version counters (bumped by every in-place op, also through detached views)
    tell when a model wrote into its inputs, and the next run then gets a new copy.  The user's own
    tensors are never handed to a model.
    """

    def __init__(self, user_args: tuple) -> None:
        self.user_args = user_args
        self._renew()

    def _renew(self) -> None:
        self.args = _clone_inputs(self.user_args)
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


@functools.lru_cache(maxsize=256)
def loss_weight(name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Fixed random weights for one output: the default loss is ``sum(out * w)`` over outputs.

    Random weights (not a plain sum) keep gradients generic: the sum of a
    softmax is constant, so its gradient would be zero.  Seeded by the
    output's name, so every backend and every node uses the same weights.
    """
    w = np.random.default_rng(zlib.crc32(name.encode())).standard_normal(shape)
    w.setflags(write=False)
    return w


def _default_loss(out: Any) -> torch.Tensor | None:
    total = None
    for name, leaf in flatten(out):
        if not isinstance(leaf, torch.Tensor) or not leaf.requires_grad or not leaf.is_floating_point():
            continue
        w = torch.tensor(loss_weight(name, tuple(leaf.shape)), dtype=leaf.dtype, device=leaf.device)
        term = (leaf * w).sum()
        total = term if total is None else total + term.to(total.dtype)
    return total


def execute(
    backend: Backend,
    base: torch.nn.Module,
    args: tuple,
    *,
    backward: bool,
    loss: Callable[[Any], torch.Tensor] | None,
    grad_inputs: list[int],
    input_names: list[str],
    measure_reductions: bool = False,
    timeout_s: float | None = None,
    scope: Callable[[], Any] | None = None,
) -> BackendRun:
    """Run one backend on a fresh copy of the model; never raises for a backend failure.

    The run gets new leaf tensors over ``args``' storage, not copies: ``args`` must be the
    caller's private copy (:func:`run` keeps one in :class:`_PrivateInputs`).  With
    ``timeout_s``, the backend runs in a worker thread; one still running after that long
    becomes an error row and its thread is abandoned (Python cannot kill a thread).
    """
    reason = backend.unavailable_reason()
    if reason is not None:
        return BackendRun(backend.name, ERROR, {}, f"not available here: {reason}", compute_dtype=backend.compute_dtype)
    kwargs = dict(
        backward=backward,
        loss=loss,
        grad_inputs=grad_inputs,
        input_names=input_names,
        measure_reductions=measure_reductions,
        scope=scope,
    )
    if timeout_s is None:
        return _execute(backend, base, args, **kwargs)
    box: list[BackendRun] = []
    worker = threading.Thread(
        target=lambda: box.append(_execute(backend, base, args, **kwargs)), daemon=True, name=f"rlx_nb:{backend.name}"
    )
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive() or not box:
        return BackendRun(
            backend.name,
            ERROR,
            {},
            f"timed out after {timeout_s:g} s (raise timeout_s if it is only slow); its thread was abandoned",
            float(timeout_s),
            compute_dtype=backend.compute_dtype,
        )
    return box[0]


def _execute(
    backend: Backend,
    base: torch.nn.Module,
    args: tuple,
    *,
    backward: bool,
    loss: Callable[[Any], torch.Tensor] | None,
    grad_inputs: list[int],
    input_names: list[str],
    measure_reductions: bool,
    scope: Callable[[], Any] | None = None,
) -> BackendRun:
    # ``scope``: a context manager factory entered around the forward and the backward.
    with scope() if scope is not None else contextlib.nullcontext():
        return _execute_in(backend, base, args, backward, loss, grad_inputs, input_names, measure_reductions)


def _execute_in(backend, base, args, backward, loss, grad_inputs, input_names, measure_reductions) -> BackendRun:
    model = copy.deepcopy(base)
    fresh = _fresh_leaves(args)
    start = time.perf_counter()
    sizes = {} if (backward and measure_reductions) else None
    hooks = _record_output_sizes(model, sizes) if sizes is not None else []
    try:
        with collecting() as notes, torch.enable_grad() if backward else torch.no_grad():
            if backward:
                for p in model.parameters():
                    if p.is_floating_point():
                        p.requires_grad_(True)
            out = backend.fn(model, fresh)
        keep = backend.keeps_outputs_on_device
        outputs = {name: _to_leaf(v, keep) for name, v in flatten(out)}
        _remove(hooks)
    except Exception as exc:
        _remove(hooks)
        return BackendRun(
            backend.name,
            ERROR,
            {},
            describe_error(exc),
            time.perf_counter() - start,
            compute_dtype=backend.compute_dtype,
            notes=notes,
            detail=error_detail(exc),
        )
    run = BackendRun(backend.name, OK, outputs, seconds=0.0, compute_dtype=backend.compute_dtype, notes=notes)
    if sizes is not None:
        run.reduction_lengths = _reduction_lengths(model, sizes)
    if backward:
        _backward(run, backend, model, out, fresh, loss, grad_inputs, input_names)
    run.seconds = time.perf_counter() - start
    return run


def _backward(run, backend, model, out, fresh, loss, grad_inputs, input_names) -> None:
    if not backend.differentiable:
        run.grad_status, run.grad_message = SKIPPED, f"{backend.name} cannot differentiate (forward only)"
        return
    try:
        value = loss(out) if loss is not None else _default_loss(out)
        if value is None or not isinstance(value, torch.Tensor) or not value.requires_grad:
            run.grad_status = SKIPPED
            run.grad_message = f"{backend.name}'s outputs carry no gradient"
            return
        if value.numel() != 1:
            raise ValueError(f"loss must be a scalar tensor, got shape {tuple(value.shape)}")
        value.backward()
    except Exception as exc:
        run.grad_status, run.grad_message, run.detail = ERROR, describe_error(exc), error_detail(exc)
        return
    keep = backend.keeps_outputs_on_device
    for name, p in _named_params(model):
        if p.grad is not None:
            run.outputs[GRAD_PREFIX + name] = _to_leaf(p.grad, keep)
    for i in grad_inputs:
        g = fresh[i].grad
        if g is not None:
            run.outputs[GRAD_PREFIX + input_names[i]] = _to_leaf(g, keep)
    run.grad_status = OK


def _record_output_sizes(model: torch.nn.Module, sizes: dict[str, int]) -> list:
    # Each module's output size (its first tensor output), for the reduction lengths below.
    def hook(name):
        def fn(module, args, out):
            leaves = [v for _, v in flatten(out) if isinstance(v, torch.Tensor)]
            if leaves:
                sizes[name] = max(sizes.get(name, 0), leaves[0].numel())

        return fn

    return [m.register_forward_hook(hook(n)) for n, m in model.named_modules()]


def _remove(hooks: list) -> None:
    for h in hooks:
        h.remove()


def _reduction_lengths(model: torch.nn.Module, sizes: dict[str, int]) -> dict[str, int]:
    # A parameter's gradient sums one term per use: about (module output size)
    # / (its leading dimension) terms per element -- batch rows for a Linear,
    # N*H*W for a conv or BatchNorm channel, tokens for a LayerNorm.
    lengths = {}
    for mod_name, module in model.named_modules():
        out = sizes.get(mod_name)
        if not out:
            continue
        for p_name, p in module.named_parameters(recurse=False):
            full = _user_name(model, f"{mod_name}.{p_name}" if mod_name else p_name)
            lead = p.shape[0] if p.dim() else 1
            lengths[GRAD_PREFIX + full] = max(1, out // max(1, lead))
    return lengths


def _user_name(model: torch.nn.Module, name: str) -> str:
    # Strip our wrappers' prefixes so names match the user's model.
    if isinstance(model, _KeywordModule) and name.startswith("model."):
        return name[len("model.") :]
    if isinstance(model, _CallableModule) and name.startswith("fn."):
        return name[len("fn.") :]
    return name


def _named_params(model: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    for name, p in model.named_parameters():
        yield _user_name(model, name), p


# Lines of an error message that state a cause rather than where a check sits: converters and
# compilers put the specific line (the unsupported op, the failed conversion) deep in a long message.
_CAUSE = re.compile(
    r"no conversion rule|conversion is failed|failed for|not supported|unsupported|not implemented|"
    r"no (?:kernel|implementation|rule)|could not|couldn't|cannot|can't|unknown|missing|invalid|mismatch|"
    r"out of (?:the )?range|expected|unexpected|does not|doesn't|illegal|overflow|out of memory",
    re.IGNORECASE,
)
_NOISE = re.compile(r"^(?:check '.*' failed at \S+:\d+:?|file \".*\", line \d+.*|\^+|-+|summary:?|traceback.*)$", re.I)
REASON_CHARS = 600


def _message_lines(exc: BaseException) -> list[str]:
    # The meaningful lines of an exception's message and of the exceptions it was raised from.
    lines: list[str] = []
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        for line in str(exc).splitlines():
            line = line.strip(" \t-:>")
            if line and not _NOISE.match(line) and line not in lines:
                lines.append(line)
        exc = exc.__cause__ or exc.__context__
    return lines


def describe_error(exc: BaseException) -> str:
    """One readable line for an error row: the exception's type, its first line and the lines that
    state the cause (for a converter, the operations it could not convert), and where it was raised."""
    lines = _message_lines(exc)
    specific = [line for line in lines[1:] if _CAUSE.search(line)]
    # A summary line (the last specific one, e.g. "Conversion is failed for: aten::cat") is the most telling.
    chosen = lines[:1] + (specific[-1:] + specific[:-1] if specific else lines[-1:] if len(lines) > 1 else [])
    text = " | ".join(dict.fromkeys(chosen))
    where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    loc = f" (at {where.name})" if where else ""
    text = f"{type(exc).__name__}: {text}"
    return (text if len(text) <= REASON_CHARS else text[: REASON_CHARS - 3] + "...") + loc


def error_detail(exc: BaseException) -> str:
    """The whole error: every line of the message, chained causes and the traceback."""
    return "".join(traceback.format_exception(exc)).rstrip()


def environment() -> dict[str, Any]:
    """Where this run happened: host, versions, devices."""
    from rlx_nb import __version__

    env: dict[str, Any] = {
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "rlx_nb": __version__,
        "cuda": torch.version.cuda,
        "threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        env["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return env


def run(
    model: Any,
    inputs: Any,
    *,
    params: Mapping[str, torch.Tensor] | None = None,
    backends: str | Iterable[str] | None = None,
    backward: bool = False,
    loss: Callable[[Any], torch.Tensor] | None = None,
    label: str | None = None,
    progress: Callable[[str], None] | bool | None = None,
    timeout_s: float | None = 600.0,
    check_determinism: bool = True,
    effective_precision: bool = True,
) -> RunResults:
    """Run ``model`` on the oracle, the fp64 reference and each candidate backend.

    Returns numpy outputs only; :func:`rlx_nb.compare` turns them into a report.
    The oracle must run: if the model fails on it, that is the user's error
    and raises :class:`~rlx_nb.InputError` with the model's message.  Candidates (and the fp64
    reference) that run longer than ``timeout_s`` become error rows.  With ``check_determinism``
    the oracle runs twice; outputs that differ between the two runs are the model's own
    nondeterminism and are recorded in ``environment["nondeterministic"]`` (the comparison then
    says so instead of blaming a backend).
    """
    candidates = resolve_backends(backends)
    args, keys = normalize_inputs(inputs)
    base = prepare_model(model, params, keys)
    input_names = keys or [f"input[{i}]" for i in range(len(args))]
    grad_inputs = [i for i, x in enumerate(args) if isinstance(x, torch.Tensor) and x.requires_grad]
    if grad_inputs and not backward:
        args = map_tensors(lambda t: t.detach(), args)
    common = dict(backward=backward, loss=loss, grad_inputs=grad_inputs, input_names=input_names)

    say = progress if callable(progress) else (lambda _: None)
    inputs_ = _PrivateInputs(args)

    def go(backend: Backend, **kw: Any) -> BackendRun:
        result = execute(backend, base, inputs_.args, **common, **kw)
        inputs_.after(result)
        return result

    # A run under this dispatch mode counts the matmul-like calls the precision anchors would round
    # (without any, the anchors would only repeat the oracle, so they are not run) and the reductions a
    # plain sequential kernel would sum in another order.  A dispatch mode sees the ops the model's own
    # run executes and changes none of them: a torch-function mode would not do, because it turns off
    # PyTorch's inference fast paths (nn.TransformerEncoderLayer, nn.MultiheadAttention).
    counter = _CountCalls()
    say(ORACLE)
    # Without a second run to count in, the oracle's own run counts.
    oracle = go(get_backend(ORACLE), measure_reductions=True, scope=None if check_determinism else lambda: counter)
    if oracle.status != OK:
        raise InputError(f"the model fails on the CPU oracle, so nothing can be compared: {oracle.message}")
    if backward and oracle.grad_status != OK:
        raise InputError(f"backward=True but the oracle's backward did not run: {oracle.grad_message}")
    unstable = {}
    if check_determinism:
        unstable = _nondeterministic(oracle, go(get_backend(ORACLE), scope=lambda: counter))
    say(REFERENCE)
    reference = go(get_backend(REFERENCE), timeout_s=timeout_s)
    sequential = None
    if counter.calls != 0:
        say("sequential")
        sequential = go(Backend("sequential", run_eager, hookable=True), timeout_s=timeout_s, scope=SequentialSums)
    failed = _why(sequential) if sequential is not None else ""
    anchors = {}
    if effective_precision and counter.matmuls != 0:
        for bits in ANCHOR_BITS:
            anchor = Backend(f"anchor:{bits}", emulate(bits, results=True), hookable=True)
            anchors[bits] = go(anchor, timeout_s=timeout_s)
    runs = {}
    with bar("rlx_nb backends", total=len(candidates), unit="backend", enabled=progress is not False) as shown:
        for backend in candidates:
            say(backend.name)
            shown.set_postfix_str(backend.name)  # compiling backends (inductor, ONNX export) show here
            runs[backend.name] = go(backend, timeout_s=timeout_s)
            shown.update()
    return RunResults(
        label=label or _default_label(model),
        oracle=oracle,
        reference=reference,
        candidates=runs,
        backward=backward,
        environment={
            **environment(),
            **({"sequential_failed": failed} if failed else {}),
            "nondeterministic": unstable,
            "model_was_training": bool(getattr(model, "training", False)),
        },
        fingerprints={"inputs": fingerprint(args), "model": fingerprint(dict(base.state_dict()))},
        anchors={b: a for b, a in anchors.items() if a.status == OK},
        sequential=sequential if sequential is not None and sequential.status == OK else None,  # grads may be missing
    )


def _why(run: BackendRun) -> str:
    # Why a helper run (or its backward) failed, or "" when it did not.
    if run.status != OK:
        return run.message
    return run.grad_message if run.grad_status not in (None, OK) else ""


# aten ops (overload packet names) that multiply matrices: what the anchors' torch-level targets
# (F.linear, matmul, bmm, convolutions, ...) and PyTorch's fused attention/transformer kernels
# dispatch to.  Generous on purpose: a false match only runs the anchors when they were not needed.
_MATMUL_LIKE = re.compile(r"mm|conv|attention|transformer|linear|matmul|dot|mv$|einsum")


class _CountCalls(CountReductions):
    """:class:`~rlx_nb.reassoc.CountReductions` that also counts matmul-like aten ops in ``matmuls``."""

    def __init__(self) -> None:
        super().__init__()
        self.matmuls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _MATMUL_LIKE.search(func.overloadpacket.__name__):
            self.matmuls += 1
        return super().__torch_dispatch__(func, types, args, kwargs)


def _nondeterministic(first: BackendRun, second: BackendRun) -> dict[str, float]:
    # Outputs whose two oracle runs differ (NaN in both counts as equal), with the largest difference.
    unstable = {}
    for name, leaf in first.outputs.items():
        other = second.outputs.get(name)
        if other is None or not leaf.is_array:
            continue
        a, b = leaf.value, other.value
        if a.shape != b.shape:
            unstable[name] = float("inf")
            continue
        if a.dtype == b.dtype and a.dtype.kind in "biufc" and _same_bits(a, b):
            continue  # the common case, one pass: bit for bit the same
        same = (a == b) | ((a != a) & (b != b)) if a.dtype.kind in "fc" else a == b
        if not np.all(same):
            with np.errstate(invalid="ignore", over="ignore"):
                diff = np.abs(a.astype(np.float64) - b.astype(np.float64)) if a.dtype.kind != "b" else (a != b)
            unstable[name] = float(np.nanmax(diff)) if diff.size else 0.0
    return unstable


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    # Byte-wise equality without copies (Leaf arrays are C-contiguous), in 4 MB slices so the
    # temporary comparison stays small.
    x = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    y = np.ascontiguousarray(b).reshape(-1).view(np.uint8)
    step = 1 << 22
    return all(np.array_equal(x[s : s + step], y[s : s + step]) for s in range(0, x.size, step))


def fingerprint(obj: Any) -> str:
    """sha256 over every tensor leaf's name, dtype, shape and bytes (and plain leaves' reprs)."""
    h = hashlib.sha256()
    for name, leaf in flatten(obj):
        h.update(name.encode())
        if isinstance(leaf, torch.Tensor):
            t = leaf.detach().to("cpu").contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            if t.numel():
                h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))  # no copy of the bytes
        else:
            h.update(repr(leaf).encode())
    return h.hexdigest()[:32]


def _default_label(model: Any) -> str:
    return type(model).__name__ if isinstance(model, torch.nn.Module) else getattr(model, "__name__", "model")
