"""A standalone repro: one Python file that shows a backend's divergence to whoever maintains the backend.

It imports only torch, numpy and the runtime under test.  It runs the culprit (the op as the model called it, or
the module as ``torch.export`` traced it) in float32 eager, in float64 and on the backend; prints each one's
largest and RMS error against float64 and the backend's as a multiple of eager's; and exits 1 when the backend is
past the line rlx_nb measured (written in the file, with how it was measured).  Inputs that do not fit inline go
in an ``.npz`` beside it (numpy, no pickle).
"""

from __future__ import annotations

import contextlib
import math
import re
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlx_nb._support.decomp_tables import cia_ops_kept
from rlx_nb._support.quiet import quiet
from rlx_nb._support.safe import code_text, docstring, write_new
from rlx_nb._support.tree import flatten
from rlx_nb._version import __version__
from rlx_nb.backends.exported_faults import Faulty
from rlx_nb.errors import InputError, still_interrupted
from rlx_nb.execution.execute import loss_weight
from rlx_nb.execution.results import GRAD_PREFIX
from rlx_nb.localization.capture import Slot
from rlx_nb.localization.culprit import Culprit
from rlx_nb.localization.runners import RUNNERS, runner_source, runtime_of
from rlx_nb.verdict.records import OutputRecord
from rlx_nb.verdict.types import MAX_LIMIT, RMSE_LIMIT

_STD = ("import contextlib", "import io", "import os", "import tempfile")
"""The standard-library imports a runner may need, written with the script's own."""

INLINE_ELEMENTS = 256
"""Inputs of at most this many elements in all are written in the file; larger ones go in the ``.npz``."""


def _function_path(func: Any) -> str | None:
    # An import path under torch that gives ``func`` back (``torch.nn.functional.softmax``, ``torch.Tensor.add``,
    # ``torch._C._nn.avg_pool2d``), or None.
    import importlib

    name = getattr(func, "__name__", "")
    for owner, path in ((torch.nn.functional, "torch.nn.functional"), (torch, "torch"), (torch.Tensor, "torch.Tensor")):
        if getattr(owner, name, None) is func:
            return f"{path}.{name}"
    module = getattr(func, "__module__", "") or ""
    if module.startswith("torch"):
        with contextlib.suppress(Exception):
            if getattr(importlib.import_module(module), name, None) is func:
                return f"{module}.{name}"
    return None


def _value(v: Any) -> str:
    # A call argument as Python source.
    if isinstance(v, Slot):
        return f"t{v.i}"
    if isinstance(v, torch.dtype):
        return str(v)
    if isinstance(v, (list, tuple)):
        items = ", ".join(_value(x) for x in v)
        return f"({items}{',' if len(v) == 1 else ''})" if isinstance(v, tuple) else f"[{items}]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k!r}: {_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, float) and not math.isfinite(v):
        return f"float({str(v)!r})"
    if v is None or isinstance(v, (bool, int, float, str)):
        return repr(v)
    raise TypeError(type(v).__name__)


def _op_source(culprit: Culprit) -> str | None:
    # ``def program(t0, ...)`` calling the op as the model did; None where an argument has no source (a held
    # object, at any depth: _value refuses it).
    args, kwargs = culprit.template
    try:
        kw = {k: v for k, v in kwargs.items() if k != "_stacklevel"}  # (where a warning points: not the numbers)
        call = ", ".join([*(_value(a) for a in args), *(f"{k}={_value(v)}" for k, v in kw.items())])
    except TypeError:
        return None
    where = _function_path(culprit.func)
    if where is None:
        return None
    names = ", ".join(f"t{i}" for i in range(len(culprit.tensors)))
    return f"def program({names}):  # {code_text(culprit.label)}\n    return {where}({call})\n"


def _traced(module: torch.nn.Module, tensors: tuple, name: str, what: str) -> tuple[str, dict[str, torch.Tensor]]:
    # ``def <name>(*weights, *inputs)`` from torch.export's graph (aten ops), and the weights it lifted, in order,
    # by their names in the module.
    try:
        with quiet(), torch.no_grad(), cia_ops_kept():
            # (functional ATen, decomposed no further: an exporter reading the program meets no in-place op on a view)
            ep = torch.export.export(module, tensors, strict=False).run_decompositions({})
    except Exception as exc:
        still_interrupted(exc)
        raise InputError(f"torch.export cannot trace {what}, so no standalone repro can hold it: {exc}") from None
    weights, seen_input = {}, False
    for spec in ep.graph_signature.input_specs:
        if spec.kind.name == "USER_INPUT":
            seen_input = True
            continue
        if seen_input:
            raise InputError(f"torch.export put a weight of {what} after its inputs; no standalone repro written")
        source = ep.constants if spec.target in ep.constants else ep.state_dict
        weights[spec.target] = source[spec.target].detach()
    _tidy(ep.graph_module)
    code = ep.graph_module.code.strip()
    code = re.sub(r";  (?:\w+ = )+None$", "", code, flags=re.M)  # (the graph's own frees)
    code = code.replace("def forward(self, ", f"def {name}(", 1).replace("def forward(self)", f"def {name}()", 1)
    return _names_for(code) + code + "\n", weights


