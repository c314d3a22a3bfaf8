"""Merge results from several nodes into one report: every backend named ``node/backend``, one oracle."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlx_nb.errors import InputError
from rlx_nb.execution.results import ERROR, BackendRun, RunResults


def merge_results(nodes: Sequence[tuple[str, RunResults | str]], *, oracle: str | None = None) -> RunResults:
    """One RunResults from ``[(node_name, results or an error message), ...]``.

    The oracle and fp64 reference come from node ``oracle`` (default: the first node with results).
    Every other node's CPU oracle becomes a candidate ``node/cpu``, and every node's candidates
    become ``node/backend``.  A node given as an error message becomes one ``node/*`` error row.
    Inputs must be identical everywhere: a node whose input fingerprint differs is refused.
    """
    names = [n for n, _ in nodes]
    if len(set(names)) != len(names):
        raise InputError(f"node names must be unique, got {names}")
    ok = [(n, r) for n, r in nodes if isinstance(r, RunResults)]
    if not ok:
        raise InputError("no node has results to merge")
    oracle = oracle or ok[0][0]
    base = dict(ok).get(oracle)
    if base is None:
        raise InputError(f"oracle node {oracle!r} has no results; nodes with results: {', '.join(n for n, _ in ok)}")
    kinds = {n: "an int8" if "int8" in r.environment else "a float" for n, r in ok}
    if len(set(kinds.values())) > 1:
        said = ", ".join(f"{n!r} {k}" for n, k in kinds.items())
        raise InputError(
            f"these nodes hold reports of two kinds ({said} one): an int8 report's runtimes are judged against its "
            "Q/DQ simulation in quanta, a float one's against the float32 oracle; merge reports of one kind"
        )
    want = base.fingerprints.get("inputs")
    candidates: dict[str, BackendRun] = {}
    for node, res in nodes:
        if not isinstance(res, RunResults):
            candidates[f"{node}/*"] = BackendRun(f"{node}/*", ERROR, {}, f"node {node} failed: {res}")
            continue
        got = res.fingerprints.get("inputs")
        if want and got and got != want:
            raise InputError(
                f"node {node!r} ran on different inputs (fingerprint {got}) than the oracle node {oracle!r} "
                f"({want}); every node must use identical inputs"
            )
        if res.backward != base.backward:
            raise InputError(f"node {node!r} has backward={res.backward} but the oracle node has {base.backward}")
        if node != oracle:
            candidates[f"{node}/cpu"] = _renamed(res.oracle, f"{node}/cpu")
        for name, run in res.candidates.items():
            candidates[f"{node}/{name}"] = _renamed(run, f"{node}/{name}")
    # An output that is nondeterministic on any node (its two oracle runs differ) cannot be judged.
    unstable: dict[str, float] = {}
    for _, res in ok:
        for name, diff in (res.environment.get("nondeterministic") or {}).items():
            unstable[name] = max(unstable.get(name, 0.0), diff)
    environment = {"nodes": {n: r.environment for n, r in ok}, "oracle_node": oracle, "nondeterministic": unstable}
    if "int8" in base.environment:  # (the oracle node's budget, as its trials)
        environment["int8"] = base.environment["int8"]
    return RunResults(
        label=base.label,
        oracle=base.oracle,
        reference=base.reference,
        candidates=candidates,
        backward=base.backward,
        environment=environment,
        fingerprints=dict(base.fingerprints),
        sequential=base.sequential,
        anchors=dict(base.anchors),  # the oracle node's, like its sequential run
        trials=dict(base.trials),  # (an int8 report's: the oracle node's budget runs)
    )


def _renamed(run: BackendRun, name: str) -> BackendRun:
    return dataclasses.replace(run, backend=name, reduction_lengths=dict(run.reduction_lengths), notes=list(run.notes))


def merge_reports(
    sources: Sequence[Any],
    *,
    names: Sequence[str] | None = None,
    oracle: str | None = None,
    rule: str = "budget",
    tol_rel: float | None = None,
):
    """Merge saved reports (paths), reports or RunResults from several nodes into one DivergenceReport.

    Node names default to each file's stem (``node1.rlxnb`` -> ``node1``) or the run's host.

    Examples
    --------
    >>> # rlx-nb check model.py:build --save out/   (on each node), then:
    >>> # report = rlx_nb.merge_reports(sorted(Path("out").glob("*.rlxnb")))
    """
    from rlx_nb.report.files import load_results
    from rlx_nb.report.report import DivergenceReport

    if not sources:
        raise InputError("merge_reports needs at least one report")
    loaded = []
    for i, src in enumerate(sources):
        if isinstance(src, (str, Path)):
            results, _ = load_results(src)
            default = Path(src).stem
        elif isinstance(src, DivergenceReport):
            results, default = src.results, str(src.results.environment.get("host", f"node{i}"))
        elif isinstance(src, RunResults):
            results, default = src, str(src.environment.get("host", f"node{i}"))
        else:
            raise InputError(f"cannot merge a {type(src).__name__}; give paths, reports or RunResults")
        loaded.append((names[i] if names else default, results))
    if not names and len({n for n, _ in loaded}) != len(loaded):
        loaded = [(f"{n}-{i}", r) for i, (n, r) in enumerate(loaded)]
    return DivergenceReport.from_results(merge_results(loaded, oracle=oracle), rule=rule, tol_rel=tol_rel)
