"""Discrete events: a ReLU (or clamp) whose input lies within round-off of its threshold, and flips.

A backend that is a little less accurate than the oracle -- legitimately: NNPACK's fast convolutions,
reduced precision -- moves a pre-activation that sits within round-off of 0 across it.  The forward
barely notices (the unit's value is round-off either way), but the backward routes its gradient
through that unit or not, and every gradient upstream of it moves by the unit's whole contribution:
thousands of times the round-off budget, "likely a kernel bug" for a backend that has none.

:func:`account` finds such events and takes them out of the excess, for a backend whose gradients are
SUSPECT:

1. the model runs once more in float32 (the oracle's values) and in float64 (the reference's), with
   every ReLU-family call recorded (``relu``, ``relu6``, ``hardtanh``, ``leaky_relu``, ``threshold``,
   ``clamp``): its input tensor, its thresholds, the gradient arriving at its output;
2. a unit is *ambiguous* when its float64 input lies within the round-off band of a threshold:
   :data:`BAND` times the oracle's own largest error on that tensor, scaled to the backend's format (a
   bfloat16 backend's band is 2**16 times an fp32 one's);
3. for each ambiguous unit (at most :data:`MAX_UNITS`), the change of every gradient output if that
   unit's decision flipped: one backward pass from that unit;
4. the backend's gradient differences from fp64 are fitted by the flips, each 0 or 1 (a box-constrained
   least squares in the output's own round-off units, rounded);
5. the chosen flips' effect is then computed *together*, exactly (:meth:`Analysis.joint`): one flip changes
   the gradient arriving at every unit upstream of it, so the one-at-a-time directions of flips in
   consecutive layers do not add up (MobileNetV2 at batch 32: 10 flips in 9 layers, the summed directions
   left 3e4 round-off units on a bias gradient, the joint effect leaves 4.7, the oracle's own).  The
   choice is refined on what the joint effect leaves, and kept only if it explains more than no flip.
   What the chosen flips explain is the backend's *correction*, subtracted from its gradients before the
   budget judges them.

The same account is made for the oracle and the sequential run, so the budget is measured on round-off
alone.  A flip is only credited where the float64 input is within round-off of the threshold, so no
other error can be explained away; what the flips do not explain is judged as before.  The corrections
travel with the results (``RunResults.discrete``) and every record says what was accounted for.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from rlx_nb._support.tree import map_tensors
from rlx_nb.execution.prepare import named_params
from rlx_nb.execution.results import GRAD_PREFIX, OK, BackendRun, Leaf

BAND = 8.0
"""How far past the oracle's own largest error on a tensor a flip is still credited (the budget's max limit)."""
MAX_UNITS = 64
"""At most this many ambiguous units are accounted for (the nearest to their thresholds first)."""


@dataclasses.dataclass
class Kink:
    """One recorded call: its input (a node of the graph), its output, thresholds and slopes either side."""

    op: str
    where: str
    pre: torch.Tensor
    out: torch.Tensor
    thresholds: tuple[float, ...]
    slopes: tuple[float, ...]  # the derivative below, between and above the thresholds (len = thresholds + 1)


def _relu_like(func: Callable, args: tuple, kwargs: dict) -> tuple[str, tuple[float, ...], tuple[float, ...]] | None:
    # (name, thresholds, slopes) for a ReLU-family call, else None.
    if func in (F.relu, torch.relu, torch.relu_, torch.Tensor.relu, torch.Tensor.relu_, F.relu_):
        return "relu", (0.0,), (0.0, 1.0)
    if func is F.relu6:
        return "relu6", (0.0, 6.0), (0.0, 1.0, 0.0)
    if func in (F.hardtanh, F.hardtanh_):
        lo = kwargs.get("min_val", args[1] if len(args) > 1 else -1.0)
        hi = kwargs.get("max_val", args[2] if len(args) > 2 else 1.0)
        return "hardtanh", (float(lo), float(hi)), (0.0, 1.0, 0.0)
    if func in (F.leaky_relu, F.leaky_relu_):
        slope = kwargs.get("negative_slope", args[1] if len(args) > 1 else 0.01)
        return "leaky_relu", (0.0,), (float(slope), 1.0)
    if func in (F.threshold, F.threshold_):
        return "threshold", (float(args[1] if len(args) > 1 else kwargs["threshold"]),), (0.0, 1.0)
    if func in (torch.clamp, torch.Tensor.clamp, torch.clamp_min, torch.Tensor.clamp_min):
        lo = kwargs.get("min", args[1] if len(args) > 1 else None)
        hi = kwargs.get("max", args[2] if len(args) > 2 and func in (torch.clamp, torch.Tensor.clamp) else None)
        if isinstance(lo, torch.Tensor) or isinstance(hi, torch.Tensor):
            return None
        bounds = [(float(v), side) for v, side in ((lo, "lo"), (hi, "hi")) if v is not None]
        if not bounds:
            return None
        slopes = (0.0, 1.0, 0.0) if len(bounds) == 2 else ((0.0, 1.0) if bounds[0][1] == "lo" else (1.0, 0.0))
        return "clamp", tuple(v for v, _ in bounds), slopes
    return None


class Recorder(TorchFunctionMode):
    """Records every ReLU-family call (:class:`Kink`); an in-place one runs out of place (same values)."""

    def __init__(self, where: Callable[[], str]) -> None:
        super().__init__()
        self.kinks: list[Kink] = []
        self.where = where

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        found = _relu_like(func, args, kwargs) if args and isinstance(args[0], torch.Tensor) else None
        if found is None or not args[0].is_floating_point():
            return func(*args, **kwargs)
        name, thresholds, slopes = found
        pre = args[0]
        plain = {k: v for k, v in kwargs.items() if k != "inplace"}
        out_of_place = {F.relu_: F.relu, torch.relu_: torch.relu, torch.Tensor.relu_: torch.relu,
                        F.hardtanh_: F.hardtanh, F.leaky_relu_: F.leaky_relu, F.threshold_: F.threshold}.get(func, func)  # fmt: skip
        out = out_of_place(*args, **plain)
        self.kinks.append(Kink(name, self.where(), pre, out, thresholds, slopes))
        return out


@dataclasses.dataclass(frozen=True)
class Unit:
    """An ambiguous unit: recorded call ``kink``, flat index, the threshold it is near, its fp64 input."""

    kink: int
    index: int
    threshold: float
    value: float
    band: float


def _where_tracker(model: torch.nn.Module) -> tuple[Callable[[], str], list]:
    # Where a call happens, for the account's words: the innermost module running, or, for a call a module's
    # own forward makes between its children, that module and the child that finished last ("after `b1`").
    stack: list[str] = []
    last: list[str] = [""]
    hooks = []

    def enter(name: str) -> Callable:
        def hook(module: Any, args: Any) -> None:
            stack.append(name)

        return hook

    def leave(module: Any, args: Any, out: Any) -> None:  # (a hook returning a value would replace the output)
        if stack:
            last[0] = stack.pop()

    for name, module in model.named_modules():
        hooks.append(module.register_forward_pre_hook(enter(name)))
        hooks.append(module.register_forward_hook(leave))

    def where() -> str:
        inner = next((n for n in reversed(stack) if n), "")
        after = last[0] if last[0] and last[0] != inner and last[0].startswith(inner) else ""
        place = f"`{inner}`" if inner else "the model's forward"
        return f"{place}, after `{after}`" if after else place

    return where, hooks


def _record(model: torch.nn.Module, args: tuple, *, grad: bool) -> tuple[Any, list[Kink]]:
    where, hooks = _where_tracker(model)
    try:
        with torch.set_grad_enabled(grad), Recorder(where) as recorder:
            out = model(*args)
    finally:
        for h in hooks:
            h.remove()
    return out, recorder.kinks


def _loss(out: Any, loss: Callable | None) -> torch.Tensor | None:
    from rlx_nb.execution.execute import _default_loss

    return loss(out) if loss is not None else _default_loss(out)


@dataclasses.dataclass
class Analysis:
    """The float64 run's gradients, each ambiguous unit's flip direction, and the units' descriptions."""

    reference: dict[str, np.ndarray]
    units: list[Unit]
    directions: list[dict[str, np.ndarray]]
    kinks: list[tuple[str, str]]  # (op, where) per recorded call
    note: str = ""
    joint: Callable[[Sequence[int]], dict[str, np.ndarray]] = lambda picked: {}
    """The gradients' change if the given units flipped together (kept while the float64 graph is; without
    one, flips explain nothing and none is credited)."""


