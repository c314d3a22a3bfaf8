"""Where an int8 runtime's error is born: the first requantization of the converted graph past the budget.

The converted graph cut after one requantization (an activation's dequantize, which it then returns) is an int8
model of its own: its oracle, reference and trials run, the backend is given it, and the shared comparison judges
it (:func:`~rlx_nb.int8.run.int8_results`), as a module is judged alone in a float model's search.  The points that
hold a computed value are bisected (a divergence is taken to persist downstream, as Polygraphy's reduction does; a
quantized constant -- a bias, an epsilon folded by PT2E -- matches everywhere and would break the order), and the
first one past the line is the culprit: the op that computed the value it rounds, and that op's module.  The
result is a :class:`~rlx_nb.Localization`, a float search's: its frame, culprit, arrays and heatmaps.

A cut judged on its own trials has a budget wider than the whole model's, so a fault can show at no cut, or first at
a cut downstream of it.  The *splice* judges a point on the report's own budget instead: the runtime's value there
put into the simulation in place of its own, the rest simulated.  It searches where no cut is past the line, and
from the first search's culprit it walks up the points that feed it.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch

from rlx_nb._support.tree import flatten
from rlx_nb.comparison.compare import compare
from rlx_nb.errors import InputError, describe_error, still_interrupted
from rlx_nb.int8 import decisive
from rlx_nb.int8.requantization import (
    _DEQUANTIZE,
    _QUANTIZE,
    _behind_moves,
    _computed,
    _module_of,
    _op,
    _op_name,
    _ops,
    _truncated,
    graph_copy,
    output_leaves,
)
from rlx_nb.int8.run import _run, int8_results, runtime_outputs
from rlx_nb.localization.result import Found, Localization
from rlx_nb.numerics.formats import INT8
from rlx_nb.report.issue import INT8_NO_REPRO as NO_REPRO
from rlx_nb.verdict.records import worst_record
from rlx_nb.verdict.types import SUSPECT


def _place(point: torch.fx.Node) -> tuple[str, str]:
    # (module path, op) of the op that computed the value a requantization point holds, past the ops that only move
    # or clip it (a ReLU fused after a convolution, a reshape of a projection): ``("fc2", "linear")``.
    producer = point.args[0].args[0] if point.args and point.args[0].args else None
    if not isinstance(producer, torch.fx.Node) or producer.op == "placeholder":
        return "(top level)", "input"
    producer = _behind_moves(producer)
    # (a value quantized again -- a residual reshaped before the next layer's product -- was computed where its first
    # quantization's input was: past every dequantize and quantize, to the op)
    while _op(producer) in (*_DEQUANTIZE, _QUANTIZE) and producer.args and isinstance(producer.args[0], torch.fx.Node):
        producer = _behind_moves(producer.args[0])
    if not isinstance(producer, torch.fx.Node) or producer.op == "placeholder":
        return "(top level)", _op_name(point.args[0])
    module = _module_of(point, producer)
    path = module.rsplit(" (", 1)[0] if module.endswith(")") and " (" in module else module
    return path, _op(producer) or producer.op


def _feeding(converted: torch.fx.GraphModule, names: list[str], output: str | None) -> set[torch.fx.Node] | None:
    # The nodes the judged output is computed from: a graph with several outputs (logits and a cache) has
    # requantizations that feed only the others, whose divergence does not persist to this one.  ``names``: the
    # outputs' names in the graph's order (the oracle's).  None where there is one output, or it cannot be found.
    leaves = output_leaves(converted)
    if len(leaves) <= 1 or output not in names or len(names) != len(leaves):
        return None
    seen: set[torch.fx.Node] = set()
    todo = [leaves[names.index(output)]]
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(node.all_input_nodes)
    return seen


def _upstream(points: list, index: dict, allowed: set[int], k: int) -> list[int]:
    # The requantization points (of ``allowed``) nearest upstream of point ``k``: those its value is computed from
    # with no other point between, in graph order.
    found, seen = set(), set()
    todo = list(points[k].all_input_nodes)
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        j = index.get(node)
        if j is not None:  # (a point: its own value is upstream's, stop there)
            if j in allowed:
                found.add(j)
            continue
        todo.extend(node.all_input_nodes)
    return sorted(found)


CUT = "the graph cut after requantization point {k} (of {n}), judged on its own trials"
SPLICE = (
    "the runtime's value at requantization point {k} (of {n}) put into the simulation in place of its own, the rest "
    "simulated: the output judged as the report judges it"
)
SPLICED = (
    "no cut of the graph judged on its own trials was past the line, while the whole output is: each point's value "
    "from the runtime was put into the simulation instead, and the output judged on the report's own budget"
)
REFINED = (
    "the first cut of the graph past the line on its own trials was at {cut}; a cut's own budget is wider than the "
    "model's, so the runtime's values there and upstream were put into the simulation instead, and the output "
    "judged on the report's own budget is past the line from {first} on"
)


def _first_past(points: list, computed: list[int], check: Any) -> int | None:
    # The first point (of ``computed``) that ``check`` finds past the line, None if the last is not: bisected in
    # graph order, then walked up the points that feed it.
    if not computed or not check(computed[-1]):
        return None
    lo, hi = 0, len(computed) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if check(computed[mid]):
            hi = mid
        else:
            lo = mid + 1
    culprit = computed[lo]
    # The bisection takes the points in graph order, where parallel branches interleave: a fault in an attention's
    # query projection is followed by the key's and value's points, which are within the line, so the bisection
    # lands on the attention after them.  Walk up from there while a point that feeds it is past the line.
    index, allowed = {p: k for k, p in enumerate(points)}, set(computed)
    while True:
        earlier = next((j for j in _upstream(points, index, allowed, culprit) if check(j)), None)
        if earlier is None:
            return culprit
        culprit = earlier


def _upstream_of(points: list, computed: list[int], k: int) -> list[int]:
    # The points (of ``computed``) that point ``k``'s value is computed from, at any distance, and ``k``: in graph order.
    index, allowed = {p: j for j, p in enumerate(points)}, set(computed)
    found, todo = {k}, [k]
    while todo:
        for j in _upstream(points, index, allowed, todo.pop()):
            if j not in found:
                found.add(j)
                todo.append(j)
    return sorted(found)


def _refined(points: list, computed: list[int], culprit: int, splice: Any) -> int:
    # From the first search's culprit (a cut past the line on its own trials), the first point upstream whose value,
    # spliced into the simulation, puts the output past the report's line; the culprit if none that feeds it is (each
    # splice lowers a cut of the graph, so the points farther up are bisected only when one that feeds it is past).
    index = {p: j for j, p in enumerate(points)}
    earlier = next((j for j in _upstream(points, index, set(computed), culprit) if splice(j)), None)
    if earlier is None:
        return culprit
    return _first_past(points, _upstream_of(points, computed, earlier), splice)


def _spliced(converted: torch.fx.GraphModule, point: int, value: torch.Tensor) -> torch.fx.GraphModule:
    # ``converted`` with its ``point``-th requantization point's value replaced by ``value`` (a held tensor).
    graph = graph_copy(converted)
    node = _ops(graph, "dequantize_per_tensor")[point]
    name = "_rlx_nb_spliced"
    graph.register_buffer(name, value)
    with graph.graph.inserting_after(node):
        held = graph.graph.get_attr(name)
    node.replace_all_uses_with(held)
    graph.recompile()
    return graph


def _runtime_value(chosen: Any, converted: torch.fx.GraphModule, args: tuple, k: int) -> Any:
    # The runtime's value at point ``k``: its run of the graph cut there (a preparation the cut's own check made is
    # reused), or why it failed.  (One graph returning every point would be one lowering, not one a point, but
    # ExecuTorch's program returning many points of an int8 graph gave other values, some inf, at most of them.)
    try:
        with torch.no_grad():
            return torch.as_tensor(flatten(runtime_outputs(chosen, _truncated(converted, k), args))[0][1]).clone()
    except Exception as exc:
        still_interrupted(exc)
        return describe_error(exc)


def _judged_as_report(report: Any, name: str, call: Any, judged: str) -> tuple[Any, Any]:
    # A run of ``call`` (the simulation with a runtime's value spliced in) judged as the report judged the runtime:
    # its oracle, reference, trials and decisive worlds; (results, the record of output ``judged``).
    run = _run(name, call, compute_dtype=INT8)
    res = report.results
    discrete = {n: r for n, r in res.discrete.items() if n not in res.candidates}
    if res.worlds is not None:
        discrete.update(decisive.accounts(res.worlds, {name: run}, res.oracle))
    results = dataclasses.replace(res, candidates={name: run}, discrete=discrete)
    records = compare(results, progress=False)
    return results, next((r for r in records if r.output == judged), worst_record(records))


def localize_int8(
    report: Any,
    converted: torch.fx.GraphModule,
    args: tuple,
    backend: str | None = None,
    *,
    trials: int,
    widths: dict[str, float],
    spreads: dict[str, float] | None = None,
    progress: bool = False,
) -> Localization:
    """Where ``backend``'s int8 error is born (default: the report's first suspect), by bisection over the
    requantization points of ``converted`` (module docstring)."""
    backend = backend or (report.suspects[0] if report.suspects else None)
    if backend is None:
        raise InputError("no SUSPECT backend to localize; name one: report.localize('executorch-xnnpack')")
    chosen = report.backend_objects.get(backend)
    if chosen is None:
        raise InputError(f"backend {backend!r} did not run in this report; it ran: {', '.join(report.backend_objects)}")
    points = _ops(converted, "dequantize_per_tensor")
    judged = report.record(backend).output
    feeding = _feeding(converted, list(report.results.oracle.outputs), judged)
    computed = [k for k, p in enumerate(points) if _computed(p) and (feeding is None or p in feeding)]
    checked: dict[int, tuple[Any, Any]] = {}
    spliced: dict[int, tuple[Any, Any]] = {}

    def check(k: int) -> bool:
        if k not in checked:
            results = int8_results(_truncated(converted, k), args, [chosen], trials=trials, widths=widths,
                                   spreads=spreads, requantizations=[], label=f"{report.results.label} to point {k}",
                                   progress=progress)  # fmt: skip
            checked[k] = (results, worst_record(compare(results, progress=False)))
        return checked[k][1].verdict == SUSPECT

    def splice(k: int) -> bool:
        if k not in spliced:
            value = _runtime_value(chosen, converted, args, k)
            if isinstance(value, torch.Tensor):
                graph = _spliced(converted, k, value)
                spliced[k] = _judged_as_report(report, chosen.name, lambda: graph(*args), judged)
            else:  # (the runtime failed on the cut: why)
                spliced[k] = (value, None)
        return spliced[k][1] is not None and spliced[k][1].verdict == SUSPECT

    culprit = _first_past(points, computed, check)
    full_run = ""
    if culprit is None and computed and report.record(backend).verdict == SUSPECT:
        # No cut judged alone is past the line, yet the whole is: a cut's own budget is wider than the model's
        # (its decisive search gave up where the model's finished, or a float op after the last requantization
        # moves what a cut cannot see).  Judge each point's value as the report does: spliced into the simulation.
        culprit = _first_past(points, computed, splice)
        full_run = SPLICED
    elif culprit is not None:
        # The first cut past the line on its own trials is past it, but the cuts upstream were judged on their own
        # budgets, each wider than the model's (a deeper model spreads further): a fault upstream of the cut may
        # not show alone.  Judge the points upstream as the report does, by the splice, and take the first past.
        first = _refined(points, computed, culprit, splice)
        if first != culprit:
            cut = " :: ".join(_place(points[culprit]))
            full_run = REFINED.format(cut=cut, first=" :: ".join(_place(points[first])))
            culprit = first
    rows, checks, names = [], {}, set()
    for k, (results, r), how in [*((k, checked[k], CUT) for k in sorted(checked)),
                                 *((k, spliced[k], SPLICE) for k in sorted(spliced))]:  # fmt: skip
        path, op = _place(points[k])
        name = f"{path} :: {op}" + (f" #{k}" if f"{path} :: {op}" in names else "")
        names.add(name)
        depth = path.count(".") + 1 if path != "(top level)" else 0
        if r is None:  # (the runtime failed on the cut: ``results`` is why)
            rows.append({"order": k, "name": name, "kind": "op", "depth": depth, "verdict": "error",
                         "output": judged, "reason": results, "notes": how.format(k=k, n=len(points))})  # fmt: skip
            continue
        checks[name] = (results, r.output)
        rows.append({
            "order": k, "name": name, "kind": "op", "depth": depth,
            "verdict": r.verdict, "output": r.output, "local_ratio_rmse": r.judgement.budget.ratio_rmse,
            "local_ratio_max": r.judgement.budget.ratio_max, "local_line": r.judgement.line, "reason": r.reason,
            "notes": how.format(k=k, n=len(points)),
        })  # fmt: skip
    module, op = _place(points[culprit]) if culprit is not None else (None, None)
    found = Found(rows, module, op, len(checked.keys() | spliced.keys()), checks=checks, source=report.source,
                  no_repro=NO_REPRO, full_run=full_run)  # fmt: skip
    loc = Localization(backend, False, found)
    if full_run and culprit is not None:
        loc.attribution = full_run[0].upper() + full_run[1:]  # (the finding says how it was found)
    loc.report = weakref.ref(report)
    return loc


__all__ = ["localize_int8"]
