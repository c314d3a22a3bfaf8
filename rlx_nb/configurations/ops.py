"""The first op that is not invariant: recorded in both configurations, aligned by module and call, the first whose
inputs are bit for bit the row's in both but whose output is not.

The ops are the model's own torch function calls, each module's first call (:class:`rlx_nb.changes.ops.OpCalls`), so
an op is named as :func:`rlx_nb.localize` names one (``"fc :: F.linear"``).  A tensor of the batched run is cut to the
row's part as the outputs are (:func:`rlx_nb.configurations.configs.aligned`); an op whose tensors do not align that way
(a reduction over the batch, a reshape that mixes rows) is passed over, neither invariant nor not.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from rlx_nb._support.tree import flatten
from rlx_nb.changes.ops import SEPARATOR, OpCall, OpCalls
from rlx_nb.configurations.configs import aligned, windowed
from rlx_nb.numerics.device import same_bits


@dataclasses.dataclass
class Recorded:
    name: str
    inputs: list[torch.Tensor]
    out: torch.Tensor


def _tensors(x: Any) -> list[torch.Tensor]:
    # Copies of the tensors an op was given, but its parameters as they are (the same in both runs: a model's weights
    # copied for every op it calls were GPT-2 small's whole size again per run).
    return [t.detach() if isinstance(t, torch.nn.Parameter) else t.detach().clone()
            for _, t in flatten(x) if isinstance(t, torch.Tensor)]  # fmt: skip


def recorded(
    run: Callable[[Any], Any],
    model: torch.nn.Module,
    *,
    against: tuple[dict, dict] | None = None,
    where: dict[str, Any] | None = None,
    first: dict[str, str] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``run(model)``'s ops in call order, and its modules' first calls in the order they end (a module's children
    before it), each with its first floating output (copies: a later in-place op does not change them).  With
    ``against`` (the row alone's record), each is compared with the row alone's as it comes (:class:`Compared`) and
    nothing of it is kept: one run's record in memory, not two.  ``first`` (with ``against``) is given the first op
    whose inputs are the row's and whose output is not, as the run makes it, and its kernel path (the op run once
    more there, :func:`rlx_nb.configurations.kernels.kernel_path`): no run of the model again to find it."""
    seen: dict[str, Any] = {}
    modules: dict[str, Any] = {}

    def store(into: dict, mine: dict, name: str, made: Callable[[], Recorded]) -> None:
        if name in into:
            return
        if against is None:
            into[name] = made()
            return
        a = mine.get(name)
        if a is not None:
            into[name] = compared(a, made(), where or {})

    def keep(op: OpCall) -> None:
        name = f"<root>{op.name}" if op.name.startswith(SEPARATOR) else op.name  # (the top level's own ops)
        store(seen, against[0] if against else {}, name,
              lambda: Recorded(name, _tensors((op.args, op.kwargs)), op.out.detach().clone()))  # fmt: skip
        c = seen.get(name)
        if first is not None and "op" not in first and isinstance(c, Compared) and c.aligned and c.inputs_same \
                and not c.same:  # fmt: skip
            from rlx_nb.configurations.kernels import kernel_path

            first["op"], first["path"] = name, kernel_path(op.func, op.args, op.kwargs)

    def ended(name: str):
        def hook(module, args, out):
            first = [t for _, t in flatten(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
            if first:
                store(modules, against[1] if against else {}, name,
                      lambda: Recorded(name, _tensors(args), first[0].detach().clone()))  # fmt: skip

        return hook

    handles = [m.register_forward_hook(ended(n)) for n, m in model.named_modules()]
    recorder = OpCalls(keep)
    try:
        with recorder.attached(model), torch.no_grad():
            run(model)
    finally:
        for h in handles:
            h.remove()
    return seen, modules


@dataclasses.dataclass
class Compared:
    """One op (or module) of a configuration's run against the row alone's: whether its output is cut to the row,
    bit for bit, how far it moved (relative), and its inputs the same."""

    name: str
    aligned: bool
    same: bool = False
    inputs_same: bool = False
    extra: int = 0
    moved: float = 0.0
    inputs_moved: float = float("nan")
    shapes: str = ""


def _cut(t: torch.Tensor, u: torch.Tensor, where: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor] | None:
    # The row alone's ``t`` and a configuration's ``u``, each cut to the part both computed (None: they do not align).
    if "window" in where:  # (a cached run's last call: the row alone's cut to the positions that call computed)
        mine = windowed(t, u.shape, *where["window"])
        return None if mine is None else (mine, u)
    theirs = aligned(u, t.shape, **where)
    return None if theirs is None else (t, theirs)


def compared(a: Recorded, b: Recorded, where: dict[str, Any]) -> Compared:
    """``b`` (a configuration's) against ``a`` (the row alone's), each tensor cut to the row's part."""
    out = _cut(a.out, b.out, where)
    if out is None:
        return Compared(a.name, False, shapes=f"{_dims(a.out)} alone against {_dims(b.out)} here")
    cut = [_cut(t, u, where) for t, u in zip(a.inputs, b.inputs, strict=False)]
    same = [c is not None and (_shared(*c) or same_bits(*c)) for c in cut]
    inputs_same = len(b.inputs) >= len(a.inputs) and all(same)
    ins = [0.0 if ok else _relative(*c) if c is not None else float("nan") for c, ok in zip(cut, same, strict=True)]
    return Compared(a.name, True, same_bits(*out), inputs_same, len(b.inputs) - len(a.inputs), _relative(*out),
                    max(ins) if ins and all(x == x for x in ins) else float("nan"), _shapes(b))  # fmt: skip


JUMP = 1e3
"""An op *moves* the row where its output's relative difference is this many times its inputs' (and past
:data:`MOVED`): where a pair is past the line, the first such op is where the bug is, not the first op that parts (a
matrix product's other path, within round-off, comes first in a padded run and changes every op after it a little)."""
MOVED = 1e-4


@dataclasses.dataclass
class Parting:
    """Where two configurations part at the op: the first op not invariant (None where none was found), its shapes in
    each, and the ops seen invariant (their outputs bit for bit the row's) and not; ``moved``: the first op whose
    output differs :data:`JUMP` times more than its inputs (None where none does), with ``jump``, that ratio."""

    op: str | None
    shapes: str = ""
    invariant: list[str] = dataclasses.field(default_factory=list)
    varying: list[str] = dataclasses.field(default_factory=list)
    moved: str | None = None
    jump: float = 0.0
    unaligned: str | None = None
    """The first op whose output covers other positions than the row alone's (its shapes in ``unaligned_shapes``):
    where a pair is past the line and no op moves the row, where a cache holding the wrong positions is read."""
    unaligned_shapes: str = ""
    kernels: str = ""
    """The op's kernel path in each configuration, where torch says it (:mod:`rlx_nb.configurations.kernels`)."""
    order: list[str] = dataclasses.field(default_factory=list)
    """Every op compared, in the row alone's call order (:func:`tree`)."""
    note: str = ""
    """Where no op is named, why (a backend searched module by module: :mod:`rlx_nb.configurations.alone`)."""


def _shared(a: torch.Tensor, b: torch.Tensor) -> bool:
    # The same memory read the same way (a parameter both runs pass as it is): equal without reading it.
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


def _dims(t: torch.Tensor) -> str:
    return "x".join(map(str, t.shape)) or "scalar"


def _shapes(r: Recorded) -> str:
    return ", ".join("x".join(map(str, t.shape)) or "scalar" for t in r.inputs[:3])


def first_parting(alone: tuple[dict, dict], other: tuple[dict, dict], where: dict[str, Any] | None = None) -> Parting:
    """The first op of ``alone``'s order whose inputs in ``other`` (its :class:`Compared`, cut to the row) are bit for
    bit its own and whose output is not; every op whose output aligns, sorted into invariant and varying.  Where no
    op is found so (the ops' own shapes depend on the configuration: a kernel that splits its work by the batch), the
    first module that is: its inputs the row's, its output not."""
    parting = _first(alone[0], other[0])
    parting.moved, parting.jump = _moved(alone[0], other[0])
    if parting.op is None:
        by_module = _first(alone[1], other[1])
        if by_module.op is not None:
            parting.op = f"{by_module.op or '<root>'} (module: its ops' shapes depend on the configuration)"
            parting.shapes = by_module.shapes if "()" not in by_module.shapes else ""
    return parting


def _relative(a: torch.Tensor, b: torch.Tensor | None) -> float:
    if b is None or not a.is_floating_point():
        return 0.0 if b is not None and same_bits(a, b) else float("nan")
    scale = float(a.double().abs().max()) if a.numel() else 0.0
    return float((a.double() - b.double()).abs().max()) / scale if scale > 0 and a.numel() else 0.0


def _moved(alone: dict[str, Recorded], other: dict[str, Compared]) -> tuple[str | None, float]:
    # The first op whose output (cut to the row) differs JUMP times more than any of its inputs, and past MOVED.
    for name in alone:
        c = other.get(name)
        if c is None or not c.aligned or not c.moved > MOVED or c.inputs_moved != c.inputs_moved:
            continue
        if c.moved > JUMP * max(c.inputs_moved, 1e-12):
            return name, c.moved / max(c.inputs_moved, 1e-12)
    return None, 0.0


def _first(alone: dict[str, Recorded], other: dict[str, Compared]) -> Parting:
    found, shapes, invariant, varying, order = None, "", [], [], []
    unaligned, unaligned_shapes = None, ""
    for name, a in alone.items():
        c = other.get(name)
        if c is not None and not c.aligned and unaligned is None:
            unaligned, unaligned_shapes = name, c.shapes
        if c is None or not c.aligned:
            continue
        (invariant if c.same else varying).append(name)
        order.append(name)
        if c.same or found is not None or not c.inputs_same:
            continue
        # (its inputs as the row alone has them: a padded run may pass one more, its mask, after them)
        found = name
        shapes = (f"({_shapes(a)}) alone against ({c.shapes}) here"
                  + (f", with {c.extra} more input(s) (a mask)" if c.extra else ""))  # fmt: skip
    return Parting(found, shapes, invariant, varying, order=order, unaligned=unaligned,
                   unaligned_shapes=unaligned_shapes)  # fmt: skip


def tree(parting: Parting) -> str:
    """The ops compared on the model's module tree, each marked ``=`` (bit for bit the row's), ``~`` (not) or
    ``<< first that parts`` (and the first that moves the row, where one does)."""
    first_module = parting.op.split(" (module", 1)[0] if parting.op and SEPARATOR not in parting.op else None
    lines: list[str] = []
    shown: set[str] = set()
    varying = set(parting.varying)
    for name in parting.order:
        module, _, op = name.partition(SEPARATOR)
        parts = [] if module in ("", "<root>") else module.split(".")
        for depth in range(len(parts) + 1):
            key = ".".join(parts[:depth])
            if key not in shown:
                shown.add(key)
                mark = (
                    "  << first that parts (its ops' shapes depend on the configuration)" if key == first_module else ""
                )
                lines.append("  " * depth + (parts[depth - 1] if depth else "<root>") + mark)
        mark = "<<" if name == parting.op else "~ " if name in varying else "= "
        note = "  first that parts" if name == parting.op else ""
        note += "  the row moves here" if name == parting.moved else ""
        lines.append("  " * (len(parts) + 1) + f"{mark} {op}{note}")
    return "\n".join(lines)


__all__ = ["Compared", "Parting", "Recorded", "compared", "first_parting", "recorded", "tree"]
