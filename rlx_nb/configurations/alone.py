"""Where a backend's configurations part, for a backend whose run records no op (a compiler, an exported runtime).

The oracle's ops are recorded as they run (:mod:`rlx_nb.configurations.ops`); a backend that compiles or converts the
model runs its own kernels (Inductor's generated code, a runtime's), which no dispatch mode sees.  So each leaf module
is run *alone* through the backend, in both configurations, on the same bits of the row: its inputs as the oracle
gave them in the configuration's run, with the row's part replaced by what the row alone gave it (so the two calls
differ only in what else is in the batch).  The first leaf module, in the row's call order, whose row of output is not
bit for bit the same is where the backend's configurations part: named with its shapes in each, and the kernel path
the backend took for it (the kernels Inductor generated, the library kernels MKL and oneDNN report).  Where no module
alone parts, the backend parts only across modules (what it fuses or converts together), and that is said.

Only the batch and position configurations are searched so (a padded row's tokens are not one slice of the batch).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

from rlx_nb.changes.ops import SEPARATOR
from rlx_nb.configurations import configs as cf
from rlx_nb.configurations.ops import Parting, _dims
from rlx_nb.errors import describe_error, still_interrupted
from rlx_nb.numerics.device import same_bits

_KERNELS = re.compile(r"extern_kernels\.\w+|cpp_fused_\w+|torch\.ops\.aten\.\w+")


def _leaf_calls(model: torch.nn.Module, run: Callable[[torch.nn.Module], Any]) -> list[tuple[str, tuple]]:
    # Each leaf module's calls in ``run(model)`` (the oracle's), in order: its name and its positional inputs.
    calls: list[tuple[str, tuple]] = []
    handles = []
    for name, module in model.named_modules():
        if name and not any(True for _ in module.children()):

            def hook(mod, args, name=name):
                calls.append((name, tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)))

            handles.append(module.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            run(model)
    finally:
        for h in handles:
            h.remove()
    return calls


def _spliced(theirs: Any, mine: Any, at: int, size: int) -> Any:
    # The configuration's input with the row's part replaced by the row alone's (None where they do not align).
    if not isinstance(theirs, torch.Tensor) or not isinstance(mine, torch.Tensor):
        return mine if theirs == mine else None
    if tuple(theirs.shape) == tuple(mine.shape):
        return mine if same_bits(theirs, mine) else None  # (what is not per row must be the same in both)
    if theirs.dim() != mine.dim() or theirs.shape[1:] != mine.shape[1:] or theirs.shape[0] != size * mine.shape[0]:
        return None
    out = theirs.clone()
    k = mine.shape[0]
    out[at * k : (at + 1) * k] = mine
    return out


def _backend_path(fn: Callable[[], Any]) -> str:
    # What the backend ran for one call: the kernels Inductor generated for it (read from the code it wrote, as text),
    # and the library kernels MKL and oneDNN say they ran.
    from torch._inductor.codecache import PyCodeCache

    from rlx_nb.configurations.kernels import library_path

    known = len(PyCodeCache.modules)
    libraries = library_path(fn)
    generated: list[str] = []
    for module in PyCodeCache.modules[known:]:
        try:
            with open(module.__file__, encoding="utf-8") as f:  # (the generated code read as text, never run here)
                generated += _KERNELS.findall(f.read())
        except (OSError, TypeError, AttributeError):
            continue
    kernels = list(dict.fromkeys(generated))
    return " -> ".join([*(f"Inductor {k}" for k in kernels), *([libraries] if libraries else [])])


def first_module_alone(base: torch.nn.Module, given: cf.Inputs, config: cf.Config, backend: Any) -> Parting:
    """The first leaf module that parts ``config`` from the row alone when run alone through ``backend`` (module
    docstring)."""
    if config.kind not in ("batch", "position"):
        return Parting(
            None,
            note=f"{backend.name}'s ops are not recorded; a {config.kind} configuration is not searched "
            "module by module (its row is not one slice of the batch)",
        )
    at, size = config.where["at"], config.where["size"]
    row = given.row(config.row)
    named = cf._with_others(given, config.row, size, at)
    alone = _leaf_calls(base, lambda m: given.call(m, row))
    there = _leaf_calls(base, lambda m: given.call(m, named))
    modules = dict(base.named_modules())
    order, invariant, failed = [], [], []
    for (name, mine), (their_name, theirs) in zip(alone, there, strict=False):
        if name != their_name or len(mine) != len(theirs):
            break  # (the two runs call other modules from here: the search stops where they stop aligning)
        spliced = tuple(_spliced(t, m, at, size) for t, m in zip(theirs, mine, strict=True))
        if any(s is None for s in spliced) or not any(isinstance(m, torch.Tensor) for m in mine):
            continue
        module = modules[name]
        label = f"{name}{SEPARATOR}{type(module).__name__} alone on {backend.name}"  # (as the oracle's ops are named)
        order.append(label)
        try:
            with torch.no_grad():
                got_alone = list(cf.outputs(backend.fn(module, mine)).values())
                got_there = list(cf.outputs(backend.fn(module, spliced)).values())
        except Exception as exc:  # (a module the backend cannot run alone, e.g. one it compiles to nothing: passed)
            still_interrupted(exc)
            failed.append(f"{name} ({describe_error(exc)[:80]})")
            continue
        cut = [cf.aligned(t, a.shape, at=at, size=size) for a, t in zip(got_alone, got_there, strict=False)]
        if all(c is not None and same_bits(a, c) for a, c in zip(got_alone, cut, strict=False)):
            invariant.append(label)
            continue
        shapes = " against ".join(", ".join(_dims(t) for t in args if isinstance(t, torch.Tensor))
                                  for args in (mine, spliced))  # fmt: skip
        mine_path = _backend_path(lambda m=module, a=mine: backend.fn(m, a))
        their_path = _backend_path(lambda m=module, a=spliced: backend.fn(m, a))
        kernels = mine_path if mine_path == their_path else f"{mine_path or '?'} alone against {their_path or '?'} here"
        return Parting(label, shapes=shapes, invariant=invariant, varying=[label], kernels=kernels, order=order)
    passed = f"; {len(failed)} module(s) it could not run alone: {', '.join(failed[:3])}" if failed else ""
    return Parting(None, note=f"no module alone parts on {backend.name}: it parts only across modules (what it "
                   f"compiles or converts together){passed}", invariant=invariant, order=order)  # fmt: skip


__all__ = ["first_module_alone"]
