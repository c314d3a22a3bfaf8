"""Localize: from a suspect output down to the module and the operator that introduced the error.

How
---
1. Run the model eagerly on the oracle with hooks and capture every module's
   inputs (first call), in execution order.
2. **Local error**: run one module alone on the candidate backend, fed the
   oracle's captured inputs, and judge its outputs with the engine's verdict
   (oracle vs backend vs a float64 run of the same module on the same
   inputs).  It is what this module introduces.
3. **Hierarchical descent**: check the top-level children first and descend
   only into those beyond budget, so the number of backend preparations
   (compiles, exports) grows with depth, not with the number of modules.
4. **Culprit**: the first suspect module (in execution order) none of whose
   children is suspect.  Below it, the torch functions its forward calls
   are recorded and each is checked alone the same way, so ``F.softmax``
   inside an attention block can be named.
5. **Propagated error**: where the backend runs the model eagerly (hooks
   fire), each module's output in the full run is compared too; the
   amplification is propagated over local.
6. ``backward=True`` judges each module's backward instead (gradients of its
   parameters and inputs for a fixed random cotangent).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch.overrides import TorchFunctionMode

from rlx_nb.backends import ORACLE, REFERENCE, get_backend
from rlx_nb.compare import OutputRecord, compare, compare_leaf
from rlx_nb.errors import InputError
from rlx_nb.frames import worst_record
from rlx_nb.prepare import KeywordModule, normalize_inputs, prepare_model
from rlx_nb.progress import bar
from rlx_nb.results import GRAD_PREFIX, to_leaf
from rlx_nb.run import run
from rlx_nb.tree import flatten
from rlx_nb.verdict import SUSPECT, VERDICT_ERROR

LOCALIZE_COLUMNS = [
    "order",
    "name",
    "kind",
    "depth",
    "verdict",
    "output",
    "local_ratio_rmse",
    "local_ratio_max",
    "local_excess",
    "propagated_ratio_rmse",
    "propagated_ratio_max",
    "propagated_excess",
    "amplification",
    "reason",
    "notes",
]
# Pure data movement: exact on every backend, not worth a preparation each.
_SKIP_OPS = {
    "view",
    "reshape",
    "permute",
    "transpose",
    "contiguous",
    "__getitem__",
    "flatten",
    "unflatten",
    "squeeze",
    "unsqueeze",
    "expand",
    "expand_as",
    "chunk",
    "split",
    "unbind",
    "t",
    "movedim",
    "clone",
    "detach",
    "to",
    "float",
    "double",
    "type_as",
    "__get__",
    "size",
    "dim",
    "numel",
    "stride",
    "narrow",
    "select",
    "split_with_sizes",
}


# -- capturing calls and replaying them ---------------------------------------------------------


def _split(obj: Any) -> tuple[Any, list[torch.Tensor]]:
    # A template with tensors replaced by their position, and the tensors.
    tensors: list[torch.Tensor] = []

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            tensors.append(x.detach().clone())
            return _Slot(len(tensors) - 1)
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(walk(v) for v in x) if not hasattr(x, "_fields") else type(x)(*(walk(v) for v in x))
        return x

    return walk(obj), tensors


@dataclasses.dataclass(frozen=True)
class _Slot:
    i: int


def _fill(template: Any, tensors: tuple) -> Any:
    if isinstance(template, _Slot):
        return tensors[template.i]
    if isinstance(template, dict):
        return {k: _fill(v, tensors) for k, v in template.items()}
    if isinstance(template, (list, tuple)):
        items = [_fill(v, tensors) for v in template]
        return type(template)(*items) if hasattr(template, "_fields") else type(template)(items)
    return template


class CallModule(torch.nn.Module):
    """Replays one captured call ``module(*args, **kwargs)`` with the tensors as positional inputs."""

    def __init__(self, module: torch.nn.Module, template: tuple[Any, Any]) -> None:
        super().__init__()
        self.module = module
        self.template = template

    def forward(self, *tensors: torch.Tensor) -> Any:
        args, kwargs = _fill(self.template, tensors)
        return self.module(*args, **kwargs)


class OpModule(torch.nn.Module):
    """Replays one captured torch function call ``func(*args, **kwargs)`` with the tensors as inputs."""

    def __init__(self, func: Callable, template: tuple[Any, Any]) -> None:
        super().__init__()
        self.func = func
        self.template = template

    def forward(self, *tensors: torch.Tensor) -> Any:
        args, kwargs = _fill(self.template, tensors)
        return self.func(*args, **kwargs)


@dataclasses.dataclass
class Call:
    """One module's first call in the oracle run."""

    name: str
    order: int
    depth: int
    template: tuple[Any, Any]
    tensors: list[torch.Tensor]
    children: list[str] = dataclasses.field(default_factory=list)