def _names_for(code: str) -> str:
    # What torch.fx's generated code reads from its module's globals, defined for the script.
    needs = [
        ("device(", "device", "torch.device"),
        (r"\binf\b", "inf", "float('inf')"),
        (r"\bnan\b", "nan", "float('nan')"),
    ]
    found = [(name, value) for pattern, name, value in needs if re.search(pattern.replace("(", r"\("), code)]
    defined = f"{', '.join(n for n, _ in found)} = {', '.join(v for _, v in found)}\n" if found else ""
    return ("import operator\n" if "operator." in code else "") + defined


_VIEWS = ("view.default", "reshape.default", "_unsafe_view.default")


def _tidy(gm: torch.fx.GraphModule) -> None:
    # Drop what changes no value, so the program reads short: permutes to the same order, views of views (one view
    # of the first input does), views to the shape the tensor has; then what no output uses.
    def val(n: Any) -> Any:  # (the tensor a node gives; None for a list of them, an unbind's)
        v = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
        return v if isinstance(v, torch.Tensor) else None

    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        target, src = str(node.target), node.args[0] if node.args else None
        if not isinstance(src, torch.fx.Node):
            continue
        same = val(node) is not None and val(src) is not None and tuple(val(node).shape) == tuple(val(src).shape)
        if target.endswith("permute.default") and list(node.args[1]) == list(range(len(node.args[1]))):
            node.replace_all_uses_with(src)
        elif target.endswith(_VIEWS) and same and val(src).is_contiguous():
            node.replace_all_uses_with(src)
        elif target.endswith(_VIEWS) and src.op == "call_function" and str(src.target).endswith(_VIEWS):
            node.args = (src.args[0], *node.args[1:])
    gm.graph.eliminate_dead_code()
    gm.recompile()


def _data(named: dict[str, torch.Tensor], npz: Path) -> tuple[str, bool]:
    # The tensors as source: inline where they are small, else loaded from ``npz`` (written here).
    total = sum(t.numel() for t in named.values())
    if total <= INLINE_ELEMENTS:
        lines = []
        for name, t in named.items():
            values = repr(t.detach().cpu().tolist())  # (float32 values written as the doubles they are: exact)
            lines.append(f"{name} = torch.tensor({values}, dtype={t.dtype}).reshape({tuple(t.shape)})")
        odd = any(t.is_floating_point() and not bool(t.isfinite().all()) for t in named.values())
        return ("nan, inf = float('nan'), float('inf')\n" if odd else "") + "\n".join(lines) + "\n", False
    np.savez(npz, **{name: t.detach().cpu().numpy() for name, t in named.items()})
    return (
        f"T = {{k: torch.from_numpy(v) for k, v in np.load(pathlib.Path(__file__).with_name({npz.name!r})).items()}}\n",
        True,
    )


def _stored(data: dict[str, torch.Tensor], w: torch.Tensor, name: str) -> str:
    # The key of ``w`` in ``data``: an equal tensor already there (the culprit's own weight), else ``name``, added.
    for key, v in data.items():
        if v.shape == w.shape and v.dtype == w.dtype and torch.equal(v, w):
            return key
    data[name] = w
    return name


def _judged_index(culprit: Culprit, record: OutputRecord, weights: list[str]) -> tuple[int, dict[str, torch.Tensor]]:
    # Which output (forward) or which tensor's gradient (backward) the record judged, in the script's order; and
    # each output by its name as rlx_nb named it (its loss weights are seeded by the name and the shape).
    with torch.no_grad():
        out = culprit.adapter(*culprit.tensors)
    leaves = {name: leaf for name, leaf in flatten(out) if isinstance(leaf, torch.Tensor)}
    names = list(leaves)
    name = record.output or ""
    if not culprit.backward:
        if name not in names:
            raise InputError(f"the judged output {name!r} is not among the culprit's outputs {names}")
        return names.index(name), leaves
    grads = [*weights, *(f"input[{i}]" for i in range(len(culprit.tensors)))]
    wanted = name.removeprefix(GRAD_PREFIX)
    if wanted not in grads:
        raise InputError(f"the judged gradient {name!r} is not one the repro computes ({', '.join(grads)})")
    return grads.index(wanted), leaves


