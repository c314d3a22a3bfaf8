"""The fault catalogue: eager backends with one deliberately wrong kernel each.

Each fault is a real kind of kernel bug, injected by swapping one torch function for a faulty
version through a ``TorchFunctionMode`` while the model runs eagerly on the CPU (and, for kernels
models write out themselves, such as Llama's RMSNorm, by replacing those modules' outputs).  They
are opt-in backends (not in the default set), registered as ``fault:<kind>`` at their default
severity; any other severity is ``fault_backend(kind, severity)`` (named ``fault:<kind>@<severity>``).
A correct verdict calls each SUSPECT once its error exceeds round-off.  The catalogue, each bug and
its default severity: ``docs/hardening.md``; :data:`CATALOGUE` holds them.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from rlx_nb.backends.base import Backend
from rlx_nb.errors import InputError

FAULT_FREE = "_rlx_fault_free"
"""Attribute that exempts a module (and everything it calls) from an injected fault.

Set it on every module but the one you want faulty: ``rlx_nb.models.demo.layered``
does, so a fault lives in one chosen layer, and :func:`rlx_nb.localize`
can be checked against a known answer.  It survives deep copies, so a
submodule run on its own keeps its exemption.
"""

HITS: collections.Counter = collections.Counter()
"""How many times each fault's faulty function actually ran (benchmarks check a fault fired)."""


class SubstituteFunctions(TorchFunctionMode):
    """Run a model with some torch functions replaced (the handler runs with the mode off).

    While ``suspended`` is non-zero (inside a fault-free module) calls pass through unchanged.
    """

    def __init__(self, replacements: dict[Callable, Callable], name: str = "") -> None:
        super().__init__()
        self.replacements = replacements
        self.suspended = 0
        self.name = name

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        impl = None if self.suspended else self.replacements.get(func)
        if impl is not None:
            out = impl(*args, **kwargs)
            if out is not NotImplemented:
                HITS[self.name] += 1
                return out
        return func(*args, **kwargs)


# -- forward faults -------------------------------------------------------------------------------


def _softmax_row(s: float):
    def softmax(x: torch.Tensor, dim: int | None = None, *args: Any, **kwargs: Any) -> torch.Tensor:
        y = F.softmax(x, dim=dim, dtype=kwargs.get("dtype"))
        scale = torch.ones_like(y).movedim(dim, -1)
        flat = scale.reshape(-1, scale.shape[-1])
        flat[0] = 1.0 / (1.0 + s)  # the first row's normaliser is off
        return y * flat.reshape(scale.shape).movedim(-1, dim)

    return _softmax_targets(softmax)


def _attention_scale(s: float):
    def softmax(x: torch.Tensor, dim: int | None = None, *args: Any, **kwargs: Any) -> torch.Tensor:
        return F.softmax(x * (1.0 + s), dim=dim, dtype=kwargs.get("dtype"))

    return _softmax_targets(softmax)


def _softmax_targets(impl: Callable) -> dict[Callable, Callable]:
    # The softmax models call themselves, and the one inside scaled-dot-product attention (what most
    # attention layers use today), computed by the math formula with the faulty softmax.
    return {
        F.softmax: impl,
        torch.softmax: impl,
        torch.Tensor.softmax: impl,
        F.scaled_dot_product_attention: _sdpa(impl),
    }


def _sdpa(softmax: Callable) -> Callable:
    def attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if dropout_p:
            return NotImplemented
        if enable_gqa and k.shape[-3] != q.shape[-3]:
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
            v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
        scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5 if scale is None else scale)
        if is_causal:
            keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
            scores = scores.masked_fill(~keep, float("-inf"))
        if attn_mask is not None:
            scores = (
                scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
            )
        return softmax(scores, dim=-1) @ v

    return attention


def _layer_norm_with(var_scale: float, eps_outside: float | None):
    def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
        dims = tuple(range(-len(normalized_shape), 0))
        mean = x.mean(dims, keepdim=True)
        var = x.var(dims, keepdim=True, unbiased=False) * var_scale
        if eps_outside is not None:
            y = (x - mean) / (var.sqrt() + eps_outside * eps)  # the bug: eps outside the square root
        else:
            y = (x - mean) / torch.sqrt(var + eps)
        if weight is not None:
            y = y * weight
        if bias is not None:
            y = y + bias
        return y

    return {F.layer_norm: layer_norm, torch.layer_norm: layer_norm}


