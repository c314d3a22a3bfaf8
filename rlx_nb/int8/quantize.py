"""int8 models as PT2E makes them: a float model quantized for XNNPACK, its inputs and calibration checked, and the
graph checked before any runtime is given it.

:func:`quantize_pt2e` exports the model (``torch.export``), annotates it with ExecuTorch's XNNPACK quantizer
(per-channel symmetric weights, per-tensor activations), calibrates it and converts it.  What would make that go
wrong deep inside torch, torchao or a runtime is said first, naming the value: a calibration that is not a list of
batches, an empty one (uncalibrated per-channel observers leave one scale for a whole weight, and ExecuTorch's
portable kernels then abort the process), a batch of other shapes than the inputs', NaN or Inf values, a model that
is a function, that ``torch.export`` cannot trace, or a PT2E graph prepared but not converted.
"""

from __future__ import annotations

import contextlib
import copy
import math
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from rlx_nb._support.held import Held
from rlx_nb._support.quiet import quiet
from rlx_nb.backends.executorch_runtime import PIP, executorch_reason
from rlx_nb.backends.onnx import _FlatOutputs
from rlx_nb.errors import BackendError, InputError, describe_error, still_interrupted, with_root_cause
from rlx_nb.execution.prepare import KeywordModule, normalize_inputs
from rlx_nb.int8.requantization import _WRAPPERS, _module_of, _op, attr


def quantize_pt2e(model: torch.nn.Module, inputs: Any, *, calibration: Iterable[Any] | None = None) -> Any:
    """``model`` quantized to int8 by PT2E with ExecuTorch's XNNPACK quantizer (per-channel symmetric weights,
    per-tensor activations), calibrated on ``calibration`` (a list of input batches, each what the model takes
    like ``inputs``, of the same shapes; default: ``inputs``).  ``model`` is left as it was (its modules' training
    flags too); its graph is checked before any runtime is given it (:func:`check_quantized`)."""
    reason = executorch_reason()
    if reason is not None:
        raise BackendError(f"int8 quantization needs ExecuTorch's XNNPACK quantizer: {reason}")
    _check_float_model(model)
    args, keys = normalize_inputs(inputs)
    batches = calibration_batches(args, calibration)
    try:
        with quiet():  # (torchao reports its optional CUDA kernels as it loads)
            from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
                XNNPACKQuantizer,
                get_symmetric_quantization_config,
            )
            from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    except Exception as exc:  # (installed, found by the probe, and does not load)
        still_interrupted(exc)
        raise BackendError(
            f"int8 quantization needs ExecuTorch's XNNPACK quantizer, which does not load: {with_root_cause(exc)} ({PIP})"
        ) from None

    training = {name: m.training for name, m in model.named_modules()}
    if keys:  # keyword inputs (a Hugging Face model's): positional from here on, as every backend takes them
        model = KeywordModule(model, keys)
    quantizer = _integer_scalars_kept(XNNPACKQuantizer)()
    quantizer.set_global(get_symmetric_quantization_config(is_per_channel=True))
    flat = _FlatOutputs(model.eval())  # (a cache object among the outputs: export takes tensors only)
    try:
        original = flat.record(tuple(args))  # (what the float model returns, whose structure the int8 graph keeps)
        with torch.no_grad(), quiet():
            try:
                exported = torch.export.export(flat, tuple(args), strict=False)
            except Exception as exc:
                still_interrupted(exc)
                raise InputError(f"int8 quantization (PT2E) needs a model torch.export can trace; it cannot trace "
                                 f"this one: {describe_error(exc)}") from None  # fmt: skip
            with _pattern_graphs_kept():
                prepared = prepare_pt2e(exported.module(), quantizer)
            for batch in batches:
                prepared(*batch)
            converted = _named_outputs(convert_pt2e(prepared), flat, original)
    finally:
        for name, m in (model.model if keys else model).named_modules():  # (the user's modules as they were)
            m.training = training.get(name, m.training)
    converted.meta[_WRAPPERS] = 2 if keys else 1  # (module paths start with them: model.[model.]fc1)
    check_quantized(converted)
    return converted


def _check_float_model(model: Any) -> None:
    # What quantize_pt2e can quantize: a float nn.Module; not a function, not a PT2E graph prepared but not converted.
    if not isinstance(model, torch.nn.Module):
        what = f"function {getattr(model, '__name__', '?')!r}" if callable(model) else type(model).__name__
        raise InputError(f"int8 quantization needs a torch.nn.Module (its weights are what PT2E quantizes); got a "
                         f"{what}: wrap it in an nn.Module, or pass a PT2E-converted graph")  # fmt: skip
    if _is_prepared(model):
        raise InputError("the model is a PT2E graph prepared for quantization but not converted (it holds observers):"
                         " calibrate it and call torchao's convert_pt2e(prepared), or pass the float model")  # fmt: skip


