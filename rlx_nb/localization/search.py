"""Search: the hierarchical descent from the model's top-level modules to the culprit module and op.

Each module runs alone on the backend, fed the oracle's captured inputs, and is judged with the
report's own verdict (:func:`rlx_nb.execution.run.run` and :func:`rlx_nb.comparison.compare.compare` on that call); the
descent enters only modules beyond budget, so preparations grow with depth, not with the number of
modules.  Where the backend runs eagerly, the full run's activations give the propagated error.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

import torch

from rlx_nb._support.progress import bar
from rlx_nb._support.tree import flatten
from rlx_nb.backends.base import ORACLE, REFERENCE
from rlx_nb.backends.registry import get_backend
from rlx_nb.comparison.compare import failed, judge_leaf
from rlx_nb.errors import InputError, still_interrupted
from rlx_nb.execution.prepare import CallableModule, KeywordModule
from rlx_nb.execution.results import to_leaf
from rlx_nb.localization.capture import Call, CallModule, OpModule, RecordOps
from rlx_nb.localization.culprit import Culprit, judge_alone
from rlx_nb.verdict.records import OutputRecord
from rlx_nb.verdict.types import SUSPECT, VERDICT_ERROR, whole_excess


@dataclasses.dataclass
class Check:
    record: OutputRecord
    suspect: bool
    results: Any = None


def descend(
    state: State, calls: dict[str, Call], ops: bool, base: torch.nn.Module, args: tuple
) -> tuple[str | None, str | None, Any]:
    # Hierarchical descent from the root's children to the innermost SUSPECT module, then its ops.
    # The culprit is the first suspect module, in execution order, none of whose children is suspect:
    # where the error is born first (errors downstream may be that one's, propagated).
    root = next(iter(calls))
    frontier = calls[root].children or [root]
    suspects = state.visit(frontier)
    if state.rows and all(row["verdict"] == VERDICT_ERROR for row in state.rows):
        # The backend cannot run the model's modules on their own (it reaches for attributes of the whole
        # model, say): watch the whole model run on it instead, module by module.
        return state.full_run_search(base, args), None, None
    if not suspects and frontier != [root]:
        # Nothing below is beyond budget: the error may be born in the root's own code.
        suspects = state.visit([root])
    culprit = state.innermost(suspects)
    culprit_op = repro = None
    if culprit is not None and ops:
        state.shown.set_postfix_str(f"ops of {culprit}")
        culprit_op, repro = state.ops(culprit)
    if culprit is not None and repro is None:  # (not narrowed to one torch function: the module is the culprit)
        call = state.calls[culprit]
        module = CallModule(copy.deepcopy(state.named[culprit]), call.template)
        repro = state.culprit(state._label(culprit), module, call.tensors)
    return culprit, culprit_op, repro


def model_name(base: torch.nn.Module) -> str:
    """What a prepared model's root (``<root>`` in a module's name) is called: the user's class, or function, name."""
    base = base.model if isinstance(base, KeywordModule) else base
    if isinstance(base, CallableModule):
        return getattr(base.fn, "__name__", type(base.fn).__name__)
    return type(base).__name__


def user_name(name: str, keys: list[str] | None) -> str:
    # Our keyword adapter adds a "model." level; users never see it.
    if keys is not None:
        return "" if name in ("", "model") else name.removeprefix("model.")
    return name


KEEP_ARRAYS_BYTES = 256e6
"""keep_arrays="auto" keeps a round-off module's arrays only when they take at most this many bytes."""


def nbytes(results: Any) -> int:
    runs = [results.oracle, results.reference, *results.candidates.values()]
    return sum(leaf.nbytes for run in runs for leaf in run.outputs.values())


