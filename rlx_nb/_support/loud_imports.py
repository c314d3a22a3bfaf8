"""torchao's import, wherever it happens, kept out of the user's cell.

torchao (installed with ``rlx_nb[executorch]``, which ExecuTorch's int8 path needs) prints "Failed to load <its CUDA
and other-Python .so>" and torch's deprecation warnings as it loads.  rlx_nb's own calls already keep that out
(:func:`rlx_nb._support.quiet.quiet`); but Hugging Face's transformers imports torchao as soon as a model is built,
so the README's quickstart showed those red lines under its first cell, from the user's own
``GPT2LMHeadModel(config)``.  A finder first in ``sys.meta_path`` loads torchao and its submodules (and nothing else)
inside :func:`~rlx_nb._support.quiet.quiet`.  An import that fails still raises, as it would.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from typing import Any

NOISY = ("torchao",)
"""The packages whose import prints what no user asked for (the top-level package's name)."""


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        from rlx_nb._support.quiet import quiet

        with quiet():
            self.inner.exec_module(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        # The package and its submodules (transformers imports some of torchao's only when it builds a model).
        if fullname.partition(".")[0] not in NOISY:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def quiet_noisy_imports() -> None:
    """Put the finder first in ``sys.meta_path`` where a noisy package is installed and not imported yet."""
    for name in NOISY:
        if name in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
            continue
        if importlib.machinery.PathFinder.find_spec(name) is not None:
            sys.meta_path.insert(0, _Finder())


__all__ = ["NOISY", "quiet_noisy_imports"]
