"""Eager PyTorch backends: the fp32 oracle, the fp64 reference, oneDNN off, and devices."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from rlx_nb._support import switches
from rlx_nb._support.hugepages import private_copy
from rlx_nb._support.tree import map_tensors
from rlx_nb.backends.base import ORACLE, REFERENCE, Backend
from rlx_nb.backends.float64_kernels import float64_kernels


def run_eager(model: Any, inputs: tuple) -> Any:
    """The oracle: the model as it is, float32 eager on the CPU."""
    return model(*inputs)


def to_float64(x: torch.Tensor) -> torch.Tensor:
    if not x.is_floating_point() or x.dtype == torch.float64:
        return x
    # A differentiable cast where gradients flow back to the input; else a copy on huge pages.
    return x.double() if x.requires_grad else private_copy(x, torch.float64)


def run_float64(model: Any, inputs: tuple) -> Any:
    """The reference: the same model with every floating param, buffer and input in float64, and the tensors it
    makes as it runs too (:func:`float64_default`); an op PyTorch has no float64 kernel for is computed from its
    definition (:mod:`rlx_nb.backends.float64_kernels`)."""
    if isinstance(model, torch.nn.Module):
        model.double()
    with float64_default(), float64_kernels():
        return model(*map_tensors(to_float64, inputs))


def float64_default() -> contextlib.AbstractContextManager:
    """float64 as the default dtype while the reference runs, restored after (:func:`rlx_nb._support.switches.flipped`): a
    tensor the model makes without a dtype (``torch.full((), torch.finfo(x.dtype).min)``: XGLM's attention mask
    floor; a position table) is float64 like the rest.  Under float32 it held float32's round-off, and XGLM's floor
    overflowed float32: the reference raised.  (Bit for bit the same reference on every zoo model, which makes no
    such tensor.)"""
    return switches.flipped(default_dtype=torch.float64)


class Float64Weights(TorchFunctionMode):
    """The model's float32 weights cast to float64 where an op uses them, each copy freed after the op.

    The streamed fp64 reference, for a model whose weights in float64 do not fit in memory: the float32
    weights stay as they are, and only the weights of the op running are held in float64 too.  Every use
    is seen (a module's forward, a parent using a child's weight, a tied weight, ``.dtype``), so the model
    computes what ``model.double()`` computes.  Forward only: a backward would keep every weight's float64
    copy for its gradients, and those would flow back into float32.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        tensors = [*model.parameters(), *model.buffers()]
        self.ids = {id(t) for t in tensors if t.is_floating_point() and t.dtype != torch.float64}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        cast: dict[int, torch.Tensor] = {}

        def wide(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and id(x) in self.ids:
                if id(x) not in cast:
                    cast[id(x)] = x.detach().to(torch.float64)
                return cast[id(x)]
            return x

        args, kwargs = tree_map(wide, (args, kwargs))
        return func(*args, **kwargs)


def run_float64_streamed(model: Any, inputs: tuple) -> Any:
    """The reference with the weights in float64 one op at a time (:class:`Float64Weights`); forward only."""
    if not isinstance(model, torch.nn.Module):
        return run_float64(model, inputs)
    with Float64Weights(model), float64_default(), float64_kernels():
        return model(*map_tensors(to_float64, inputs))


def run_nomkldnn(model: Any, inputs: tuple) -> Any:
    """Eager with oneDNN (mkldnn) and NNPACK disabled: ATen's native kernels, other kernels on the same chip.

    NNPACK is off too: with oneDNN off PyTorch runs convolutions through NNPACK's fast algorithms from batch
    16 (Winograd, FFT: several times the oracle's round-off), so "oneDNN off" alone was a different backend at
    batch 16 than at batch 8.  ``cpu-nnpack`` is that one.  The switches are process-wide;
    :mod:`rlx_nb._support.switches` keeps them from outliving the run.
    """
    with switches.flipped(mkldnn_enabled=False, nnpack_enabled=False):
        return model(*inputs)


def run_nnpack(model: Any, inputs: tuple) -> Any:
    """Eager with oneDNN disabled and NNPACK as PyTorch picks it: its fast convolutions from batch 16."""
    with switches.flipped(mkldnn_enabled=False, nnpack_enabled=True):
        return model(*inputs)


def nnpack_reason() -> str | None:
    return None if torch.backends.nnpack.is_available() else "this torch has no NNPACK"


def device_reason(device: str) -> str | None:
    """``None`` when ``device`` (cuda, mps, xpu, cpu) is usable here, else why not."""
    if device == "cpu":
        return None
    if device == "cuda":
        return None if torch.cuda.is_available() else "no CUDA device (torch.cuda.is_available() is False)"
    if device == "mps":
        mps = getattr(torch.backends, "mps", None)
        return None if mps is not None and mps.is_available() else "no MPS device"
    if device == "xpu":
        xpu = getattr(torch, "xpu", None)
        return None if xpu is not None and xpu.is_available() else "no XPU device"
    return f"unknown device {device!r}"


def cuda_tf32(enabled: bool) -> contextlib.AbstractContextManager:
    """Set TF32 for CUDA matmuls and cuDNN convolutions, restoring the previous state (:mod:`rlx_nb._support.switches`)."""
    return switches.flipped(cuda_matmul_allow_tf32=enabled, cudnn_allow_tf32=enabled)


def to_cpu_float(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.is_floating_point() and x.dtype != torch.float64 else x


def on_device(device: str, *, tf32: bool = False, autocast: torch.dtype | None = None):
    """A backend fn that runs the model eager on ``device``.

    TF32 is switched off unless ``tf32=True``, so ``cuda`` is a true fp32
    backend; ``autocast`` runs under ``torch.autocast`` in that dtype and
    casts floating outputs back to float32.
    """

    def fn(model: Any, inputs: tuple) -> Any:
        if isinstance(model, torch.nn.Module):
            model.to(device)
        moved = map_tensors(lambda t: t.to(device), inputs)
        guard = cuda_tf32(tf32) if device == "cuda" else contextlib.nullcontext()
        cast = torch.autocast(device_type=device, dtype=autocast) if autocast is not None else contextlib.nullcontext()
        with guard, cast:
            out = model(*moved)
        return map_tensors(to_cpu_float, out) if autocast is not None else out

    fn.__name__ = f"run_on_{device}"
    return fn


def _probe(device: str):
    return lambda: device_reason(device)


BACKENDS = [
    Backend(
        ORACLE, run_eager, description="torch eager, float32 (the oracle)", builtin=True, hookable=True, on_caller=True
    ),
    Backend(
        REFERENCE,
        run_float64,
        compute_dtype="float64",
        default=False,
        description="torch eager, float64 (the reference the verdict uses)",
        builtin=True,
        hookable=True,
        on_caller=True,
    ),
    Backend(
        "cpu-nomkldnn",
        run_nomkldnn,
        description="torch eager with oneDNN and NNPACK disabled (ATen's native kernels)",
        builtin=True,
        hookable=True,
        on_caller=True,
    ),
    Backend(
        "cpu-nnpack",
        run_nnpack,
        default=False,
        probe=nnpack_reason,
        description="torch eager with oneDNN disabled: NNPACK's fast convolutions from batch 16, as PyTorch picks them",
        builtin=True,
        hookable=True,
        on_caller=True,
    ),
    Backend(
        "cuda",
        on_device("cuda"),
        device="cuda",
        probe=_probe("cuda"),
        description="torch eager on CUDA, TF32 off",
        builtin=True,
        hookable=True,
    ),
    Backend(
        "cuda-tf32",
        on_device("cuda", tf32=True),
        device="cuda",
        compute_dtype="tf32",
        probe=_probe("cuda"),
        description="torch eager on CUDA, TF32 matmuls and convolutions",
        builtin=True,
        hookable=True,
    ),
    Backend(
        "cuda-bf16",
        on_device("cuda", autocast=torch.bfloat16),
        device="cuda",
        compute_dtype="bfloat16",
        probe=_probe("cuda"),
        description="CUDA autocast bfloat16",
        builtin=True,
        hookable=True,
    ),
    Backend(
        "mps",
        on_device("mps"),
        device="mps",
        probe=_probe("mps"),
        description="torch eager on Apple MPS (no float64 there)",
        builtin=True,
        hookable=True,
    ),
    Backend(
        "xpu",
        on_device("xpu"),
        device="xpu",
        probe=_probe("xpu"),
        description="torch eager on Intel XPU",
        builtin=True,
        hookable=True,
    ),
]
