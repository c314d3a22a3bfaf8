"""The worlds of an int8 model's decisive elements (:mod:`rlx_nb.int8.decisive`): each way of rounding them, as the
Q/DQ simulation computes it, and the search for the world nearest a run's outputs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from rlx_nb._support.tree import flatten
from rlx_nb.execution.results import Leaf

WORLD_RUNS = 12
"""A runtime's world grows one element a step (the element best explaining what is left first, the next where that
world comes no nearer): at most this many runs of the simulation per decisive element, and :data:`MAX_WORLD_RUNS` in
all, for every trial and every runtime alike (the budget holds what a search of that size leaves)."""
MAX_WORLD_RUNS = 128


@dataclasses.dataclass(frozen=True)
class Element:
    """One decisive element: its requantization (quantize node), its flat index, how far (quanta) it sits from the
    boundary, the integer the oracle gives it (zero point included) and what rounding it alone moves the output by
    (its share of what every candidate moves)."""

    node: str
    index: int
    distance: float
    integer: int
    share: float
    op: str = ""
    module: str = ""

    def says(self) -> str:
        near = "exactly on a tie" if self.distance == 0 else f"{self.distance:.2g} quanta from a rounding boundary"
        return f"element {self.index} of {self.module or '(top level)'} :: {self.op} ({self.node}), {near}"


def _by_node(pairs: Any) -> dict[str, torch.Tensor]:
    # (requantization, flat index) pairs as each requantization's indices.
    out: dict[str, list[int]] = {}
    for node, index in pairs:
        out.setdefault(node, []).append(index)
    return {k: torch.tensor(v, dtype=torch.long) for k, v in out.items()}


def _floats(outputs: Any) -> dict[str, torch.Tensor]:
    # A run's floating-point outputs by name, as it gave them (float32: a world's outputs are kept at its size).
    return {
        k: v.detach()
        for k, v in flatten(outputs)
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel()
    }


def _tensor(value: Any) -> torch.Tensor:
    # A leaf's array as a tensor, sharing its memory where it may (torch warns on a read-only array: copied).
    a = np.asarray(value)
    return torch.from_numpy(a if a.flags.writeable else a.copy())


def _largest(a: torch.Tensor, b: torch.Tensor) -> float:
    d = (a.to(torch.float64) - b.to(torch.float64)).reshape(-1)
    d = d[torch.isfinite(d)]
    return float(d.abs().max()) if d.numel() else 0.0


def _rms(a: torch.Tensor, b: torch.Tensor) -> float:
    d = (a.to(torch.float64) - b.to(torch.float64)).reshape(-1)
    d = d[torch.isfinite(d)]
    return float(d.square().mean().sqrt()) if d.numel() else 0.0


@dataclasses.dataclass
class Worlds:
    """The decisive elements of one model and inputs: each one's own move of the outputs (rounded the other way
    alone), and a way to run any combination of them (a world); ``outputs[0]`` is the oracle's."""

    elements: list[Element]
    outputs: list[dict[str, torch.Tensor]]
    scales: dict[str, float]  # each output's RMS move with every candidate rounded the other way
    probes: int = 0
    candidates: int = 0
    complete: bool = True
    """Whether the search found every decisive element (else none is held: :func:`find`)."""
    seconds: float = 0.0
    left: int = 0
    """Candidates the search had not resolved when it stopped (0 when complete)."""
    to_finish: int = 0
    """About how many more runs would have finished it (each group left bisected down to one element)."""
    moves: list[dict[str, torch.Tensor]] = dataclasses.field(default_factory=list)
    """Each element's own move of each output (its world of one, less the oracle's), as measured by the search."""
    runner: Any = None
    """``runner(flips)``: the simulation's outputs with these elements rounded the other way."""
    units: dict[str, float] = dataclasses.field(default_factory=dict)
    """Each output's unit of distance between worlds: its quantum, or its :attr:`scales` where it has none."""
    _runs: dict[tuple[int, ...], dict[str, torch.Tensor]] = dataclasses.field(default_factory=dict)

    @property
    def held(self) -> dict[str, torch.Tensor]:
        """The decisive elements by requantization: what the trials hold as the oracle rounds them."""
        return _by_node((e.node, e.index) for e in self.elements)

    @property
    def forced(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The decisive elements' integers as the oracle rounds them, for the exact simulation."""
        out: dict[str, tuple[list[int], list[int]]] = {}
        for e in self.elements:
            out.setdefault(e.node, ([], []))
            out[e.node][0].append(e.index)
            out[e.node][1].append(e.integer)
        return {
            k: (torch.tensor(i, dtype=torch.long), torch.tensor(q, dtype=torch.float64)) for k, (i, q) in out.items()
        }

    def flipped(self, world: tuple[int, ...]) -> list[Element]:
        """The elements world ``world`` (their positions in :attr:`elements`) rounds the other way."""
        return [self.elements[i] for i in world]

    def world(self, chosen: tuple[int, ...], *, keep: bool = True) -> dict[str, torch.Tensor]:
        """The outputs of the world that rounds ``chosen`` the other way: a run of the simulation (kept)."""
        if not chosen:
            return self.outputs[0]
        if chosen in self._runs:
            return self._runs[chosen]
        got = _floats(self.runner(_by_node((e.node, e.index) for e in self.flipped(chosen))))
        if keep:
            self._runs[chosen] = got
        return got

    def distance(self, got: dict[str, torch.Tensor], world: dict[str, torch.Tensor]) -> float:
        """How far a run's outputs are from a world's: each output's RMS difference in its quanta (in units of
        :attr:`scales` for an output without one), squared and summed over every output."""
        d = 0.0
        for k, unit in self.units.items():
            if k in got and k in world and got[k].shape == world[k].shape:
                d += (_rms(got[k], world[k]) / unit) ** 2
        return d

    def nearest(self, outputs: dict[str, Leaf]) -> tuple[int, ...]:
        """The world nearest to a run's outputs, found by actual runs: from the oracle's, the element whose own move
        best explains what is left of the run's difference from the current world is added, while the world that
        adds it, run as it is, comes nearer (at most :data:`WORLD_RUNS` runs an element).  A correct kernel's
        roundings cascade through the layers after them (a rounding moves values downstream across boundaries), so a
        world is only ever taken as the simulation computes it, never as its elements' moves added.  ``()`` where
        no world is nearer than the oracle's."""
        if not self.elements:
            return ()
        got = {k: _tensor(v.value) for k, v in outputs.items()
               if k in self.units and v.is_array and v.value is not None}  # fmt: skip
        chosen: tuple[int, ...] = ()
        current, dist = self.outputs[0], self.distance(got, self.outputs[0])
        runs, cap = 0, min(WORLD_RUNS * len(self.elements), MAX_WORLD_RUNS)
        # The growth starts from the nearest of three worlds taken at once: the oracle's, every element rounded the
        # other way (a runtime that rounds them all so: one step, where growing one at a time would run out), and
        # every element whose own move points the run's way.
        scores = self._explained(got, current, chosen)
        for start in (tuple(range(len(self.elements))), tuple(int(i) for i in np.flatnonzero(scores > 0))):
            if not start or start == chosen or runs >= cap:
                continue
            world = self.world(start, keep=False)
            runs += 1
            d = self.distance(got, world)
            if d < dist:
                chosen, current, dist = start, world, d
        while dist > 0 and runs < cap:
            scores = self._explained(got, current, chosen)
            improved = False
            for i in np.argsort(-scores):  # (every one, best first: a cascade can make an element's own move a
                if scores[i] == -np.inf or runs >= cap:  # poor guide to its move here)
                    break
                trial = tuple(sorted((*chosen, int(i))))
                world = self.world(trial, keep=False)
                runs += 1
                d = self.distance(got, world)
                if d < dist:
                    chosen, current, dist, improved = trial, world, d, True
                    break
            if not improved:
                break
        chosen, current, dist = self._refined(got, chosen, current, dist, cap - runs)
        if chosen:
            self._runs[chosen] = current
        return chosen

    def _refined(self, got: dict[str, torch.Tensor], chosen: tuple[int, ...], current: dict[str, torch.Tensor],
                 dist: float, runs: int) -> tuple[tuple[int, ...], dict[str, torch.Tensor], float]:  # fmt: skip
        # Passes over every element, each taken out of the world or put in where that brings it nearer (a greedy
        # growth stops where one element's own move misleads it: several roundings in a chain of layers).
        improved = True
        while improved and dist > 0 and runs > 0:
            improved = False
            for i in range(len(self.elements)):
                if runs <= 0 or dist == 0:
                    break
                trial = tuple(sorted(set(chosen) ^ {i}))
                world = self.world(trial, keep=False)
                runs -= 1
                d = self.distance(got, world)
                if d < dist:
                    chosen, current, dist, improved = trial, world, d, True
        return chosen, current, dist

    def _explained(self, got: dict[str, torch.Tensor], current: dict[str, torch.Tensor],
                   chosen: tuple[int, ...]) -> np.ndarray:  # fmt: skip
        # How much each element's own move would take off the distance left (2 r.m - m.m, in each output's unit);
        # -inf for the elements already in the world.
        score = np.zeros(len(self.moves))
        for k, unit in self.units.items():
            if k not in got or k not in current or got[k].shape != current[k].shape:
                continue
            r = (got[k].to(torch.float64) - current[k].to(torch.float64)).reshape(-1)
            r = torch.where(torch.isfinite(r), r, torch.zeros_like(r))
            n = float(r.numel()) * unit * unit
            for i, mv in enumerate(self.moves):
                if k in mv:
                    m = mv[k].reshape(-1)
                    score[i] += float(2 * (r @ m) - m @ m) / n
        score[list(chosen)] = -np.inf
        return score


__all__ = ["MAX_WORLD_RUNS", "WORLD_RUNS", "Element", "Worlds"]
