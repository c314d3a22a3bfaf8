"""A plain sequential fp32 run: how far another legitimate summation order can drift.

A backend that sums in another order than the oracle (Inductor's generated loops, another
BLAS, a GPU's tree) differs from it by round-off whose size depends on the *terms* of each sum,
not only on the result or its length.  On the detection benchmark's conv net, Inductor's
BatchNorm-bias gradient is 36x the oracle's error, and bit for bit what a scalar loop gives:
ATen's kernel sums the 8,192 terms of each channel in 16 vector lanes, Inductor's generated code
in one accumulator, and the terms (a pooled gradient, equal across each image) make the
sequential rounding errors add up coherently instead of averaging out.  A floor guessed from
the sum's length cannot know that; so the budget measures it.

:class:`SequentialSums` runs the model (forward and backward) in float32 with every reduction it covers
summed in another legitimate order than ATen's: ``sum``/``mean``; BatchNorm's batch statistics in training
(and the running statistics updated from them); the parameter gradients (and the
input-gradient row sums) of LayerNorm, BatchNorm and GroupNorm; softmax and log-softmax backward; a
convolution's bias gradient -- each with one accumulator per output (per :data:`SEQUENTIAL_BLOCK` terms of a
longer sum, the blocks then added pairwise, as a real kernel's cascade does), adding the terms strictly in index
order (memory order for contiguous tensors).  Matrix products (``mm``, ``addmm``, ``bmm``, ``baddbmm``:
linear layers, attention's products, their backward) and convolutions (forward, input gradient and
weight gradient) sum their inner dimension in two halves, each half by the library's own kernel, the two
added: the blocked order another BLAS, a tiled GPU kernel or a compiler's loop split produces.  (It had
left them to the BLAS, so on convolutional models its error equalled the oracle's on every output: the
budget knew one accumulation order.)  Fused attention kernels are left as they are.  The run's error
against the float64 reference is one more legitimate error, next to the oracle's: the budget is sized by
the larger of the two (:func:`rlx_nb.comparison.compare.compare`).
"""

from __future__ import annotations

import functools
import math
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlx_nb.numerics.fused import sequential_kernel

aten = torch.ops.aten


SEQUENTIAL_BLOCK = 8192
"""The most terms one accumulator of the sequential run adds (then the blocks' sums are added pairwise): the longest
single-accumulator sum a real backend was seen to make (Inductor's BatchNorm-bias gradient: 8,192 terms; its
cascade chunks are 4,096).  No real kernel adds 2**28 terms in one float32 accumulator -- past 2**24 such a sum
stops growing -- and a run that did would widen every budget past what any legitimate order gives (pytorch#154703,
Inductor's mean of 2**28 floats without a cascade, read round-off against it)."""


def sequential_sum(x: torch.Tensor, dims: Sequence[int], keepdim: bool = False) -> torch.Tensor:
    """``x.sum(dims)`` in float32, each output summed in index order by one accumulator per block of at most
    :data:`SEQUENTIAL_BLOCK` terms, the blocks' sums then added pairwise (a cascade)."""
    nd = x.dim()
    if nd == 0:
        return x.detach().to(torch.float32, copy=True)
    dims = sorted({d % nd for d in dims})
    kept = [d for d in range(nd) if d not in dims]
    shape = [x.shape[d] for d in kept]
    # Terms of another dtype (a half tensor summed with dtype=float32) are added as float32.
    rows = x.detach().to(torch.float32).permute(*kept, *dims).reshape(math.prod(shape), -1).contiguous().numpy()
    n = rows.shape[1]
    if n <= SEQUENTIAL_BLOCK:
        out = accumulate(rows)
    else:
        full = n // SEQUENTIAL_BLOCK * SEQUENTIAL_BLOCK
        blocks = accumulate(rows[:, :full].reshape(-1, SEQUENTIAL_BLOCK)).reshape(rows.shape[0], -1)
        if full < n:
            blocks = np.concatenate([blocks, accumulate(np.ascontiguousarray(rows[:, full:]))[:, None]], axis=1)
        while blocks.shape[1] > 1:  # pairwise, in float32
            pairs = blocks[:, 0 : blocks.shape[1] - 1 : 2] + blocks[:, 1::2]
            blocks = np.concatenate([pairs, blocks[:, -1:]], axis=1) if blocks.shape[1] % 2 else pairs
        out = np.ascontiguousarray(blocks[:, 0])
    result = torch.from_numpy(out).reshape(shape)
    if keepdim:
        result = result.reshape([1 if d in dims else s for d, s in enumerate(x.shape)])
    return result


