"""A plain sequential fp32 run: how far another legitimate summation order can drift.

A backend that sums in another order than the oracle (Inductor's generated loops, another
BLAS, a GPU's tree) differs from it by round-off whose size depends on the *terms* of each sum,
not only on the result or its length.  On the detection benchmark's conv net, Inductor's
BatchNorm-bias gradient is 36x the oracle's error, and bit for bit what a scalar loop gives:
ATen's kernel sums the 8,192 terms of each channel in 16 vector lanes, Inductor's generated code
in one accumulator, and the terms (a pooled gradient, equal across each image) make the
sequential rounding errors add up coherently instead of averaging out.  A floor guessed from
the sum's length cannot know that; so the budget measures it.

:class:`SequentialSums` runs the model (forward and backward) in float32 with every reduction
computed as the plainest legitimate kernel would: one accumulator per output, adding the terms
strictly in index order (memory order for contiguous tensors).  Covered: ``sum``/``mean``; the parameter gradients (and the
input-gradient row sums) of LayerNorm, BatchNorm and GroupNorm; softmax and log-softmax
backward; a convolution's bias gradient.  Matrix products are left to the BLAS, whose kernels
already accumulate each element sequentially along K.  The run's error against the float64
reference is then one more legitimate error, next to the oracle's: the budget is sized by the
larger of the two (:func:`rlx_nb.compare.compare`).
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

from rlx_nb._fused import sequential_kernel

aten = torch.ops.aten


def sequential_sum(x: torch.Tensor, dims: Sequence[int], keepdim: bool = False) -> torch.Tensor:
    """``x.sum(dims)`` in float32, each output summed by one accumulator in index order."""
    nd = x.dim()
    if nd == 0:
        return x.detach().to(torch.float32, copy=True)
    dims = sorted({d % nd for d in dims})
    kept = [d for d in range(nd) if d not in dims]
    shape = [x.shape[d] for d in kept]
    # Terms of another dtype (a half tensor summed with dtype=float32) are added as float32.
    rows = x.detach().to(torch.float32).permute(*kept, *dims).reshape(math.prod(shape), -1).contiguous().numpy()
    out = np.empty(rows.shape[0], np.float32)
    run = sequential_kernel()
    if run is not None:
        run(rows, out)
    elif rows.shape[1]:
        out[:] = np.add.accumulate(rows.T, axis=0, dtype=np.float32)[-1]  # left to right per column
    else:
        out[:] = 0
    result = torch.from_numpy(out).reshape(shape)
    if keepdim:
        result = result.reshape([1 if d in dims else s for d, s in enumerate(x.shape)])
    return result


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


_SEQUENTIAL: dict[Any, Callable[[tuple, dict, Any], Any]] = {
    aten.sum.dim_IntList: _sum,
    aten.sum.default: _sum,
    aten.mean.dim: _mean,
    aten.mean.default: _mean,
    aten.native_layer_norm_backward.default: _layer_norm_backward,
    aten.native_batch_norm_backward.default: _batch_norm_backward,
    aten.native_group_norm_backward.default: _group_norm_backward,
    aten._softmax_backward_data.default: _softmax_backward,
    aten._log_softmax_backward_data.default: _log_softmax_backward,
    aten.convolution_backward.default: _convolution_backward,
}


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
        out = func(*args, **kwargs)
        return _SEQUENTIAL[func](args, kwargs, out) if _changes(func, kwargs, out) else out


class CountReductions(QuietDispatchMode):
    """Counts the reductions :class:`SequentialSums` would change, in ``calls``; changes nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _changes(func, kwargs, out):
            self.calls += 1
        return out


def _changes(func: Any, kwargs: dict, out: Any) -> bool:
    # A covered reduction with float32 CPU results (a sum asked for another dtype is left alone).
    if func not in _SEQUENTIAL or kwargs.get("dtype") not in (None, torch.float32):
        return False
    leaves = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
    return bool(leaves) and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in leaves)


# aten ops (overload packet names) that multiply matrices: what the anchors' torch-level targets
# (F.linear, matmul, bmm, convolutions, ...) and PyTorch's fused attention/transformer kernels
# dispatch to.  Generous on purpose: a false match only runs the anchors when they were not needed.
_MATMUL_LIKE = re.compile(r"mm|conv|attention|transformer|linear|matmul|dot|mv$|einsum")


class CountCalls(CountReductions):
    """:class:`~rlx_nb.reassoc.CountReductions` that also counts matmul-like aten ops in ``matmuls``."""

    def __init__(self) -> None:
        super().__init__()
        self.matmuls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _MATMUL_LIKE.search(func.overloadpacket.__name__):
            self.matmuls += 1
        return super().__torch_dispatch__(func, types, args, kwargs)