def analyse(
    base: torch.nn.Module,
    args: tuple,
    *,
    loss: Callable | None,
    grad_inputs: Sequence[int],
    input_names: Sequence[str],
    scale: float,
    outputs: set[str],
) -> Analysis | None:
    """Find the ambiguous units of ``base`` on ``args`` and each one's effect on the gradient ``outputs``.

    ``scale``: the widest format scale of the runs to account for (the band is scaled by it).  None when
    the model has no ReLU-family call.
    """
    model32 = copy.deepcopy(base)
    with torch.no_grad():
        _, kinks32 = _record(model32, args, grad=False)
    del model32
    if not kinks32:
        return None
    model64 = copy.deepcopy(base).double()
    args64 = map_tensors(lambda t: t.detach().double() if t.is_floating_point() else t.detach(), args)
    for i in grad_inputs:
        args64[i].requires_grad_(True)
    for p in model64.parameters():
        if p.is_floating_point():
            p.requires_grad_(True)
    out64, kinks = _record(model64, args64, grad=True)
    if len(kinks) != len(kinks32) or any(k.pre.shape != k32.pre.shape for k, k32 in zip(kinks, kinks32, strict=False)):
        return Analysis(
            {}, [], [], [], "the float32 and float64 runs took other paths: discrete events not accounted for"
        )
    value = _loss(out64, loss)
    if value is None:
        return None
    targets = {GRAD_PREFIX + n: p for n, p in named_params(model64) if p.requires_grad}
    targets.update({GRAD_PREFIX + input_names[i]: args64[i] for i in grad_inputs})
    targets = {n: t for n, t in targets.items() if n in outputs}
    names = list(targets)
    grads = torch.autograd.grad(
        value, [targets[n] for n in names] + [k.out for k in kinks], retain_graph=True, allow_unused=True
    )
    reference = {n: g.detach().numpy() for n, g in zip(names, grads[: len(names)], strict=True) if g is not None}
    upstream = grads[len(names) :]
    units = _ambiguous(kinks, kinks32, scale)
    if len(units) > MAX_UNITS:
        note = f"{len(units)} units within round-off of a threshold; the {MAX_UNITS} nearest accounted for"
        units = sorted(units, key=lambda u: abs(u.value - u.threshold) / u.band)[:MAX_UNITS]
    else:
        note = ""
    directions = []
    for u in units:
        g = upstream[u.kink]
        if g is None:
            directions.append({})
            continue
        cot = torch.zeros_like(kinks[u.kink].pre)
        cot.view(-1)[u.index] = _slope_change(kinks[u.kink], u) * g.reshape(-1)[u.index]
        d = torch.autograd.grad(
            kinks[u.kink].pre, [targets[n] for n in names], grad_outputs=cot, retain_graph=True, allow_unused=True
        )
        directions.append({n: x.detach().numpy() for n, x in zip(names, d, strict=True) if x is not None})

    def joint(picked: Sequence[int]) -> dict[str, np.ndarray]:
        return _joint(kinks, upstream, [units[i] for i in picked], [targets[n] for n in names], names)

    return Analysis(reference, units, directions, [(k.op, k.where) for k in kinks], note, joint)