def accumulate(rows: np.ndarray) -> np.ndarray:
    """Each row's sum (a 2-D float32 array's) by one float32 accumulator, left to right."""
    out = np.empty(rows.shape[0], np.float32)
    run = sequential_kernel()
    if run is not None:
        run(rows, out)
    elif rows.shape[1]:
        out[:] = np.add.accumulate(rows.T, axis=0, dtype=np.float32)[-1]
    else:
        out[:] = 0
    return out


def _dims(x: torch.Tensor, dims: Any) -> list[int]:
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(x.dim()))
    return [dims] if isinstance(dims, int) else list(dims)


def _reduction(args: tuple, kwargs: dict) -> tuple[torch.Tensor, list[int], bool]:
    # (input, reduced dims, keepdim) of an aten sum/mean call.
    x = args[0]
    dims = _dims(x, args[1] if len(args) > 1 else kwargs.get("dim"))
    return x, dims, bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))


def _sum(args: tuple, kwargs: dict, out: Any) -> Any:
    return sequential_sum(*_reduction(args, kwargs))


def _mean(args: tuple, kwargs: dict, out: Any) -> Any:
    x, dims, keepdim = _reduction(args, kwargs)
    count = math.prod(x.shape[d % x.dim()] for d in dims) if x.dim() else 1
    return sequential_sum(x, dims, keepdim) / max(1, count)


def _layer_norm_backward(args: tuple, kwargs: dict, out: Any) -> Any:
    grad, x, shape, mean, rstd, weight = args[:6]
    gi, gw, gb = out
    nd = len(shape)
    rows, cols = list(range(x.dim() - nd)), list(range(x.dim() - nd, x.dim()))
    xhat = (x - mean) * rstd
    if gw is not None and rows:
        gw = sequential_sum(grad * xhat, rows).reshape(gw.shape)
    if gb is not None and rows:
        gb = sequential_sum(grad, rows).reshape(gb.shape)
    if gi is not None:
        wg = grad * weight if weight is not None else grad
        count = math.prod(shape)
        gi = rstd * (wg - sequential_sum(wg, cols, True) / count - xhat * sequential_sum(wg * xhat, cols, True) / count)
    return gi, gw, gb


def _batch_norm_backward(args: tuple, kwargs: dict, out: Any) -> Any:
    grad, x, weight, running_mean, running_var, save_mean, save_invstd, train, eps = args[:9]
    gi, gw, gb = out
    view = [1, -1] + [1] * (x.dim() - 2)
    mean, invstd = (save_mean, save_invstd) if train else (running_mean, torch.rsqrt(running_var + eps))
    xhat = (x - mean.reshape(view)) * invstd.reshape(view)
    dims = [d for d in range(x.dim()) if d != 1]
    sum_g, sum_gx = sequential_sum(grad, dims), sequential_sum(grad * xhat, dims)
    gw = sum_gx.reshape(gw.shape) if gw is not None else None
    gb = sum_g.reshape(gb.shape) if gb is not None else None
    if train and gi is not None:
        count = x.numel() // max(1, x.shape[1])
        scale = invstd * weight if weight is not None else invstd
        gi = scale.reshape(view) * (grad - (sum_g / count).reshape(view) - xhat * (sum_gx / count).reshape(view))
    return gi, gw, gb


