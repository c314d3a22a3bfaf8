"""Float64 kernels for the ops PyTorch has none for, so the fp64 reference computes every model it runs.

The fp64 reference runs the model with its floating tensors in float64 (:func:`rlx_nb.backends.eager.run_float64`).
A few ATen ops have CPU kernels for the float32 family only: ``aten::_grouped_mm`` (``torch.nn.functional.grouped_mm``,
the experts' matmuls of Hugging Face's mixture-of-experts models: Mixtral, Qwen2-MoE, OLMoE, ...) raises
"Expected mat_a to be Float32, BFloat16 or Float16 matrix, got Double", and the reference failed, leaving every
verdict on the model to the fixed tolerance.  :class:`Float64Kernels` is a dispatch mode (it sees the ATen ops the
model's own run executes and changes none of the others; PyTorch's fused fast paths stay on) that computes such an
op from its definition, in float64: for ``_grouped_mm``, one ``mm`` per group (and the 2D x 2D and 3D x 2D forms
its gradients take: :func:`rlx_nb.execution.run.run` keeps the mode on around the reference's backward too).  Operands of
any other dtype go to PyTorch's own kernel.

Examples
--------
>>> a, b = torch.randn(5, 3, dtype=torch.float64), torch.randn(2, 3, 4, dtype=torch.float64)
>>> offs = torch.tensor([2, 5], dtype=torch.int32)
>>> with Float64Kernels():
...     out = torch.nn.functional.grouped_mm(a, b, offs=offs)
>>> bool(torch.equal(out[:2], a[:2] @ b[0])) and bool(torch.equal(out[2:], a[2:] @ b[1]))
True
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from rlx_nb._support.hugepages import HUGE_COPY_BYTES, huge_empty
from rlx_nb.backends.sequential import QuietDispatchMode

aten = torch.ops.aten


def _bounds(offs: torch.Tensor) -> list[tuple[int, int]]:
    # Each group's (start, end) along the jagged dimension: offs[i] is the end of group i.
    ends = [int(e) for e in offs.tolist()]
    return list(zip([0, *ends[:-1]], ends, strict=True))


def grouped_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    offs: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``aten::_grouped_mm`` from its definition, one ``mm`` per group (the dtype of the operands).

    2D x 3D with ``offs`` (the rows of ``a`` split into groups, group ``g`` times ``b[g]``), 3D x 3D (a batched
    matmul), 2D x 2D with ``offs`` (the shared dimension split: one ``M x N`` product per group) and 3D x 2D with
    ``offs`` (the columns of ``b`` split, group ``g`` times ``a[g]``).  Rows and columns past ``offs[-1]`` are zero.
    """
    del out_dtype  # (a float64 result stays float64: the reference's precision)
    if a.dim() == 3 and b.dim() == 3 and offs is None:
        out = torch.bmm(a, b)
        return out + bias.unsqueeze(1) if bias is not None else out
    if offs is None:
        raise NotImplementedError(f"_grouped_mm of {a.dim()}D x {b.dim()}D operands needs offs")
    groups = _bounds(offs)
    if a.dim() == 2 and b.dim() == 3:
        out = a.new_zeros(a.shape[0], b.shape[2])
        for g, (s, e) in enumerate(groups):
            if e > s:
                out[s:e] = a[s:e] @ b[g] + (bias[g] if bias is not None else 0)
        return out
    if bias is not None:
        raise NotImplementedError(f"_grouped_mm with a bias on {a.dim()}D x {b.dim()}D operands")
    if a.dim() == 2 and b.dim() == 2:
        out = a.new_zeros(len(groups), a.shape[0], b.shape[1])
        for g, (s, e) in enumerate(groups):
            out[g] = a[:, s:e] @ b[s:e]
        return out
    if a.dim() == 3 and b.dim() == 2:
        out = a.new_zeros(a.shape[1], b.shape[1])
        for g, (s, e) in enumerate(groups):
            if e > s:
                out[:, s:e] = a[g] @ b[:, s:e]
        return out
    raise NotImplementedError(f"_grouped_mm of {a.dim()}D x {b.dim()}D operands")


KERNELS: dict[Any, Callable[..., torch.Tensor]] = {aten._grouped_mm.default: grouped_mm}
"""The ops computed here when their operands are float64, and how."""


_OUT: dict[Any, Any] = {}