def _is_prepared(model: Any) -> bool:
    # A prepare_pt2e graph: observer or fake-quantize modules inserted as activation_post_process_* submodules.
    return isinstance(model, torch.fx.GraphModule) and any(
        name.startswith("activation_post_process") for name, _ in model.named_children()
    )


def calibration_batches(args: tuple, calibration: Any) -> list[tuple]:
    """The calibration batches as argument tuples, checked: a non-empty list of batches, each with the inputs'
    structure, shapes and dtypes (the model is exported for those), every floating value finite."""
    if calibration is None:
        batches = [tuple(args)]
    else:
        if (
            isinstance(calibration, (torch.Tensor, str, bytes))
            or not isinstance(calibration, Iterable)
            or (isinstance(calibration, dict))
        ):
            hint = " (one batch: calibration=[x])" if isinstance(calibration, (torch.Tensor, dict)) else ""
            raise InputError(f"calibration must be a list of input batches, each what the model takes; got "
                             f"{type(calibration).__name__} {_short(calibration)}{hint}")  # fmt: skip
        batches = [tuple(normalize_inputs(c)[0]) for c in calibration]
        if not batches:
            raise InputError("calibration is empty: give at least one batch of inputs (calibration=[x]); "
                             "uncalibrated observers leave one scale where a per-channel weight needs one per "
                             "channel, and a runtime given that graph aborts")  # fmt: skip
    want = _signature(tuple(args))
    for k, batch in enumerate(batches):
        got = _signature(batch)
        if calibration is not None and got != want:
            raise InputError(f"calibration batch {k} is {_describe(got)}; the model is exported for the inputs' "
                             f"{_describe(want)}, and every batch must match them")  # fmt: skip
        for i, x in enumerate(batch):
            if isinstance(x, torch.Tensor) and x.is_floating_point() and not bool(torch.isfinite(x).all()):
                where = "the inputs" if calibration is None else f"calibration batch {k}"
                bad = int((~torch.isfinite(x)).sum())
                raise InputError(f"{where} hold {bad} NaN/Inf value(s) in argument {i}: observers cannot calibrate "
                                 "a quantization range on them")  # fmt: skip
    return batches


