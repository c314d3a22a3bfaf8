"""Real bugs reproduced as backends, outside the fault catalogue: each is wrong only at some sizes, so not SUSPECT
on every demo model (the catalogue's contract), but at the sizes its report names.

- ``fault:sum-no-cascade``: pytorch#154703.  Inductor's C++ sum kept one accumulator per vector lane over the whole
  range, with no cascade; on a mean of 2**28 floats a lane's running sum grows until the terms no longer register
  (6.1e-6 off fp64 where eager is 2.5e-8 off).  Round-off over a few thousand terms.

``bench/large_reductions.py`` runs it; :func:`known_bug` makes its backend.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlx_nb.backends.base import Backend
from rlx_nb.backends.faults import Fault, fault_backend
from rlx_nb.backends.sequential import accumulate
from rlx_nb.errors import InputError

LANES = 16
"""Vector lanes of :func:`_sum_no_cascade`'s kernel (AVX-512's float32 lanes)."""


def _sum_no_cascade(s: float):
    # pytorch#154703: Inductor's C++ sum kept one accumulator per vector lane over the whole range, with no cascade;
    # on a mean of 2**28 floats a lane's running sum grows until the terms no longer register.  The value is the
    # kernel's, the gradient the exact sum's (a forward kernel's bug).
    def reduce(x, dim=None, keepdim=False, *, dtype=None, mean=False):
        if x.dtype != torch.float32 or x.device.type != "cpu" or dtype not in (None, torch.float32) or x.dim() == 0:
            return NotImplemented
        dims = sorted({d % x.dim() for d in ((dim,) if isinstance(dim, int) else dim or range(x.dim()))})
        kept = [d for d in range(x.dim()) if d not in dims]
        n = 1
        for d in dims:
            n *= x.shape[d]
        exact = x.sum(dims, keepdim=keepdim)
        rows = x.detach().permute(*kept, *dims).reshape(-1, n)
        rows = F.pad(rows, (0, -n % LANES)).reshape(rows.shape[0], -1, LANES).transpose(1, 2).contiguous()
        lanes = torch.from_numpy(accumulate(rows.reshape(-1, rows.shape[2]).numpy())).reshape(-1, LANES)
        buggy = lanes.sum(1).reshape(exact.shape)  # (the lanes added at the end)
        out = exact + (buggy - exact.detach())
        return out / n if mean else out

    def summ(x, dim=None, keepdim=False, *, dtype=None):
        return reduce(x, dim, keepdim, dtype=dtype)

    def average(x, dim=None, keepdim=False, *, dtype=None):
        return reduce(x, dim, keepdim, dtype=dtype, mean=True)

    return {torch.sum: summ, torch.Tensor.sum: summ, torch.mean: average, torch.Tensor.mean: average}


KNOWN_BUGS: dict[str, Fault] = {
    f.name: f
    for f in [
        Fault(
            "fault:sum-no-cascade",
            "sum and mean with one float32 accumulator per vector lane over the whole range (pytorch#154703)",
            _sum_no_cascade,
            1.0,
            (1.0,),
        ),
    ]
}
"""The reproductions, by backend name."""


def known_bug(name: str) -> Backend:
    """The backend of a reproduced bug (not registered: pass it in ``backends=[...]``).

    Examples
    --------
    >>> known_bug("fault:sum-no-cascade").name
    'fault:sum-no-cascade'
    """
    if name not in KNOWN_BUGS:
        raise InputError(f"unknown bug {name!r}; reproduced here: {', '.join(KNOWN_BUGS)}")
    return fault_backend(KNOWN_BUGS[name])


__all__ = ["KNOWN_BUGS", "known_bug"]