def _slope_change(kink: Kink, u: Unit) -> float:
    # The derivative on the other side of the unit's threshold minus the one on the reference's side.
    pos = list(kink.thresholds).index(u.threshold)
    below, above = kink.slopes[pos], kink.slopes[pos + 1]
    return above - below if u.value < u.threshold else below - above


def _joint(
    kinks: list[Kink], upstream: Sequence[torch.Tensor | None], flipped: list[Unit], targets: list, names: list[str]
) -> dict[str, np.ndarray]:
    # The change of every target's gradient if the ``flipped`` units flipped together, exactly: the
    # recorded calls run in the forward's order, a topological one, so going through the flipped calls from
    # the last, each one's change of slope meets the gradient arriving at it *with* the flips after it
    # (``extra``), and sends its own change on to the targets and to the flipped calls before it.
    by_kink: dict[int, list[Unit]] = {}
    for u in flipped:
        by_kink.setdefault(u.kink, []).append(u)
    order = sorted(by_kink, reverse=True)
    extra: dict[int, torch.Tensor] = {}
    total: list[torch.Tensor | None] = [None] * len(targets)
    for n, j in enumerate(order):
        g = upstream[j]
        if g is None and j not in extra:
            continue
        arriving = (g if g is not None else 0) + extra.get(j, 0)
        arriving = torch.as_tensor(arriving).reshape(-1)
        cot = torch.zeros_like(kinks[j].pre)
        for u in by_kink[j]:
            cot.view(-1)[u.index] = _slope_change(kinks[j], u) * arriving[u.index]
        before = [kinks[i].out for i in order[n + 1 :]]
        got = torch.autograd.grad(
            kinks[j].pre, targets + before, grad_outputs=cot, retain_graph=True, allow_unused=True
        )
        for t, x in enumerate(got[: len(targets)]):
            if x is not None:
                total[t] = x if total[t] is None else total[t] + x
        for i, x in zip(order[n + 1 :], got[len(targets) :], strict=True):
            if x is not None:
                extra[i] = x if i not in extra else extra[i] + x
    return {name: x.detach().numpy() for name, x in zip(names, total, strict=True) if x is not None}


