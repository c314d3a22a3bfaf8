"""int8 models: is a quantized runtime's gap quantization noise, or a kernel bug?

An int8 runtime is not judged against the float model (every element would be past an fp32 budget: quantization
moves outputs by whole quanta), nor against fp64.  Its oracle is the quantized model itself, as PT2E converts it:
each quantize/dequantize pair simulated in float32 on the CPU (the ``Q/DQ`` simulation, what a correct int8
kernel computes up to the rounding of each requantization).  A correct kernel may still land one quantum away
from the simulation wherever the value it requantizes sits near a rounding boundary (it accumulates in int32
exactly and applies the scale in its own order), and that one quantum then travels through the layers after it.

The budget measures that, rather than guessing it: the Q/DQ simulation is run ``trials`` more times with every
activation requantization rounded stochastically (each element within a *width* of a rounding boundary rounded
to the quantum below or above, at random: a rounding a correct kernel could make, one quantum at most per
requantization), and what those runs leave at each output -- its RMS, its largest element, each slice's RMS --
is the budget.  The width is measured for each requantization (:func:`requantizations`): one step of the integer
accumulator that feeds it, or the fp32 simulation's own arithmetic error there (against float64 from the same
quantized inputs) times a margin, whichever is larger.  A backend is SUSPECT past
the same limits as the float verdict (its RMS error 4x the budget's, its largest 8x, or one slice's RMS 4x what
the trials leave in that slice: one channel's scale off), "quantization noise" otherwise.

    >>> import rlx_nb
    >>> from rlx_nb.models import demo
    >>> model, inputs = demo.mlp()
    >>> report = rlx_nb.quantized_divergence(model, inputs)            # doctest: +SKIP
    >>> report.summary                                                    # doctest: +SKIP

Needs ExecuTorch (``pip install 'rlx_nb[executorch]'``): its XNNPACK quantizer makes the int8 model (per-channel
symmetric weights, per-tensor activations) and its runtimes are the candidates.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from rlx_nb._support.copies import module_copy
from rlx_nb._support.progress import bar
from rlx_nb._support.tree import flatten
from rlx_nb.backends.base import Backend
from rlx_nb.backends.registry import get_backend, resolve_backends
from rlx_nb.comparison.tables import Table
from rlx_nb.errors import BackendError, InputError, RlxError, describe_error
from rlx_nb.execution.prepare import normalize_inputs
from rlx_nb.quantize import calibration_batches, check_quantized, quantize_pt2e
from rlx_nb.requantization import (
    _QUANTIZE,
    _computed,
    _module_of,
    _op,
    _op_name,
    _ops,
    _truncated,
    requantizations,
    stochastic_copy,
)
from rlx_nb.verdict.types import MAX_LIMIT, RMSE_LIMIT, ROUNDOFF, SUSPECT, VERDICT_ERROR

CANDIDATES = ("executorch-xnnpack", "executorch-portable")
"""The int8 runtimes run by default: XNNPACK's int8 kernels, and the Q/DQ ops on ExecuTorch's portable kernels."""

TRIALS = 4
"""Stochastically rounded runs of the Q/DQ simulation that measure the budget."""

NOISE = "quantization noise"
BUG = "likely a kernel bug"

_DEQUANTIZE_CHANNEL = "dequantize_per_channel"


def is_quantized(model: Any) -> bool:
    """Whether ``model`` is a PT2E-converted graph (it holds quantize/dequantize ops)."""
    return isinstance(model, torch.fx.GraphModule) and bool(_ops(model, _QUANTIZE))


def channel_scale_fault(*, layer: int = 0, channel: int = 0, factor: float = 1.25, runtime: str = "executorch-xnnpack"):
    """A planted int8 kernel bug: ``runtime`` run with one output channel's weight scale of the ``layer``-th
    per-channel-quantized weight multiplied by ``factor`` (named ``int8-fault:scale@<layer>.<channel>x<factor>``).
    """
    inner = get_backend(runtime)

    def fn(model: Any, inputs: tuple) -> Any:
        faulty = module_copy(model, {})
        weights = _ops(faulty, _DEQUANTIZE_CHANNEL)
        if not -len(weights) <= layer < len(weights):
            raise InputError(f"layer {layer} is past the model's {len(weights)} per-channel weights")
        scale = weights[layer].args[1]
        values = getattr(faulty, scale.target).clone()
        values[channel] *= factor
        setattr(faulty, scale.target, values)
        return inner.fn(faulty, inputs)

    return Backend(
        f"int8-fault:scale@{layer}.{channel}x{factor:g}",
        fn,
        default=False,
        differentiable=False,
        probe=inner.probe,
        description=f"{runtime} with weight {layer}'s channel {channel} scale x{factor:g}",
    )


def _output_quanta(converted: torch.fx.GraphModule, names: list[str]) -> dict[str, float]:
    # Each output's quantum: the scale of the dequantize that produces it (NaN for an output computed in float).
    (output,) = [n for n in converted.graph.nodes if n.op == "output"]
    found = output.args[0]
    flat = (
        list(found.values())
        if isinstance(found, dict)
        else list(found)
        if isinstance(found, (tuple, list))
        else [found]
    )
    quanta = {}
    for name, node in zip(names, [n for n in flat if isinstance(n, torch.fx.Node)], strict=False):
        is_dq = _op(node) == "dequantize_per_tensor"
        quanta[name] = float(node.args[1]) if is_dq and isinstance(node.args[1], float) else math.nan
    return quanta


def _arrays(outputs: Any) -> dict[str, np.ndarray]:
    return {
        name: v.detach().cpu().to(torch.float64).numpy()
        for name, v in flatten(outputs)
        if isinstance(v, torch.Tensor) and v.is_floating_point()
    }


def _slice_rms(d: np.ndarray) -> list[tuple[int, np.ndarray]]:
    # Per axis of more than one element, the RMS of each slice along it.
    out = []
    for axis in range(d.ndim):
        if d.shape[axis] > 1 and d.size > d.shape[axis]:
            rest = tuple(a for a in range(d.ndim) if a != axis)
            out.append((axis, np.sqrt(np.mean(d * d, axis=rest))))
    return out


def judge(oracle: np.ndarray, got: np.ndarray, trials: Sequence[np.ndarray], quantum: float) -> dict[str, Any]:
    """The int8 verdict of one output (module docstring): the figures, the verdict and its reading."""
    d = got - oracle
    legit = [t - oracle for t in trials]
    # NaN/Inf the simulation does not have: no rounding explains them, and they would make every figure NaN.
    broken = int(np.count_nonzero(~np.isfinite(got) & np.isfinite(oracle)))
    d = np.where(np.isfinite(d), d, 0.0)
    rms = float(np.sqrt(np.mean(d * d))) if d.size else 0.0
    worst = float(np.abs(d).max(initial=0.0))
    floor = quantum if quantum == quantum else 1e-30
    budget_rmse = max(
        max((float(np.sqrt(np.mean(t * t))) for t in legit), default=0.0), floor / math.sqrt(max(d.size, 1))
    )
    budget_max = max(max((float(np.abs(t).max(initial=0.0)) for t in legit), default=0.0), floor)
    ratio_slice, slice_at = 0.0, None
    legit_slices = [dict(_slice_rms(t)) for t in legit]  # each trial's per-axis slice RMS, once
    for axis, got_rms in _slice_rms(d):
        allowed = np.max([slices[axis] for slices in legit_slices], axis=0)
        ratios = got_rms / np.maximum(allowed, budget_rmse)
        k = int(np.argmax(ratios))
        if ratios[k] > ratio_slice:
            ratio_slice, slice_at = float(ratios[k]), (axis, k)
    line = max(rms / budget_rmse / RMSE_LIMIT, worst / budget_max / MAX_LIMIT, ratio_slice / RMSE_LIMIT)
    if broken:
        line = math.inf
    verdict = SUSPECT if line > 1.0 else ROUNDOFF
    q = quantum  # (NaN for an output computed in float: its figures in quanta are NaN too)
    return {
        "verdict": verdict,
        "reading": BUG if verdict == SUSPECT else NOISE,
        "line": line,
        "max_abs": worst,
        "rmse": rms,
        "max_quanta": worst / q,
        "budget_rmse": budget_rmse,
        "budget_max": budget_max,
        "budget_max_quanta": budget_max / q,
        "slice_ratio": ratio_slice,
        "slice_axis": slice_at[0] if slice_at else None,
        "slice_index": slice_at[1] if slice_at else None,
        "mismatched": int(np.count_nonzero(d)) + broken,
        "nonfinite": broken,
        "quantum": q,
    }


def _why(row: dict[str, Any]) -> str:
    where = f"axis {row['slice_axis']} index {row['slice_index']}" if row["slice_axis"] is not None else "it"
    quanta = f" ({row['max_quanta']:.3g} quanta)" if row["quantum"] == row["quantum"] else ""
    if row["verdict"] == SUSPECT:
        if row.get("nonfinite"):
            return (f"{BUG}: {row['nonfinite']} NaN/Inf element(s) where the Q/DQ simulation is finite (no rounding "
                    "explains them)")  # fmt: skip
        if row["slice_ratio"] / RMSE_LIMIT >= row["line"] - 1e-12:
            return (f"{BUG}, {row['line']:.3g}x the line: the slice at {where} is {row['slice_ratio']:.3g}x what "
                    "requantization rounding leaves there")  # fmt: skip
        return f"{BUG}, {row['line']:.3g}x the line: its largest error {row['max_abs']:.3g}{quanta}"
    return (f"{NOISE}, {row['line']:.2g} of the line: its largest error {row['max_abs']:.3g}{quanta} against "
            f"{row['budget_max']:.3g} that requantization rounding leaves")  # fmt: skip


def localize_int8(
    converted: torch.fx.GraphModule, backend: Backend, args: tuple, *, trials: int, width: float | dict[str, float]
) -> dict:
    """The first requantization point (in graph order) where ``backend`` is past the int8 budget, found by
    bisection (a divergence is taken to persist downstream, as Polygraphy's reduction does), its op and module.
    Only points that hold a computed value are bisected: a quantized constant (a bias or an epsilon, folded by
    PT2E) matches everywhere and would break the bisection's order."""
    points = _ops(converted, "dequantize_per_tensor")
    computed = [k for k, p in enumerate(points) if _computed(p)]
    checked: dict[int, dict] = {}

    def check(k: int) -> dict:
        if k not in checked:
            cut = _truncated(converted, k)
            with torch.no_grad():
                (sim,) = _arrays(cut(*args)).values()
                legit = [next(iter(_arrays(stochastic_copy(cut, seed=t, width=width)(*args)).values()))
                         for t in range(trials)]  # fmt: skip
            got = next(iter(_arrays(backend.fn(module_copy(cut, {}), args)).values()))
            scale = points[k].args[1]
            checked[k] = judge(sim, got, legit, float(scale) if isinstance(scale, float) else math.nan)
        return checked[k]

    lo, hi = 0, len(computed) - 1
    if not computed or check(computed[hi])["verdict"] != SUSPECT:
        return {"point": None, "op": None, "module": None, "checked": len(checked), "rows": checked}
    while lo < hi:
        mid = (lo + hi) // 2
        if check(computed[mid])["verdict"] == SUSPECT:
            hi = mid
        else:
            lo = mid + 1
    point = points[computed[lo]]
    return {"point": computed[lo], "op": _op_name(point.args[0]), "module": _module_of(point), "checked": len(checked),
            "rows": checked}  # fmt: skip


class QuantizedReport:
    """An int8 model's runtimes against its Q/DQ simulation: ``summary`` (one row per backend and output),
    ``suspects``, ``arrays(backend, output)`` and ``plot_heatmap(backend, output)``."""

    def __init__(self, label: str, converted: Any, rows: list[dict], arrays: dict, notes: dict[str, list[str]]):
        self.label, self.converted, self.rows, self._arrays, self.notes = label, converted, rows, arrays, notes
        self.run: dict[str, Any] = {}  # the inputs, the backends by name, trials and width: what localize reruns

    def localize(self, backend: str | None = None) -> dict[str, Any]:
        """Where ``backend``'s int8 error is born (default: the first suspect): the first requantization point of
        the graph past the budget and the op and module that computed it (``point``, ``op``, ``module``,
        ``checked``: how many truncated graphs were lowered and judged, ``rows``: their judgements).  ``point`` is
        None when the last point is within the budget (the error is in an output computed in float after it)."""
        backend = backend or (self.suspects[0] if self.suspects else None)
        if backend is None:
            raise InputError("no SUSPECT backend to localize; name one: report.localize('executorch-xnnpack')")
        if backend not in self.run.get("backends", {}):
            raise InputError(f"backend {backend!r} did not run here; it ran: {sorted(self.run.get('backends', {}))}")
        return localize_int8(self.converted, self.run["backends"][backend], self.run["args"], trials=self.run["trials"],
                             width=self.run["width"])  # fmt: skip

    @property
    def summary(self) -> Table:
        columns = ["backend", "output", "verdict", "reading", "line", "why", "max_abs", "max_quanta",
                   "budget_max_quanta", "rmse", "budget_rmse", "slice_ratio", "slice_axis", "slice_index", "quantum"]  # fmt: skip
        return Table([{c: r.get(c) for c in columns} for r in self.rows], columns=columns)

    @property
    def suspects(self) -> list[str]:
        return list(dict.fromkeys(r["backend"] for r in self.rows if r["verdict"] == SUSPECT))

    @property
    def widths(self) -> Table:
        """Each activation requantization (graph order): the op and module that computed it, its accumulator's step
        and the fp32 simulation's error there (in its quanta), and the width the trials round it within
        (:func:`requantizations`; a ``width=`` given to the call replaces the measured one)."""
        columns = ["node", "op", "module", "accumulator_quantum", "fp32_error", "width"]
        return Table(self.run.get("requantizations", []), columns=columns)

    @property
    def any_suspect(self) -> bool:
        return bool(self.suspects)

    def record(self, backend: str, output: str | None = None) -> dict[str, Any]:
        """The row of ``backend``'s ``output`` (default: its worst)."""
        rows = [r for r in self.rows if r["backend"] == backend and (output is None or r["output"] == output)]
        if not rows:
            raise InputError(f"no row for backend {backend!r} output {output!r}; backends: {sorted(self.notes)}")
        return max(rows, key=lambda r: r["line"] if r["line"] == r["line"] else -1.0)

    def arrays(self, backend: str, output: str | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(oracle, backend)``: the Q/DQ simulation's output and the backend's, float64."""
        row = self.record(backend, output)
        return self._arrays["oracle"][row["output"]], self._arrays[backend][row["output"]]

    def plot_heatmap(self, backend: str, output: str | None = None, **kwargs: Any):
        """The backend's error in quanta of the output, element by element (:func:`rlx_nb.plot.heatmap.plot_heatmap`)."""
        from rlx_nb.plot.heatmap import plot_heatmap

        row = self.record(backend, output)
        oracle, got = self.arrays(backend, row["output"])
        kwargs.setdefault("title", f"{backend} · x int8 budget")
        # (the simulation is the reference here: the error is the backend's from it, in units of the budget)
        return plot_heatmap(oracle, got, oracle, metric="budget", budget=row["budget_max"], **kwargs)

    def lines(self) -> list[str]:
        return [f"rlx_nb: [{self.label}] {r['backend']} (int8) {r['output']}: {r['why']}" for r in self.rows]

    def __repr__(self) -> str:
        return f"<QuantizedReport {self.label!r}: {len(self.notes)} backend(s) vs the Q/DQ simulation, suspects={self.suspects}>"


def _checked_call(model: Any, inputs: Any, backends: Any, calibration: Any, *, trials: Any, width: Any) -> tuple:
    # The call's options, inputs and model checked, and the model quantized: (args, backends, converted graph).
    if not isinstance(trials, int) or isinstance(trials, bool) or trials < 2:
        raise InputError(f"trials must be an int of at least 2 (the budget's runs); got {trials!r}")
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
    label: str | None = None,
    progress: bool = True,
) -> QuantizedReport:
    """Judge int8 runtimes of ``model`` against its PT2E Q/DQ simulation (module docstring).

    ``model``: a float ``nn.Module`` (quantized here: :func:`quantize_pt2e`, calibrated on ``calibration`` or
    ``inputs``) or a PT2E-converted graph.  ``backends``: names or :class:`Backend` objects run on the converted
    graph (default :data:`CANDIDATES`).  ``trials``: stochastically rounded runs that measure the budget.
    ``width``: how close to a rounding boundary, in quanta, a value may sit and round the other way in a trial;
    default: measured for each requantization (:func:`~rlx_nb.requantization.requantizations`, shown by
    ``report.widths``).
    """
    label = label or type(getattr(model, "_orig_mod", model)).__name__
    try:
        args, chosen, converted = _checked_call(model, inputs, backends, calibration, trials=trials, width=width)
    except RlxError as exc:  # (the caller's context first, no traceback through rlx_nb's internals)
        raise type(exc)(f"quantized_divergence({label}): {exc}") from None
    names = [b.name for b in chosen]
    shown = bar(f"int8 {label}", total=2 + trials + len(chosen), enabled=progress)
    with torch.no_grad():
        oracle = _arrays(converted(*args))
        shown.update()
        measured = requantizations(converted, args)
        if width is not None:  # (one width given: it replaces the measured ones)
            measured = [{**r, "width": float(width)} for r in measured]
        widths = {r["node"]: r["width"] for r in measured}
        shown.update()
        trial_runs = []
        for k in range(trials):
            trial_runs.append(_arrays(stochastic_copy(converted, seed=k, width=widths)(*args)))
            shown.update()
    quanta = _output_quanta(converted, list(oracle))
    rows, kept, notes = [], {"oracle": oracle}, {}
    from rlx_nb.backends.notes import collecting

    for name, backend in zip(names, chosen, strict=True):
        reason = backend.unavailable_reason()
        with collecting() as said:
            try:
                if reason is not None:
                    raise BackendError(f"not available here: {reason}")
                got = _arrays(backend.fn(module_copy(converted, {}), args))
                error = None
            except Exception as exc:
                got, error = {}, describe_error(exc)
        shown.update()
        notes[name] = list(said)
        if error is not None:
            rows.append({"backend": name, "output": None, "verdict": VERDICT_ERROR, "reading": "", "line": math.nan,
                         "why": f"error: {error}"})  # fmt: skip
            continue
        kept[name] = got
        for out, o in oracle.items():
            if out not in got or got[out].shape != o.shape:
                rows.append({"backend": name, "output": out, "verdict": VERDICT_ERROR, "reading": "", "line": math.nan,
                             "why": f"error: output {out} missing or of another shape"})  # fmt: skip
                continue
            row = {"backend": name, "output": out, **judge(o, got[out], [t[out] for t in trial_runs], quanta[out])}
            row["why"] = _why(row)
            rows.append(row)
    shown.close()
    report = QuantizedReport(label, converted, rows, kept, notes)
    report.run = {"args": args, "backends": dict(zip(names, chosen, strict=True)), "trials": trials, "width": widths,
                  "requantizations": measured}  # fmt: skip
    if progress:
        for line in report.lines():
            print(line)
    return report


__all__ = [
    "QuantizedReport",
    "channel_scale_fault",
    "quantized_divergence",
]
