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
   the candidates are bisected (best first) for single elements that alone move an output by at least
   :data:`DECISIVE_SHARE` of that.  The search runs until it has found them all, or until its budget is spent (by
   default :data:`SEARCH_SECONDS`, at least :data:`MIN_RUNS` runs: a small transformer's simulation takes
   milliseconds a run, and its 60-odd candidates need a few hundred); only a search that finds them all (at most
   :data:`MAX_DECISIVE`) is used: otherwise a legitimate rounding of one not found would fall outside a budget the
   others' holding made narrow, so none is held, the trials keep their chance, and the report says so, with what
   finishing the search would cost (``quantized_divergence(search_runs=...)``);
3. the trials round every other candidate at random and hold the decisive ones as the oracle does, and the exact
   simulation (the reference) rounds them as the oracle does too, so the budget measures what the rest leaves;
4. each way of rounding the decisive elements is a world of its own.  A candidate runtime is judged from the world
   nearest to it: each element's own move is measured alone, the combination that best explains the runtime's
   output (its moves added, every combination weighed) is run as it is, and where that world is nearer than the
   oracle what it differs from the oracle by is taken out of the runtime's error before the budget judges it
   (``RunResults.discrete``); its record says which elements it rounded the other way.  Only elements within a width
   of a boundary are ever credited, a world is only ever a real run of the simulation, and it is chosen only where
   it is nearer than the oracle, so no other error is explained away.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import numpy as np
import torch

from rlx_nb.execution.results import OK, BackendRun, Leaf, to_leaf
from rlx_nb.int8.requantization import (
    _QUANTIZE,
    _module_of,
    _op_name,
    _ops,
    dequantized_once,
    element_reach,
    graph_copy,
    rounded_at_random,
)
from rlx_nb.int8.worlds import (
    Element,
    Worlds,
    _by_node,
    _floats,
    _largest,
    _rms,
    _tensor,
)

DECISIVE_SHARE = 0.25
"""An element is decisive when rounding it alone the other way moves some output by at least this share (RMS) of
what every candidate rounded the other way moves it."""
MAX_DECISIVE = 64
"""At most this many decisive elements are held (each moves some output by a quarter of what all move it: a model
whose outputs include its caches' keys has many, each deciding its own element); where there are more, none is, and
the trials keep their chance for all of them."""
HOLD_ALL_BYTES = 256 * 2**20
"""Every candidate is measured alone and held (no rounding left to the trials' chance) where their moves of the
outputs, kept in float64, take at most this much memory and the runs fit the search's budget."""
FLOOR_QUANTA = 1.5
"""An output that every candidate rounded the other way together moves by at most this many of its quanta at any
element is at the budget's floor (one element one quantum off) whatever is held: it decides no element."""
SEARCH_SECONDS = 30.0
"""By default the search runs the simulation for at most this long (and at least :data:`MIN_RUNS` times)."""
MIN_RUNS = 32
"""The search's runs however slow the model (the budget before #63 was this many)."""


class _Planned:
    """The Q/DQ simulation whose activation requantizations follow a plan: elements rounded the other way
    (``flips``), and optionally every element within its width rounded at random (``jitter``) except the ``held``
    ones.  One graph copy; the plan changes between runs without recompiling."""

    def __init__(self, converted: torch.fx.GraphModule, widths: dict[str, float],
                 spreads: dict[str, float] | None = None) -> None:  # fmt: skip
        self.graph = dequantized_once(graph_copy(converted))
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
            if plan.record is not None or plan.generator is not None:  # (a plain run reaches nothing: none computed)
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


