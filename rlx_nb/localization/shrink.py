"""Shrink a culprit's inputs to the smallest case that still crosses the line, judged by the verdict.

Each step halves one size (taken from the front: ``t[..., :n // 2, ...]``) and keeps the change only where the
culprit, run again on the backend, is still SUSPECT with its whole output past the line (what a standalone repro
checks).  A size is halved in every tensor that has it first (a batch, a sequence or a channel count shared by
an op's operands), then in each tensor's dimension alone; a step that breaks the op (shapes that no longer
agree) or loses the divergence (the fault lived in the part cut away) is undone.  No fixed tolerance anywhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from rlx_nb.localization.culprit import Culprit
from rlx_nb.verdict.records import OutputRecord

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


def shrink(culprit: Culprit, *, told: Callable[[str], None] | None = None) -> Shrunk:
    """The smallest inputs (halving one size at a time) on which ``culprit`` still crosses the line."""
    told = told or (lambda _: None)
    tensors = [t.detach() for t in culprit.tensors]
    before = tuple(tuple(t.shape) for t in tensors)
    tries, record = 0, None

    def attempt(candidate: list[torch.Tensor]) -> bool:
        nonlocal tries, record
        tries += 1
        told(f"shrink: try {tries}, {sum(t.numel() for t in candidate)} elements")
        found = culprit.crossing(candidate)
        if found is not None:  # (kept: the candidate is taken)
            record = found
        return found is not None

    changed = True
    while changed and tries < MAX_TRIES:
        changed = False
        sizes = sorted({n for t in tensors if t.is_floating_point() for n in t.shape if n > 1}, reverse=True)
        for size in sizes:  # every tensor's dimensions of this size at once
            if tries >= MAX_TRIES:
                break
            candidate = list(tensors)
            for i, t in enumerate(tensors):
                for d in range(t.dim()):
                    if candidate[i].shape[d] == size:
                        candidate[i] = _cut(candidate[i], d, size // 2)
            if any(c.shape != t.shape for c, t in zip(candidate, tensors, strict=True)) and attempt(candidate):
                tensors, changed = candidate, True
                break
        if changed:
            continue
        for i, t in enumerate(tensors):  # each dimension alone
            for d in range(t.dim()):
                if tries >= MAX_TRIES or changed or t.shape[d] < 2:
                    continue
                candidate = [*tensors[:i], _cut(t, d, t.shape[d] // 2), *tensors[i + 1 :]]
                if attempt(candidate):
                    tensors, changed = candidate, True
    return Shrunk(culprit.but(tensors=tuple(tensors)), before, tuple(tuple(t.shape) for t in tensors), tries, record)


__all__ = ["MAX_TRIES", "Shrunk", "shrink"]
