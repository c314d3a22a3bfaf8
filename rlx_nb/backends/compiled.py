"""``torch.compile`` backends (Inductor) on the CPU and on CUDA."""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch

from rlx_nb.backends.eager import device_reason, on_device
from rlx_nb.backends.registry import Backend


def compiler_reason() -> str | None:
    """Inductor's CPU code generation needs a C++ compiler on PATH."""
    names = [os.environ.get("CXX", ""), "g++", "clang++", "c++"]
    if any(n and shutil.which(n) for n in names):
        return None
    return "no C++ compiler on PATH (Inductor needs g++ or clang++; set CXX)"


def run_inductor(model: Any, inputs: tuple) -> Any:
    """Compile with Inductor (fixed shapes) and run once.

    Compiled artefacts land in Inductor's on-disk cache, so a second run of
    the same model compiles in about a second instead of several.
    """
    compiled = torch.compile(model, backend="inductor", dynamic=False)
    return compiled(*inputs)


def run_cuda_inductor(model: Any, inputs: tuple) -> Any:
    """Move to CUDA, compile with Inductor, run with TF32 off."""
    if isinstance(model, torch.nn.Module):
        model.to("cuda")
    compiled = torch.compile(model, backend="inductor", dynamic=False)
    return on_device("cuda")(compiled, inputs)


BACKENDS = [
    Backend(
        "cpu-inductor",
        run_inductor,
        probe=compiler_reason,
        description="torch.compile (Inductor) on the CPU",
        builtin=True,
    ),
    Backend(
        "cuda-inductor",
        run_cuda_inductor,
        device="cuda",
        probe=lambda: device_reason("cuda"),
        description="torch.compile (Inductor) on CUDA, TF32 off",
        builtin=True,
    ),
]