def capture_calls(base: torch.nn.Module, args: tuple) -> dict[str, Call]:
    """Every module's first call (inputs as templates + tensors), in execution order."""
    calls: dict[str, Call] = {}
    handles = []

    def pre(name: str):
        def hook(module, a, kw):
            if name not in calls:
                template, tensors = _split((a, kw))
                calls[name] = Call(name, len(calls), 0, template, tensors)

        return hook

    for name, module in base.named_modules():
        handles.append(module.register_forward_pre_hook(pre(name), with_kwargs=True))
    try:
        with torch.no_grad():
            base(*copy.deepcopy(args))
    finally:
        for h in handles:
            h.remove()
    for name, call in calls.items():
        if name:
            parent = name.rpartition(".")[0]
            while parent and parent not in calls:  # e.g. a ModuleList, never called itself
                parent = parent.rpartition(".")[0]
            calls[parent].children.append(name)
            call.depth = calls[parent].depth + 1
    return calls


def _float_inputs_require_grad(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors]


# -- the localization itself ----------------------------------------------------------------------


@dataclasses.dataclass
class _Check:
    record: OutputRecord
    suspect: bool
    results: Any = None


class Localization:
    """Where along the model a backend's error is born.

    Attributes
    ----------
    frame : pandas.DataFrame
        One row per module (then op) checked, in execution order.
    culprit : str or None
        ``"<module>"`` or ``"<module> :: <op>"`` of the first place whose own error is beyond
        round-off; None when everything checked is within it.
    culprit_module, culprit_op : str or None
    preparations : int
        How many times the backend prepared (ran, compiled or exported) a module or op.
    """

    def __init__(
        self,
        backend: str,
        backward: bool,
        rows: list[dict],
        culprit_module: str | None,
        culprit_op: str | None,
        preparations: int,
        repro_case: dict | None,
    ) -> None:
        self.backend = backend
        self.backward = backward
        self.frame = (
            pd.DataFrame(rows, columns=LOCALIZE_COLUMNS)
            .sort_values(["kind", "order"], key=_kind_order)
            .reset_index(drop=True)
        )
        self.culprit_module = culprit_module
        self.culprit_op = culprit_op
        self.preparations = preparations
        self._repro_case = repro_case
        self._checks: dict[str, tuple[Any, str | None]] = {}

    def arrays(self, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """``(oracle, backend, fp64)`` of the worst output of one checked module or op, run alone."""
        if name not in self._checks:
            raise InputError(f"{name!r} was not checked; checked: {', '.join(self._checks)}")
        results, output = self._checks[name]
        if results is None:
            raise InputError(
                f"the arrays of {name!r} were not kept: it was within round-off and its outputs take "
                f"{output / 1e6:.0f} MB (above keep_arrays='auto''s {KEEP_ARRAYS_BYTES / 1e6:.0f} MB); "
                "run localize(..., keep_arrays='all') to keep every checked module's arrays"
            )
        run = results.candidates[self.backend]
        if output is None or output not in run.outputs:
            raise InputError(f"{name!r} produced no comparable output on {self.backend}")
        ref = results.reference.outputs.get(output)
        return (results.oracle.outputs[output].value, run.outputs[output].value, ref.value if ref is not None else None)

    def plot_heatmap(self, name: str, **kwargs: Any):
        """The error heatmap of one checked module's (or op's) worst output, run alone on the backend."""
        from rlx_nb.plotting import plot_heatmap

        o, b, r = self.arrays(name)
        kwargs.setdefault("title", f"{self.backend} · {name} (alone)")
        if kwargs.get("metric") == "budget":
            kwargs.setdefault("budget", self._budget(name))
        return plot_heatmap(o, b, r, **kwargs)

    def _budget(self, name: str) -> float:
        results, output = self._checks[name]
        recs = [r for r in compare(results) if r.output == output]
        return recs[0].budget_rmse if recs else float("nan")

    @property
    def culprit(self) -> str | None:
        if self.culprit_module is None:
            return None
        label = self.culprit_module or "<root>"
        return f"{label} :: {self.culprit_op}" if self.culprit_op else label

    def __repr__(self) -> str:
        what = "backward" if self.backward else "forward"
        return (
            f"<Localization {self.backend} ({what}): culprit={self.culprit!r}, "
            f"{len(self.frame)} checks, {self.preparations} preparations>"
        )

    def _repr_html_(self) -> str:
        head = (
            f"<p><b>{self.backend}</b> ({'backward' if self.backward else 'forward'}): culprit "
            f"<b>{self.culprit or 'none — every module within round-off'}</b>; "
            f"{self.preparations} backend preparations.</p>"
        )
        return head + self.frame.to_html(index=False, float_format=lambda v: f"{v:.3g}")

    def plot(self, *, ax=None):
        """Local vs propagated error along the model's depth (see :func:`rlx_nb.plotting.plot_localization`)."""
        from rlx_nb.plotting import plot_localization

        return plot_localization(self.frame, ax=ax, title=f"{self.backend}: where the error is born")

    def repro(self, path: str | Path) -> Path:
        """Write a standalone reproduction of the culprit op to ``path`` (a directory).

        Files: ``inputs.npz`` (numpy, loaded with ``allow_pickle=False``),
        ``case.json`` (the function, the argument structure, the backend) and
        ``repro.py``, which rebuilds the call, runs it on the CPU oracle and on
        the backend with :func:`rlx_nb.backend_divergence`, and prints the
        verdict lines.  Returns the script's path.
        """
        if self._repro_case is None:
            raise InputError(
                "no culprit op to reproduce: "
                + (
                    "nothing is beyond round-off"
                    if self.culprit_module is None
                    else f"the culprit {self.culprit!r} was not narrowed to a torch function"
                )
            )
        return write_repro(Path(path), **self._repro_case)


def _kind_order(col: pd.Series) -> pd.Series:
    return col.map({"module": 0, "op": 1}) if col.name == "kind" else col


def localize(
    model: Any,
    inputs: Any,
    *,
    backend: str,
    params: dict[str, torch.Tensor] | None = None,
    backward: bool = False,
    ops: bool = True,
    propagated: bool = True,
    keep_arrays: str = "auto",
) -> Localization:
    """Find the module (and the torch function) where ``backend``'s error is born.

    Parameters
    ----------
    model, inputs, params
        As for :func:`rlx_nb.backend_divergence`.
    backend : str
        The candidate backend to localize (registered, compiled or eager).
    backward : bool
        Judge each module's backward instead of its forward.
    ops : bool
        Below the culprit module, check each torch function it calls.
    propagated : bool
        Also compare each module's output in a full run on the backend, where
        the backend runs eagerly (hooks fire); ignored otherwise.
    keep_arrays : {"auto", "all"}
        Which checked modules keep their (oracle, backend, fp64) arrays for
        :meth:`Localization.arrays` and heatmaps: ``"all"``, or ``"auto"``
        (default): every SUSPECT one, and round-off ones whose arrays take at
        most :data:`KEEP_ARRAYS_BYTES` (so localizing LLM-sized activations does
        not hold every module's outputs three times over).

    Examples
    --------
    >>> from rlx_nb import demo, localize
    >>> model, inputs = demo.layered(fault_layer=1)
    >>> loc = localize(model, inputs, backend="fault:softmax-row")
    >>> loc.culprit
    'blocks.1.attn :: F.softmax'
    """
    if keep_arrays not in ("auto", "all"):
        raise InputError(f"keep_arrays must be 'auto' or 'all', got {keep_arrays!r}")
    cand = get_backend(backend)
    if backend in (ORACLE, REFERENCE):
        raise InputError(f"{backend!r} is the {'oracle' if backend == ORACLE else 'reference'}; localize a candidate")
    reason = cand.unavailable_reason()
    if reason:
        raise InputError(f"backend {backend!r} is not available here: {reason}")
    if backward and not cand.differentiable:
        raise InputError(f"backend {backend!r} cannot differentiate, so its backward cannot be localized")
    args, keys = normalize_inputs(inputs)
    base = prepare_model(model, params, keys)
    calls = capture_calls(base, args)
    named = dict(base.named_modules())
    state = _State(backend, backward, calls, named)
    state.keep_arrays = keep_arrays
    state.shown = bar(f"rlx_nb localize {backend}", unit="check")
    try:
        culprit, culprit_op, repro = _descend(state, calls, ops)
        if propagated and not backward:
            state.shown.set_postfix_str("propagated error (full run)")
            state.propagate(base, args)
    finally:
        state.shown.close()
    loc = Localization(
        backend,
        backward,
        state.rows,
        _user(culprit, keys) if culprit is not None else None,
        culprit_op,
        state.preparations,
        repro,
    )
    loc._checks = state.checks
    return loc


def _descend(state: _State, calls: dict[str, Call], ops: bool) -> tuple[str | None, str | None, Any]:
    # Hierarchical descent from the root's children to the innermost SUSPECT module, then its ops.
    root = next(iter(calls))
    frontier = calls[root].children or [root]
    suspects = state.visit(frontier)
    if not suspects and frontier != [root]:
        # Nothing below is beyond budget: the error may be born in the root's own code.
        suspects = state.visit([root])
    culprit = state.innermost(suspects)
    culprit_op = repro = None
    if culprit is not None and ops:
        state.shown.set_postfix_str(f"ops of {culprit}")
        culprit_op, repro = state.ops(culprit)
    return culprit, culprit_op, repro


def _user(name: str, keys: list[str] | None) -> str:
    # Our keyword adapter adds a "model." level; users never see it.
    if keys is not None:
        return "" if name in ("", "model") else name.removeprefix("model.")
    return name


KEEP_ARRAYS_BYTES = 256e6
"""keep_arrays="auto" keeps a round-off module's arrays only when they take at most this many bytes."""


def _nbytes(results: Any) -> int:
    runs = [results.oracle, results.reference, *results.candidates.values()]
    return sum(leaf.nbytes for run in runs for leaf in run.outputs.values())


class _State:
    def __init__(self, backend: str, backward: bool, calls: dict[str, Call], named: dict[str, torch.nn.Module]):
        self.backend, self.backward, self.calls, self.named = backend, backward, calls, named
        self.keep_arrays = "auto"
        self.rows: list[dict] = []
        self.checks: dict[str, tuple[Any, str | None]] = {}
        self.preparations = 0
        self.keyword = isinstance(named.get(""), KeywordModule)
        self.shown: Any = bar("", enabled=False)

    def _judge(self, adapter: torch.nn.Module, tensors: list[torch.Tensor]) -> _Check:
        inputs = tuple(_float_inputs_require_grad(tensors)) if self.backward else tuple(tensors)
        self.preparations += 1
        self.shown.update()
        # progress=False: the localize bar counts these checks; no bar per check inside it.
        results = run(adapter, inputs, backends=[self.backend], backward=self.backward, progress=False)
        records = compare(results, progress=False)
        if self.backward:
            # Judge the module's backward; keep the forward records only if it produced no gradients.
            grads = [r for r in records if (r.output or "").startswith(GRAD_PREFIX) or r.output is None]
            records = grads or records
        worst = worst_record(records)
        return _Check(worst, worst.verdict == SUSPECT, results)

    def _row(self, name: str, kind: str, order: int, depth: int, check: _Check) -> None:
        r = check.record
        if check.results is not None:
            size = _nbytes(check.results)
            if self.keep_arrays == "all" or check.suspect or size <= KEEP_ARRAYS_BYTES:
                self.checks[name] = (check.results, r.output)
            else:  # keep_arrays="auto": a large module within round-off keeps its record, not its arrays
                self.checks[name] = (None, size)
        self.rows.append(
            {
                "order": order,
                "name": name,
                "kind": kind,
                "depth": depth,
                "verdict": r.verdict,
                "output": r.output,
                "local_ratio_rmse": r.ratio_rmse,
                "local_ratio_max": r.ratio_max,
                "local_excess": r.excess,
                "propagated_ratio_rmse": math.nan,
                "propagated_ratio_max": math.nan,
                "propagated_excess": math.nan,
                "amplification": math.nan,
                "reason": r.reason,
                "notes": "; ".join(check.results.candidates[self.backend].notes) if check.results is not None else "",
            }
        )

    def visit(self, names: list[str]) -> list[str]:
        suspects = []
        for name in sorted(names, key=lambda n: self.calls[n].order):
            call = self.calls[name]
            try:
                check = self._judge(CallModule(self.named[name], call.template), call.tensors)
            except InputError as exc:  # the module cannot run on its own (e.g. needs state)
                rec = OutputRecord(
                    self.backend, None, -1, "forward", VERDICT_ERROR, VERDICT_ERROR, None, str(exc), "float32"
                )
                check = _Check(rec, False)
            self._row(self._label(name), "module", call.order, call.depth, check)
            if check.suspect:
                suspects.append(name)
        for name in list(suspects):
            children = self.calls[name].children
            if children:
                suspects.extend(self.visit(children))
        return suspects

    def _label(self, name: str) -> str:
        return _user(name, [] if self.keyword else None) or "<root>"

    def innermost(self, suspects: list[str]) -> str | None:
        inner = [s for s in suspects if not any(c in suspects for c in self.calls[s].children)]
        return min(inner, key=lambda s: self.calls[s].order) if inner else None

    def ops(self, name: str) -> tuple[str | None, dict | None]:
        call = self.calls[name]
        recorder = _RecordOps()
        module = copy.deepcopy(self.named[name])
        # Only the culprit's own code: its children were judged within budget already.
        handles = []
        for child_name in call.children:
            child = module.get_submodule(child_name[len(name) + 1 :] if name else child_name)
            handles.append(child.register_forward_pre_hook(lambda *_: recorder.enter(1)))
            handles.append(child.register_forward_hook(lambda *_: recorder.enter(-1)))
        try:
            with torch.no_grad(), recorder:
                CallModule(module, call.template)(*[t.clone() for t in call.tensors])
        finally:
            for h in handles:
                h.remove()
        culprit = repro = None
        for i, (label, func, template, tensors) in enumerate(recorder.ops):
            try:
                check = self._judge(OpModule(func, template), tensors)
            except InputError:
                continue  # an op that cannot run on its own

            self._row(f"{self._label(name)} :: {label}", "op", i, call.depth + 1, check)
            if check.suspect and culprit is None:
                culprit = label
                repro = {
                    "func": func,
                    "label": label,
                    "template": template,
                    "tensors": tensors,
                    "backend": self.backend,
                    "backward": self.backward,
                }
                break
        return culprit, repro

    def propagate(self, base: torch.nn.Module, args: tuple) -> None:
        backend = get_backend(self.backend)
        if not backend.hookable:
            return  # compiled/exported: hooks would see tracing, not the backend; local errors only
        outs = {
            who: _full_run_outputs(b, base, args)
            for who, b in (("oracle", get_backend(ORACLE)), ("reference", get_backend(REFERENCE)), ("backend", backend))
        }
        if not outs["backend"]:
            return  # compiled/exported: hooks did not fire, only local errors are known
        for row in self.rows:
            if row["kind"] != "module":
                continue
            name = next((n for n in self.calls if self._label(n) == row["name"]), None)
            o, r, b = (outs[k].get(name) for k in ("oracle", "reference", "backend"))
            if o is None or b is None or r is None or not o.is_array:
                continue
            rec = compare_leaf(
                o,
                b,
                r,
                rule="budget",
                backend=self.backend,
                output=row["name"],
                output_index=0,
                kind="forward",
                compute_dtype=backend.compute_dtype,
                tol_rel=2e-3,
            )
            row["propagated_ratio_rmse"], row["propagated_ratio_max"] = rec.ratio_rmse, rec.ratio_max
            row["propagated_excess"] = rec.excess
            local = row["local_excess"]
            row["amplification"] = rec.excess / local if local and local == local and local > 0 else math.nan


def _full_run_outputs(backend, base: torch.nn.Module, args: tuple) -> dict[str, Any]:
    model = copy.deepcopy(base)
    captured: dict[str, Any] = {}

    def post(name: str):
        def hook(module, a, out):
            leaves = [v for _, v in flatten(out) if isinstance(v, torch.Tensor)]
            if name not in captured and leaves:
                captured[name] = to_leaf(leaves[0])

        return hook

    handles = [m.register_forward_hook(post(n)) for n, m in model.named_modules()]
    try:
        with torch.no_grad():
            backend.fn(model, copy.deepcopy(args))
    except Exception:
        return {}
    finally:
        for h in handles:
            h.remove()
    return captured


class _RecordOps(TorchFunctionMode):
    """Record every torch function call with a floating tensor result (data movement skipped)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, Callable, Any, list[torch.Tensor]]] = []
        self.inside_children = 0

    def enter(self, by: int) -> None:
        self.inside_children += by

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", str(func))
        if (
            not self.inside_children
            and isinstance(out, torch.Tensor)
            and out.is_floating_point()
            and name not in _SKIP_OPS
            and not name.endswith("_")
        ):
            template, tensors = _split((args, kwargs))
            self.ops.append((_op_label(func), func, template, tensors))
        return out


def _op_label(func: Callable) -> str:
    name = getattr(func, "__name__", str(func))
    module = getattr(func, "__module__", "") or ""
    if module == "torch.nn.functional":
        return f"F.{name}"
    qual = getattr(func, "__qualname__", name)
    if qual.startswith("TensorBase.") or qual.startswith("Tensor."):
        return "Tensor." + name
    return f"torch.{name}"


def _resolve_func(label: str) -> str:
    # The import path the repro script uses to find the function again.
    kind, _, name = label.partition(".")
    return {"F": "torch.nn.functional", "Tensor": "torch.Tensor", "torch": "torch"}[kind] + "." + name


_SCRIPT = '''\
"""Standalone reproduction written by rlx_nb.localize: {label} on {backend} vs the CPU oracle."""

import json
import pathlib
import sys

import numpy as np
import torch

import rlx_nb
from rlx_nb.localize import OpModule, resolve_function, template_from_json

here = pathlib.Path(__file__).parent
case = json.loads((here / "case.json").read_text())
with np.load(here / "inputs.npz", allow_pickle=False) as data:
    tensors = [torch.from_numpy(data[f"t{{i}}"]) for i in range(len(data.files))]
func = resolve_function(case["function"])
op = OpModule(func, template_from_json(case["template"]))
if case["backward"]:
    tensors = [t.requires_grad_(t.is_floating_point()) for t in tensors]
report = rlx_nb.backend_divergence(op, tuple(tensors), backends=[case["backend"]], backward=case["backward"],
                                   label=case["label"])
print(report)
sys.exit(1 if report.any_suspect else 0)
'''


def write_repro(
    path: Path, *, func: Callable, label: str, template: Any, tensors: list[torch.Tensor], backend: str, backward: bool
) -> Path:
    """Write ``inputs.npz``, ``case.json`` and ``repro.py`` under ``path``; return the script."""
    path.mkdir(parents=True, exist_ok=True)
    arrays = {f"t{i}": t.detach().cpu().numpy() for i, t in enumerate(tensors)}
    np.savez(path / "inputs.npz", **arrays)
    case = {
        "format": "rlx_nb.repro/1",
        "function": _resolve_func(label),
        "label": label,
        "backend": backend,
        "backward": backward,
        "template": template_to_json(template),
    }
    (path / "case.json").write_text(json.dumps(case, indent=2))
    script = path / "repro.py"
    script.write_text(_SCRIPT.format(label=label, backend=backend))
    return script


def resolve_function(path: str) -> Callable:
    """The torch function named by ``path`` (``torch.nn.functional.softmax``, ``torch.Tensor.matmul``).

    Only names under ``torch`` are accepted: a repro case never runs code of its own.
    """
    import importlib

    owner, _, name = path.rpartition(".")
    if not owner.startswith("torch") or not name.isidentifier():
        raise InputError(f"repro function {path!r} is not a torch function")
    obj = torch.Tensor if owner == "torch.Tensor" else importlib.import_module(owner)
    func = getattr(obj, name, None)
    if not callable(func):
        raise InputError(f"{path!r} does not name a callable")
    return func


def template_to_json(template: Any) -> Any:
    """A JSON form of a call template (tensor slots, lists, tuples, dicts, plain values)."""
    if isinstance(template, _Slot):
        return {"__slot__": template.i}
    if isinstance(template, dict):
        return {"__dict__": {k: template_to_json(v) for k, v in template.items()}}
    if isinstance(template, (list, tuple)):
        return {"__tuple__" if isinstance(template, tuple) else "__list__": [template_to_json(v) for v in template]}
    if isinstance(template, torch.dtype):
        return {"__dtype__": str(template).removeprefix("torch.")}
    if template is None or isinstance(template, (bool, int, float, str)):
        return template
    raise InputError(f"cannot write a repro for an argument of type {type(template).__name__}: {template!r:.80}")


def template_from_json(obj: Any) -> Any:
    """The inverse of :func:`template_to_json`."""
    if isinstance(obj, dict):
        if "__slot__" in obj:
            return _Slot(int(obj["__slot__"]))
        if "__dict__" in obj:
            return {k: template_from_json(v) for k, v in obj["__dict__"].items()}
        if "__tuple__" in obj:
            return tuple(template_from_json(v) for v in obj["__tuple__"])
        if "__list__" in obj:
            return [template_from_json(v) for v in obj["__list__"]]
        if "__dtype__" in obj:
            return getattr(torch, obj["__dtype__"])
    return obj


__all__ = ["CallModule", "Localization", "OpModule", "capture_calls", "localize", "resolve_function"]
