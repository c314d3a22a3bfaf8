"""Diff: where two environments part, module by module, each change judged against that module's round-off.

How
---
- **Local change**: the module alone, fed the inputs it had in the old environment, run here on the backend,
  against the output it gave there.  The budget is that module's own round-off: its old output's error against
  the float64 module on the same inputs (:func:`rlx_nb.comparison.compare.judge_leaf`, the verdict every report
  uses, with the old output as the oracle).  A module whose local change is past the line computes differently
  here.  As in :func:`rlx_nb.localize`, the search descends from the top-level modules into those past the line
  only (``local="all"`` checks every one), so its cost grows with depth.
- **Propagated change**: the whole model run here (on a backend that runs it eagerly, so hooks fire), each
  module's output against its old one, judged against the old run's round-off there (its error against the float64
  model's, the snapshot's reference).  Past the line but within it locally: the change was carried in.
- Two snapshots (no model): propagated changes only.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from rlx_nb._support import switches
from rlx_nb._support.progress import bar
from rlx_nb._support.tree import flatten
from rlx_nb.backends.base import ORACLE, REFERENCE
from rlx_nb.backends.eager import run_float64_streamed
from rlx_nb.backends.registry import get_backend
from rlx_nb.changes.environment import differences, snapshot_environment
from rlx_nb.changes.ops import module_of, shown
from rlx_nb.changes.record import alone, watched_run
from rlx_nb.changes.result import Diff, row
from rlx_nb.changes.snapshot_file import Snapshot, as_snapshot
from rlx_nb.comparison.compare import failed, judge_leaf
from rlx_nb.errors import InputError, still_interrupted
from rlx_nb.execution import fingerprints
from rlx_nb.execution.environment import packages_of
from rlx_nb.execution.prepare import normalize_inputs, prepare_model
from rlx_nb.execution.results import Leaf, to_leaf
from rlx_nb.report.baseline import fingerprint_differences
from rlx_nb.verdict.records import OutputRecord, worst_record
from rlx_nb.verdict.types import SUSPECT


def diff(
    old: Any,
    new: Any,
    inputs: Any = None,
    *,
    backend: str | None = None,
    params: dict[str, torch.Tensor] | None = None,
    local: str = "descend",
    progress: bool | None = None,
) -> Diff:
    """Where this environment's run of a model parts from a snapshot's, module by module, judged on round-off.

    ``diff(snapshot, model, inputs)`` runs here; ``diff(a, b)`` compares two snapshots (propagated changes only).

    Parameters
    ----------
    old : Snapshot or str or Path
        What :func:`rlx_nb.snapshot` recorded (or its file).
    new : nn.Module or callable, or Snapshot or str or Path
        The model, run here; or another snapshot.
    inputs, params
        As for :func:`rlx_nb.backend_divergence` (the model's).
    backend : str, optional
        What to run here (default: what the snapshot ran on).  Any backend runs the modules alone (local changes);
        propagated changes need one that runs the model eagerly.
    local : {"descend", "all"}
        ``"descend"`` (default): check modules alone from the top-level ones down into those past the line, as
        :func:`rlx_nb.localize` does; ``"all"``: every module.

    Returns
    -------
    Diff
        ``frame`` (one row per module), ``culprit`` (the first module whose local change is past the line, none of
        whose children's is), the environment differences beside it, ``plot()``, ``to_html()``.

    Examples
    --------
    >>> import rlx_nb, tempfile, os
    >>> from rlx_nb.models import demo
    >>> model, inputs = demo.mlp()
    >>> path = rlx_nb.snapshot(model, inputs, os.path.join(tempfile.mkdtemp(), "before"))
    >>> rlx_nb.diff(path, model, inputs).culprit is None
    True
    """
    if local not in ("descend", "all"):
        raise InputError(f"local must be 'descend' or 'all', got {local!r}")
    a = as_snapshot(old, "old")
    if isinstance(new, (Snapshot, str, Path)):
        if inputs is not None or backend is not None or params is not None:
            raise InputError("diff of two snapshots takes no inputs, backend or params: both runs are recorded")
        return _two_snapshots(a, as_snapshot(new, "new"))
    if inputs is None:
        raise InputError("diff(snapshot, model, inputs): pass the model's inputs (or two snapshots)")
    return _against_model(a, new, inputs, backend=backend or a.backend, params=params, local=local, progress=progress)


def _leaves(out: Any) -> dict[str, Leaf]:
    # A module's output (any structure) as its floating tensor leaves, by the names a snapshot records.
    return {k: to_leaf(v) for k, v in flatten(out) if isinstance(v, torch.Tensor) and v.is_floating_point()}


def _judge(old: dict[str, Leaf], got: dict[str, Leaf], ref: dict[str, Leaf], label: str, name: str) -> OutputRecord:
    # The worst of a module's output leaves, each judged both ways round against float64 on the same inputs: the new
    # output on the old one's round-off (a kernel that now computes worse), and the old output on the new one's (a
    # function that changed, which the float64 run here follows: an edited module, an op that now means another).
    return _judgements(old, got, ref, label, name)[0]


def _judgements(
    old: dict[str, Leaf], got: dict[str, Leaf], ref: dict[str, Leaf], label: str, name: str
) -> tuple[OutputRecord, OutputRecord]:
    # (both ways round, the new output on the old one's round-off only): _judge's, and the forward one alone.
    records, forward = [], []
    for leaf, o in old.items():
        g, r = got.get(leaf), ref.get(leaf)
        if g is None or r is None or not g.is_array:
            continue
        if tuple(g.shape) != tuple(o.shape):
            records.append(failed(label, f"{name} output {leaf} is {tuple(g.shape)} here, {tuple(o.shape)} there"))
            forward.append(records[-1])
            continue
        output = f"{name}:{leaf}" if leaf != "out" else name
        forward.append(judge_leaf(o, g, r, backend=label, output=output))
        records.append(forward[-1])
        back = judge_leaf(g, o, r, backend=label, output=output)
        if back.verdict == SUSPECT:
            records.append(
                dataclasses.replace(back, reason=f"the old output against the float64 value here: {back.reason}")
            )
    if not records:
        return (failed(label, "no output of it was recorded in both"),) * 2
    return worst_record(records), worst_record(forward)


def _explained(rows: dict[str, dict], propagated: dict[str, tuple[OutputRecord, OutputRecord]], local: dict) -> dict:
    # Each module's propagated change.  Past the line only the other way round (the old output against the float64
    # value here) reads a function that changed (the float64 run here follows the new code) -- but a changed function
    # shows as a local change where it changed, in the module itself, inside it or before it.  Where none did, the
    # function is the same in both, the float64 value here is the one there, and that reading only sets one run's
    # round-off against the other's smaller one: this environment computes it more accurately (Mamba's scan, ops of
    # its recurrence, read 1.1-1.6x the line under MKL_CBWR=COMPATIBLE, bench/changes.py --ops).  The new output on
    # the old one's round-off is the judgement then.
    changed = [n for n, (rec, _) in local.items() if rec is not None and rec.verdict == SUSPECT]
    out = {}
    for name, (both, forward) in propagated.items():
        if both.verdict == SUSPECT and forward.verdict != SUSPECT and name in rows:
            at = rows[name]["order"]
            if not any(rows[c]["order"] <= at or _within(c, name) for c in changed if c in rows):
                out[name] = dataclasses.replace(forward, reason=(
                    f"{forward.reason}; the old output is further from the float64 value than this run's round-off "
                    f"({both.judgement.line:.3g}x the line), but nothing before it changed on its own: this "
                    "environment computes it more accurately"))  # fmt: skip
                continue
        out[name] = both
    return out


def _within(inner: str, outer: str) -> bool:
    # Whether module or op ``inner`` is ``outer`` itself or inside it (the root holds every one).
    if inner == outer or outer == "":
        return True
    return module_of(inner) == outer or module_of(inner).startswith(outer + ".")


def _two_snapshots(a: Snapshot, b: Snapshot) -> Diff:
    if not (a.has_reference or b.has_reference):
        raise InputError(
            "neither snapshot holds its float64 reference, which a change is judged against: write one with "
            "rlx_nb.snapshot(..., reference=True), or diff a snapshot against the model: rlx_nb.diff(a, model, inputs)"
        )
    notes, unchecked = fingerprint_differences(a.fingerprints, b.fingerprints)
    rows = []
    for name in a.modules:
        m = a.entry(name)
        if name not in b.modules:
            rows.append(row(m, note=f"not called in {b.label!r}"))
            continue
        same = _same_inputs(a, b, name)
        if not same and (a.meta["alone"] or b.meta["alone"]):  # (outputs of a module run alone: no whole run to set)
            rows.append(row(m, note="a snapshot ran each module alone, and the two fed it other inputs: its change "
                                    "needs the model (rlx_nb.diff(snapshot, model, inputs))"))  # fmt: skip
            continue
        ref = a.reference(name) if a.has_reference else b.reference(name)
        rec = _judge(a.outputs(name), b.outputs(name), ref, b.label, _shown(name, a))
        if same:  # (fed the very same bytes: whatever changed, changed in it)
            rows.append(row(m, local=rec, propagated=rec, note="fed bit for bit the same inputs in both"))
        else:
            rows.append(row(m, propagated=rec, note="two snapshots: its change alone needs the model"))
    rows += [row(b.entry(n), note=f"not called in {a.label!r}") for n in b.modules if n not in a.modules]

    def arrays(name: str, side: str) -> tuple[dict, dict, dict]:
        return a.outputs(name), b.outputs(name), a.reference(name) if a.has_reference else b.reference(name)

    return Diff(rows, a, new_label=b.label, backend=b.backend,
                environment=differences(a.environment, b.environment, b.backend), notes=[*notes, *unchecked],
                checked_alone=False, keyword=a.meta["keyword"], arrays=arrays,
                environments=(a.environment, b.environment))  # fmt: skip


def _same_inputs(a: Snapshot, b: Snapshot, name: str) -> bool:
    # Whether a module was called with bit for bit the same tensors (and the same call) in both snapshots.
    ea, eb = a.entry(name), b.entry(name)
    if ea["call"] is None or ea["call"] != eb["call"] or len(ea["inputs"]) != len(eb["inputs"]):
        return False
    return all(torch.equal(x, y) for x, y in zip(a.tensors(name), b.tensors(name), strict=True))


def _shown(name: str, a: Snapshot) -> str:
    return shown(name, a.meta["keyword"])


def _against_model(
    a: Snapshot, model: Any, inputs: Any, *, backend: str, params: Any, local: str, progress: Any
) -> Diff:
    chosen = get_backend(backend)
    if backend == REFERENCE:
        raise InputError(f"{backend!r} is the float64 reference; diff what a model computes in float32 or lower")
    reason = chosen.unavailable_reason()
    if reason:
        raise InputError(f"backend {backend!r} is not available here: {reason}")
    env = snapshot_environment()
    with switches.exclusive():
        args, keys = normalize_inputs(inputs)
        base = prepare_model(model, params, keys)
        if (keys is not None) != a.meta["keyword"]:
            raise InputError("the snapshot's inputs were " + ("keywords (a dict)" if a.meta["keyword"] else
                             "positional") + "; pass the inputs the same way")  # fmt: skip
        now = {"inputs": fingerprints.quick_fingerprint(args), "model": fingerprints.quick_fingerprint(dict(base.state_dict())),
               "input_structure": fingerprints.structure(args),
               "model_structure": fingerprints.structure(dict(base.state_dict()))}  # fmt: skip
        notes, unchecked = fingerprint_differences(a.fingerprints, now)
        named = dict(base.named_modules())
        label = _label_here(env, backend, a.label)
        shown = bar(f"rlx_nb diff {backend}", unit="check", enabled=progress)
        try:
            whole = chosen.hookable and not a.meta["alone"]  # (outputs in one run, to set against the old run's)
            propagated, called = _propagated(a, base, args, chosen, label) if whole else ({}, [])
            local_checks = _local(a, named, chosen, label, how=local, shown=shown)
        finally:
            shown.close()
    if a.meta["alone"]:
        notes.append(f"the snapshot ran each module alone on {a.backend} (it compiles or exports the whole model): "
                     "only local changes are judged")  # fmt: skip
    elif not chosen.hookable:
        notes.append(f"{backend} compiles or exports the whole model: its modules' outputs in a full run are not "
                     "seen, so only local changes are judged")  # fmt: skip
    explained = _explained({n: a.entry(n) for n in a.modules}, propagated, local_checks)
    rows = []
    for name in a.modules:
        m = a.entry(name)
        if module_of(name) not in named:
            rows.append(row(m, note="no such module in the model here"))
            continue
        rec, note = local_checks.get(name, (None, ""))
        rows.append(row(m, local=rec, propagated=explained.get(name), note=note or a.why(name)))
    rows += [row({"name": n, "order": len(rows) + i, "depth": n.count(".") + 1 if n else 0, "parent": None},
                 note="not in the snapshot: a module called here, not there (added since?)")
             for i, n in enumerate(n for n in called if n not in a.modules)]  # fmt: skip

    def arrays(name: str, side: str) -> tuple[dict, dict, dict]:
        # What the explorer shows of one module (Diff.report): recomputed here, one module alone or one whole run.
        with switches.exclusive():
            if side == "local":
                got, ref = _alone(a, named, name, chosen)
                return a.outputs(name), got, ref
            got = {}

            def kept(n: str, out: Any) -> None:
                if n == name:
                    got.update({k: to_leaf(v, copy=True) for k, v in flatten(out)
                                if isinstance(v, torch.Tensor) and v.is_floating_point()})  # fmt: skip

            _whole_run(a, base, lambda: chosen.fn(base, args), kept, f"the model failed on {backend!r} here")
            ref = a.reference(name) if a.has_reference else _reference_here(a, base, args, only=name).get(name, {})
            return a.outputs(name), got, ref

    return Diff(rows, a, new_label=label, backend=backend, environment=differences(a.environment, env, backend),
                notes=[*notes, *unchecked], checked_alone=True, keyword=a.meta["keyword"], arrays=arrays,
                environments=(a.environment, env))  # fmt: skip


def _label_here(env: dict, backend: str, old: str) -> str:
    # This environment's name: its host and versions (torch's, the backend's runtime's), the backend where it is not
    # the oracle; told apart from the snapshot's where both would read the same.
    versions = [f"torch {env.get('torch')}", *(f"{p} {env[p]}" for p in packages_of(backend) if env.get(p))]
    label = f"{env.get('host')} {', '.join(versions)}" + ("" if backend == ORACLE else f" ({backend})")
    return label if label != old else f"{label}, here"


def _whole_run(a: Snapshot, base: torch.nn.Module, run: Any, on_output: Any, failed: str) -> None:
    # ``run()`` (a run of ``base``) watched: ``on_output(name, out)`` with each module's first output as it comes, and
    # each op's (rlx_nb.changes.ops) where the snapshot recorded its modules' ops.
    watched_run(base, run, failed=failed, first_output=on_output,
                op_called=(lambda op: on_output(op.name, op.out)) if a.has_ops else None)  # fmt: skip


def _propagated(a: Snapshot, base: torch.nn.Module, args: tuple, backend: Any, label: str) -> tuple[dict, list[str]]:
    # ({name: (both ways round, forward only)}, the names called here in order): see _judgements.
    # The whole model here, each module's (and op's) first output judged as it comes against the old one (nothing
    # held); and every module called here, in order.
    residual: dict[str, dict[str, Leaf]] = {}
    if not a.has_reference:  # (the float64 model's value of each module, here: as good as there)
        residual = _reference_here(a, base, args)
    found: dict[str, tuple[OutputRecord, OutputRecord]] = {}
    called: list[str] = []

    def judged(name: str, out: Any) -> None:
        called.append(name)
        if name in a.modules:
            ref = a.reference(name) if a.has_reference else residual.get(name, {})
            found[name] = _judgements(a.outputs(name), _leaves(out), ref, label, _shown(name, a))

    _whole_run(a, base, lambda: backend.fn(base, args), judged, f"the model failed on {backend.name!r} here")
    return found, called


def _reference_here(
    a: Snapshot, base: torch.nn.Module, args: tuple, only: str | None = None
) -> dict[str, dict[str, Leaf]]:
    # The float64 model run here: each recorded module's (and op's) output (``only``: that one's).
    refs: dict[str, dict[str, Leaf]] = {}

    def kept(name: str, out: Any) -> None:
        if name in a.modules and only in (None, name):
            refs[name] = {k: to_leaf(v, copy=True) for k, v in flatten(out) if isinstance(v, torch.Tensor)
                          and v.is_floating_point()}  # fmt: skip

    _whole_run(a, base, lambda: run_float64_streamed(base, args), kept, "the float64 reference failed here")
    return refs


def _local(a: Snapshot, named: dict, backend: Any, label: str, *, how: str, shown: Any) -> dict:
    # Modules alone, fed their old inputs: from the top-level ones down into those past the line ("descend").
    children: dict[str, list[str]] = {n: [] for n in a.modules}
    for n in a.modules:
        parent = a.entry(n)["parent"]
        if parent is not None and parent in children:
            children[parent].append(n)
    checks: dict[str, tuple[OutputRecord | None, str]] = {}

    def check(name: str) -> bool:
        shown.update()
        if module_of(name) not in named:
            return False
        parts = a.entry(name)
        if parts["call"] is None:
            checks[name] = (None, a.why(name) or "its call was not recorded")
            return False
        try:
            got, ref = _alone(a, named, name, backend)
        except Exception as exc:
            still_interrupted(exc)
            checks[name] = (failed(label, f"{type(exc).__name__}: {exc}"[:300]), "")
            return False
        rec = _judge(a.outputs(name), got, ref, label, _shown(name, a))
        checks[name] = (rec, "")
        return rec.verdict == SUSPECT

    if how == "all":
        for n in a.modules:
            check(n)
        return checks
    root = a.modules[0] if a.modules else None
    if root is None:
        return checks
    frontier = children[root] or [root]
    suspects = _visit(frontier, check, children)
    if not suspects and frontier != [root]:
        _visit([root], check, children)
    return checks


def _alone(a: Snapshot, named: dict, name: str, backend: Any) -> tuple[dict[str, Leaf], dict[str, Leaf]]:
    # One module (or op) alone, fed the inputs it had in the old environment: its outputs here on the backend, and
    # the float64 module's on the same inputs.
    entry, tensors = a.entry(name), a.tensors(name)
    with torch.no_grad():
        got = backend.fn(alone(entry, named), tuple(t.clone() for t in tensors))
        ref = run_float64_streamed(alone(entry, named, copy=False), tuple(tensors))
    return _leaves(got), _leaves(ref)


def _visit(names: list[str], check, children: dict[str, list[str]]) -> list[str]:
    suspects = [n for n in names if check(n)]
    for n in list(suspects):
        suspects += _visit(children.get(n, []), check, children)
    return suspects


__all__ = ["diff"]
