"""The package version, in a module of its own so that any module can read it without importing the package root,
and the torch releases it is tested on."""

__version__ = "0.1.0"

TORCH_OLDEST = (2, 13)
"""The oldest torch release rlx_nb is tested on (CI runs 2.13.0); pyproject asks for it.  Older releases lack what
rlx_nb uses: ``aten._grouped_mm`` (the fp64 kernels), ``torch._dynamo.config.accumulated_recompile_limit``
(``accumulated_cache_size_limit`` before 2.7) and ``torch._dynamo.disable(wrapping=...)``, measured on 2.5.1."""


def check_torch(version: str | None = None) -> None:
    """Raise ImportError naming the installed torch and the range when it is older than :data:`TORCH_OLDEST`."""
    import re

    if version is None:
        import torch

        version = torch.__version__
    found = re.match(r"(\d+)\.(\d+)", str(version))
    if found is not None and (int(found.group(1)), int(found.group(2))) < TORCH_OLDEST:
        oldest = ".".join(map(str, TORCH_OLDEST))
        raise ImportError(
            f"rlx_nb needs torch>={oldest} (the releases it is tested on); torch {version} is installed: "
            f"pip install 'torch>={oldest}'"
        )


check_torch()  # on import, before an obscure error deeper in (rlx_nb/__init__ imports this module first)
