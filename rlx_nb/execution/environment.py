"""Where a run happened: host, versions, the CPU and its SIMD flags, devices, the global precision settings.

Each report's ``environment`` starts with :func:`environment`; the HTML report shows it, so a divergence
seen on one machine can be told from one seen on another (another ATen vector ISA, another runtime).
"""

from __future__ import annotations

import functools
import platform
import re
import sys
from typing import Any

import numpy as np
import torch

from rlx_nb.execution import cache as preparations


def environment() -> dict[str, Any]:
    """Where this run happened: host, versions, the CPU and its SIMD flags, devices, global settings."""
    from rlx_nb._version import __version__

    env: dict[str, Any] = {
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "rlx_nb": __version__,
        **backend_versions(),
        "cuda": torch.version.cuda,
        "threads": torch.get_num_threads(),
        **cpu(),
        "settings": {k: v for k, v in preparations.global_settings().items() if k not in ("torch", "threads")},
    }
    if torch.cuda.is_available():
        env["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return env


# Instruction-set flags that change which kernels run (and so the rounding): vector widths, FMA, bf16/fp16.
_SIMD = re.compile(r"^(sse4_[12]|avx\w*|fma|f16c|amx\w*|neon|asimd\w*|sve\w*)$")


@functools.cache
def cpu() -> dict[str, Any]:
    # The CPU model and its SIMD flags (Linux /proc/cpuinfo; elsewhere what platform knows), and the
    # vector ISA ATen's CPU kernels dispatch to here.
    name, flags = platform.processor() or platform.machine(), []
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Hardware", "cpu model") and name in ("", platform.machine()):
                    name = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = sorted(v for v in value.split() if _SIMD.match(v))
    except OSError:
        pass
    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: None)()
    return {"machine": platform.machine(), "cpu": name, "cpu_simd": flags, "aten_cpu_capability": capability}


def backend_versions() -> dict[str, str]:
    # The runtimes other backends use, when installed (read from their metadata: nothing is imported).
    return dict(_versions(tuple(d in sys.modules for d in _RUNTIMES)))


_RUNTIMES = ("onnxruntime", "openvino", "onnx", "executorch", "ai-edge-litert", "litert-torch")

RUNTIME_PACKAGES = {
    "onnxruntime": ("onnxruntime", "onnx"),
    "openvino": ("openvino",),
    "executorch": ("executorch", "torchao"),
    "litert": ("litert-torch", "ai-edge-litert"),
}
"""The packages a backend runs on, by its name's first part (a fault carried through one, ``onnxruntime+...``,
too); torch's own backends need torch alone."""


def packages_of(backend: str) -> tuple[str, ...]:
    """The runtime packages ``backend`` runs on (:data:`RUNTIME_PACKAGES`), ``()`` for torch's own.

    Examples
    --------
    >>> packages_of("onnxruntime+softmax-row"), packages_of("cpu-inductor")
    (('onnxruntime', 'onnx'), ())
    """
    family = next((k for k in RUNTIME_PACKAGES if backend.startswith(k)), None)
    return RUNTIME_PACKAGES.get(family, ())


def runtime_packages() -> tuple[str, ...]:
    """Every runtime package an environment may record (:func:`backend_versions`)."""
    return _RUNTIMES


@functools.lru_cache(maxsize=8)
def _versions(loaded: tuple[bool, ...]) -> tuple[tuple[str, str], ...]:
    # Read again only when one of them has been imported since (~4 ms of metadata parsing a call otherwise): one
    # installed while the process runs is read once a backend has loaded it.
    from importlib import metadata

    found = {}
    for dist in _RUNTIMES:
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return tuple(found.items())