def _batch_norm(args: tuple, kwargs: dict, out: Any) -> Any:
    # Training mode: the batch's mean and variance summed in index order (Inductor's generated loop sums them so, in
    # one accumulator per channel, where ATen's kernel keeps lanes), the output and the running statistics from
    # them as ATen's kernel makes them.  Eval mode reads the running statistics: nothing is summed.
    x, weight, bias, running_mean, running_var, training, momentum, eps = (*args, *[None] * 8)[:8]
    if not training or x.dtype != torch.float32:
        return aten.native_batch_norm.default(*args, **kwargs)
    view = [1, -1] + [1] * (x.dim() - 2)
    dims = [d for d in range(x.dim()) if d != 1]
    count = x.numel() // max(1, x.shape[1])
    mean = sequential_sum(x, dims) / count
    centered = x - mean.reshape(view)
    var = sequential_sum(centered * centered, dims) / count
    invstd = torch.rsqrt(var + eps)
    y = centered * invstd.reshape(view)
    if weight is not None:
        y = y * weight.reshape(view)
    if bias is not None:
        y = y + bias.reshape(view)
    if running_mean is not None and running_var is not None:
        running_mean.mul_(1 - momentum).add_(mean * momentum)
        running_var.mul_(1 - momentum).add_(var * (count / max(1, count - 1)) * momentum)
    return y, mean, invstd


def _group_norm_backward(args: tuple, kwargs: dict, out: Any) -> Any:
    grad, x, mean, rstd, _weight, n, c, _hxw, group = args[:9]
    gi, gw, gb = out
    xhat = ((x.reshape(n, group, -1) - mean.reshape(n, group, 1)) * rstd.reshape(n, group, 1)).reshape(n, c, -1)
    g = grad.reshape(n, c, -1)
    gw = sequential_sum(g * xhat, [0, 2]).reshape(gw.shape) if gw is not None else None
    gb = sequential_sum(g, [0, 2]).reshape(gb.shape) if gb is not None else None
    return gi, gw, gb


def _softmax_backward(args: tuple, kwargs: dict, out: Any) -> Any:
    grad, y, dim = args[:3]
    return y * (grad - sequential_sum(grad * y, [dim], True))


def _log_softmax_backward(args: tuple, kwargs: dict, out: Any) -> Any:
    grad, y, dim = args[:3]
    return grad - y.exp() * sequential_sum(grad, [dim], True)


def _convolution_backward(args: tuple, kwargs: dict, out: Any) -> Any:
    gi, gw, gb = out
    if gb is not None:
        gb = sequential_sum(args[0], [d for d in range(args[0].dim()) if d != 1]).reshape(gb.shape)
    return gi, gw, gb


