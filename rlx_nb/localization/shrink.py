"""Shrink a culprit's inputs to the smallest case that still crosses the line, judged by the verdict.

Each step halves one size (taken from the front: ``t[..., :n // 2, ...]``) and keeps the change only where the
culprit, run again on the backend, is still SUSPECT with its whole output past the line (what a standalone repro
checks) by a margin (:data:`SHRINK_MARGIN`).  A size is halved in every tensor that has it (a batch, a sequence or
a channel count shared by an op's operands), or in one tensor's dimension alone; a cut that would make an operand
broadcast where it did not is not tried, and one that breaks the op or loses the divergence (the fault lived in
the part cut away) is undone.  The smallest cases are tried first, and of equally small ones the furthest past the
line is kept.  No fixed tolerance anywhere.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from rlx_nb._support import switches
from rlx_nb.localization.culprit import Culprit
from rlx_nb.verdict.records import OutputRecord
from rlx_nb.verdict.types import MAX_LIMIT, RMSE_LIMIT

MAX_TRIES = 48
"""At most this many trial runs (each one run of the culprit on the backend, a compile or an export where the
backend has one)."""


@dataclasses.dataclass(frozen=True)
class Shrunk:
    """What shrinking did: the culprit on its smallest inputs, and the inputs' shapes before and after."""

    culprit: Culprit
    before: tuple[tuple[int, ...], ...]
    after: tuple[tuple[int, ...], ...]
    tries: int
    record: OutputRecord | None = None
    """The verdict on the smallest inputs (None where nothing was cut: the culprit's own)."""

    @property
    def elements(self) -> tuple[int, int]:
        return _count(self.before), _count(self.after)

    def __str__(self) -> str:
        n0, n1 = self.elements
        if n0 == n1:
            return f"Not shrunk: no smaller input still crossed the line ({_shapes(self.before)}; {self.tries} tries)."
        return (
            f"Shrunk from {_shapes(self.before)} ({n0} elements) to {_shapes(self.after)} ({n1} elements, "
            f"{n0 / max(n1, 1):.0f}x fewer) in {self.tries} tries, each judged by rlx_nb's verdict."
        )


def _count(shapes: tuple[tuple[int, ...], ...]) -> int:
    return sum(int(torch.Size(s).numel()) for s in shapes)


def _shapes(shapes: tuple[tuple[int, ...], ...]) -> str:
    return ", ".join("x".join(map(str, s)) or "scalar" for s in shapes)


def _cut(t: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    return t.narrow(dim, 0, n).contiguous()


SHRINK_MARGIN = 4.0
"""A shrunk case stays at least this many times past the line (or as far past it as the whole case was, where that
is less): a case just past the line here (XNNPACK's tanh GELU shrank to one element at 1.03x) may be under it on
another CPU, and then the repro no longer shows the bug to whoever runs it."""


def strength(record: OutputRecord) -> float:
    """How far past the line the whole output's error is: the larger of its largest and RMS error over the line's
    (1.0 is the line; infinite for a NaN or infinity where float64 has none)."""
    j = record.judgement
    if j.events.nonfinite_unexplained > 0:
        return math.inf
    return max(j.budget.ratio_max / MAX_LIMIT, j.budget.ratio_rmse / RMSE_LIMIT)


def consistent(before: list[tuple[int, ...]], after: list[tuple[int, ...]]) -> bool:
    """Whether cut shapes keep the operands from broadcasting where they did not: two dimensions (aligned from the
    right, as broadcasting aligns them) of the same size never become 1 against more than 1 (q 1x1x5x2 against k
    2x1x1x2 ran only by broadcasting).  Sizes that were the same may otherwise part (attention's value width)."""
    for i, a in enumerate(before):
        for j in range(i + 1, len(before)):
            b = before[j]
            for k in range(1, min(len(a), len(b)) + 1):
                x, y = after[i][-k], after[j][-k]
                if a[-k] == b[-k] and x != y and 1 in (x, y):
                    return False
    return True


def _candidates(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    # Every cut of one step: a size halved in every tensor that has it (a batch, a sequence or a channel count an
    # op's operands share), then each tensor's dimension alone; those that keep the operands' relations only.
    shapes = [tuple(t.shape) for t in tensors]
    out = []
    for size in sorted({n for t in tensors if t.is_floating_point() for n in t.shape if n > 1}, reverse=True):
        cut = list(tensors)
        for i, t in enumerate(tensors):
            for d in range(t.dim()):
                if cut[i].shape[d] == size:
                    cut[i] = _cut(cut[i], d, size // 2)
        out.append(cut)
    for i, t in enumerate(tensors):
        for d in range(t.dim()):
            if t.shape[d] > 1:
                out.append([*tensors[:i], _cut(t, d, t.shape[d] // 2), *tensors[i + 1 :]])
    return [c for c in out if [tuple(t.shape) for t in c] != shapes and consistent(shapes, [tuple(t.shape) for t in c])]


@switches.guarded
def shrink(
    culprit: Culprit, *, told: Callable[[str], None] | None = None, record: OutputRecord | None = None
) -> Shrunk:
    """The smallest inputs (halving one size at a time) on which ``culprit`` still crosses the line, with the
    margin :data:`SHRINK_MARGIN` (``record``: the culprit's own verdict, whose strength sets it), and of equally
    small cases the one furthest past it."""
    told = told or (lambda _: None)
    tensors = [t.detach() for t in culprit.tensors]
    before = tuple(tuple(t.shape) for t in tensors)
    floor = min(SHRINK_MARGIN, strength(record)) if record is not None else 1.0
    tries, kept = 0, None

    def attempt(candidate: list[torch.Tensor]) -> OutputRecord | None:
        nonlocal tries
        tries += 1
        told(f"shrink: try {tries}, {sum(t.numel() for t in candidate)} elements")
        found = culprit.crossing(candidate)
        return found if found is not None and strength(found) >= floor else None

    while tries < MAX_TRIES:
        groups: dict[int, list[list[torch.Tensor]]] = {}
        for c in _candidates(tensors):
            groups.setdefault(sum(t.numel() for t in c), []).append(c)
        taken = None
        for size in sorted(groups):  # the smallest cases first; of those, the furthest past the line
            found = [(r, c) for c in groups[size][: MAX_TRIES - tries] if (r := attempt(c)) is not None]
            if found:
                taken = max(found, key=lambda rc: strength(rc[0]))
                break
            if tries >= MAX_TRIES:
                break
        if taken is None:
            break
        kept, tensors = taken
    return Shrunk(culprit.but(tensors=tuple(tensors)), before, tuple(tuple(t.shape) for t in tensors), tries, kept)


__all__ = ["MAX_TRIES", "SHRINK_MARGIN", "Shrunk", "consistent", "shrink", "strength"]
