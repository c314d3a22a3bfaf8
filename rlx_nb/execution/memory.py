"""What a phase of a run needs in memory, against what is free: a phase that would not fit is skipped, said.

A 1.1B-parameter model's float64 reference, an ONNX export, an OpenVINO conversion each need gigabytes;
a process killed for memory loses every result and the kernel.  :class:`Memory` estimates each phase's
need before it runs (from the weights' size and what the oracle's forward added) against what is free,
drops kept preparations first to make room, and otherwise makes the phase a ``skipped`` row saying what
it needed and what was free.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from rlx_nb._support import meter as phases
from rlx_nb._support.meter import available_bytes, rss_bytes
from rlx_nb.backends.base import REFERENCE, Backend
from rlx_nb.errors import InputError
from rlx_nb.execution import cache as preparations


def check_budget(budget: Any) -> float | None:
    """``memory_budget`` as a number of bytes (``inf``: no phase is skipped; None: what the kernel says is free),
    or an :class:`~rlx_nb.InputError` naming the value and what is allowed.

    >>> check_budget(4e9), check_budget(None)
    (4000000000.0, None)
    >>> check_budget(10**400)
    Traceback (most recent call last):
    rlx_nb.errors.InputError: memory_budget must be a positive number of bytes (inf: no phase is skipped) or None; got an int of 401 digits, past any float: use float('inf') for no budget
    """
    if budget is None:
        return None
    if not isinstance(budget, (int, float)) or isinstance(budget, bool):
        raise InputError(f"{_ALLOWED}; got {type(budget).__name__} {budget!r}")
    try:
        value = float(budget)
    except OverflowError:
        raise InputError(f"{_ALLOWED}; got an int of {len(str(budget))} digits, past any float: use float('inf') "
                         "for no budget") from None  # fmt: skip
    if not value > 0:
        raise InputError(f"{_ALLOWED}; got {budget!r}")
    return value


_ALLOWED = "memory_budget must be a positive number of bytes (inf: no phase is skipped) or None"


def _size(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


class Memory:
    """What each phase of a run may need, against what is free: a phase that would not fit is skipped, said.

    ``P`` is the weights' size (float32), ``A`` what the oracle's forward added to the process (its
    activations and outputs), measured once it has run.  Estimates: the fp64 reference ``P + 2A`` (it
    holds the weights in float64, lent, not copied); an eager run ``A``; a compiling backend ``P/2 + A``;
    a converting one (ONNX Runtime, OpenVINO) ``2P + 2A`` (its own copy of the weights, and the export on
    the way), or more where a conversion earlier in the run was measured to need more.  Free is
    ``memory_budget`` less what the process holds beyond its start, or what the kernel says is
    available; kept preparations are dropped first, least recently used, to make room.
    """

    KEEP_SHARE = 0.25
    """Kept preparations may hold this share of what was free when the call began."""

    def __init__(self, model: torch.nn.Module, budget: float | None) -> None:
        own = {id(t): t for t in model.parameters()}.values()
        self.weights = sum(t.numel() * t.element_size() for t in own)
        self.largest = max((t.numel() * t.element_size() for t in own), default=0)
        self.budget = budget = check_budget(budget)
        self.unlimited = budget is not None and math.isinf(budget)  # (memory_budget=inf: no phase is skipped)
        self.start_rss = rss_bytes()
        self.activations = 0
        self.conversion = 0  # the most a conversion earlier in this run added at its peak
        free = available_bytes() if self.unlimited else self.free()
        self.keep_bytes = int(self.KEEP_SHARE * free) if free is not None else None

    def free(self) -> int | None:
        """Bytes free for the next phase; None where nothing limits it (``memory_budget=inf``, or no reading)."""
        if self.unlimited:
            return None
        if self.budget is not None:
            return int(self.budget) - max(0, rss_bytes() - self.start_rss)
        return available_bytes()

    def need(self, backend: Backend, phase: str, streamed: bool = False) -> int:
        p, a = self.weights, self.activations
        if backend.name == REFERENCE:  # streamed: the float64 copies of one op's weights at a time
            return 2 * a + 4 * self.largest if streamed else p + 2 * a
        if backend.prepare is None or phase in ("oracle", "determinism rerun"):
            return a
        return p // 2 + a if backend.differentiable else max(2 * p + 2 * a, self.conversion)

    def shortfall(self, backend: Backend, phase: str, streamed: bool = False) -> str:
        """Why ``phase`` cannot run in the memory left ("" when it can); ``streamed``: the streamed reference."""
        if phase == "oracle":
            return ""  # the oracle must run: the user's model, as it is
        need = self.need(backend, phase, streamed)
        free = self.free()
        dropped = 1  # (twice as many each time: a full garbage collection a preparation cost seconds in a long session)
        while free is not None and need > free and preparations.drop_oldest(dropped):
            free, dropped = self.free(), 2 * dropped
        if free is None or need <= free:
            return ""
        what = {REFERENCE: "the fp64 reference (the weights in float64)"}.get(backend.name, "its run")
        if streamed:
            what = "the streamed fp64 reference (one op's weights in float64 at a time)"
        if backend.prepare is not None and backend.name != REFERENCE:
            what = "its conversion" if not backend.differentiable else "its compile"
        override = "a larger memory_budget= to override" if self.budget is not None else "memory_budget= to override"
        return (
            f"not run for memory: {what} needs ~{_size(need)}, {_size(max(free, 0))} free "
            f"(weights {_size(self.weights)}, activations ~{_size(self.activations)}); {override}"
        )

    def measured(self, backend: Backend, phase: str, meter: phases.Meter, before: int) -> None:
        """Learn from a phase that ran (``before``: the resident memory when it began)."""
        if phase not in meter.phases:
            return
        added = max(0, int(meter.phases[phase]["peak_bytes"]) - before)
        if phase == "oracle":
            self.activations = max(0, int(meter.phases["oracle"]["peak_bytes"]) - self.start_rss)
        elif backend.prepare is not None and not backend.differentiable and backend.name != REFERENCE:
            self.conversion = max(self.conversion, added)

    def describe(self) -> dict[str, Any]:
        return {
            "weights_bytes": self.weights,
            "activations_bytes": self.activations,
            "budget_bytes": self.budget,
            "keep_preparations_bytes": self.keep_bytes,
            "largest_conversion_bytes": self.conversion,
        }