def _layernorm_eps(s: float):
    return _layer_norm_with(1.0, s)


def _layernorm_unbiased(s: float):
    def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
        n = 1
        for d in normalized_shape:
            n *= d
        return _layer_norm_with(1.0 + s / max(1, n - 1), None)[F.layer_norm](x, normalized_shape, weight, bias, eps)

    return {F.layer_norm: layer_norm, torch.layer_norm: layer_norm}


def _linear_bias_channel(s: float):
    def linear(x, weight, bias=None):
        if bias is None:
            return NotImplemented
        b = bias.clone()
        b[0] = bias[0] * (1.0 - s)  # the bug: channel 0 loses (part of) its bias
        return F.linear(x, weight, b)

    return {F.linear: linear}


def _mean_off_by_one(s: float):
    def mean(x, dim=None, keepdim=False, *, dtype=None):
        if dim is None or not x.is_floating_point():
            return NotImplemented
        dims = (dim,) if isinstance(dim, int) else tuple(dim)
        last = dims[-1] % x.dim()
        n = 1
        for d in dims:
            n *= x.shape[d]
        weights = torch.ones(x.shape[last], dtype=x.dtype)
        weights[-1] = 1.0 - s  # the bug: the reduction stops one element short
        shape = [1] * x.dim()
        shape[last] = x.shape[last]
        return (x * weights.view(shape)).sum(dims, keepdim=keepdim) / n

    return {torch.mean: mean, torch.Tensor.mean: mean}


def _gelu_approx(s: float):
    def gelu(x, approximate="none"):
        if approximate != "none":
            return NotImplemented
        return (1 - s) * F.gelu(x) + s * F.gelu(x, approximate="tanh")

    return {F.gelu: gelu}


def _linear_lowp_accum(s: float):
    dtype = torch.bfloat16 if s >= 1 else torch.float16

    def linear(x, weight, bias=None):
        out = F.linear(x.to(dtype), weight.to(dtype)).to(x.dtype)
        return out + bias if bias is not None else out

    return {F.linear: linear}


# -- backward faults ------------------------------------------------------------------------------


class _LayerNormWrongBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, s):
        mean = x.mean(-1, keepdim=True)
        rstd = torch.rsqrt(x.var(-1, keepdim=True, unbiased=False) + eps)
        xhat = (x - mean) * rstd
        ctx.save_for_backward(xhat, rstd, weight)
        ctx.s = s
        y = xhat * weight if weight is not None else xhat
        return y + bias if bias is not None else y

    @staticmethod
    def backward(ctx, grad):
        xhat, rstd, weight = ctx.saved_tensors
        g = grad * weight if weight is not None else grad
        # The bug: a fraction s of the mean(g) term is dropped.
        grad_x = rstd * (g - (1 - ctx.s) * g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
        red = tuple(range(grad.dim() - 1))
        grad_w = (grad * xhat).sum(red) if weight is not None else None
        grad_b = grad.sum(red) if weight is not None else None
        return grad_x, grad_w, grad_b, None, None


def _layernorm_backward(s: float):
    def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
        if len(normalized_shape) != 1:
            return NotImplemented
        return _LayerNormWrongBackward.apply(x, weight, bias, eps, s)

    return {F.layer_norm: layer_norm, torch.layer_norm: layer_norm}


class _RmsNormWrongBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, s):
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.s = s
        y = x * rstd
        return y * weight if weight is not None else y

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        gw = grad * weight if weight is not None else grad
        # The bug: a fraction s of the normaliser's own derivative
        # (- x * rstd^3 * mean(gw * x)) is dropped.
        grad_x = gw * rstd - (1 - ctx.s) * x * rstd.pow(3) * (gw * x).mean(-1, keepdim=True)
        grad_w = (grad * x * rstd).reshape(-1, x.shape[-1]).sum(0) if weight is not None else None
        return grad_x, grad_w, None, None


def _rmsnorm_backward(s: float):
    def rms_norm(x, normalized_shape, weight=None, eps=None):
        eps = torch.finfo(x.dtype).eps if eps is None else eps
        return _RmsNormWrongBackward.apply(x, weight, eps, s)

    return {F.rms_norm: rms_norm, torch.rms_norm: rms_norm}