def find(
    converted: torch.fx.GraphModule,
    args: tuple,
    widths: dict[str, float],
    oracle: dict[str, Leaf],
    *,
    spreads: dict[str, float] | None = None,
    search_runs: float | None = None,
    quanta: dict[str, float | None] | None = None,
) -> tuple[Worlds, _Planned]:
    """The decisive elements of ``converted`` on ``args`` and their worlds (module docstring); ``oracle``: the
    simulation's outputs (the oracle run's); ``search_runs``: the most runs the search may take (``None``: up to
    :data:`SEARCH_SECONDS`, at least :data:`MIN_RUNS`; ``math.inf``: until it is complete).  Where every candidate
    can be run alone within that (and their moves kept within :data:`HOLD_ALL_BYTES`), every one is measured and
    held (:func:`_every_one`); else they are bisected for the decisive ones.  Returns the worlds and the planned
    simulation (for the trials)."""
    start = time.perf_counter()
    planned = _Planned(converted, widths, spreads)
    recorded = planned.candidates(args)
    base = {  # (the oracle's outputs, not copied)
        k: _tensor(v.value)
        for k, v in oracle.items()
        if v.is_array and v.value is not None and np.asarray(v.value).dtype.kind == "f" and v.value.size
    }
    items = [(name, int(i), float(d), float(q)) for name, (index, dist, q) in recorded.items()
             for i, d, q in zip(index.tolist(), dist.tolist(), q.tolist(), strict=True)]  # fmt: skip
    worlds = Worlds([], [base], {}, candidates=len(items), runner=lambda flips: planned.run(args, flips=flips))
    if not items or not base:
        return worlds, planned

    def spent(more: int = 0) -> bool:
        runs = worlds.probes + more
        if search_runs is not None:
            return runs > search_runs
        took = time.perf_counter() - start
        return runs > MIN_RUNS and took / max(worlds.probes, 1) * runs > SEARCH_SECONDS

    def moves(group: Any) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
        worlds.probes += 1
        got = _floats(planned.run(args, flips=_by_node(items[k][:2] for k in group)))
        return {k: _rms(got[k], base[k]) for k in base if k in got and got[k].shape == base[k].shape}, got

    everything, all_flipped = moves(range(len(items)))
    # (an output that every flip together moves by at most a quantum an element -- a requantized value the model
    # returns as it is, a cache's keys -- is at the budget's floor whatever is held: none of its flips is decisive)
    floor = {k for k, q in (quanta or {}).items() if q and k in all_flipped and k in base
             and _largest(all_flipped[k], base[k]) <= FLOOR_QUANTA * q}  # fmt: skip
    worlds.scales = {k: v for k, v in everything.items() if v > 0 and math.isfinite(v) and k not in floor}
    worlds.units = {k: (quanta or {}).get(k) or worlds.scales[k] for k in base if (quanta or {}).get(k) or
                    k in worlds.scales}  # fmt: skip
    if not worlds.scales:
        return worlds, planned
    kept = len(items) * sum(t.numel() for t in base.values()) * 8  # (each candidate's move, in float64)
    if kept <= HOLD_ALL_BYTES and not spent(len(items)):
        found = _every_one(items, moves, worlds)
    else:
        found = _bisected(items, moves, worlds, spent)
    worlds.seconds = time.perf_counter() - start
    if found is None:
        return worlds, planned
    nodes = {n.name: n for n in _ops(converted, _QUANTIZE)}  # (the planned copy's quantize targets are its own)
    for k, s, alone in sorted(found, key=lambda f: f[0]):
        name, index, distance, integer = items[k]
        if alone is None:  # (the one candidate there was: never split, so never run alone)
            alone = _floats(planned.run(args, flips=_by_node([items[k][:2]])))
        node = nodes.get(name)
        where = {"op": _op_name(node), "module": _module_of(node)} if node is not None else {}
        worlds.elements.append(Element(name, index, distance, int(integer), s, **where))
        worlds.moves.append({o: alone[o].to(torch.float64) - base[o].to(torch.float64) for o in base if o in alone})
        worlds._runs[(len(worlds.elements) - 1,)] = alone
    return worlds, planned


def _share(moved: dict[str, float], worlds: Worlds) -> float:
    # What one group's rounding moves the outputs by, as a share of what every candidate's moves them (the largest
    # over the outputs not at the floor).
    return max((moved.get(k, 0.0) / s for k, s in worlds.scales.items()), default=0.0)


def _every_one(items: list, moves: Any, worlds: Worlds) -> list[tuple[int, float, dict]]:
    # Every candidate run alone and held (those whose rounding moves no output are left out: they decide nothing).
    # Then no rounding is left to the trials' chance: each runtime is judged from the world of candidates nearest it.
    found = []
    for k in range(len(items)):
        moved, got = moves((k,))
        if any(v > 0 for v in moved.values()):
            found.append((k, _share(moved, worlds), got))
    return found


