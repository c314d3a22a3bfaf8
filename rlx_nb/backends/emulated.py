"""Reduced-precision emulation on the CPU: matmul and convolution operands rounded to fewer mantissa bits.

``cpu-tf32-emulated`` rounds the operands of every matmul, linear, batched matmul and convolution to
TF32's 10 stored mantissa bits (11 bits of precision, round to nearest even) and computes in float32,
which is what TF32 tensor cores do on Ampere and later GPUs — so the TF32 story can be shown and
tested without a GPU (``cuda-tf32`` is the real one).  The same mechanism at 8 and 11 bits gives
the anchors the effective-precision estimate is calibrated on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from rlx_nb.backends.base import Backend
from rlx_nb.numerics.fused import round_kernel

_FAST_FROM = 4096  # elements: below this the kernel's call costs more than the tensor passes


def round_mantissa(x: torch.Tensor, bits: int, *, gradient: bool = False) -> torch.Tensor:
    """Round a float32 tensor to ``bits`` bits of precision (implicit bit included), nearest even.

    Differentiable as the identity (a straight-through gradient): on TF32 hardware the rounding is
    part of the matmul, so the gradient reaches the operand itself.  ``gradient=True`` rounds the
    gradient too, as a cast to a narrower dtype does (autocast: the gradient of a bfloat16 copy is
    bfloat16).

    Examples
    --------
    >>> round_mantissa(torch.tensor([1.0 + 2**-12]), 11).item()
    1.0
    """
    if not x.is_floating_point() or bits >= 24:
        return x
    return _Rounded.apply(x, bits, gradient) if x.requires_grad and torch.is_grad_enabled() else _round(x, bits)


def _round(x: torch.Tensor, bits: int) -> torch.Tensor:
    fast = round_kernel() if x.dtype == torch.float32 and x.device.type == "cpu" and x.numel() >= _FAST_FROM else None
    if fast is not None:  # (a parameter requires grad even where none is recorded: its bits are what count)
        # One pass in numba instead of six tensor passes and their temporaries (the weights of a 124M model
        # are rounded once per anchor run: 2.2 s of a GPT-2 call before).  The same integer arithmetic.
        src = x.detach().contiguous()
        out = torch.empty_like(src)
        fast(
            src.reshape(-1).view(torch.int32).numpy().view(np.uint32),
            out.reshape(-1).view(torch.int32).numpy().view(np.uint32),
            24 - bits,
        )
        return out
    x32 = x.float().contiguous()
    drop = 24 - bits
    i = x32.view(torch.int32)
    half = (1 << (drop - 1)) - 1
    lsb = (i >> drop) & 1
    rounded = ((i + half + lsb) >> drop) << drop
    finite = torch.isfinite(x32)
    return torch.where(finite, rounded.view(torch.float32), x32).to(x.dtype)


class _Rounded(torch.autograd.Function):
    # The rounded operand in the forward; the gradient straight through to the operand (rounded too
    # when it stands for a cast to a narrower dtype).
    @staticmethod
    def forward(ctx, x, bits, gradient):
        ctx.bits = bits if gradient else None
        return _round(x, bits)

    @staticmethod
    def backward(ctx, grad):
        return (grad if ctx.bits is None else _round(grad, ctx.bits)), None, None


class _GradientRounded(torch.autograd.Function):
    # The identity in the forward; rounds the gradient arriving at a matmul's output, which is the
    # operand of that matmul's backward matmuls (their other operand is the rounded forward operand).
    @staticmethod
    def forward(ctx, y, bits):
        ctx.bits = bits
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return round_mantissa(grad, ctx.bits), None


TARGETS: tuple[Callable, ...] = (
    F.linear,
    torch.matmul,
    torch.Tensor.matmul,
    torch.Tensor.__matmul__,
    torch.bmm,
    torch.Tensor.bmm,
    F.conv1d,
    F.conv2d,
    F.conv3d,
    torch.addmm,
    torch.baddbmm,
    *((torch._grouped_mm,) if hasattr(torch, "_grouped_mm") else ()),  # (F.grouped_mm calls it: MoE experts)
)


class RoundMatmulOperands(TorchFunctionMode):
    """Round the tensor operands of matmuls and convolutions to ``bits`` before they run.

    In a backward the gradient arriving at such a call's output is rounded too, so the backward's
    matmuls also take ``bits``-bit operands, as on TF32 hardware.  ``results=True`` also rounds each
    call's result, and the gradients the backward produces for its operands: the casts autocast makes
    around a matmul in a narrower dtype (its inputs, its output, and in the backward the gradients
    in and out), with float32 accumulation inside.
    """

    def __init__(self, bits: int, *, results: bool = False) -> None:
        super().__init__()
        self.bits = bits
        self.results = results
        self.seen: dict[tuple[int, int], torch.Tensor] = {}
        self.kept: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def weight(self, v: torch.Tensor) -> torch.Tensor:
        # A parameter rounded again at every use of a loop (a decode's 64 steps) costs more than the steps:
        # from its second use outside autograd, its rounded copy is kept (the key holds its version; the
        # parameter itself is held beside it, so a new tensor at a freed one's address is never taken for it).
        key = (id(v), v._version)
        held = self.kept.get(key)
        if held is not None and held[0] is v:
            return held[1]
        out = round_mantissa(v, self.bits, gradient=self.results)
        if self.seen.get(key) is v:
            self.kept[key] = (v, out)
        self.seen[key] = v
        return out

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in TARGETS:
            bits, both = self.bits, self.results
            reuse = not torch.is_grad_enabled()

            def narrow(v: Any) -> Any:
                if not isinstance(v, torch.Tensor):
                    return v
                if reuse and isinstance(v, torch.nn.Parameter):
                    return self.weight(v)
                return round_mantissa(v, bits, gradient=both)

            out = func(*(narrow(a) for a in args), **{k: narrow(v) for k, v in kwargs.items()})
            if not isinstance(out, torch.Tensor):
                return out
            if both:
                return round_mantissa(out, bits, gradient=True)
            return _GradientRounded.apply(out, bits) if out.requires_grad else out
        return func(*args, **kwargs)


def emulate(bits: int, *, results: bool = False) -> Callable[[Any, tuple], Any]:
    """A backend fn running the model eagerly with matmul/conv operands (and ``results``) rounded to ``bits``."""

    def fn(model: Any, inputs: tuple) -> Any:
        with RoundMatmulOperands(bits, results=results):
            return model(*inputs)

    fn.__name__ = f"run_with_{bits}_bit_{'matmuls' if results else 'operands'}"
    return fn


BACKENDS = [
    Backend(
        "cpu-tf32-emulated",
        emulate(11),
        compute_dtype="tf32",
        default=False,
        builtin=True,
        hookable=True,
        on_caller=True,
        description="eager CPU with matmul/conv operands rounded to TF32 (10-bit mantissa)",
    ),
]