class State:
    def __init__(self, backend: str, backward: bool, calls: dict[str, Call], named: dict[str, torch.nn.Module]):
        self.backend, self.backward, self.calls, self.named = backend, backward, calls, named
        self.keep_arrays = "auto"
        self.rows: list[dict] = []
        self.checks: dict[str, tuple[Any, str | None]] = {}
        self.preparations = 0
        self.keyword = isinstance(named.get(""), KeywordModule)
        self.shown: Any = bar("", enabled=False)
        self.full_run = ""  # why the search watched full runs instead of modules alone ("" when it did not)

    def _judge(self, adapter: torch.nn.Module, tensors: list[torch.Tensor]) -> Check:
        self.preparations += 1
        self.shown.update()
        # progress=False: the localize bar counts these checks; no bar per check inside it.
        worst, results = judge_alone(adapter, tensors, self.backend, self.backward)
        return Check(worst, worst.verdict == SUSPECT, results)

    def culprit(self, label: str, adapter: torch.nn.Module, tensors: list[torch.Tensor], **op: Any) -> Culprit:
        """The culprit found, alone, for what comes after (a repro, a bisection); the backend object is kept, so
        one the registry lends only for the search (a report's own backend object) still runs it after."""
        return Culprit(label, self.backend, self.backward, adapter, tuple(t.detach() for t in tensors),
                       lent=get_backend(self.backend), root=model_name(self.named[""]), **op)  # fmt: skip

    def _row(self, name: str, kind: str, order: int, depth: int, check: Check) -> None:
        r = check.record
        if check.results is not None:
            size = nbytes(check.results)
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
                "local_ratio_rmse": r.judgement.budget.ratio_rmse,
                "local_ratio_max": r.judgement.budget.ratio_max,
                "local_line": r.judgement.line,
                "propagated_ratio_rmse": math.nan,
                "propagated_ratio_max": math.nan,
                "propagated_line": math.nan,
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
                rec = failed(self.backend, str(exc))
                check = Check(rec, False)
            self._row(self._label(name), "module", call.order, call.depth, check)
            if check.suspect:
                suspects.append(name)
        for name in list(suspects):
            children = self.calls[name].children
            if children:
                suspects.extend(self.visit(children))
        return suspects

    def _label(self, name: str) -> str:
        return user_name(name, [] if self.keyword else None) or "<root>"

    def innermost(self, suspects: list[str]) -> str | None:
        inner = [s for s in suspects if not any(c in suspects for c in self.calls[s].children)]
        return min(inner, key=lambda s: self.calls[s].order) if inner else None

    def ops(self, name: str) -> tuple[str | None, dict | None]:
        call = self.calls[name]
        recorder = RecordOps()
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
                repro = self.culprit(f"{self._label(name)} :: {label}", OpModule(func, template), tensors,
                                     func=func, template=template)  # fmt: skip
                break
        return culprit, repro

    def full_run_search(self, base: torch.nn.Module, args: tuple) -> str | None:
        """Every module's output in a full run on the backend against the oracle's and fp64's (forward only):
        the culprit is the first suspect module, in execution order, none of whose children is suspect."""
        cause = self.rows[0]["reason"]
        backend = get_backend(self.backend)
        outs = {
            who: full_run_outputs(b, base, args)
            for who, b in (("oracle", get_backend(ORACLE)), ("reference", get_backend(REFERENCE)), ("backend", backend))
        }
        if self.backward or not outs["backend"]:
            why = "its backward" if self.backward else "a full run on it shows no module's output (no hook fired)"
            raise InputError(
                f"localize cannot place {self.backend!r}'s error: the backend fails on the model's modules run "
                f"alone ({cause}), and {why}; let its fn accept any module (it gets each module, or a wrapper "
                "around one, in place of the whole model), or register it with hookable=True if it runs eagerly"
            )
        self.full_run = cause
        suspects = []
        for name, call in self.calls.items():
            o, r, b = (outs[k].get(name) for k in ("oracle", "reference", "backend"))
            if o is None or b is None or r is None or not o.is_array:
                continue
            rec = judge_leaf(
                o, b, r, backend=self.backend, output=self._label(name), compute_dtype=backend.compute_dtype
            )
            self._row(self._label(name), "module", call.order, call.depth, Check(rec, rec.verdict == SUSPECT))
            row = self.rows[-1]
            row["propagated_ratio_rmse"], row["propagated_ratio_max"] = (
                rec.judgement.budget.ratio_rmse,
                rec.judgement.budget.ratio_max,
            )
            row["propagated_line"], row["notes"] = (
                rec.judgement.line,
                "full run on the backend (modules could not run alone)",
            )
            for key in ("local_ratio_rmse", "local_ratio_max", "local_line"):
                row[key] = math.nan
            if rec.verdict == SUSPECT:
                suspects.append(name)
        self.rows = [row for row in self.rows if row["notes"].startswith("full run")]
        return self.innermost(suspects)

    def propagate(self, base: torch.nn.Module, args: tuple) -> None:
        backend = get_backend(self.backend)
        if not backend.hookable:
            return  # compiled/exported: hooks would see tracing, not the backend; local errors only
        outs = {
            who: full_run_outputs(b, base, args)
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
            rec = judge_leaf(o, b, r, backend=self.backend, output=row["name"], compute_dtype=backend.compute_dtype)
            row["propagated_ratio_rmse"], row["propagated_ratio_max"] = (
                rec.judgement.budget.ratio_rmse,
                rec.judgement.budget.ratio_max,
            )
            row["propagated_line"] = rec.judgement.line
            local = row["local_line"]
            if local == 0:  # (bit for bit the oracle's alone: at the oracle's own round-off, what it adds is that)
                local = whole_excess(row["local_ratio_rmse"], row["local_ratio_max"])
            row["amplification"] = rec.judgement.line / local if local and local == local and local > 0 else math.nan


def full_run_outputs(backend, base: torch.nn.Module, args: tuple) -> dict[str, Any]:
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
    except Exception as _stop:
        still_interrupted(_stop)
        return {}
    finally:
        for h in handles:
            h.remove()
    return captured
