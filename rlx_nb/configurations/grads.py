"""A row's per-sample gradients in a configuration (``invariance(..., backward=True)``): what training computes.

The row's outputs, cut to the row as the comparison cuts them, are set against a fixed cotangent (random numbers
seeded by each output's name: the same in every configuration), and the gradient of that one number is taken with
respect to every parameter.  Inside a batch, only the row's outputs reach it, so the gradient is the row's own,
computed by the batch's backward kernels (the other rows' parts of each product are zeros): bit for bit the row
alone's where the backward is invariant.  The float64 reference takes the same gradient of a float64 copy of the model.
"""

from __future__ import annotations

import copy
import zlib
from collections.abc import Callable
from typing import Any

import torch

from rlx_nb.configurations.configs import aligned


def _cotangent(name: str, like: torch.Tensor) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(like.shape, generator=gen)


def row_grads(run: Callable[[], dict[str, torch.Tensor]], model: torch.nn.Module, like: dict[str, torch.Tensor],
              where: dict[str, Any]) -> dict[str, torch.Tensor]:  # fmt: skip
    """``grad:<parameter>`` for each of ``model``'s trained parameters: the gradient of the row's outputs of ``run()``
    (cut to the shapes ``like`` holds, the row alone's) against their fixed cotangents (module docstring)."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not params:
        return {}
    with torch.enable_grad():
        out = run()
        terms = []
        for k in sorted(like):
            v = out.get(k)
            cut = aligned(v, like[k].shape, **where) if v is not None else None
            if cut is not None and cut.requires_grad:
                terms.append((cut * _cotangent(k, like[k]).to(cut.dtype)).sum())
        if not terms:
            return {}
        grads = torch.autograd.grad(torch.stack(terms).sum(), [p for _, p in params], allow_unused=True)
    return {f"grad:{n}": g.detach() for (n, _), g in zip(params, grads, strict=True) if g is not None}


def float64_row_grads(model: torch.nn.Module, call: Callable[[Any], Any], like: dict[str, torch.Tensor],
                      outputs: Callable[[Any], dict]) -> dict[str, torch.Tensor]:  # fmt: skip
    """The same gradients of a float64 copy of ``model`` (``call(model64)``: the row alone, its inputs in float64)."""
    from rlx_nb.backends.eager import float64_default
    from rlx_nb.backends.float64_kernels import float64_kernels

    with float64_default(), float64_kernels():
        model64 = copy.deepcopy(model).to(torch.float64)
        return row_grads(lambda: outputs(call(model64)), model64, like, {})


__all__ = ["float64_row_grads", "row_grads"]