def _halves(n: int) -> tuple[slice, slice] | None:
    # Two halves of an inner dimension of length n (None when there is nothing to split).
    return (slice(0, n // 2), slice(n // 2, n)) if n >= 2 else None


def _mm(args: tuple, kwargs: dict, out: Any) -> Any:
    a, b = args[0], args[1]
    split = _halves(a.shape[-1])
    if split is None:
        return aten.mm.default(a, b)
    lo, hi = split
    return aten.mm.default(a[:, lo], b[lo]) + aten.mm.default(a[:, hi], b[hi])


def _addmm(args: tuple, kwargs: dict, out: Any) -> Any:
    bias, a, b = args[:3]
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    split = _halves(a.shape[-1])
    if split is None:
        return aten.addmm.default(bias, a, b, beta=beta, alpha=alpha)
    lo, hi = split
    first = aten.addmm.default(bias, a[:, lo], b[lo], beta=beta, alpha=alpha)
    return aten.addmm.default(first, a[:, hi], b[hi], alpha=alpha)


def _bmm(args: tuple, kwargs: dict, out: Any) -> Any:
    a, b = args[0], args[1]
    split = _halves(a.shape[-1])
    if split is None:
        return aten.bmm.default(a, b)
    lo, hi = split
    return aten.bmm.default(a[..., lo], b[:, lo]) + aten.bmm.default(a[..., hi], b[:, hi])


def _baddbmm(args: tuple, kwargs: dict, out: Any) -> Any:
    bias, a, b = args[:3]
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    split = _halves(a.shape[-1])
    if split is None:
        return aten.baddbmm.default(bias, a, b, beta=beta, alpha=alpha)
    lo, hi = split
    first = aten.baddbmm.default(bias, a[..., lo], b[:, lo], beta=beta, alpha=alpha)
    return aten.baddbmm.default(first, a[..., hi], b[:, hi], alpha=alpha)


def _tap_halves(weight: torch.Tensor, transposed: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    # A convolution's weight split into two weights, each holding half of the terms every output sums (the
    # input channels of its group times the kernel taps) and zeros elsewhere: their two convolutions add up
    # to the one, in another order.  (A transposed convolution's weight is (in, out / groups, *kernel).)
    w = weight.movedim(0, 1) if transposed else weight  # (out-ish, in_per_group, *kernel)
    terms = math.prod(w.shape[1:])
    if terms < 2:
        return None
    mask = (torch.arange(terms) < terms // 2).reshape(w.shape[1:]).to(w.dtype)
    first, second = w * mask, w * (1 - mask)
    if transposed:
        first, second = first.movedim(1, 0), second.movedim(1, 0)
    return first.contiguous(), second.contiguous()


def _convolution(args: tuple, kwargs: dict, out: Any) -> Any:
    x, weight, bias = args[:3]
    halves = _tap_halves(weight, bool(args[6]))
    if halves is None:
        return aten.convolution.default(*args, **kwargs)
    first = aten.convolution.default(x, halves[0], bias, *args[3:])
    return first + aten.convolution.default(x, halves[1], None, *args[3:])


def _convolution_backward_reordered(args: tuple, kwargs: dict, out: Any) -> Any:
    # The input gradient sums over output channels and taps: split the weight's terms as the forward does.
    # The weight gradient sums over the batch and the output positions: split the batch (or, with one
    # item, the output positions) and add the two halves.  The bias gradient: one sequential accumulator.
    grad, x, weight = args[:3]
    rest = args[3:10]  # (args[10] is the output mask: out says which gradients were asked for)
    gi, gw, gb = out
    transposed = bool(args[7])
    if gi is not None:
        halves = _tap_halves(weight, transposed)
        if halves is not None:
            gi = sum(aten.convolution_backward.default(grad, x, w, *rest, [True, False, False])[0] for w in halves)
    if gw is not None:
        n = grad.shape[0]
        if n >= 2:
            parts = [(grad[s], x[s]) for s in _halves(n)]
        else:
            positions = torch.arange(grad[0, 0].numel()).reshape(grad.shape[2:])
            half = (positions < positions.numel() // 2).to(grad.dtype)
            parts = [(grad * half, x), (grad * (1 - half), x)]
        gw = sum(aten.convolution_backward.default(g, xi, weight, *rest, [False, True, False])[1] for g, xi in parts)
    return _convolution_backward((grad, *args[1:]), kwargs, (gi, gw, gb))


_SEQUENTIAL: dict[Any, Callable[[tuple, dict, Any], Any]] = {
    aten.sum.dim_IntList: _sum,
    aten.sum.default: _sum,
    aten.mean.dim: _mean,
    aten.mean.default: _mean,
    aten.native_layer_norm_backward.default: _layer_norm_backward,
    aten.native_batch_norm.default: _batch_norm,
    aten.native_batch_norm_backward.default: _batch_norm_backward,
    aten.native_group_norm_backward.default: _group_norm_backward,
    aten._softmax_backward_data.default: _softmax_backward,
    aten._log_softmax_backward_data.default: _log_softmax_backward,
    aten.convolution_backward.default: _convolution_backward_reordered,
    aten.mm.default: _mm,
    aten.addmm.default: _addmm,
    aten.bmm.default: _bmm,
    aten.baddbmm.default: _baddbmm,
    aten.convolution.default: _convolution,
}
_REPLACED = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.convolution.default,
             aten.native_batch_norm.default}  # fmt: skip
"""Ops computed again from their arguments alone: the original call is not needed first."""


class QuietDispatchMode(TorchDispatchMode):
    """A dispatch mode whose first op does not import ``torch._dynamo``.

    ``TorchDispatchMode`` wraps each subclass's ``__torch_dispatch__`` in ``torch._disable_dynamo``,
    which imports ``torch._dynamo`` on its first call: 2.6 s of the first report in a process, for
    a mode that only counts ops.  Dynamo can only be tracing once it has been imported, so these
    modes turn it off themselves, and only then.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # the wrapping is done below, in __init_subclass__

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "__torch_dispatch__" in cls.__dict__:
            cls.__torch_dispatch__ = _dynamo_off_once_imported(cls.__dict__["__torch_dispatch__"])


def _dynamo_off_once_imported(fn: Callable) -> Callable:
    # fn run with dynamo disabled (as torch._disable_dynamo does) when torch._dynamo is imported,
    # and as it is before: nothing can be compiling then, not even while another thread imports it.
    disabled: list[Callable] = []

    @functools.wraps(fn)
    def inner(*args: Any, **kwargs: Any) -> Any:
        if not disabled:
            disable = getattr(sys.modules.get("torch._dynamo"), "disable", None)
            if disable is None:
                return fn(*args, **kwargs)
            disabled.append(disable(fn, recursive=True, wrapping=False))
        return disabled[0](*args, **kwargs)

    return inner


class SequentialSums(QuietDispatchMode):
    """Within it, float32 CPU reductions sum with one accumulator per output, in memory order.

    Enter it around a float32 forward *and* backward (see the module docstring); other
    dtypes, devices and operators run unchanged.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _REPLACED and _float32_cpu(args):
            return _SEQUENTIAL[func](args, kwargs, None)
        out = func(*args, **kwargs)
        return _SEQUENTIAL[func](args, kwargs, out) if _changes(func, kwargs, out) else out


def _float32_cpu(args: tuple) -> bool:
    # The tensor arguments of a matrix product or a convolution are float32 on the CPU.
    tensors = [a for a in args[:3] if isinstance(a, torch.Tensor)]
    return bool(tensors) and all(
        t.dtype == torch.float32 and t.device.type == "cpu" and not t.is_sparse for t in tensors
    )


class CountReductions(QuietDispatchMode):
    """Counts the reductions :class:`SequentialSums` would change, in ``calls``; changes nothing.

    ``dtypes``: the result dtypes counted.  A float32 run's reductions are float32's; counted during the
    float64 reference run (``(torch.float32, torch.float64)``), its float64 reductions are the ones the
    float32 model computes in float32 there.
    """

    def __init__(self, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> None:
        super().__init__()
        self.calls = 0
        self.dtypes = dtypes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _changes(func, kwargs, out, self.dtypes):
            self.calls += 1
        return out


def _changes(func: Any, kwargs: dict, out: Any, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> bool:
    # A covered reduction with CPU results in ``dtypes`` (a sum asked for another dtype is left alone).
    if func not in _SEQUENTIAL or kwargs.get("dtype") not in (None, *dtypes):
        return False
    leaves = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
    return bool(leaves) and all(t.dtype in dtypes and t.device.type == "cpu" for t in leaves)


# aten ops (overload packet names) that multiply matrices: what the anchors' torch-level targets
# (F.linear, matmul, bmm, convolutions, ...) and PyTorch's fused attention/transformer kernels
# dispatch to.  Generous on purpose: a false match only runs the anchors when they were not needed.
_MATMUL_LIKE = re.compile(r"mm|conv|attention|transformer|linear|matmul|dot|mv$|einsum")


class CountCalls(CountReductions):
    """:class:`~rlx_nb.backends.sequential.CountReductions` that also counts matmul-like aten ops in ``matmuls``, and by class
    in ``ops`` (``convolution``, ``matrix product``, ``attention``)."""

    def __init__(self, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> None:
        super().__init__(dtypes)
        self.matmuls = 0
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if _MATMUL_LIKE.search(name):
            self.matmuls += 1
            kind = "convolution" if "conv" in name else "attention" if "attention" in name else "matrix product"
            self.ops[kind] = self.ops.get(kind, 0) + 1
        return super().__torch_dispatch__(func, types, args, kwargs)
