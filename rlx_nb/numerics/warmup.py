"""Once-per-process costs paid in the background right after ``import rlx_nb``.

The numba kernels (numba's import and the kernels from its disk cache), which every report's
comparison needs, load in a daemon thread while a notebook user builds a model and its inputs; a
first call that comes sooner waits on the same import (Python's import lock), never on a second one.
``RLX_NB_WARMUP=0`` turns it off.

``torch._dynamo`` (about 2.6 s here) is not imported here any more.  rlx_nb's own dispatch modes no
longer need it (:class:`rlx_nb.backends.sequential.QuietDispatchMode`), so a run with only eager backends never
pays for it; a compiling or exporting backend imports it on the main thread, when it needs it.
Importing it in the background is unsafe besides: torch._dynamo and torch._inductor import each
other, and a main thread that reaches ``torch.compile`` while another thread is inside that import
gets Python's ``_DeadlockError`` (seen here, in a test, when the import was started at run time).
"""

from __future__ import annotations

import os
import threading


def _load_kernels() -> None:
    try:
        from rlx_nb.numerics import fused as _fused

        for load in (_fused.kernel, _fused.reference_kernel, _fused.slice_kernel, _fused.round_kernel):
            load()
    except Exception:  # a warm-up must never break the import; the first call then pays as before
        pass


def start() -> threading.Thread | None:
    """Start loading the numba kernels in a daemon thread (unless ``RLX_NB_WARMUP=0``); returns it."""
    if os.environ.get("RLX_NB_WARMUP", "1") == "0":
        return None
    thread = threading.Thread(target=_load_kernels, daemon=True, name="rlx_nb:warm-up")
    thread.start()
    return thread
