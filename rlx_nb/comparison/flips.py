"""How the comparison reads a discrete-event account (:mod:`rlx_nb.execution.discrete`): per output, what flipped
ReLU inputs explain of each run's gradient, and a run's values without it."""

from __future__ import annotations

import dataclasses

import numpy as np

from rlx_nb.backends.base import ORACLE
from rlx_nb.execution.results import Leaf, RunResults


@dataclasses.dataclass(frozen=True)
class Flips:
    """What discrete events explain of one output (:mod:`rlx_nb.execution.discrete`): per run, the part of its gradient
    that flipped ReLU inputs account for (``None``: no flip credited to that run)."""

    backend: np.ndarray | None
    oracle: np.ndarray | None
    sequential: np.ndarray | None
    count: int
    note: str

    def apply(self, eo: np.ndarray, eb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The oracle's and the backend's outputs without their flips (as they were where there is none)."""
        return less(eo, self.oracle), less(eb, self.backend)

    def sequential_leaf(self, leaf: Leaf | None) -> Leaf | None:
        if leaf is None or self.sequential is None or not leaf.is_array:
            return leaf
        value = less(leaf.value, self.sequential)
        return leaf if value is leaf.value else Leaf(value, leaf.dtype, leaf.shape)


def less(x: np.ndarray, correction: np.ndarray | None) -> np.ndarray:
    """``x`` without a run's discrete-event ``correction`` (``x`` itself where there is none)."""
    if correction is None or correction.size != x.size:
        return x
    return x.astype(np.float64) - correction.reshape(x.shape)


def flips_of(results: RunResults, backend: str, output: str) -> Flips | None:
    """The discrete events accounted for on ``output``, for ``backend`` and the legitimate runs (None: none)."""

    def part(run: str) -> np.ndarray | None:
        found = results.discrete.get(run)
        leaf = found.outputs.get(output) if found is not None else None
        return leaf.value if leaf is not None and leaf.is_array else None

    mine, oracle, sequential = part(backend), part(ORACLE), part("sequential")
    if mine is None and oracle is None and sequential is None:
        return None
    found = results.discrete.get(backend)
    count = int(found.message) if found is not None and found.message.isdigit() else 0
    note = found.notes[0] if found is not None and found.notes else ""
    if oracle is not None and results.discrete[ORACLE].notes:
        note = "; ".join(n for n in (note, f"the oracle's own: {results.discrete[ORACLE].notes[0]}") if n)
    return Flips(mine, oracle, sequential, count, note)


__all__ = ["Flips", "flips_of", "less"]
