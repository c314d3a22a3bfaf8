"""Large private copies on transparent huge pages.

Most of the time of a fresh copy of a large CPU tensor is page faults, not the copy: the kernel maps
the new buffer 4 KB at a time.  numpy asks the kernel for transparent huge pages on large buffers
(``madvise(MADV_HUGEPAGE)``, on by default on Linux); torch's CPU allocator does so only when the
process started with ``THP_MEM_ALLOC_ENABLE=1``.  So the copies rlx_nb makes itself (the private
input copy, the inputs of the fp64 reference) take their memory from numpy: a 200 MB float32 copy
takes 0.03 s there against 0.11 s through ``Tensor.clone``, a float64 cast 0.05 s against 0.21 s
(`bench/end_to_end.py`'s machine).  The buffers are 64-byte aligned like torch's own, so kernels
whose results depend on alignment (MKL's) see what they would see on the user's tensors.
"""

from __future__ import annotations

import numpy as np
import torch

HUGE_COPY_BYTES = 1 << 22  # below 4 MB the page faults are negligible: plain torch copies
_ALIGN = 64


def huge_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor on numpy's (transparent huge page) memory, 64-byte aligned as torch's."""
    nbytes = max(1, int(np.prod(shape, dtype=np.int64))) * dtype.itemsize
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    start = -raw.ctypes.data % _ALIGN
    return torch.from_numpy(raw[start : start + nbytes]).view(dtype).view(shape)


def private_copy(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A detached copy of ``t`` (cast to ``dtype`` if given) with the same values, shape and strides.

    The layout is the user's: a channels-last tensor stays channels-last, and a non-contiguous view (a
    slice with a step, a transpose, an expanded tensor) keeps its strides and its alignment, because
    kernels take other paths on such inputs and a layout-dependent bug must show in the copy
    (pytorch/pytorch#177839).  Large contiguous CPU tensors get numpy-allocated (huge-page) memory;
    anything else (other devices, subclasses, sparse, conjugate bits) is copied by torch itself.

    Examples
    --------
    >>> x = torch.arange(6.0).reshape(2, 3)
    >>> y = private_copy(x, torch.float64)
    >>> y.dtype, bool((y == x).all()), y.data_ptr() != x.data_ptr()
    (torch.float64, True, True)
    >>> private_copy(torch.zeros(4, 6)[:, ::2]).stride()
    (6, 2)
    """
    d = t.detach()
    dtype = dtype or d.dtype
    nbytes = d.numel() * dtype.itemsize
    plain = (
        type(d) is torch.Tensor
        and d.device.type == "cpu"
        and d.layout == torch.strided
        and not (d.is_quantized or d.is_conj() or d.is_neg())
    )
    if plain and not d.is_contiguous() and not _dense(d):
        return _same_layout(d, dtype)
    if not plain or not d.is_contiguous() or nbytes < HUGE_COPY_BYTES:
        return d.to(dtype) if dtype != d.dtype else d.clone()  # (both keep a dense layout: channels-last)
    out = huge_empty(tuple(d.shape), dtype)
    out.copy_(d)
    return out


SPREAD_LIMIT = 4
"""A strided view spanning more than this many times its elements' memory is copied contiguous instead
(a small view of a huge tensor: keeping its strides would copy the memory between its elements)."""


def _dense(d: torch.Tensor) -> bool:
    # Non-overlapping and dense (contiguous in some order, e.g. channels-last): clone keeps such strides.
    return d._is_non_overlapping_and_dense() if hasattr(d, "_is_non_overlapping_and_dense") else d.is_contiguous()


def _same_layout(d: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # The memory a strided view spans, copied from its first element, with the view's strides over it and
    # its first element as far from a 64-byte boundary as the user's.
    if d.numel() == 0 or any(s < 0 for s in d.stride()):
        return d.to(dtype) if dtype != d.dtype else d.clone()
    extent = 1 + sum((n - 1) * s for n, s in zip(d.shape, d.stride(), strict=True))
    if extent > SPREAD_LIMIT * d.numel() + _ALIGN:
        return d.to(dtype) if dtype != d.dtype else d.clone()
    shift = (d.data_ptr() % _ALIGN) // d.element_size()
    buf = torch.empty(extent + shift, dtype=dtype, device=d.device)
    buf[shift:].copy_(d.as_strided((extent,), (1,)))
    return buf.as_strided(d.shape, d.stride(), shift)


def weights_bytes(model: torch.nn.Module) -> int:
    """The bytes of ``model``'s parameters and buffers, each tensor once (a tied weight is one)."""
    return sum(
        t.numel() * t.element_size() for t in {id(t): t for t in (*model.parameters(), *model.buffers())}.values()
    )


def raw_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy and without numpy.

    (``t.numpy()`` would mark the tensor's storage as shared with numpy, and such a storage can no longer
    be resized, which :meth:`rlx_nb.execution.prepare.PrivateModel.release` does to free the weights.)

    Examples
    --------
    >>> bytes(raw_bytes(torch.tensor([1], dtype=torch.int32)))
    b'\\x01\\x00\\x00\\x00'
    """
    import ctypes

    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("raw_bytes needs a contiguous CPU tensor")
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    view = (ctypes.c_char * n).from_address(t.data_ptr())
    view.owner = t  # the memoryview keeps ``view`` alive, and ``view`` the tensor
    return memoryview(view).cast("B")
