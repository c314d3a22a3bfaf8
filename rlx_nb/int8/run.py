"""An int8 model's run, as a float model's: the oracle, the reference, the legitimate runs and each candidate, in one
:class:`~rlx_nb.execution.results.RunResults` that the shared comparison judges (:mod:`rlx_nb.comparison`).

- the **oracle** (``cpu``) is the PT2E Q/DQ simulation: the converted graph on the CPU in float32, each
  quantize/dequantize pair simulated (what a correct int8 kernel computes, up to each requantization's rounding);
- the **reference** (``fp64``) is the exact simulation: float64 between the quantize/dequantize ops, each
  requantization rounding the float64 value (:func:`~rlx_nb.int8.requantization.exact_simulation`) -- what fp64 is
  to a float model;
- the **trials** are the Q/DQ simulation again with every activation requantization rounding an element the other
  way where a correct kernel could (:func:`~rlx_nb.int8.requantization.rounded_at_random`, within each
  requantization's measured width): the legitimate runs the budget is measured from, as the oracle and the
  sequential-sums run are a float model's;
- each **candidate** is an int8 runtime given the converted graph (``compute_dtype`` ``int8``).

The environment says so (``environment["int8"]``: the trials, each output's quantum, each requantization's width).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import torch

from rlx_nb._support.meter import available_bytes, rss_bytes
from rlx_nb._support.progress import bar
from rlx_nb._support.tree import flatten
from rlx_nb.backends.base import ORACLE, Backend
from rlx_nb.backends.notes import add_note, collecting
from rlx_nb.errors import BackendError, describe_error, error_detail, still_interrupted
from rlx_nb.execution import cache as preparations
from rlx_nb.execution.environment import environment
from rlx_nb.execution.fingerprints import later
from rlx_nb.execution.results import ERROR, OK, BackendRun, Fingerprints, RunResults, to_leaf
from rlx_nb.int8 import decisive
from rlx_nb.int8.requantization import _op, exact_simulation, graph_copy, output_leaves
from rlx_nb.numerics.formats import INT8  # (also the key of ``environment`` that says a run is an int8 model's)


def output_quanta(converted: torch.fx.GraphModule, names: list[str]) -> dict[str, float | None]:
    """Each output's quantum: the scale of the dequantize that gives it (None for an output computed in float)."""
    quanta: dict[str, float | None] = {}
    for name, node in zip(names, output_leaves(converted), strict=False):
        is_dq = _op(node) == "dequantize_per_tensor" and isinstance(node.args[1], float)
        quanta[name] = float(node.args[1]) if is_dq else None
    return quanta


def _leaves(outputs: Any) -> dict[str, Any]:
    return {name: to_leaf(v, copy=True) for name, v in flatten(outputs)}


def _run(name: str, fn: Any, *, compute_dtype: str = "float32") -> BackendRun:
    # One run of the converted graph, timed; a failure is an error row with its gist and whole text.
    start = time.perf_counter()
    with collecting() as said:
        try:
            with torch.no_grad():
                outputs = _leaves(fn())
            status, message, detail = OK, "", ""
        except Exception as exc:
            still_interrupted(exc)
            outputs, status, message, detail = {}, ERROR, describe_error(exc), error_detail(exc)
    return BackendRun(name, status, outputs, message, time.perf_counter() - start, compute_dtype=compute_dtype,
                      notes=list(said), detail=detail)  # fmt: skip


_WRITES = ("copy_", "add_", "mul_", "fill_", "zero_", "index_put_")


def _writes_state(converted: torch.fx.GraphModule) -> bool:
    # Whether the graph writes a tensor in place (a step counter): a kept program would go on from the state its
    # last run left, so such a graph is lowered afresh each time.
    return any(n.op == "call_function" and (_op(n) or "").endswith(_WRITES) for n in converted.graph.nodes)


