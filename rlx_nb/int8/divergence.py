"""int8 models: is a quantized runtime's gap requantization rounding, or a kernel bug?

An int8 runtime is not judged against the float model (every element would be past an fp32 budget: quantization
moves outputs by whole quanta).  Its oracle is the quantized model itself, as PT2E converts it, run on the CPU: each
quantize/dequantize pair simulated in float32 (the ``Q/DQ`` simulation, what a correct int8 kernel computes up to
the rounding of each requantization), and its reference the same graph in float64 (:mod:`rlx_nb.int8.run`).

The call is a float model's call with another budget: its runs are one :class:`~rlx_nb.execution.results.RunResults`,
judged by the same comparison and verdict into the same :class:`~rlx_nb.DivergenceReport` -- its lines, tables,
plots, explorer, HTML, file, merge, baseline and gates.  The one difference is what the budget is measured from.  A
correct kernel may land one quantum away from the simulation wherever the value it requantizes sits within its own
arithmetic's reach of a rounding boundary (it accumulates in int32 exactly, rounds its bias to the accumulator's
grid and applies the scale in its own order), and that quantum then travels through the layers after it.  The
Q/DQ simulation run ``trials`` more times, each requantization rounding an element the other way at random within
that reach (its *width*, measured for each requantization: :func:`~rlx_nb.int8.requantization.requantizations`),
gives legitimate runs beside the oracle, as the sequential-sums run is for a float model: the budget is what they
leave (their RMS error, their largest, each slice's), never less than one element one quantum off.  Past the same
limits as a float model's, a backend is SUSPECT.  A few values whose rounding alone moves the whole output (one
element of the zoo's Llama) are not left to the trials' chance: each way of rounding them is a world of its own, and
a runtime is judged from the world nearest it (:mod:`rlx_nb.int8.decisive`).

    >>> import rlx_nb
    >>> from rlx_nb.models import demo
    >>> model, inputs = demo.mlp()
    >>> report = rlx_nb.quantized_divergence(model, inputs)            # doctest: +SKIP
    >>> report.summary                                                    # doctest: +SKIP

Needs ExecuTorch (``pip install 'rlx_nb[executorch]'``): its XNNPACK quantizer makes the int8 model (per-channel
symmetric weights, per-tensor activations) and its runtimes are the candidates.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from rlx_nb.backends.base import Backend
from rlx_nb.backends.registry import resolve_backends
from rlx_nb.comparison.compare import compare
from rlx_nb.errors import InputError, RlxError
from rlx_nb.execution.prepare import normalize_inputs
from rlx_nb.execution.source import WeakSource
from rlx_nb.int8.quantize import calibration_batches, check_quantized, quantize_pt2e
from rlx_nb.int8.requantization import _QUANTIZE, _ops, requantizations
from rlx_nb.int8.run import int8_results
from rlx_nb.report.report import DivergenceReport

CANDIDATES = ("executorch-xnnpack", "executorch-portable")
"""The int8 runtimes run by default: XNNPACK's int8 kernels, and the Q/DQ ops on ExecuTorch's portable kernels."""

TRIALS = 4
"""Runs of the Q/DQ simulation with requantizations rounded as a correct kernel may: the budget's legitimate runs."""


def is_quantized(model: Any) -> bool:
    """Whether ``model`` is a PT2E-converted graph (it holds quantize/dequantize ops)."""
    return isinstance(model, torch.fx.GraphModule) and bool(_ops(model, _QUANTIZE))