def out_variant(func: Any) -> Any:
    """The ``out=`` overload of a pointwise op that computes the same function (``aten.mul.Tensor`` ->
    ``aten.mul.out``), or None: its schema is the op's own plus one ``out`` tensor."""
    if func in _OUT:
        return _OUT[func]
    found = None
    schema = getattr(func, "_schema", None)
    if schema is not None and torch.Tag.pointwise in getattr(func, "tags", ()) and not schema.is_mutable:
        own = [(a.name, str(a.type)) for a in schema.arguments]
        for name in func.overloadpacket.overloads():
            candidate = getattr(func.overloadpacket, name)
            args = candidate._schema.arguments
            if args and args[-1].name == "out" and [(a.name, str(a.type)) for a in args[:-1]] == own:
                found = candidate
                break
    _OUT[func] = found
    return found


def broadcast(shapes: list[torch.Size]) -> tuple[int, ...] | None:
    """The shape ``shapes`` broadcast to, or None where they do not: ``torch.broadcast_shapes``'s answer without
    its first call's import of sympy (half a second of a process's first reference).

    >>> broadcast([torch.Size([4, 1]), torch.Size([3])]), broadcast([torch.Size([2]), torch.Size([3])])
    ((4, 3), None)
    """
    out = [1] * max((len(s) for s in shapes), default=0)
    for shape in shapes:
        for i, size in enumerate(shape, len(out) - len(shape)):
            if size != 1:
                if out[i] not in (1, size):
                    return None
                out[i] = size
    return tuple(out)


def _result_dtype(func: Any, args: tuple, kwargs: dict) -> torch.dtype | None:
    # What the op gives for these operands, from one element of each: its CPU kernel, no other mode seeing it.  (Its
    # meta kernel is Python, from torch._refs: its first call imports torch._dynamo, 1.5 s of a process's first
    # reference.)  None for an op that draws random numbers (one more draw would move the stream) or does not run.
    if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
        return None

    def one(v: Any) -> Any:
        return v.new_zeros((1,) * v.dim()) if isinstance(v, torch.Tensor) else v

    try:
        with torch._C._DisableTorchDispatch(), torch.no_grad():
            got = func(*map(one, args), **{k: one(v) for k, v in kwargs.items()})
    except Exception:  # (an op that refuses zeros: run as it is)
        return None
    return got.dtype if isinstance(got, torch.Tensor) else None


def _huge_result(func: Any, args: tuple, kwargs: dict) -> Any:
    # A large float64 pointwise result written to huge-page memory through the op's out= overload (the same kernel:
    # the same bits), or None where the op is not one (the caller runs it as it is).  The reference's outputs were
    # torch's 4 KB pages, faulted in one at a time: a float64 SiLU-then-scale over 5e7 elements took 0.45 s, 0.17 s
    # on huge pages.  (Below autograd, as every dispatch mode is: a backward records the op as it would, and its own
    # kernels come here too.)
    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    if not tensors or any(t.dtype != torch.float64 or t.device.type != "cpu" or type(t) is not torch.Tensor
                          or t.is_nested or t.layout != torch.strided for t in tensors):  # fmt: skip
        return None  # (a nested tensor has no one shape: its sizes raise)
    shape = broadcast([t.shape for t in tensors])
    if shape is None or math.prod(shape) * 8 < HUGE_COPY_BYTES or not all(t.is_contiguous() for t in tensors):
        return None
    out = out_variant(func)
    if out is None or _result_dtype(func, args, kwargs) != torch.float64:  # (a comparison gives bool: as it is)
        return None
    # (A pointwise op over contiguous operands gives a contiguous result of their broadcast shape.)
    return out(*args, **kwargs, out=huge_empty(shape, torch.float64))


class Float64Kernels(QuietDispatchMode):
    """Compute the ops in :data:`KERNELS` from their definitions where their tensor operands are float64, and write
    large float64 pointwise results to huge-page memory (:func:`_huge_result`: the same kernel, the same bits).  (A
    :class:`~rlx_nb.backends.sequential.QuietDispatchMode`: an eager run never imports ``torch._dynamo`` for it.)"""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        kernel = KERNELS.get(func)
        if kernel is not None and all(
            t.dtype == torch.float64
            for t in (*args, *kwargs.values())
            if isinstance(t, torch.Tensor) and t.is_floating_point()
        ):
            return kernel(*args, **kwargs)
        found = _huge_result(func, args, kwargs)
        return found if found is not None else func(*args, **kwargs)


def float64_kernels() -> contextlib.AbstractContextManager:
    """A :class:`Float64Kernels` mode, or none where one is already on: the fp64 reference's scope holds one around
    its forward and backward (:func:`rlx_nb.execution.run.run`), and a second inside it would only add a Python call per op.

    >>> with Float64Kernels():
    ...     inner = float64_kernels()
    >>> type(inner).__name__, type(float64_kernels()).__name__
    ('nullcontext', 'Float64Kernels')
    """
    if any(isinstance(mode, Float64Kernels) for mode in _get_current_dispatch_mode_stack()):
        return contextlib.nullcontext()
    return Float64Kernels()