def runtime_outputs(backend: Backend, converted: torch.fx.GraphModule, args: tuple) -> Any:
    """``backend`` run on a copy of ``converted``.  A runtime with a prepare step (ExecuTorch's export and
    lowering, seconds each) is prepared once for the same graph, weights and input shapes, as a float model's is
    (:mod:`rlx_nb.execution.cache`): a re-run cell, a second report on the same model, or a localization that checks
    the graph the report ran, reuse it.  The graph's key is made afresh on every call (every weight hashed), so a
    weight changed in place between calls is a new preparation, never a stale one.  Kept preparations hold at most
    half of the memory that was free before this one was made (the least recently used dropped first), as a float
    model's run keeps them."""
    if backend.prepare is None or _writes_state(converted):
        return backend.fn(graph_copy(converted), args)
    k = (backend, preparations.settings_key(), preparations.model_key(converted), preparations.inputs_key(args), False)
    kept = preparations.lookup(k)
    if kept is not None:
        return preparations.run_kept(k, kept, args)
    start, before, free = time.perf_counter(), rss_bytes(), available_bytes()
    with collecting() as made:
        runner = backend.prepare(graph_copy(converted), args)
        out = runner(args)
    for note in made:
        add_note(note)
    held = max(0, rss_bytes() - before)
    preparations.store(k, preparations.Preparation(backend.name, None, runner, list(made),
                                                   time.perf_counter() - start, time.time(), held))  # fmt: skip
    preparations.fit(free // 2 if free else None)  # (kept ones hold at most half of what was free, as a run's do)
    return out


def int8_results(
    converted: torch.fx.GraphModule,
    args: tuple,
    backends: list[Backend],
    *,
    trials: int,
    widths: dict[str, float],
    requantizations: list[dict[str, Any]],
    spreads: dict[str, float] | None = None,
    search_runs: float | None = None,
    label: str,
    progress: bool = True,
) -> RunResults:
    """The oracle, reference, trials and candidates of ``converted`` on ``args`` (module docstring)."""
    with bar(f"int8 {label}", total=2 + trials + len(backends), enabled=progress) as shown:
        oracle = _run(ORACLE, lambda: converted(*args))
        if oracle.status != OK:
            raise BackendError(f"the Q/DQ simulation (the oracle) failed on the CPU: {oracle.message}")
        shown.update()
        quanta = output_quanta(converted, list(oracle.outputs))
        worlds, planned = decisive.find(
            converted, args, widths, oracle.outputs, spreads=spreads, search_runs=search_runs, quanta=quanta
        )
        forced = worlds.forced
        reference = _run("fp64", lambda: exact_simulation(converted, args, forced=forced), compute_dtype="float64")
        shown.update()
        runs = {}
        for k in range(trials):  # (every candidate rounded at random; then judged from its own nearest world)
            trial = _run(f"trial{k}", lambda k=k: planned.run(args, seed=k))
            runs[f"trial{k}"] = decisive.from_its_world(worlds, trial, oracle)
            shown.update()
        candidates = {}
        for b in backends:
            reason = b.unavailable_reason()

            def call(b: Backend = b, reason: str | None = reason) -> Any:
                if reason is not None:
                    raise BackendError(f"not available here: {reason}")
                return runtime_outputs(b, converted, args)

            candidates[b.name] = _run(b.name, call, compute_dtype=INT8)
            shown.update()
    accounted = decisive.accounts(worlds, candidates, oracle)
    env = environment()
    env[INT8] = {
        "oracle": "the PT2E Q/DQ simulation on the CPU (float32); the reference is the exact simulation (float64 "
        "between quantize/dequantize ops)",
        "trials": trials,
        "quanta": {k: (v if v is not None and math.isfinite(v) else None) for k, v in quanta.items()},
        "requantizations": requantizations,
        "decisive": [dataclasses.asdict(e) for e in worlds.elements],
        "candidates": worlds.candidates,
        "decisive_search": {
            "complete": worlds.complete,
            "runs": worlds.probes,
            "seconds": worlds.seconds,
            "left": worlds.left,
            "to_finish": worlds.to_finish,
            "outputs": sorted(worlds.scales),
        },
    }
    return RunResults(
        label=label,
        oracle=oracle,
        reference=reference,
        candidates=candidates,
        backward=False,
        environment=env,
        fingerprints=Fingerprints(later(args, converted, None)),
        trials=runs,
        discrete=accounted,
        worlds=worlds if worlds.elements else None,  # (none found: nothing to account, nothing kept)
    )


__all__ = ["int8_results", "output_quanta"]
