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


def private_copy(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A detached copy of ``t`` (cast to ``dtype`` if given) with the same values, shape and strides.

    Large contiguous CPU tensors get numpy-allocated (huge-page) memory; anything else (other
    devices, subclasses, sparse, strided views, conjugate bits) is copied by torch itself.

    Examples
    --------
    >>> x = torch.arange(6.0).reshape(2, 3)
    >>> y = private_copy(x, torch.float64)
    >>> y.dtype, bool((y == x).all()), y.data_ptr() != x.data_ptr()
    (torch.float64, True, True)
    """
    d = t.detach()
    dtype = dtype or d.dtype
    nbytes = d.numel() * dtype.itemsize
    plain = (
        type(d) is torch.Tensor
        and d.device.type == "cpu"
        and d.layout == torch.strided
        and not (d.is_quantized or d.is_conj() or d.is_neg())
        and d.is_contiguous()
    )
    if not plain or nbytes < HUGE_COPY_BYTES:
        return d.to(dtype) if dtype != d.dtype else d.clone()
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    start = -raw.ctypes.data % _ALIGN
    out = torch.from_numpy(raw[start : start + nbytes]).view(dtype).view(d.shape)
    out.copy_(d)
    return out
