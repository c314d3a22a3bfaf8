"""The fault catalogue: eager backends with one deliberately wrong kernel each.

Each fault is a real kind of kernel bug, injected by swapping one function
(``F.softmax``, ``F.layer_norm``, ``F.rms_norm``, ``F.cross_entropy``) for a
faulty version through a ``TorchFunctionMode`` while the model runs eagerly
on the CPU.  They are opt-in backends (not in the default set), registered as
``fault:<kind>``, for notebooks, tests and benchmarks: a correct verdict calls
every one of them SUSPECT.

=========================  ==========================================================
name                       bug
=========================  ==========================================================
``fault:softmax-row``      softmax normaliser ×(1+1e-3) on the first row only
``fault:layernorm-eps``    LayerNorm divides by ``sqrt(var) + eps``, not ``sqrt(var + eps)``
``fault:rmsnorm-backward`` RMSNorm forward right, backward drops the normaliser's own term
``fault:xent-backward``    cross-entropy forward right, backward's softmax sums all classes but the last
=========================  ==========================================================
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from rlx_nb.backends.registry import Backend

FAULT_FREE = "_rlx_fault_free"
"""Attribute that exempts a module (and everything it calls) from an injected fault.

Set it on every module but the one you want faulty: ``rlx_nb.demo.layered``
does, so a fault lives in one chosen layer, and :func:`rlx_nb.localize`
can be checked against a known answer.  It survives deep copies, so a
submodule run on its own keeps its exemption.
"""


class SubstituteFunctions(TorchFunctionMode):
    """Run a model with some torch functions replaced (the handler runs with the mode off).

    While ``suspended`` is non-zero (inside a fault-free module) calls pass through unchanged.
    """

    def __init__(self, replacements: dict[Callable, Callable]) -> None:
        super().__init__()
        self.replacements = replacements
        self.suspended = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        impl = None if self.suspended else self.replacements.get(func)
        if impl is not None:
            return impl(*args, **kwargs)
        return func(*args, **kwargs)


def _softmax_row(severity: float):
    def softmax(x: torch.Tensor, dim: int | None = None, *args: Any, **kwargs: Any) -> torch.Tensor:
        dtype = kwargs.get("dtype")
        y = F.softmax(x, dim=dim, dtype=dtype)
        scale = torch.ones_like(y).movedim(dim, -1)
        flat = scale.reshape(-1, scale.shape[-1])
        flat[0] = 1.0 / (1.0 + severity)  # the first row's normaliser is off
        return y * flat.reshape(scale.shape).movedim(-1, dim)

    return softmax


def _layernorm_eps():
    def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
        dims = tuple(range(-len(normalized_shape), 0))
        mean = x.mean(dims, keepdim=True)
        var = x.var(dims, keepdim=True, unbiased=False)
        y = (x - mean) / (var.sqrt() + eps)  # the bug: eps outside the square root
        if weight is not None:
            y = y * weight
        if bias is not None:
            y = y + bias
        return y

    return layer_norm


class _RmsNormWrongBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        y = x * rstd
        return y * weight if weight is not None else y

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        gw = grad * weight if weight is not None else grad
        # The bug: only the direct term; the normaliser's own derivative
        # (- x * rstd^3 * mean(gw * x)) is dropped.
        grad_x = gw * rstd
        grad_w = None
        if weight is not None:
            grad_w = (grad * x * rstd).reshape(-1, x.shape[-1]).sum(0)
        return grad_x, grad_w, None


def _rmsnorm_backward():
    def rms_norm(x, normalized_shape, weight=None, eps=None):
        eps = torch.finfo(x.dtype).eps if eps is None else eps
        return _RmsNormWrongBackward.apply(x, weight, eps)

    return rms_norm


class _CrossEntropyWrongBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target):
        ctx.save_for_backward(logits, target)
        return F.cross_entropy(logits, target)

    @staticmethod
    def backward(ctx, grad):
        logits, target = ctx.saved_tensors
        shifted = logits - logits.max(-1, keepdim=True).values
        e = shifted.exp()
        # The bug: an off-by-one in the normaliser's reduction (last class left out).
        p = e / e[..., :-1].sum(-1, keepdim=True)
        p = p - F.one_hot(target, logits.shape[-1]).to(p.dtype)
        return grad * p / logits.shape[0], None


def _xent_backward():
    def cross_entropy(logits, target, *args, **kwargs):
        if (
            logits.dim() != 2
            or target.dtype not in (torch.int64, torch.int32)
            or args
            or any(kwargs.get(k) not in (None, "mean", -100, 0.0) for k in kwargs)
        ):
            return F.cross_entropy(logits, target, *args, **kwargs)
        return _CrossEntropyWrongBackward.apply(logits, target)

    return cross_entropy


@dataclasses.dataclass(frozen=True)
class Fault:
    """One catalogue entry: which functions it replaces and what bug it is."""

    name: str
    description: str
    replacements: Callable[[], dict[Callable, Callable]]
    backward_only: bool = False


def _softmax_targets(impl: Callable) -> dict[Callable, Callable]:
    return {F.softmax: impl, torch.softmax: impl, torch.Tensor.softmax: impl}


CATALOGUE: dict[str, Fault] = {
    f.name: f
    for f in [
        Fault(
            "fault:softmax-row",
            "softmax normaliser x(1+1e-3) on the first row only",
            lambda: _softmax_targets(_softmax_row(1e-3)),
        ),
        Fault(
            "fault:layernorm-eps",
            "LayerNorm divides by sqrt(var)+eps instead of sqrt(var+eps)",
            lambda: {F.layer_norm: _layernorm_eps(), torch.layer_norm: _layernorm_eps()},
        ),
        Fault(
            "fault:rmsnorm-backward",
            "RMSNorm backward drops the normaliser's own derivative",
            lambda: {F.rms_norm: _rmsnorm_backward(), torch.rms_norm: _rmsnorm_backward()},
            True,
        ),
        Fault(
            "fault:xent-backward",
            "cross-entropy backward: softmax normaliser sums all classes but the last",
            lambda: {F.cross_entropy: _xent_backward()},
            True,
        ),
    ]
}


def _bump(mode: SubstituteFunctions, by: int) -> None:
    mode.suspended += by


def fault_fn(fault: Fault) -> Callable[[Any, tuple], Any]:
    """The backend function that runs a model eagerly with ``fault`` injected."""

    def fn(model: Any, inputs: tuple) -> Any:
        mode = SubstituteFunctions(fault.replacements())
        handles = []
        if isinstance(model, torch.nn.Module):
            for m in model.modules():
                if getattr(m, FAULT_FREE, False):
                    handles.append(m.register_forward_pre_hook(lambda *_: _bump(mode, 1)))
                    handles.append(m.register_forward_hook(lambda *_: _bump(mode, -1)))
        try:
            with mode:
                return model(*inputs)
        finally:
            for h in handles:
                h.remove()

    fn.__name__ = "run_" + fault.name.replace(":", "_").replace("-", "_")
    return fn


BACKENDS = [
    Backend(f.name, fault_fn(f), default=False, description=f.description, builtin=True, hookable=True)
    for f in CATALOGUE.values()
]
