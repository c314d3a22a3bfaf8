"""What a snapshot records of its environment beyond a report's, and how two environments differ, in words.

A report's :func:`~rlx_nb.execution.environment.environment` (versions, CPU and SIMD flags, ATen's vector ISA, the
global switches) plus what decides which kernels a CPU op runs: the BLAS and oneDNN torch was built with, the
thread pools, and the variables that move MKL's, oneDNN's and ATen's dispatch (``MKL_CBWR``, ``ONEDNN_MAX_CPU_ISA``,
``ATEN_CPU_CAPABILITY``...).
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

from rlx_nb.execution.environment import environment, packages_of, runtime_packages

VARIABLES = (
    "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "MKL_DEBUG_CPU_TYPE", "MKL_NUM_THREADS", "MKL_DYNAMIC",
    "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ONEDNN_DEFAULT_FPMATH_MODE", "ATEN_CPU_CAPABILITY",
    "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OPENBLAS_CORETYPE", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE",
    "NVIDIA_TF32_OVERRIDE", "CUBLAS_WORKSPACE_CONFIG",
)  # fmt: skip
"""Environment variables that change which kernel an op runs (or how many threads split it)."""

_LIBRARIES = re.compile(r"Math Kernel Library Version (\S+)|MKL-DNN (v[\d.]+)|oneDNN (v[\d.]+)|BLAS_INFO=(\w+)")


def snapshot_environment() -> dict[str, Any]:
    """A report's environment, and the libraries, thread pools and dispatch variables that pick a CPU kernel."""
    env = environment()
    config = torch.__config__.show()
    found = {}
    for m in _LIBRARIES.finditer(config):
        mkl, dnn, dnn2, blas = m.groups()
        if mkl:
            found["mkl"] = mkl
        if dnn or dnn2:
            found["onednn"] = dnn or dnn2
        if blas:
            found["blas"] = blas
    env.update(found)
    env["interop_threads"] = torch.get_num_interop_threads()
    env["variables"] = {k: os.environ[k] for k in VARIABLES if k in os.environ}
    return env


# What each difference can move (the first that matches names it); the rest are listed as they are.
_WHAT = {
    "torch": "every kernel torch ships (a new release changes kernels, fusions, defaults)",
    "onnxruntime": "every kernel ONNX Runtime runs (and the exporter's graph)",
    "openvino": "every kernel OpenVINO runs",
    "onnx": "the exported graph's opset and checks",
    "executorch": "ExecuTorch's lowering and its kernels (XNNPACK, portable)",
    "ai-edge-litert": "LiteRT's interpreter and kernels (XNNPACK delegate)",
    "litert-torch": "the conversion to LiteRT (its lowerings and passes)",
    "threads": "how a reduction, matmul or convolution is split, and so its summation order",
    "interop_threads": "which ops run side by side",
    "aten_cpu_capability": "ATen's vectorized kernels (their vector width and so their summation order)",
    "cpu_simd": "which vector kernels the libraries pick",
    "cpu": "the machine",
    "mkl": "matmul and linear (MKL's GEMM)",
    "onednn": "convolutions and oneDNN's matmuls",
    "blas": "matmul and linear",
    "settings.mkldnn_enabled": "convolutions (oneDNN on or off)",
    "settings.float32_matmul_precision": "float32 matmuls (TF32 or bf16 passes)",
    "variables.MKL_CBWR": "MKL's code path (conditional numerical reproducibility)",
    "variables.ATEN_CPU_CAPABILITY": "ATen's vectorized kernels",
    "variables.ONEDNN_MAX_CPU_ISA": "oneDNN's instruction set",
}
_IGNORED = ("rlx_nb", "host")


def _flat(env: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in env.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def differences(old: dict, new: dict, backend: str | None = None) -> list[str]:
    """Each way the two environments differ, as ``key: old -> new (what it can move)``: torch first, then the
    packages ``backend`` runs on, then what changes kernels, then the rest; runtime packages ``backend`` never uses
    last, on one line; the hosts' names only when nothing else differs."""
    a, b = _flat(old), _flat(new)
    own = packages_of(backend) if backend else runtime_packages()
    unused = [k for k in runtime_packages() if k not in own]

    def rank(key: str) -> tuple:
        return (key != "torch", key not in own, key not in _WHAT, key)

    lines, aside = [], []
    for key in sorted(set(a) | set(b), key=rank):
        if key in _IGNORED or a.get(key) == b.get(key):
            continue
        shown = "unset" if key not in a else _short(a[key]), "unset" if key not in b else _short(b[key])
        if key in unused:
            aside.append(f"{key} {shown[0]} -> {shown[1]}")
            continue
        what = _WHAT.get(key, "")
        lines.append(f"{key}: {shown[0]} -> {shown[1]}" + (f" ({what})" if what else ""))
    if aside:
        lines.append(f"packages {backend} does not run on: {'; '.join(aside)}")
    if not lines and a.get("host") != b.get("host"):
        lines.append(f"host: {a.get('host')} -> {b.get('host')} (another machine, same software and settings)")
    return lines


def _short(v: Any) -> str:
    text = ",".join(map(str, v)) if isinstance(v, list) else str(v)
    return text if len(text) <= 60 else text[:57] + "..."


__all__ = ["VARIABLES", "differences", "snapshot_environment"]