def _checked_call(model: Any, inputs: Any, backends: Any, calibration: Any, *, trials: Any, width: Any,
                  search_runs: Any = None) -> tuple:  # fmt: skip
    # The call's options, inputs and model checked, and the model quantized: (args, backends, converted graph).
    if not isinstance(trials, int) or isinstance(trials, bool) or trials < 2:
        raise InputError(f"trials must be an int of at least 2 (the budget's runs); got {trials!r}")
    if search_runs is not None and (isinstance(search_runs, bool) or not isinstance(search_runs, (int, float))
                                    or not search_runs >= 1):  # fmt: skip
        raise InputError(f"search_runs must be None (a time budget), a number of runs >= 1 or math.inf (until the "
                         f"search is complete); got {search_runs!r}")  # fmt: skip
    if width is not None and (not isinstance(width, (int, float)) or isinstance(width, bool) or not 0 < width <= 0.5):
        raise InputError(
            f"width must be None (measured) or a number of quanta in (0, 0.5] (0.5: any rounding); got {width!r}"
        )
    args = tuple(normalize_inputs(inputs)[0])
    # (the inputs as given: keyword inputs make the quantized graph take them positionally, as ``args`` are)
    given = CANDIDATES if backends is None else [backends] if isinstance(backends, Backend) else backends
    chosen = resolve_backends(given)  # (the registry's parsing and errors: names, a comma string, Backend objects)
    if not chosen:
        raise InputError(f"backends={backends!r} leaves no int8 runtime to judge (cpu is the float oracle, run "
                         f"here as the Q/DQ simulation); name one: {', '.join(CANDIDATES)}, or your own")  # fmt: skip
    if is_quantized(model):
        if calibration is not None:
            raise InputError("calibration= is for a float model; this one is already converted (its quantization "
                             "parameters are fixed): drop calibration=, or pass the float model")  # fmt: skip
        calibration_batches(args, None)  # (the inputs' values: finite)
        check_quantized(model)
        converted = model
    else:
        converted = quantize_pt2e(model, inputs, calibration=calibration)
    return args, chosen, converted


def quantized_divergence(
    model: Any,
    inputs: Any,
    *,
    backends: str | Iterable[str | Backend] | None = None,
    calibration: Iterable[Any] | None = None,
    trials: int = TRIALS,
    width: float | None = None,
    search_runs: float | None = None,
    label: str | None = None,
    progress: bool = True,
) -> DivergenceReport:
    """Judge int8 runtimes of ``model`` against its PT2E Q/DQ simulation (module docstring): a
    :class:`~rlx_nb.DivergenceReport` like :func:`rlx_nb.backend_divergence`'s, its oracle the simulation.

    ``model``: a float ``nn.Module`` (quantized here: :func:`~rlx_nb.int8.quantize.quantize_pt2e`, calibrated on
    ``calibration`` or ``inputs``) or a PT2E-converted graph.  ``backends``: names or :class:`Backend` objects run
    on the converted graph (default :data:`CANDIDATES`).  ``trials``: runs that measure the budget.  ``width``: how
    close to a rounding boundary, in quanta, a value may sit and round the other way in a trial; default: measured
    for each requantization (``report.requantizations`` shows them).  ``search_runs``: the most runs of the
    simulation the search for decisive elements may take (default: up to
    :data:`~rlx_nb.int8.decisive.SEARCH_SECONDS`; ``math.inf``: until it finds them all).  Where it gives up, the
    budget is as wide as every candidate's rounding leaves it, and the report says so, with what finishing would
    cost.  ``report.localize(backend)`` finds the first requantization past the budget, its op and module.
    """
    label = label or type(getattr(model, "_orig_mod", model)).__name__
    try:
        args, chosen, converted = _checked_call(model, inputs, backends, calibration, trials=trials, width=width,
                                                search_runs=search_runs)  # fmt: skip
    except RlxError as exc:  # (the caller's context first, no traceback through rlx_nb's internals)
        raise type(exc)(f"quantized_divergence({label}): {exc}") from None
    with torch.no_grad():
        measured = requantizations(converted, args)
    if width is not None:  # (one width given: it replaces the measured ones, and the trials jitter within it)
        measured = [{**r, "width": float(width), "spread": float(width)} for r in measured]
    widths = {r["node"]: r["width"] for r in measured}
    spreads = {r["node"]: r["spread"] for r in measured}
    results = int8_results(converted, args, chosen, trials=trials, widths=widths, requantizations=measured,
                           spreads=spreads, search_runs=search_runs, label=label, progress=progress)  # fmt: skip
    report = DivergenceReport(results, compare(results, progress=False), rule="budget", tol_rel=None,
                              source=WeakSource(converted, args, None))  # fmt: skip
    report.backend_objects = {b.name: b for b in chosen}

    def localize(backend: str | None = None, **kwargs: Any):
        from rlx_nb.int8.locate import localize_int8

        return localize_int8(report, converted, args, backend, trials=trials, widths=widths, spreads=spreads,
                             **kwargs)  # fmt: skip

    report.localizer = localize
    return report  # (its lines are its repr's: printed here too, a notebook showed them twice)


__all__ = ["CANDIDATES", "TRIALS", "is_quantized", "quantized_divergence"]