def line_of(record: OutputRecord) -> tuple[float, float]:
    """``(largest error, RMS error)`` against float64 past which the whole output is SUSPECT: the line's limits
    times the round-off budget rlx_nb measured for this output."""
    b = record.judgement.budget
    if not (math.isfinite(b.budget_max) and math.isfinite(b.budget_rmse)):
        raise InputError(
            f"{record.backend} on {record.output!r} has no round-off budget (no fp64 reference ran), so there is "
            "no line a standalone repro could check"
        )
    return MAX_LIMIT * b.budget_max, RMSE_LIMIT * b.budget_rmse


_HEAD = """\
{backend} diverges from float64 on {label} ({direction}): a bug, not round-off.

{how}
{shrunk}{attribution}
Needs only torch{needs}; exits 1 past the line. By rlx_nb {version}, torch {torch}.
"""

DOC_WIDTH = 100
"""The longest line of the script's docstring."""

_MAIN = """\
def judged(fn, tensors):  # {judged_what}
{judged_body}
def errors(out, ref):  # largest and RMS error against float64, and non-finite values where float64 has none
    d = (out.detach().cpu().double() - ref).flatten()
    bad, d = int((~d.isfinite() & ref.flatten().isfinite()).sum()), d.nan_to_num(0.0, 0.0, 0.0)
    return d.abs().max().item(), d.square().mean().sqrt().item(), bad

tensors = [*WEIGHTS, *INPUTS]
with torch.set_grad_enabled({backward}):
    ref = judged(program, [t.double() if t.is_floating_point() else t for t in tensors]).detach()
    eager = errors(judged(program, tensors), ref)
    mx, rms, bad = errors(judged(lambda *t: on_backend({backend_fn}, {backend_weights}, t[len(WEIGHTS):]), tensors), ref)
print(f"float32 eager: largest |error| {{eager[0]:.3g}}, RMS {{eager[1]:.3g}} against float64")
print(f"{{BACKEND}}: largest |error| {{mx:.3g}}, RMS {{rms:.3g}}" + (f", {{bad}} non-finite" if bad else "")
      + (f"; {{mx / eager[0]:.3g}}x and {{rms / eager[1]:.3g}}x eager's" if eager[0] and eager[1] else "; eager is exact"))
past = mx > LINE_MAX or rms > LINE_RMS or bad > 0
print(("PAST" if past else "within") + f" the line (largest {{LINE_MAX:.3g}}, RMS {{LINE_RMS:.3g}}): " + ("a bug" if past else "round-off"))
raise SystemExit(1 if past else 0)
"""

_LEAVES = "[o for o in torch.utils._pytree.tree_leaves(fn(*tensors)) if isinstance(o, torch.Tensor)]"
_FORWARD = f"    return {_LEAVES}[{{k}}]\n"
_BACKWARD = (
    "    tensors = [t.detach().requires_grad_(t.is_floating_point()) for t in tensors]\n"
    f"    loss = sum((o * w.to(o.dtype)).sum() for o, w in zip({_LEAVES}, COTANGENTS) if o.requires_grad)\n"
    "    return torch.autograd.grad(loss, tensors[{k}])[0]\n"
)