def _signature(batch: tuple) -> list:
    return [(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else type(x).__name__ for x in batch]


def _describe(signature: list) -> str:
    parts = [f"{list(s[0])} {str(s[1]).replace('torch.', '')}" if isinstance(s, tuple) else s for s in signature]
    return f"{len(parts)} argument(s): " + ", ".join(parts)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_quantized(converted: torch.fx.GraphModule) -> None:
    """Check what a runtime will be given before any runs it: each quantize/dequantize's parameters as the op needs
    them (a per-channel op one scale and zero point per channel of its axis, every scale finite and positive).  A
    runtime given otherwise may abort the process (ExecuTorch's portable ``dequantize_per_channel`` asserts)."""
    for node in converted.graph.nodes:
        op = _op(node)
        if op not in ("quantize_per_tensor", "dequantize_per_tensor", "quantize_per_channel", "dequantize_per_channel"):
            continue
        scale = _value(converted, node.args[1])
        if scale is None:  # (computed in the graph: nothing to check before it runs)
            continue
        if op.endswith("per_channel"):
            x, zero = _value(converted, node.args[0]), _value(converted, node.args[2])
            axis = int(node.args[3])
            size = x.shape[axis] if isinstance(x, torch.Tensor) and x.dim() > axis else None
            counts = [t.numel() if isinstance(t, torch.Tensor) else 1 for t in (scale, zero)]
            if size is not None and counts != [size, size]:
                raise InputError(f"the quantized graph's {node.name} ({_module_of(node) or 'a weight'}) has {counts[0]} "
                                 f"scale(s) and {counts[1]} zero point(s) for {size} channels along axis {axis}: was the "
                                 "model calibrated? (an uncalibrated per-channel observer leaves one)")  # fmt: skip
        values = scale.reshape(-1).tolist() if isinstance(scale, torch.Tensor) else [scale]
        if any(not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0 for v in values):
            bad = next(v for v in values if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0)
            raise InputError(f"the quantized graph's {node.name} ({_module_of(node) or 'an activation'}) has scale "
                             f"{bad!r}: a quantization scale must be finite and positive")  # fmt: skip


def _value(converted: torch.fx.GraphModule, arg: Any) -> Any:
    # A node argument's value where it is a constant: a get_attr's tensor, or the number itself (None otherwise).
    if isinstance(arg, torch.fx.Node):
        if arg.op == "get_attr":
            return attr(converted, arg.target)
        return None
    return arg


def _named_outputs(converted: torch.fx.GraphModule, flat: _FlatOutputs, original: Any) -> torch.fx.GraphModule:
    # The converted graph returns what the float model returned: the same structure when that is a tree of tensors
    # only (a tensor, a tuple, a dict), otherwise (a Hugging Face output holding a cache object) a dict of the
    # tensors by their names (``logits``, ``cache.layers[0].keys``), in order -- never the wrapper's bare tuple.
    names = flat.kept()
    codegen = converted.graph._codegen
    info = getattr(codegen, "pytree_info", None)
    if info is None or info.out_spec is None or info.out_spec.num_leaves != len(names):
        return converted
    leaves, spec = torch.utils._pytree.tree_flatten(original)
    if len(leaves) != len(names) or not all(isinstance(v, torch.Tensor) for v in leaves):
        if len(set(names)) != len(names):
            return converted
        spec = torch.utils._pytree.tree_structure(dict.fromkeys(names))
    codegen.pytree_info = info._replace(out_spec=spec)
    converted.recompile()
    return converted


def _integer_scalars_kept(base: type) -> type:
    """``base`` (ExecuTorch's XNNPACK quantizer) with its scalar pass kept to float arithmetic.

    Before annotating, the quantizer turns every scalar operand of an ``add``/``mul`` into a float32 tensor
    constant (``_convert_scalars_to_attrs``, ExecuTorch 1.5.1), integer ones too: a Hugging Face model's position
    ids (``arange + past_length``) come out float and its embedding lookup fails.  Here that pass sees only the
    nodes whose result is floating point; the integer ones keep their scalars."""

    class IntegerScalarsKept(base):
        def transform_for_annotation(self, model: torch.fx.GraphModule) -> torch.fx.GraphModule:
            scalar_ops = (torch.ops.aten.add.Tensor, torch.ops.aten.mul.Tensor)
            hidden = []
            for node in model.graph.nodes:
                val = node.meta.get("val")
                if (
                    node.op == "call_function"
                    and node.target in scalar_ops
                    and not (isinstance(val, torch.Tensor) and val.is_floating_point())
                ):
                    hidden.append((node, node.target))
                    node.target = _Hidden(node.target)  # (not one of the pass's targets while it runs)
            try:
                model = super().transform_for_annotation(model)
            finally:
                for node, target in hidden:
                    node.target = target
                model.recompile()
            return model

    return IntegerScalarsKept


_PATTERNS: dict[tuple, torch.fx.GraphModule] = {}
_PATTERNS_LOCK = threading.Lock()
_PATTERNS_HELD = Held()


def _pattern_key(pattern: Any, example_inputs: tuple, is_cuda: bool, kwargs: dict) -> tuple | None:
    # What a pattern's graph is made of: its function's code and what the code closes over (the conv function, the
    # ReLU flags), the example inputs' shapes and dtypes.  None where any of it cannot be a key (traced afresh).
    fn = getattr(pattern, "fn", None)
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    try:
        cells = tuple(c.cell_contents for c in fn.__closure__ or ())
        inputs = tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x for x in example_inputs)
        key = (code, cells, fn.__defaults__, inputs, is_cuda, tuple(sorted(kwargs.items())))
        hash(key)
    except (TypeError, ValueError):
        return None
    return key


@contextlib.contextmanager
def _pattern_graphs_kept() -> Iterator[None]:
    """ExecuTorch's XNNPACK quantizer traces each conv-batch-norm pattern it looks for with ``torch.export`` on every
    annotation, twelve of them: 1.8 s of the 1.9 s a small MLP's ``quantize_pt2e`` took, measured.  While this runs,
    each pattern is traced once a process and given as a copy (the matcher rewrites the graph it is given)."""
    try:
        from executorch.backends.xnnpack.quantizer import xnnpack_quantizer_utils as utils
    except ImportError:
        yield
        return
    trace = utils._get_aten_graph_module_for_pattern

    def kept(pattern: Any, example_inputs: tuple, is_cuda: bool = False, **kwargs: Any) -> Any:
        key = _pattern_key(pattern, example_inputs, is_cuda, kwargs)
        if key is None:
            return trace(pattern, example_inputs, is_cuda, **kwargs)
        with _PATTERNS_LOCK:
            graph = _PATTERNS.get(key)
        if graph is None:
            graph = trace(pattern, example_inputs, is_cuda, **kwargs)
            with _PATTERNS_LOCK:
                _PATTERNS[key] = graph
        return copy.deepcopy(graph)

    with _PATTERNS_HELD.replaced(lambda: [(utils, "_get_aten_graph_module_for_pattern", kept)]):
        yield


class _Hidden:
    # A stand-in target for an integer add/mul while the scalar pass runs (it calls the op it stands for).
    def __init__(self, target: Any) -> None:
        self.target = target
        self.__name__ = f"hidden_{getattr(target, '__name__', 'op')}".replace(".", "_")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.target(*args, **kwargs)


__all__ = ["calibration_batches", "check_quantized", "quantize_pt2e"]
