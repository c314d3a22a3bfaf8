"""Requantization: where a correct int8 kernel may round a value the other way, and the runs that measure it.

An int8 kernel requantizes each activation: it rounds a value it computed (exactly, in int32, or in float between
quantized ops) to the nearest quantum.  It may round the other way from the Q/DQ simulation only where the value
sits close to a rounding boundary, and how close is measured here for each requantization (its *width*):
:func:`requantizations` runs the simulation in lockstep with a float64 copy fed the same quantized values (the
simulation's own arithmetic error there) and reads the step of the integer accumulator that feeds it.
:func:`rounded_at_random` rounds within those widths, as the trial runs do (:mod:`rlx_nb.int8.decisive`); :func:`exact_simulation` is what the
quantized model computes with exact arithmetic.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from rlx_nb._support.copies import module_copy
from rlx_nb.errors import still_interrupted

CONTRACTION_STEPS = 0.5
"""A matmul's or convolution's requantization width, in steps of the accumulator that feeds it, where it adds a
bias.  An int8 kernel accumulates exactly on the grid of its two inputs' scales' product and rounds its bias to that
grid (int32), so the value it requantizes is at most half a step from the exact one.  Measured (ExecuTorch 1.5.1's
XNNPACK int8, the demo MLP, CNN and transformer): at the first requantization where it differs from the simulation,
every element it rounds the other way lies within 0.41 of that step from the rounding boundary.  Without a bias the
accumulator is exact, and only the arithmetic that scales it is left (:data:`ARITHMETIC_MARGIN`): XNNPACK gives the
simulation bit for bit on Llama and GPT-2, whose projections have none, where half a step at each of their 15 linears
made trials that left 1.6-1.8 quanta RMS at the logits."""

AVERAGE_STEPS = 1.0
"""A mean's (an average pool's) width, in steps of its grid (its input's quantum over the count it averages): the
kernel divides on that grid.  Measured: within 1.0 step (the demo CNN's global mean)."""

ARITHMETIC_MARGIN = 8.0
"""A requantization's width, in multiples of the fp32 simulation's own error there: a float op between quantized
ones (a norm, a softmax, an activation) computed in another order or with another approximation.  Measured: XNNPACK's
first flips after a linear lie within 4x the simulation's error (which is at most 2e-4 quanta on the zoo)."""

RELATIVE_REACH = 2.0**-22
"""Every element's width is at least this much of its own value (in quanta): two float32 steps of it, as far as a
correctly rounded float32 op computed another way (an FMA, another order of one rounding) can move it.  An exact
tie (a value on the boundary) is within it, and kernels round ties either way."""

TRIAL_MARGIN = 4.0
"""A trial's spread where a requantization's width is its fp32 arithmetic's, in multiples of the simulation's *mean*
fp32 error there.  The width bounds where a correct kernel may round the other way (the largest error, with margin);
how often it does is another figure.  Jitter uniform within a spread ``r`` rounds a fraction ``r/2`` of the elements
the other way; a kernel whose own error is independent of the simulation's and of its size rounds a fraction
``E|e1 - e2|`` = sqrt(2) x the mean error the other way, one with 1.7x the simulation's error 2x.  At 4x the mean error
the trials flip as often as the latter; within the whole width (8x the *largest* error, about 30x the mean) they
flipped 8-10x as often as any correct kernel does, and on a deep model (T5 at batch 1) those flips alone moved the
logits by 1-2 quanta RMS where XNNPACK and portable move them by none (#48).  An accumulator's reach (a bias rounded to
its grid) is added whole: that rounding is uniform, as the jitter is, and a kernel's deviation is the sum of the two
(on the demo MLP's first linear XNNPACK rounds 20 of 131072 elements the other way; the larger of the two parts alone
would flip 12.8, their sum 20-23)."""

FALLBACK_WIDTH = 0.02
"""The width of a requantization whose fp32 error could not be measured (an op that would not run in float64)."""

_QUANTIZE = "quantize_per_tensor"
_DEQUANTIZE = ("dequantize_per_tensor", "dequantize_per_channel")
_WRAPPERS = "rlx_nb_wrappers"  # (how many wrapper modules quantize_pt2e put around the model: its paths' prefix)


def _op(node: Any) -> str | None:
    # A call_function node's op without its namespace and overload (``aten.linear.default`` -> ``linear``).
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return None
    target = str(node.target)
    return target.split(".")[-2] if target.count(".") >= 2 else target


def _ops(graph_module: torch.fx.GraphModule, kind: str) -> list[torch.fx.Node]:
    # The call_function nodes of one quantized_decomposed op (quantize_per_tensor's overloads, not dequantize).
    return [n for n in graph_module.graph.nodes if _op(n) == kind]


_THROUGH = frozenset({
    "relu", "relu_", "hardtanh", "hardtanh_", "clamp", "view", "reshape", "_unsafe_view", "permute", "transpose", "t",
    "expand", "clone", "contiguous", "squeeze", "unsqueeze", "flatten", "slice", "select", "_to_copy", "alias", "pad",
    "constant_pad_nd", "dropout",
})  # fmt: skip
"""Ops that move or clip a value without computing a new one (a dropout in an inference graph passes it as it is): a
requantization's accumulator is the op before them."""

CORRECTLY_ROUNDED = frozenset({
    "input", "add", "sub", "rsub", "mul", "div", "neg", "abs", "cat", "stack", "to", "maximum", "minimum", "where",
}) | _THROUGH  # fmt: skip
"""Ops IEEE float32 computes to one correctly rounded result, and those that only move or clip values
(:data:`_THROUGH`): any correct kernel gives their value bit for bit, so they add no width of their own beyond
:data:`RELATIVE_REACH` (the fp32 error the lockstep run measures after them is the simulation's rounding of that one
result, which a kernel shares).  A model input's quantization is one of them."""

_CONTRACTIONS = frozenset({"linear", "conv1d", "conv2d", "conv3d", "convolution", "matmul", "mm", "bmm", "addmm",
                           "baddbmm", "einsum"})  # fmt: skip
_AVERAGES = frozenset({"mean", "sum", "avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d",
                       "adaptive_avg_pool2d", "adaptive_avg_pool3d"})  # fmt: skip


def attr(module: torch.nn.Module, target: str) -> Any:
    """The tensor (or module) a ``get_attr`` node's dotted ``target`` names in ``module``."""
    for part in target.split("."):
        module = getattr(module, part)
    return module


def output_leaves(graph_module: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The nodes a graph returns, in its outputs' order (a dict's values, a tuple's items, or the one node)."""
    (output,) = [n for n in graph_module.graph.nodes if n.op == "output"]
    found = output.args[0]
    flat = (
        list(found.values())
        if isinstance(found, dict)
        else list(found)
        if isinstance(found, (tuple, list))
        else [found]
    )
    return [n for n in flat if isinstance(n, torch.fx.Node)]


def _behind_moves(node: Any) -> Any:
    # The op that computed ``node``'s value, past the ops that only move or clip it (:data:`_THROUGH`).
    while _op(node) in _THROUGH:
        node = node.args[0]
    return node


def _input_scale(node: Any, module: torch.fx.GraphModule) -> float | None:
    # The quantum ``node`` carries when it is a dequantized value (the largest, for a per-channel one), else None.
    node = _behind_moves(node)
    if _op(node) not in _DEQUANTIZE:
        return None
    scale = node.args[1]
    if isinstance(scale, torch.fx.Node) and scale.op == "get_attr":
        return float(torch.as_tensor(attr(module, scale.target)).abs().max())
    return float(scale) if isinstance(scale, (int, float)) else None


def _count(node: torch.fx.Node, sizes: dict[str, int]) -> int | None:
    # How many inputs each output of a reduction averages: its input's elements over its output's (None: unknown).
    source = node.args[0]
    a = sizes.get(source.name) if isinstance(source, torch.fx.Node) else None
    b = sizes.get(node.name)
    return max(a // b, 1) if a and b else None


def accumulator_quantum(quantize: torch.fx.Node, module: torch.fx.GraphModule, sizes: dict[str, int]) -> float:
    """The grid step, in quanta of the requantization ``quantize``, an int8 kernel accumulates the value it
    requantizes on (0 where the op before it is not an integer accumulation a kernel would make: a float op, or a
    reduction whose count is unknown).  ``sizes``: each node's element count in a run (:class:`_Lockstep`)."""
    op = _behind_moves(quantize.args[0])
    kind, out = _op(op), quantize.args[1]
    if kind is None or not isinstance(out, (int, float)) or not out > 0:
        return 0.0
    if kind in _CONTRACTIONS:
        tensors = [a for a in op.args if isinstance(a, torch.fx.Node)][:2]
        scales = [_input_scale(a, module) for a in tensors]
        if len(scales) == 2 and None not in scales:
            return scales[0] * scales[1] / out
    elif kind in _AVERAGES:
        scale, count = _input_scale(op.args[0], module), 1 if kind == "sum" else _count(op, sizes)
        if scale is not None and count is not None:
            return scale / count / out
    return 0.0


def _steps(op: Any) -> float:
    # How many accumulator steps a correct kernel's value may be from the exact one before it requantizes (the
    # width's accumulator part): half a step where a contraction adds a bias rounded to the grid, a whole one for a
    # mean, none for a contraction without a bias (its integer accumulator is exact).
    kind = _op(op)
    if kind in _AVERAGES:
        return AVERAGE_STEPS
    if kind in ("addmm", "baddbmm"):  # (the bias is the first argument)
        return CONTRACTION_STEPS
    if kind in _CONTRACTIONS:
        bias = op.args[2] if len(op.args) > 2 else op.kwargs.get("bias")
        return CONTRACTION_STEPS if bias is not None else 0.0
    return 0.0


class _Pair:
    # A value of the lockstep run: as the fp32 simulation computes it, and in float64 from the same quantized inputs.
    __slots__ = ("double", "exact", "single")

    def __init__(self, single: Any, double: Any, exact: bool = True) -> None:
        self.single, self.double, self.exact = single, double, exact


def _double(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype == torch.float32:
        return value.to(torch.float64)
    if value is torch.float32:  # (an op's dtype argument: float64 in the exact run)
        return torch.float64
    if isinstance(value, (list, tuple)):
        return type(value)(_double(v) for v in value)
    if isinstance(value, dict):
        return {k: _double(v) for k, v in value.items()}
    return value


class _Lockstep(torch.fx.Interpreter):
    """The Q/DQ simulation run twice in lockstep: in fp32, and in float64 fed the same quantized values, so that at
    each requantization the gap between the two is the fp32 simulation's own arithmetic error there (in quanta).
    ``follow=False``: the float64 run requantizes its own values instead (the exact simulation), and is returned."""

    def __init__(self, module: torch.fx.GraphModule, *, follow: bool = True, forced: dict | None = None) -> None:
        super().__init__(module)
        self.follow = follow
        self.forced = forced or {}  # (requantization -> (flat indices, integers): rounded as given, not as computed)
        self.errors: dict[str, float] = {}  # each requantization's largest fp32 error, in quanta (NaN: not measured)
        self.mean_errors: dict[str, float] = {}  # ... and its mean over the elements
        self.sizes: dict[str, int] = {}  # each tensor value's element count

    def run_node(self, n: torch.fx.Node) -> Any:
        with self._set_current_node(n):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            pairs: list[_Pair] = []  # (every lockstep value among the arguments, however nested)
            torch.fx.node.map_aggregate((args, kwargs), lambda v: pairs.append(v) if isinstance(v, _Pair) else None)
            exact = all(p.exact for p in pairs)

            def side(value: Any, double: bool) -> Any:
                return torch.fx.node.map_aggregate(
                    value, lambda v: (v.double if double else v.single) if isinstance(v, _Pair) else v
                )

            if n.op == "placeholder":
                value = next(self.args_iter)
                if isinstance(value, torch.Tensor):
                    self.sizes[n.name] = value.numel()
                return _Pair(value, _double(value))
            if n.op == "get_attr":
                value = self.fetch_attr(n.target)
                return _Pair(value, _double(value))
            if n.op == "output":
                return side(args[0], not self.follow)
            run = getattr(self, n.op)
            single = run(n.target, side(args, False), side(kwargs, False))
            if isinstance(single, torch.Tensor):
                self.sizes[n.name] = single.numel()
            if _op(n) == _QUANTIZE:
                scale, x = float(side(args[1], False)), args[0]
                gap = ((x.single * (1.0 / scale)).to(torch.float64) - x.double / scale).abs()
                self.errors[n.name] = (float(gap.max()) if gap.numel() else 0.0) if x.exact else math.nan
                self.mean_errors[n.name] = (float(gap.mean()) if gap.numel() else 0.0) if x.exact else math.nan
                if self.follow:
                    return _Pair(single, single)  # (both runs go on from the simulation's quantized values)
                zero, low, high, dtype = side(args[2:6], False)
                rounded = torch.round(x.double / scale) + zero
                if n.name in self.forced:
                    index, integers = self.forced[n.name]
                    rounded = rounded.contiguous()
                    rounded.reshape(-1)[index] = integers.to(rounded.dtype)
                return _Pair(single, torch.clamp(rounded, low, high).to(dtype), x.exact)
            double_kwargs = _double(side(kwargs, True))
            if _op(n) in _DEQUANTIZE:  # (its integers times its scale, in float64)
                double_kwargs["out_dtype"] = torch.float64
            try:
                double = run(n.target, _double(side(args, True)), double_kwargs)
            except Exception as _stop:  # (an op with no float64 kernel: its error downstream is not measured)
                still_interrupted(_stop)
                double, exact = _double(single), False
            return _Pair(single, double, exact)


def requantizations(converted: torch.fx.GraphModule, args: tuple) -> list[dict[str, Any]]:
    """Each activation requantization of ``converted``, in graph order, with how far from a rounding boundary (in
    quanta) a correct int8 kernel's value may sit and still round the other way (``width``): the largest of the
    accumulator's reach (``accumulator_quantum`` x :data:`CONTRACTION_STEPS` where a contraction adds a bias, x
    :data:`AVERAGE_STEPS` for a mean), the fp32
    simulation's own error there, measured against float64 from the same quantized inputs (``fp32_error`` x
    :data:`ARITHMETIC_MARGIN`; none after an op any correct kernel computes bit for bit, :data:`CORRECTLY_ROUNDED`); at
    most 0.5.  Each element's width is also at least :data:`RELATIVE_REACH` of its value (:func:`element_reach`).

    ``spread``: the half-width a trial jitters within: the accumulator's part of the width plus :data:`TRIAL_MARGIN`
    x the mean fp32 error (none after a correctly rounded op); never more than the width."""
    lockstep = _Lockstep(converted)
    with torch.no_grad():
        lockstep.run(*args)
    rows = []
    for node in _ops(converted, _QUANTIZE):
        error, mean = lockstep.errors.get(node.name, math.nan), lockstep.mean_errors.get(node.name, math.nan)
        accumulator = accumulator_quantum(node, converted, lockstep.sizes)
        arithmetic = FALLBACK_WIDTH if error != error else ARITHMETIC_MARGIN * error
        often = arithmetic if mean != mean else TRIAL_MARGIN * mean  # (how wide a trial's jitter is, for it)
        behind = _behind_moves(node.args[0])  # (a reshape of a matmul's output holds the matmul's value)
        if _kind(behind) in CORRECTLY_ROUNDED:
            arithmetic = often = 0.0
        steps = _steps(behind)
        width = min(0.5, max(arithmetic, steps * accumulator))
        spread = min(width, often + steps * accumulator)  # (independent deviations: their reaches add)
        rows.append({"node": node.name, "op": _op_name(node), "module": _module_of(node),
                     "accumulator_quantum": accumulator, "fp32_error": error, "fp32_mean_error": mean,
                     "width": width, "spread": spread})  # fmt: skip
    return rows


def _kind(producer: Any) -> str:
    # A node's op by name (``linear``, ``gelu``; ``input`` for a model input).
    if not isinstance(producer, torch.fx.Node) or producer.op == "placeholder":
        return "input"
    return _op(producer) or producer.op


def _op_name(quantize: torch.fx.Node) -> str:
    # The op whose value a requantization rounds (``linear``, ``gelu``; ``input`` for a model input).
    return _kind(quantize.args[0])


def exact_simulation(converted: torch.fx.GraphModule, args: tuple, *, forced: dict | None = None) -> Any:
    """What ``converted`` computes with exact arithmetic (float64 between its quantize/dequantize ops, each
    requantization rounding the float64 value): a correct int8 model's reference, as fp64 is an fp32 model's.
    ``forced``: requantization -> (flat indices, integers) rounded as given (:mod:`rlx_nb.int8.decisive`: the
    decisive elements, as the oracle rounds them)."""
    with torch.no_grad():
        return _Lockstep(converted, follow=False, forced=forced).run(*args)


def element_reach(v: torch.Tensor, width: float) -> torch.Tensor:
    """Each element's reach, in quanta: how far from a rounding boundary a correct kernel's value may sit and round
    the other way -- the requantization's ``width``, at least :data:`RELATIVE_REACH` of the value, at most 0.5."""
    return torch.clamp(v.abs() * RELATIVE_REACH, min=width, max=0.5)


def rounded_at_random(
    v: torch.Tensor, reach: torch.Tensor, generator: torch.Generator, held: torch.Tensor | None = None
) -> torch.Tensor:
    """``v`` (in quanta) rounded to the quantum below or above at random within ``reach`` (probability by distance):
    a rounding any int8 kernel could make, one quantum at most from round-to-nearest.  ``held``: flat indices
    rounded to nearest."""
    jitter = (torch.rand(v.shape, generator=generator, dtype=torch.float32) - 0.5) * (2.0 * reach)
    if held is not None:
        jitter.reshape(-1)[held] = 0.0
    return torch.round(v + jitter)


def graph_copy(converted: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``converted`` (its modules and graph) holding the very tensors it holds -- its int8 weights, scales
    and biases, no copy of them: a trial changes only its quantize ops, a runtime only reads the weights, and a
    planted fault replaces a tensor, never writes into one."""
    memo: dict[int, Any] = {}
    for m in converted.modules():
        held = (*m._parameters.values(), *m._buffers.values(), *vars(m).values())
        memo.update((id(t), t) for t in held if isinstance(t, torch.Tensor))
    return module_copy(converted, memo)


DEQUANTIZED_BYTES = 64 * 2**20
""":func:`dequantized_once` holds at most this much of float32 weights (the copies of a graph share their int8
weights: a GPT-2's held whole would be 4x its int8 weights, 0.5 GB more)."""


def dequantized_once(graph: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``graph`` (a :func:`graph_copy`, changed in place) with each dequantization of a constant -- an int8 weight
    and its scales -- computed once and held as a float32 tensor, in graph order up to :data:`DEQUANTIZED_BYTES`: a
    Q/DQ simulation run many times (the decisive search, the trials) dequantized every weight in every run: 4x an
    MLP's run.  The same values, bit for bit; for simulations only (a runtime lowers the Q/DQ pattern itself)."""
    held = 0
    fetch = lambda a: attr(graph, a.target)  # noqa: E731  (a get_attr node's tensor)
    for k, node in enumerate(n for n in list(graph.graph.nodes) if _op(n) in _DEQUANTIZE):
        if not node.all_input_nodes or any(a.op != "get_attr" for a in node.all_input_nodes):
            continue
        size = 4 * fetch(node.args[0]).numel()  # (float32 out)
        if held + size > DEQUANTIZED_BYTES:
            break
        held += size
        with torch.no_grad():
            value = node.target(*torch.fx.node.map_arg(node.args, fetch), **torch.fx.node.map_arg(node.kwargs, fetch))
        name = f"_rlx_nb_dequantized_{k}"
        graph.register_buffer(name, value, persistent=False)
        with graph.graph.inserting_before(node):
            node.replace_all_uses_with(graph.graph.get_attr(name))
        inputs = node.all_input_nodes
        graph.graph.erase_node(node)
        for a in inputs:  # (the int8 weight and scales, where nothing else reads them; the tensors are kept)
            if not a.users:
                graph.graph.erase_node(a)
    graph.recompile()
    return graph


def _module_of(node: torch.fx.Node, producer: torch.fx.Node | None = None) -> str:
    # The module that computed the value a requantization (its quantize, or the dequantize after it) holds: its
    # producing op's innermost module (``producer``: another op to name the module of).
    quantize = node.args[0] if _op(node) in _DEQUANTIZE and node.args else node
    if producer is None:
        producer = quantize.args[0] if isinstance(quantize, torch.fx.Node) and quantize.args else node
    producer = producer if isinstance(producer, torch.fx.Node) else node
    stack = producer.meta.get("nn_module_stack") or {}
    if not stack:
        return "(top level)"
    path, kind = list(stack.values())[-1]
    path = str(path).replace("L['self'].", "").replace("L['self']", "")
    owner = node.graph.owning_module
    for _ in range(owner.meta.get(_WRAPPERS, 0) if owner is not None else 0):  # (quantize_pt2e's own wrappers)
        path = path.partition(".")[2] if path.split(".")[0] == "model" else path
    path = path.removeprefix("_orig_mod.") if path != "_orig_mod" else ""  # (a compiled model's)
    if not path:
        return "(top level)"
    return f"{path} ({getattr(kind, '__name__', str(kind).rsplit('.', 1)[-1])})"


def _truncated(converted: torch.fx.GraphModule, point: int) -> torch.fx.GraphModule:
    # The graph up to its ``point``-th requantization point (an activation's dequantize), which it returns.
    cut = graph_copy(converted)
    node = _ops(cut, "dequantize_per_tensor")[point]
    (output,) = [n for n in cut.graph.nodes if n.op == "output"]
    output.args = ((node,),)
    info = getattr(cut.graph._codegen, "pytree_info", None)
    if info is not None and info.out_spec is not None:  # (the model's own outputs: a cut returns one tensor)
        cut.graph._codegen.pytree_info = info._replace(out_spec=torch.utils._pytree.tree_structure(0))
    cut.recompile()  # (no dead-code pass: the weights after the point keep their places, for a fault that counts them)
    return cut


def _computed(dequantize: torch.fx.Node) -> bool:
    # Whether a requantization point holds a value the graph computes (not a quantized constant).
    quantize = dequantize.args[0] if dequantize.args else None
    return isinstance(quantize, torch.fx.Node) and quantize.op == "call_function"


__all__ = [
    "AVERAGE_STEPS",
    "CONTRACTION_STEPS",
    "TRIAL_MARGIN",
    "accumulator_quantum",
    "element_reach",
    "exact_simulation",
    "requantizations",
    "rounded_at_random",
]