def write_standalone(
    path: Path, culprit: Culprit, record: OutputRecord, *, shrunk: str = "", attribution: str = ""
) -> Path:
    """Write the repro of ``culprit`` (judged ``record``, whose line the script checks) to ``path`` (a ``.py``
    file; an ``.npz`` beside it where the inputs do not fit inline).  Returns the script's path."""
    runtime, carries = runtime_of(culprit.backend)
    if culprit.backward and not RUNNERS[runtime].differentiable:
        raise InputError(f"{culprit.backend} runs no backward, so a backward repro cannot run on it")
    line_max, line_rms = line_of(record)
    op = _op_source(culprit) if culprit.kind == "op" else None
    weights: dict[str, torch.Tensor] = {}
    if op is not None:
        program = op
    else:
        program, weights = _traced(culprit.adapter, culprit.tensors, "program", f"the culprit {culprit.label!r}")
    data = {f"w{i}": w for i, w in enumerate(weights.values())}
    backend_fn, backend_weights = "program", "t[:len(WEIGHTS)]"
    if carries:
        carried = getattr(culprit.lent, "carries", None) or culprit.lent
        if carried is None:
            raise InputError(f"backend {culprit.backend!r} is not known here")
        traced, theirs = _traced(Faulty(culprit.adapter, carried.fn, carried.name), culprit.tensors,
                                 "backend_program", f"{culprit.backend}'s computation")  # fmt: skip
        program += "\n" + traced
        backend_fn, backend_weights = "backend_program", "BACKEND_WEIGHTS"
        refs = [_stored(data, w, f"v{i}") for i, w in enumerate(theirs.values())]
    k, outs = _judged_index(culprit, record, list(weights))
    inputs = {f"x{i}": x for i, x in enumerate(culprit.tensors)}
    data.update(inputs)
    if culprit.backward:
        for i, (name, o) in enumerate(outs.items()):
            data[f"c{i}"] = torch.from_numpy(np.array(loss_weight(name, tuple(o.shape))))
    path = Path(path)
    source, on_disk = _data(data, path.with_suffix(".npz"))
    lists = {"WEIGHTS": [f"w{i}" for i in range(len(weights))], "INPUTS": list(inputs)}
    if carries:
        lists["BACKEND_WEIGHTS"] = refs
    if culprit.backward:
        lists["COTANGENTS"] = [f"c{i}" for i in range(len(outs))]
    named = (lambda k: f"T[{k!r}]") if on_disk else (lambda k: k)  # (the tensors by name, or from T)
    source += f"{', '.join(lists)} = {', '.join('[' + ', '.join(map(named, v)) + ']' for v in lists.values())}\n"
    imports, runner = runner_source(runtime)
    text = _head(culprit, record, imports + ("import numpy\n" if on_disk else ""), shrunk, attribution)
    std = {*(["pathlib"] if on_disk else []), *(m.split()[1] for m in imports.splitlines() if m in _STD)}
    third = [m for m in imports.splitlines() if m and m not in _STD]
    text += f"import {', '.join(sorted(std))}\n\n" if std else ""  # (the standard library's, on one line)
    numpy = on_disk and "import numpy as np" not in third
    text += ("import numpy as np\n" if numpy else "") + "import torch\n" + "".join(f"{m}\n" for m in third)
    text += (f"\nBACKEND, LINE_MAX, LINE_RMS = {culprit.backend!r}, {float(f'{line_max:.6g}')!r}, "
             f"{float(f'{line_rms:.6g}')!r}  # (see above)\n")  # fmt: skip
    text += source + "\n" + program + "\n" + runner + "\n"
    what = f"the gradient rlx_nb judged: of tensor {k}" if culprit.backward else f"output {k}, the one rlx_nb judged"
    text += _MAIN.format(
        judged_what=what,
        judged_body=(_BACKWARD if culprit.backward else _FORWARD).format(k=k),
        backward=culprit.backward,
        backend_fn=backend_fn,
        backend_weights=backend_weights,
    )
    _check_source(text, culprit)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not on_disk:  # (an .npz an earlier repro left under this name is not this one's)
        path.with_suffix(".npz").unlink(missing_ok=True)
    write_new(path, text)
    return path


def _check_source(text: str, culprit: Culprit) -> None:
    # The script compiles: every string from outside went in through repr() or code_text (a test feeds hostile
    # names), and a failure here says so instead of leaving a script that only "does not reproduce".
    try:
        compile(text, "repro.py", "exec", dont_inherit=True)
    except SyntaxError as exc:
        raise InputError(
            f"the repro of {culprit.backend} on {culprit.label!r} does not compile ({exc.msg}, line {exc.lineno}); "
            "not written: please report it to rlx_nb"
        ) from None


def _head(culprit: Culprit, record: OutputRecord, imports: str, shrunk: str, attribution: str) -> str:
    needs = sorted({m.split()[1].split(".")[0] for m in imports.splitlines() if m.startswith(("import ", "from "))}
                   - {"contextlib", "io", "os", "tempfile"})  # fmt: skip
    text = _HEAD.format(
        backend=code_text(culprit.backend),
        label=code_text(culprit.label),
        direction="its gradient" if culprit.backward else "forward",
        how=_how(record),
        shrunk=f"{shrunk} " if shrunk else "",
        attribution=f"{attribution}" if attribution else "",
        needs="".join(f", {n}" for n in needs),
        version=__version__,
        torch=torch.__version__,
    )
    wrapped = [textwrap.fill(line, DOC_WIDTH, break_on_hyphens=False) if line else "" for line in text.splitlines()]
    return docstring("\n".join(wrapped) + "\n") + "\n"


def _how(record: OutputRecord) -> str:
    # Two lines: how the line was measured.
    return (
        f"LINE_MAX, LINE_RMS: {MAX_LIMIT:g}x / {RMSE_LIMIT:g}x the round-off budget rlx_nb measured for this output's "
        f"largest / RMS error (float32 eager's, with room for chance); rlx_nb read it at {record.judgement.line:.3g}x."
    )


__all__ = ["INLINE_ELEMENTS", "line_of", "write_standalone"]