def _is_custom_rmsnorm(module: torch.nn.Module) -> bool:
    # RMSNorm written out in a model's own code (Llama's, Qwen2's, T5's LayerNorm): a module of that name
    # with a 1-d weight, which calls no F.rms_norm the function replacement could catch.
    name = type(module).__name__
    weight = getattr(module, "weight", None)
    return (
        (name.endswith("RMSNorm") or name == "T5LayerNorm")
        and not isinstance(module, torch.nn.RMSNorm)
        and isinstance(weight, torch.nn.Parameter)
        and weight.dim() == 1
    )


def _rmsnorm_module_backward(s: float) -> Callable:
    def output(module: torch.nn.Module, x: torch.Tensor, out: Any) -> Any:
        if not isinstance(out, torch.Tensor) or x.shape != out.shape:
            return None
        eps = getattr(module, "variance_epsilon", None) or getattr(module, "eps", None) or torch.finfo(x.dtype).eps
        return _RmsNormWrongBackward.apply(x.float(), module.weight, float(eps), s).to(out.dtype)

    return output


class _CrossEntropyWrongBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, s, ignore_index):
        ctx.save_for_backward(logits, target)
        ctx.s, ctx.ignore_index = s, ignore_index
        return F.cross_entropy(logits, target, ignore_index=ignore_index)

    @staticmethod
    def backward(ctx, grad):
        logits, target = ctx.saved_tensors
        valid = target != ctx.ignore_index
        e = (logits - logits.max(-1, keepdim=True).values).exp()
        # The bug: an off-by-one in the normaliser's reduction (the last class left out, a fraction s of it).
        p = e / (e.sum(-1, keepdim=True) - ctx.s * e[..., -1:])
        p = p - F.one_hot(target.clamp(min=0), logits.shape[-1]).to(p.dtype)
        p = p * valid.unsqueeze(-1).to(p.dtype)
        return grad * p / valid.sum().clamp(min=1), None, None, None


def _xent_backward(s: float):
    def cross_entropy(logits, target, *args, **kwargs):
        plain = all(
            kwargs.get(k, d) == d
            for k, d in (("weight", None), ("reduction", "mean"), ("ignore_index", -100), ("label_smoothing", 0.0))
        )
        if logits.dim() != 2 or target.dtype not in (torch.int64, torch.int32) or args or not plain:
            return NotImplemented
        return _CrossEntropyWrongBackward.apply(logits, target, s, kwargs.get("ignore_index", -100))

    return {F.cross_entropy: cross_entropy}


# -- the catalogue ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Fault:
    """One catalogue entry: what it replaces at a severity, and what bug it is."""

    name: str
    description: str
    replacements: Callable[[float], dict[Callable, Callable]]
    default_severity: float
    severities: tuple[float, ...]
    """Severities the detection benchmark sweeps, mildest first."""
    backward_only: bool = False
    modules: tuple[Callable[[torch.nn.Module], bool], Callable[[float], Callable]] | None = None
    """``(which modules, severity -> output(module, input, output))``: modules whose output is replaced,
    for kernels a model writes out in its own code rather than calling a torch function for."""


