"""Decisive elements: the few near-boundary values whose rounding alone moves an int8 model's output.

A correct int8 kernel may round a value the other way wherever it sits within its requantization's width of a
boundary (:mod:`rlx_nb.int8.requantization`).  Most such values barely move the output, but on some models one does
it all: on the zoo's Llama, one element of layer 0's attention output sits 3.8e-6 quanta from a boundary, and
rounding it the other way moves the logits 0.81 quanta RMS through the two layers after it, where the other 114
requantization points together move them at most 0.03.  Trials that round such an element at random (the budget's
legitimate runs) then leave a spread 25x what correct kernels leave, and a weight-sign fault 100x XNNPACK's error
reads as round-off.

So those elements are found and taken out of the trials' chance, as ReLU flips are for gradients
(:mod:`rlx_nb.execution.discrete`):

1. the Q/DQ simulation runs once recording each requantization's *candidates* -- the elements within its width of a
   boundary (:func:`~rlx_nb.int8.requantization.element_reach`, as the trials' reach);
2. every candidate rounded the other way at once is one legitimate *world*, the most they move the output together;
   the candidates are bisected (best first, at most :data:`MAX_PROBES` runs) for single elements that alone move an
   output by at least :data:`DECISIVE_SHARE` of that.  Only a search that finds them all (at most
   :data:`MAX_DECISIVE`) is used: otherwise a legitimate rounding of one not found would fall outside a budget the
   others' holding made narrow, so none is held and the trials keep their chance, as before this account;
3. each combination of the decisive elements rounded either way is a world of its own (``2**k`` runs, the oracle
   one of them); the trials round every other candidate at random and hold the decisive ones as the oracle does,
   and the exact simulation (the reference) rounds them as the oracle does too, so the budget measures what the
   rest leaves;
4. a candidate runtime is judged from the world nearest to it (:func:`accounts`): what that world differs from the
   oracle by is taken out of its error before the budget judges it (``RunResults.discrete``), and its record says
   which elements it rounded the other way.  Only elements within a width of a boundary are ever credited, and a
   world is chosen only where it is nearer than the oracle, so no other error is explained away.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import torch

from rlx_nb._support.tree import flatten
from rlx_nb.execution.results import OK, BackendRun, Leaf, to_leaf
from rlx_nb.int8.requantization import (
    _QUANTIZE,
    _module_of,
    _op_name,
    _ops,
    element_reach,
    graph_copy,
    rounded_at_random,
)

DECISIVE_SHARE = 0.25
"""An element is decisive when rounding it alone the other way moves some output by at least this share (RMS) of
what every candidate rounded the other way moves it."""
MAX_DECISIVE = 4
"""At most this many decisive elements are held (``2**4`` worlds); where there are more, none is, and the trials keep
their chance for all of them (as where the search runs out of runs)."""
MAX_PROBES = 32
"""At most this many runs of the simulation bisect the candidates (a model whose spread is many small flips, where no
element is decisive, stops there)."""


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


class _Planned:
    """The Q/DQ simulation whose activation requantizations follow a plan: elements rounded the other way
    (``flips``), and optionally every element within its width rounded at random (``jitter``) except the ``held``
    ones.  One graph copy; the plan changes between runs without recompiling."""

    def __init__(self, converted: torch.fx.GraphModule, widths: dict[str, float],
                 spreads: dict[str, float] | None = None) -> None:  # fmt: skip
        self.graph = graph_copy(converted)
        self.widths = widths
        self.spreads = widths if spreads is None else spreads  # (a trial's jitter: requantization.TRIAL_MARGIN)
        self.flips: dict[str, torch.Tensor] = {}
        self.held: dict[str, torch.Tensor] = {}
        self.generator: torch.Generator | None = None
        self.record: dict[str, Any] | None = None
        for node in _ops(self.graph, _QUANTIZE):
            node.target = self._quantize(node.name)
        self.graph.recompile()

    def _quantize(self, name: str):
        plan = self

        def quantize(x, scale, zero_point, quant_min, quant_max, dtype):
            v = x * (1.0 / scale)
            reach = element_reach(v, plan.widths.get(name, 0.0))
            if plan.record is not None:  # (the candidates: within reach of a boundary)
                near = (0.5 - (v - torch.round(v)).abs()) < reach
                index = torch.nonzero(near.reshape(-1)).reshape(-1)
                flat = v.reshape(-1)[index]
                plan.record[name] = (index, 0.5 - (flat - torch.round(flat)).abs(), torch.round(flat) + zero_point)
            if plan.generator is not None:
                spread = element_reach(v, plan.spreads.get(name, 0.0))
                r = rounded_at_random(v, torch.minimum(spread, reach), plan.generator, plan.held.get(name))
            else:
                r = torch.round(v)
            flips = plan.flips.get(name)
            if flips is not None and flips.numel():
                r = r.contiguous()
                flat, at = r.reshape(-1), v.reshape(-1)[flips]
                near = flat[flips]
                flat[flips] = torch.where(at >= near, near + 1.0, near - 1.0)  # (the other neighbour)
            return torch.clamp(r + zero_point, quant_min, quant_max).to(dtype)

        return quantize

    def run(self, args: tuple, *, flips: dict[str, torch.Tensor] | None = None, seed: int | None = None,
            held: dict[str, torch.Tensor] | None = None) -> Any:  # fmt: skip
        self.flips, self.held = flips or {}, held or {}
        self.generator = torch.Generator().manual_seed(seed) if seed is not None else None
        try:
            with torch.no_grad():
                return self.graph(*args)
        finally:
            self.flips, self.held, self.generator = {}, {}, None

    def candidates(self, args: tuple) -> dict[str, tuple]:
        self.record = {}
        try:
            self.run(args)
            return self.record
        finally:
            self.record = None


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


def _rms(a: torch.Tensor, b: torch.Tensor) -> float:
    d = (a.to(torch.float64) - b.to(torch.float64)).reshape(-1)
    d = d[torch.isfinite(d)]
    return float(d.square().mean().sqrt()) if d.numel() else 0.0


@dataclasses.dataclass
class Worlds:
    """The decisive elements of one model and inputs, and what each combination of them rounded the other way gives
    (``outputs[0]`` is the oracle's)."""

    elements: list[Element]
    outputs: list[dict[str, torch.Tensor]]
    scales: dict[str, float]  # each output's RMS move with every candidate rounded the other way
    probes: int = 0
    candidates: int = 0
    complete: bool = True
    """Whether the search found every decisive element (else none is held: :func:`find`)."""

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

    def flipped(self, world: int) -> list[Element]:
        """The elements world ``world`` rounds the other way (bit ``i`` of ``world``: element ``i``)."""
        return [e for i, e in enumerate(self.elements) if world >> i & 1]

    def nearest(self, outputs: dict[str, Leaf]) -> int:
        """The world nearest to a run's outputs (each output in units of :attr:`scales`); 0 (the oracle's) unless
        another is strictly nearer."""
        if len(self.outputs) < 2:
            return 0
        got = {k: _tensor(v.value) for k, v in outputs.items()
               if k in self.scales and v.is_array and v.value is not None}  # fmt: skip
        best, best_d = 0, math.inf
        for w, world in enumerate(self.outputs):
            d = 0.0
            for k, scale in self.scales.items():
                if k in got and got[k].shape == world[k].shape:
                    d += (_rms(got[k], world[k]) / scale) ** 2
            if d == d and d < best_d:
                best, best_d = w, d
        return best


def find(
    converted: torch.fx.GraphModule,
    args: tuple,
    widths: dict[str, float],
    oracle: dict[str, Leaf],
    spreads: dict[str, float] | None = None,
) -> tuple[Worlds, _Planned]:
    """The decisive elements of ``converted`` on ``args`` and their worlds (module docstring); ``oracle``: the
    simulation's outputs (the oracle run's).  Returns the worlds and the planned simulation (for the trials)."""
    planned = _Planned(converted, widths, spreads)
    recorded = planned.candidates(args)
    base = {  # (the oracle's outputs, not copied)
        k: _tensor(v.value)
        for k, v in oracle.items()
        if v.is_array and v.value is not None and np.asarray(v.value).dtype.kind == "f" and v.value.size
    }
    items = [(name, int(i), float(d), float(q)) for name, (index, dist, q) in recorded.items()
             for i, d, q in zip(index.tolist(), dist.tolist(), q.tolist(), strict=True)]  # fmt: skip
    worlds = Worlds([], [base], {}, candidates=len(items))
    if not items or not base:
        return worlds, planned

    def moves(group: range) -> dict[str, float]:
        worlds.probes += 1
        got = _floats(planned.run(args, flips=_by_node(items[k][:2] for k in group)))
        return {k: _rms(got[k], base[k]) for k in base if k in got and got[k].shape == base[k].shape}

    everything = moves(range(len(items)))
    worlds.scales = {k: v for k, v in everything.items() if v > 0 and math.isfinite(v)}
    if not worlds.scales:
        return worlds, planned

    def share(moved: dict[str, float]) -> float:
        return max((moved.get(k, 0.0) / s for k, s in worlds.scales.items()), default=0.0)

    queue = [(share(everything), range(len(items)))]
    found: list[tuple[int, float]] = []
    cut_short = False  # (a split whose halves were not all measured)
    while queue and not cut_short and len(found) <= MAX_DECISIVE:
        queue.sort(key=lambda q: q[0])
        s, group = queue.pop()
        if len(group) == 1:
            found.append((group[0], s))
            continue
        mid = group.start + len(group) // 2
        for half in (range(group.start, mid), range(mid, group.stop)):
            if worlds.probes >= MAX_PROBES:
                cut_short = True
                break
            h = share(moves(half))
            if h >= DECISIVE_SHARE:
                queue.append((h, half))
    if queue or cut_short or len(found) > MAX_DECISIVE:
        # Not every element that moves the output by that share was found (more of them than MAX_DECISIVE, or the
        # runs ran out on many small ones): holding some and not the others would leave a legitimate rounding of
        # the others outside a budget made narrow, so no element is held and the trials keep their chance.
        worlds.complete = False
        return worlds, planned
    nodes = {n.name: n for n in _ops(converted, _QUANTIZE)}  # (the planned copy's quantize targets are its own)
    for k, s in sorted(found):
        name, index, distance, integer = items[k]
        node = nodes.get(name)
        where = {"op": _op_name(node), "module": _module_of(node)} if node is not None else {}
        worlds.elements.append(Element(name, index, distance, int(integer), s, **where))
    for w in range(1, 2 ** len(worlds.elements)):
        got = planned.run(args, flips=_by_node((e.node, e.index) for e in worlds.flipped(w)))
        worlds.outputs.append(_floats(got))
    return worlds, planned


def accounts(worlds: Worlds, runs: dict[str, BackendRun], oracle: BackendRun) -> dict[str, BackendRun]:
    """For each run nearer another world than the oracle's: what that world differs from the oracle by, per output
    (``RunResults.discrete``'s form: the message is how many elements it rounded the other way, the note which)."""
    out: dict[str, BackendRun] = {}
    if len(worlds.outputs) < 2:
        return out
    for name, run in runs.items():
        if run.status != OK:
            continue
        w = worlds.nearest(run.outputs)
        if w == 0:
            continue
        world, base = worlds.outputs[w], worlds.outputs[0]
        correction = {}
        for k, leaf in oracle.outputs.items():
            if k in world and leaf.is_array and tuple(world[k].shape) == tuple(leaf.shape):
                diff = (world[k].to(torch.float64) - base[k].to(torch.float64)).reshape(leaf.shape)
                correction[k] = to_leaf(diff)
        flipped = worlds.flipped(w)
        note = (
            f"{len(flipped)} requantized value(s) within a correct kernel's reach of a rounding boundary, which alone "
            f"move the output, rounded the other way (as a correct kernel may): "
            + "; ".join(e.says() for e in flipped)
            + "; judged from that rounding"
        )
        out[name] = BackendRun(name, OK, correction, message=str(len(flipped)), notes=[note])
    return out


__all__ = ["DECISIVE_SHARE", "MAX_DECISIVE", "MAX_PROBES", "Element", "Worlds", "accounts", "find"]
