"""Reduced-precision backends: CPU autocast in bfloat16 and float16 (opt-in)."""

from __future__ import annotations

import torch

from rlx_nb.backends.base import Backend
from rlx_nb.backends.eager import on_device

BACKENDS = [
    Backend(
        "cpu-bf16",
        on_device("cpu", autocast=torch.bfloat16),
        compute_dtype="bfloat16",
        default=False,
        description="CPU autocast bfloat16 (judged against a bfloat16 budget)",
        builtin=True,
        hookable=True,
        on_caller=True,
    ),
    Backend(
        "cpu-fp16",
        on_device("cpu", autocast=torch.float16),
        compute_dtype="float16",
        default=False,
        description="CPU autocast float16 (judged against a float16 budget; slow on most CPUs)",
        builtin=True,
        hookable=True,
        on_caller=True,
    ),
]