CATALOGUE: dict[str, Fault] = {
    f.name: f
    for f in [
        Fault(
            "fault:softmax-row",
            "softmax normaliser x(1+s) on the first row only",
            _softmax_row,
            1e-3,
            (1e-6, 1e-5, 1e-4, 1e-3),
        ),
        Fault(
            "fault:attention-scale",
            "softmax input scaled by (1+s): wrong attention scale",
            _attention_scale,
            1e-3,
            (1e-6, 1e-5, 1e-4, 1e-3),
        ),
        Fault(
            "fault:layernorm-eps",
            "LayerNorm divides by sqrt(var)+eps instead of sqrt(var+eps)",
            _layernorm_eps,
            1.0,
            (0.1, 1.0, 10.0),
        ),
        Fault(
            "fault:layernorm-unbiased",
            "LayerNorm with the unbiased (N-1) variance",
            _layernorm_unbiased,
            1.0,
            (1e-3, 1e-2, 1e-1, 1.0),
        ),
        Fault(
            "fault:linear-bias-channel",
            "Linear drops the bias of output channel 0",
            _linear_bias_channel,
            1.0,
            (1e-5, 1e-4, 1e-3, 1.0),
        ),
        Fault(
            "fault:mean-off-by-one",
            "mean over an axis leaves out its last element",
            _mean_off_by_one,
            1.0,
            (1e-5, 1e-3, 1.0),
        ),
        Fault(
            "fault:gelu-approx", "exact GELU swapped for the tanh approximation", _gelu_approx, 1.0, (1e-3, 1e-2, 1.0)
        ),
        Fault(
            "fault:linear-lowp-accum",
            "Linear computed from bfloat16 operands (fp16 at s<1)",
            _linear_lowp_accum,
            1.0,
            (0.5, 1.0),
        ),
        Fault(
            "fault:layernorm-backward",
            "LayerNorm backward drops the mean-gradient term",
            _layernorm_backward,
            1.0,
            (1e-3, 1e-2, 1.0),
            True,
        ),
        Fault(
            "fault:rmsnorm-backward",
            "RMSNorm backward drops the normaliser's own derivative",
            _rmsnorm_backward,
            1.0,
            (1e-3, 1e-2, 1.0),
            True,
            (_is_custom_rmsnorm, _rmsnorm_module_backward),
        ),
        Fault(
            "fault:xent-backward",
            "cross-entropy backward: softmax normaliser sums all classes but the last",
            _xent_backward,
            1.0,
            (1e-3, 1e-1, 1.0),
            True,
        ),
    ]
}


def _bump(mode: SubstituteFunctions, by: int) -> None:
    mode.suspended += by


def _module_fault(mode: SubstituteFunctions, replace: Callable) -> Callable:
    # A forward hook that swaps a module's output for the faulty kernel's (not inside fault-free modules).
    def hook(module: torch.nn.Module, args: tuple, out: Any) -> Any:
        if mode.suspended or not args or not isinstance(args[0], torch.Tensor):
            return None
        new = replace(module, args[0], out)
        if new is not None:
            HITS[mode.name] += 1
        return new

    return hook


def fault_fn(fault: Fault, severity: float | None = None) -> Callable[[Any, tuple], Any]:
    """The backend function that runs a model eagerly with ``fault`` injected at ``severity``."""
    s = fault.default_severity if severity is None else severity
    label = fault.name if severity is None else f"{fault.name}@{s:g}"

    def fn(model: Any, inputs: tuple) -> Any:
        mode = SubstituteFunctions(fault.replacements(s), label)
        handles = []
        if isinstance(model, torch.nn.Module):
            for m in model.modules():
                if getattr(m, FAULT_FREE, False):
                    handles.append(m.register_forward_pre_hook(lambda *_: _bump(mode, 1)))
                    handles.append(m.register_forward_hook(lambda *_: _bump(mode, -1)))
            if fault.modules is not None:
                which, make = fault.modules
                replace = make(s)
                for m in model.modules():
                    if which(m):
                        handles.append(m.register_forward_hook(_module_fault(mode, replace)))
        try:
            with mode:
                return model(*inputs)
        finally:
            for h in handles:
                h.remove()

    fn.__name__ = "run_" + label.replace(":", "_").replace("-", "_").replace("@", "_at_").replace(".", "_")
    return fn


def fault_backend(kind: str | Fault, severity: float | None = None) -> Backend:
    """A fault backend at ``severity`` (registered under ``fault:<kind>@<severity>`` by the caller); ``kind`` a
    catalogue name or a :class:`Fault` (:mod:`rlx_nb.backends.known_bugs`).

    Examples
    --------
    >>> fault_backend("fault:softmax-row", 1e-5).name
    'fault:softmax-row@1e-05'
    """
    fault = kind if isinstance(kind, Fault) else CATALOGUE.get(kind) or CATALOGUE.get(f"fault:{kind}")
    if fault is None:
        raise InputError(f"unknown fault {kind!r}; the catalogue has: {', '.join(CATALOGUE)}")
    name = fault.name if severity is None else f"{fault.name}@{severity:g}"
    return Backend(
        name,
        fault_fn(fault, severity),
        default=False,
        description=fault.description,
        builtin=True,
        hookable=True,
        on_caller=True,
    )


BACKENDS = [fault_backend(name) for name in CATALOGUE]