def _bisected(items: list, moves: Any, worlds: Worlds, spent: Any) -> list[tuple[int, float, dict]] | None:
    # The candidates bisected (best first) for those that alone move an output by DECISIVE_SHARE of what all move it;
    # None where the search could not find them all (worlds.complete, .left and .to_finish say so).
    def share(moved: dict[str, float]) -> float:
        return _share(moved, worlds)

    everything, _ = moves(range(len(items)))
    queue = [(share(everything), range(len(items)), None)]
    found: list[tuple[int, float, dict | None]] = []
    while queue and len(found) <= MAX_DECISIVE and not spent():
        queue.sort(key=lambda q: q[0])
        s, group, alone = queue.pop()
        if len(group) == 1:
            found.append((group[0], s, alone))
            continue
        mid = group.start + len(group) // 2
        for half in (range(group.start, mid), range(mid, group.stop)):
            moved, got = moves(half)
            h = share(moved)
            if h >= DECISIVE_SHARE:
                queue.append((h, half, got if len(half) == 1 else None))
    if queue or len(found) > MAX_DECISIVE:
        # Not every element that moves the output by that share was found (more of them than MAX_DECISIVE, or the
        # budget ran out first): holding some and not the others would leave a legitimate rounding of the others
        # outside a budget made narrow, so no element is held and the trials keep their chance.
        worlds.complete = False
        worlds.left = sum(len(g) for _, g, _ in queue)
        worlds.to_finish = sum(2 * max(1, math.ceil(math.log2(len(g)))) for _, g, _ in queue)
        return None
    return found


def from_its_world(worlds: Worlds, trial: BackendRun, oracle: BackendRun) -> BackendRun:
    """A trial as the budget reads it: what is left of it once the world nearest to it is taken out (the oracle's
    outputs plus the trial's difference from that world).  A trial rounds every candidate at random; a runtime is
    judged from its nearest world (:func:`accounts`) by the same search, so the budget holds what that search leaves
    of a correct kernel's roundings, whatever it explains and whatever it does not."""
    if trial.status != OK or not worlds.elements:
        return trial
    chosen = worlds.nearest(trial.outputs)
    if not chosen:
        return trial
    world = worlds.world(chosen)
    outputs = dict(trial.outputs)
    for k, leaf in trial.outputs.items():
        base = oracle.outputs.get(k)
        if (
            k in world
            and leaf.is_array
            and base is not None
            and base.is_array
            and tuple(world[k].shape) == tuple(leaf.shape)
        ):
            left = _tensor(leaf.value).to(torch.float64) - world[k].to(torch.float64)
            outputs[k] = to_leaf((_tensor(base.value).to(torch.float64) + left).to(torch.float32).reshape(leaf.shape))
    return dataclasses.replace(trial, outputs=outputs, notes=[*trial.notes, f"judged from its nearest world: "
                               f"{len(chosen)} decisive element(s) rounded the other way"])  # fmt: skip


def accounts(worlds: Worlds, runs: dict[str, BackendRun], oracle: BackendRun) -> dict[str, BackendRun]:
    """For each run nearer another world than the oracle's: what that world differs from the oracle by, per output
    (``RunResults.discrete``'s form: the message is how many elements it rounded the other way, the note which)."""
    out: dict[str, BackendRun] = {}
    if not worlds.elements:
        return out
    for name, run in runs.items():
        if run.status != OK:
            continue
        chosen = worlds.nearest(run.outputs)
        if not chosen:
            continue
        world, base = worlds.world(chosen), worlds.outputs[0]
        correction = {}
        for k, leaf in oracle.outputs.items():
            if k in world and leaf.is_array and tuple(world[k].shape) == tuple(leaf.shape):
                diff = (world[k].to(torch.float64) - base[k].to(torch.float64)).reshape(leaf.shape)
                correction[k] = to_leaf(diff)
        flipped = worlds.flipped(chosen)
        note = (
            f"{len(flipped)} requantized value(s) within a correct kernel's reach of a rounding boundary, which alone "
            f"move the output, rounded the other way (as a correct kernel may): "
            + "; ".join(e.says() for e in flipped)
            + "; judged from that rounding"
        )
        out[name] = BackendRun(name, OK, correction, message=str(len(flipped)), notes=[note])
    return out


__all__ = ["DECISIVE_SHARE", "MAX_DECISIVE", "MIN_RUNS", "SEARCH_SECONDS", "accounts", "find", "from_its_world"]