def _ambiguous(kinks: list[Kink], kinks32: list[Kink], scale: float) -> list[Unit]:
    units = []
    for j, (k, k32) in enumerate(zip(kinks, kinks32, strict=True)):
        x64 = k.pre.detach().reshape(-1)
        x32 = k32.pre.detach().reshape(-1).double()
        err = float((x32 - x64).abs().max()) if x64.numel() else 0.0
        band = BAND * scale * max(err, 2.0**-24 * float(x64.abs().max()) if x64.numel() else 0.0)
        if band <= 0:
            continue
        for t in k.thresholds:
            near = torch.nonzero((x64 - t).abs() <= band).reshape(-1)
            units += [Unit(j, int(i), t, float(x64[i]), band) for i in near.tolist()]
    return units


def fit(diffs: dict[str, np.ndarray], directions: list[dict[str, np.ndarray]], weights: dict[str, float]) -> np.ndarray:
    """Which flips (0 or 1 each) explain ``diffs`` (a run's gradients minus fp64's), each output weighted.

    Box-constrained least squares by coordinate descent, then rounded: a flip happened or it did not.
    """
    k = len(directions)
    if k == 0:
        return np.zeros(0)
    gram, rhs = np.zeros((k, k)), np.zeros(k)
    for name, y in diffs.items():
        w = weights.get(name, 1.0) ** 2
        cols = [d.get(name) for d in directions]
        flat = [c.reshape(-1) if c is not None else None for c in cols]
        yf = y.reshape(-1)
        for a in range(k):
            if flat[a] is None:
                continue
            rhs[a] += w * float(flat[a] @ yf)
            for b in range(a, k):
                if flat[b] is not None:
                    gram[a, b] += w * float(flat[a] @ flat[b])
    gram = np.triu(gram) + np.triu(gram, 1).T
    s = np.zeros(k)
    for _ in range(200):
        moved = 0.0
        for a in range(k):
            if gram[a, a] <= 0:
                continue
            new = min(1.0, max(0.0, s[a] + (rhs[a] - gram[a] @ s) / gram[a, a]))
            moved = max(moved, abs(new - s[a]))
            s[a] = new
        if moved < 1e-9:
            break
    return (s > 0.5).astype(np.float64)


