"""Planted int8 kernel bugs: a runtime run on a copy of the converted graph with one thing wrong, as a kernel could
have it wrong -- one channel's weight scale, one weight's sign, one channel's bias, a requantization that truncates.
Each is a :class:`~rlx_nb.backends.base.Backend` named for what it plants (``int8-fault:sign@0.1``), for tests,
benchmarks and notebooks: what :func:`rlx_nb.quantized_divergence` must call a kernel bug."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rlx_nb.backends.base import Backend
from rlx_nb.backends.registry import get_backend
from rlx_nb.errors import InputError
from rlx_nb.int8.requantization import _QUANTIZE, _op, _ops, attr, graph_copy

_DEQUANTIZE_CHANNEL = "dequantize_per_channel"


def _set_attr(module: torch.nn.Module, target: str, value: torch.Tensor) -> None:
    *path, last = target.split(".")
    for part in path:
        module = getattr(module, part)
    if isinstance(getattr(module, last), torch.nn.Parameter):
        value = torch.nn.Parameter(value, requires_grad=False)
    setattr(module, last, value)


def _weight(graph: torch.fx.GraphModule, layer: int, channel: int) -> torch.fx.Node:
    # The ``layer``-th per-channel-quantized weight's dequantize, with ``channel`` one of its output channels.
    weights = _ops(graph, _DEQUANTIZE_CHANNEL)
    if not isinstance(layer, int) or not -len(weights) <= layer < len(weights):
        raise InputError(f"layer {layer!r} is past the model's {len(weights)} per-channel-quantized weights")
    channels = len(attr(graph, weights[layer].args[1].target))
    if not isinstance(channel, int) or not 0 <= channel < channels:
        raise InputError(f"channel {channel!r} is past weight {layer}'s {channels} output channels")
    return weights[layer]


def _planted(name: str, description: str, plant: Callable[[torch.fx.GraphModule], None], runtime: str) -> Backend:
    inner = get_backend(runtime)

    def planted(model: Any) -> torch.fx.GraphModule:
        faulty = graph_copy(model)
        plant(faulty)
        faulty.recompile()
        return faulty

    def fn(model: Any, inputs: tuple) -> Any:
        return inner.fn(planted(model), inputs)

    # (prepared as its runtime is: the same fault on the same graph is lowered once, rlx_nb.int8.run.runtime_outputs)
    prepare = None if inner.prepare is None else lambda model, inputs: inner.prepare(planted(model), inputs)
    return Backend(name, fn, prepare=prepare, default=False, differentiable=False, probe=inner.probe,
                   description=f"{runtime} with {description}")  # fmt: skip


def channel_scale_fault(*, layer: int = 0, channel: int = 0, factor: float = 1.25, runtime: str = "executorch-xnnpack"):
    """``runtime`` with one output channel's weight scale of the ``layer``-th per-channel-quantized weight multiplied
    by ``factor`` (``int8-fault:scale@<layer>.<channel>x<factor>``)."""

    def plant(g: torch.fx.GraphModule) -> None:
        scale = _weight(g, layer, channel).args[1]
        values = attr(g, scale.target).clone()
        values[channel] *= factor
        _set_attr(g, scale.target, values)

    return _planted(f"int8-fault:scale@{layer}.{channel}x{factor:g}",
                    f"weight {layer}'s channel {channel} scale x{factor:g}", plant, runtime)  # fmt: skip


def weight_sign_fault(*, layer: int = 0, channel: int = 0, runtime: str = "executorch-xnnpack"):
    """``runtime`` with the largest int8 weight of one output channel of the ``layer``-th weight negated
    (``int8-fault:sign@<layer>.<channel>``)."""

    def plant(g: torch.fx.GraphModule) -> None:
        values = _weight(g, layer, channel).args[0]
        w = attr(g, values.target).clone()
        row = w[channel].reshape(-1)
        k = int(row.abs().argmax())
        row[k] = -row[k]
        w[channel] = row.reshape(w[channel].shape)
        _set_attr(g, values.target, w)

    return _planted(f"int8-fault:sign@{layer}.{channel}", f"weight {layer}'s channel {channel} largest weight negated",
                    plant, runtime)  # fmt: skip


def bias_fault(*, layer: int = 0, channel: int = 0, quanta: float = 3.0, runtime: str = "executorch-xnnpack"):
    """``runtime`` with one output channel's bias of the ``layer``-th weight's op moved by ``quanta`` quanta of the
    requantization after it (``int8-fault:bias@<layer>.<channel>+<quanta>q``)."""

    def plant(g: torch.fx.GraphModule) -> None:
        op = next(iter(_weight(g, layer, channel).users))
        bias = op.args[2] if len(op.args) > 2 else None
        if not isinstance(bias, torch.fx.Node) or bias.op != "get_attr":
            raise InputError(f"weight {layer}'s op ({_op(op)}) has no bias to move")
        after = op
        while _op(after) != _QUANTIZE and after.users:
            after = next(iter(after.users))
        values = attr(g, bias.target).detach().clone()
        values[channel] += quanta * float(after.args[1])
        _set_attr(g, bias.target, values)

    return _planted(f"int8-fault:bias@{layer}.{channel}+{quanta:g}q",
                    f"weight {layer}'s channel {channel} bias {quanta:+g} quanta", plant, runtime)  # fmt: skip


def truncation_fault(*, point: int = -1, runtime: str = "executorch-xnnpack"):
    """``runtime`` with the ``point``-th activation requantization (of a computed value) rounding down instead of
    to nearest: half a quantum taken off before it rounds (``int8-fault:truncate@<point>``)."""

    def plant(g: torch.fx.GraphModule) -> None:
        points = [
            q for q in _ops(g, _QUANTIZE) if isinstance(q.args[0], torch.fx.Node) and q.args[0].op != "placeholder"
        ]
        if not isinstance(point, int) or not -len(points) <= point < len(points):
            raise InputError(f"point {point!r} is past the model's {len(points)} requantizations of computed values")
        q = points[point]
        with g.graph.inserting_before(q):
            down = g.graph.call_function(torch.ops.aten.sub.Tensor, (q.args[0], 0.5 * float(q.args[1])))
        q.args = (down, *q.args[1:])

    return _planted(f"int8-fault:truncate@{point}", f"requantization {point} rounding down", plant, runtime)


def half_up_runtime(name: str = "int8-half-up") -> Backend:
    """A correct int8 runtime that rounds ties half up where PyTorch's Q/DQ ops round them half to even: the Q/DQ
    simulation on the CPU with that one change.  Legitimate: the verdict must call it round-off."""

    def quantize(x, scale, zero_point, quant_min, quant_max, dtype):
        return torch.clamp(torch.floor(x * (1.0 / scale) + 0.5) + zero_point, quant_min, quant_max).to(dtype)

    def fn(model: Any, inputs: tuple) -> Any:
        g = graph_copy(model)
        for q in _ops(g, _QUANTIZE):
            q.target = quantize
        g.recompile()
        with torch.no_grad():
            return g(*inputs)

    return Backend(name, fn, default=False, differentiable=False,
                   description="the Q/DQ simulation rounding ties half up (a correct runtime's other tie rule)")  # fmt: skip


__all__ = ["bias_fault", "channel_scale_fault", "half_up_runtime", "truncation_fault", "weight_sign_fault"]
