"""Capture: every module's first call in the oracle run, and the torch functions a module calls.

A captured call is a template (the arguments with tensors replaced by slots) and the tensors, so it
can be replayed alone on any backend (:class:`CallModule`, :class:`OpModule`).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from rlx_nb._support.tree import PLAIN, map_tensors

# Pure data movement: exact on every backend, not worth a preparation each.
_SKIP_OPS = {
    "view",
    "reshape",
    "permute",
    "transpose",
    "contiguous",
    "__getitem__",
    "flatten",
    "unflatten",
    "squeeze",
    "unsqueeze",
    "expand",
    "expand_as",
    "chunk",
    "split",
    "unbind",
    "t",
    "movedim",
    "clone",
    "detach",
    "to",
    "float",
    "double",
    "type_as",
    "__get__",
    "size",
    "dim",
    "numel",
    "stride",
    "narrow",
    "select",
    "split_with_sizes",
}


def split_call(obj: Any) -> tuple[Any, list[torch.Tensor]]:
    # A template with tensors replaced by their position, and the tensors.  An object that holds tensors
    # (a Hugging Face cache passed to each decoder layer) is copied as it is at the call, with slots for
    # its tensors: the model goes on changing it (every layer appends its keys), and a replay of one layer
    # must see the cache that layer saw.
    tensors: list[torch.Tensor] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        tensors.append(t.detach().clone())
        return tensors[-1]

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            keep(x)
            return Slot(len(tensors) - 1)
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(walk(v) for v in x) if not hasattr(x, "_fields") else type(x)(*(walk(v) for v in x))
        if isinstance(x, PLAIN) or isinstance(x, torch.nn.Module) or callable(x):
            return x
        first = len(tensors)
        try:
            held = map_tensors(keep, x)  # a copy around the kept clones
            held = copy.deepcopy(x) if held is x else held  # no tensor yet (an empty cache): still its state
        except Exception:  # an object that cannot be copied is passed as it is
            del tensors[first:]
            return x
        return Held(held, tuple(range(first, len(tensors))), tuple(tensors[first:]))

    return walk(obj), tensors


@dataclasses.dataclass(frozen=True)
class Slot:
    i: int


@dataclasses.dataclass(frozen=True)
class Held:
    """An object holding tensors, copied at the call around the captured tensors ``kept`` (positions ``at``)."""

    obj: Any
    at: tuple[int, ...]
    kept: tuple[torch.Tensor, ...]


def fill(template: Any, tensors: tuple) -> Any:
    if isinstance(template, Slot):
        return tensors[template.i]
    if isinstance(template, Held):
        # A fresh copy for every replay (the module changes it), around this replay's tensors: the deep
        # copy's memo maps each captured tensor to its replacement, as tree.map_tensors does.
        memo: dict[int, Any] = {id(t): tensors[i] for i, t in zip(template.at, template.kept, strict=True)}
        memo[id(memo)] = list(template.kept)
        return copy.deepcopy(template.obj, memo)
    if isinstance(template, dict):
        return {k: fill(v, tensors) for k, v in template.items()}
    if isinstance(template, (list, tuple)):
        items = [fill(v, tensors) for v in template]
        return type(template)(*items) if hasattr(template, "_fields") else type(template)(items)
    return template


class CallModule(torch.nn.Module):
    """Replays one captured call ``module(*args, **kwargs)`` with the tensors as positional inputs."""

    def __init__(self, module: torch.nn.Module, template: tuple[Any, Any]) -> None:
        super().__init__()
        self.module = module
        self.template = template

    def forward(self, *tensors: torch.Tensor) -> Any:
        args, kwargs = fill(self.template, tensors)
        return self.module(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        # A backend given this wrapper sees the module's own attributes too (``model.weight``), as it would
        # on the module itself.
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("module"), name)


class OpModule(torch.nn.Module):
    """Replays one captured torch function call ``func(*args, **kwargs)`` with the tensors as inputs."""

    def __init__(self, func: Callable, template: tuple[Any, Any]) -> None:
        super().__init__()
        self.func = func
        self.template = template

    def forward(self, *tensors: torch.Tensor) -> Any:
        args, kwargs = fill(self.template, tensors)
        return self.func(*args, **kwargs)


@dataclasses.dataclass
class Call:
    """One module's first call in the oracle run."""

    name: str
    order: int
    depth: int
    template: tuple[Any, Any]
    tensors: list[torch.Tensor]
    children: list[str] = dataclasses.field(default_factory=list)


def capture_calls(base: torch.nn.Module, args: tuple) -> dict[str, Call]:
    """Every module's first call (inputs as templates + tensors), in execution order."""
    calls: dict[str, Call] = {}
    handles = []

    def pre(name: str):
        def hook(module, a, kw):
            if name not in calls:
                template, tensors = split_call((a, kw))
                calls[name] = Call(name, len(calls), 0, template, tensors)

        return hook

    for name, module in base.named_modules():
        handles.append(module.register_forward_pre_hook(pre(name), with_kwargs=True))
    try:
        with torch.no_grad():
            base(*copy.deepcopy(args))
    finally:
        for h in handles:
            h.remove()
    for name, call in calls.items():
        if name:
            parent = called_parent(name, calls)
            calls[parent].children.append(name)
            call.depth = calls[parent].depth + 1
    return calls


def called_parent(name: str, called: Any) -> str:
    """The nearest ancestor of module ``name`` that is in ``called`` (the modules a run called, in a container):
    its parent, or further up past one never called itself (a ModuleList); ``""`` (the root) at the top."""
    parent = name.rpartition(".")[0]
    while parent and parent not in called:
        parent = parent.rpartition(".")[0]
    return parent


def inputs_requiring_grad(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors]


class RecordOps(TorchFunctionMode):
    """Record every torch function call with a floating tensor result (data movement skipped)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, Callable, Any, list[torch.Tensor]]] = []
        self.inside_children = 0

    def enter(self, by: int) -> None:
        self.inside_children += by

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", str(func))
        if (
            not self.inside_children
            and isinstance(out, torch.Tensor)
            and out.is_floating_point()
            and name not in _SKIP_OPS
            and not name.endswith("_")
        ):
            template, tensors = split_call((args, kwargs))
            self.ops.append((op_label(func), func, template, tensors))
        return out


NAMESPACES: tuple[tuple[str, Any], ...] = (
    ("F", torch.nn.functional),
    ("torch.special", torch.special),
    ("torch.linalg", torch.linalg),
    ("torch.fft", torch.fft),
    ("torch", torch),
    ("Tensor", torch.Tensor),
)
"""Where an op's function is looked up by its public name, in this order (``F.gelu``, not ``torch._C._nn``'s)."""


def op_name(func: Callable) -> str | None:
    """``func``'s public name, as code calls it (``F.softmax``, ``F.avg_pool2d``, ``Tensor.__add__``), or None when
    no namespace holds it under its own name."""
    name = getattr(func, "__name__", None)
    if not isinstance(name, str):
        return None
    for prefix, space in NAMESPACES:
        if getattr(space, name, None) is func:
            return f"{prefix}.{name}"
    return None


def op_label(func: Callable) -> str:
    """How a localization names an op: its public name (:func:`op_name`), else a name made from the function's."""
    public = op_name(func)
    if public is not None:
        return public
    name = getattr(func, "__name__", str(func))
    qual = getattr(func, "__qualname__", name)
    if qual.startswith("TensorBase.") or qual.startswith("Tensor."):
        return "Tensor." + name
    return f"torch.{name}"