def account(
    analysis: Analysis,
    runs: dict[str, BackendRun],
    weights: dict[str, float],
    scales: dict[str, float],
) -> dict[str, BackendRun]:
    """Each run's correction (the gradients its fitted flips explain), as ``discrete:<name>`` runs.

    ``weights``: each gradient output's round-off unit (1 / the oracle's error RMS); ``scales``: each run's
    format scale (its band).  A run whose fit chose no flip gets nothing.
    """
    found = {}
    for name, run in runs.items():
        if run is None or run.status != OK:
            continue
        diffs = {}
        for out, ref in analysis.reference.items():
            leaf = run.outputs.get(out)
            if leaf is not None and leaf.is_array and leaf.value.shape == ref.shape:
                diffs[out] = leaf.value.astype(np.float64) - ref
        band = scales.get(name, 1.0)
        usable = [
            i
            for i, u in enumerate(analysis.units)
            if u.band * band / max(scales.values()) >= abs(u.value - u.threshold)
        ]
        picked, explained = _choose(analysis, diffs, usable, weights)
        if not picked:
            continue
        correction = {out: Leaf(x, "float64", tuple(x.shape)) for out, x in explained.items() if out in diffs}
        found[name] = BackendRun(
            f"discrete:{name}", OK, correction, str(len(picked)), notes=[describe(analysis, picked)]
        )
    return found


REFINE = 16
"""At most this many toggles of a run's chosen flips are tried exactly, on what their joint effect leaves."""


def _choose(
    analysis: Analysis, diffs: dict[str, np.ndarray], usable: list[int], weights: dict[str, float]
) -> tuple[list[int], dict[str, np.ndarray]]:
    # The flips (of ``usable``) that explain ``diffs``, and what they explain together (nothing: ``[], {}``).
    def left(explained: dict[str, np.ndarray]) -> float:
        return sum(
            weights.get(n, 1.0) ** 2 * float(np.sum((y - explained[n]) ** 2 if n in explained else y**2))
            for n, y in diffs.items()
        )

    chosen = fit(diffs, [analysis.directions[i] for i in usable], weights)
    picked = [usable[i] for i, c in enumerate(chosen) if c > 0]
    if not picked:
        return [], {}
    explained = analysis.joint(picked)
    cost = left(explained)
    tries, improved = 0, True
    while improved and tries < REFINE:
        # the toggles (add a unit, or take one back) the one-at-a-time directions rate best on what is left,
        # tried exactly in that order until one explains more
        rest = {n: y - explained.get(n, 0.0) for n, y in diffs.items()}
        gains = {i: _gain(rest, analysis.directions[i], weights, -1.0 if i in picked else 1.0) for i in usable}
        ranked = [i for i in sorted(gains, key=gains.get, reverse=True) if gains[i] > 0]
        improved = False
        for i in ranked[: REFINE - tries]:
            tries += 1
            trial = sorted(set(picked) ^ {i})
            trial_explained = analysis.joint(trial) if trial else {}
            trial_cost = left(trial_explained)
            if trial_cost < cost:
                picked, explained, cost, improved = trial, trial_explained, trial_cost, True
                break
    if not picked or cost >= left({}):
        return [], {}  # (the flips together explain nothing: none is credited)
    return picked, explained


def _gain(
    rest: dict[str, np.ndarray], direction: dict[str, np.ndarray], weights: dict[str, float], sign: float
) -> float:
    # How much a toggle along ``sign * direction`` would lower the weighted squares of ``rest`` (linear view).
    total = 0.0
    for name, d in direction.items():
        if name in rest:
            w = weights.get(name, 1.0) ** 2
            total += w * (2.0 * sign * float(np.vdot(d, rest[name])) - float(np.vdot(d, d)))
    return total


def describe(analysis: Analysis, picked: list[int]) -> str:
    """``2 relu inputs at `b1` within round-off of their threshold flipped (fp64 -3.1e-08, 4.2e-09)``."""
    by_place: dict[tuple[str, str], list[Unit]] = {}
    for i in picked:
        u = analysis.units[i]
        by_place.setdefault(analysis.kinks[u.kink], []).append(u)
    parts = []
    for (op, where), units in by_place.items():
        values = ", ".join(f"{u.value:.2g}" for u in units[:3]) + (", ..." if len(units) > 3 else "")
        thresholds = sorted({u.threshold for u in units})
        at = " or ".join(f"{t:g}" for t in thresholds)
        parts.append(f"{len(units)} {op} input(s) in {where} within round-off of {at} flipped (fp64 {values})")
    return "; ".join(parts) + "; they carry into the gradients upstream of them, and are taken out of the excess"


__all__ = ["Analysis", "Kink", "Recorder", "Unit", "account", "analyse", "fit"]
