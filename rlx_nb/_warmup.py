"""Once-per-process costs paid in the background right after ``import rlx_nb``.

The first report in a process paid about 2.6 s importing ``torch._dynamo`` (torch loads it the first
time a dispatch mode is entered, and the run counts ops under one) and loading the numba kernels.  A
notebook user spends longer than that building a model and its inputs, so a daemon thread started at
import pays both meanwhile; a first call that comes sooner waits on the same import (Python's import
lock), never on a second one.  ``RLX_NB_WARMUP=0`` turns it off.
"""

from __future__ import annotations

import os
import threading


def _warm() -> None:
    try:
        import torch._dynamo  # noqa: F401

        from rlx_nb import _fused

        for load in (_fused.kernel, _fused.reference_kernel, _fused.slice_kernel):
            load()
    except Exception:  # a warm-up must never break the import; the first call then pays as before
        pass


def start() -> threading.Thread | None:
    """Start the warm-up thread (unless ``RLX_NB_WARMUP=0``); returns it."""
    if os.environ.get("RLX_NB_WARMUP", "1") == "0":
        return None
    thread = threading.Thread(target=_warm, daemon=True, name="rlx_nb:warm-up")
    thread.start()
    return thread
