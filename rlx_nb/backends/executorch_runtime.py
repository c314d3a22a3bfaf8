"""ExecuTorch, an optional extra: ``torch.export`` -> ``to_edge_transform_and_lower`` -> ExecuTorch's Python runtime.

``executorch-xnnpack`` lowers what the XNNPACK partitioner takes to the XNNPACK delegate and runs the rest on
ExecuTorch's portable kernels (the row's notes name those ops and how often they occur); ``executorch-portable``
lowers nothing, so every op runs on the portable kernels.  The two on one model tell a delegate bug (only
``executorch-xnnpack`` SUSPECT) from an export or portable-kernel one (both).  Forward only; each module of a
localization is exported alone.  ``pip install 'rlx_nb[executorch]'``.
"""

from __future__ import annotations

import collections
import importlib.util
from typing import Any

import torch

from rlx_nb._support import meter as phases
from rlx_nb._support.decomp_tables import cia_ops_kept
from rlx_nb._support.quiet import quiet, quiet_first
from rlx_nb.backends.base import Backend
from rlx_nb.backends.notes import add_note
from rlx_nb.backends.onnx import _FlatOutputs, attempt
from rlx_nb.errors import still_interrupted, with_root_cause

PIP = "pip install 'rlx_nb[executorch]'"

DELEGATE_CALL = "executorch_call_delegate"
"""The edge graph's call into a delegate (what the partitioner took); every other op runs on portable kernels."""


NATIVE = "executorch.extension.pybindings._C"
"""ExecuTorch's runtime, compiled: what its Python runtime (``executorch.runtime``) loads programs with."""


def executorch_reason() -> str | None:
    """None when ExecuTorch's exporter, its native runtime and torchao are installed, else why not and the pip line.

    Found, not loaded: ExecuTorch's Python runtime imports its whole exporter as it loads (5 s of every process that
    lists the live backends: each command-line run, each notebook kernel).  An installed runtime that does not load
    is said when the backend first runs (:func:`runtime`), as its row's error, with the same pip line.
    """
    missing = [m for m in ("executorch", "torchao") if importlib.util.find_spec(m) is None]
    if missing:
        return f"not installed: {' '.join(missing)} ({PIP})"
    try:
        native = importlib.util.find_spec(NATIVE)
    except (ImportError, ValueError):  # (a package above it that does not import)
        native = None
    if native is None:
        return f"installed without its native runtime ({NATIVE}) ({PIP})"
    return None


def runtime() -> Any:
    """ExecuTorch's ``Runtime`` class, loaded (its exporter too); a clear error with the pip line if it does not load."""
    try:
        with quiet():  # torchao reports its optional CUDA kernels as it loads
            from executorch.runtime import Runtime
    except Exception as exc:
        still_interrupted(exc)
        raise RuntimeError(f"ExecuTorch's runtime does not load: {with_root_cause(exc)} ({PIP})") from None
    return Runtime


def fallback_ops(edge_program: Any) -> dict[str, int]:
    """The ops of a lowered edge program outside any delegate, with how often each occurs (memory ops aside)."""
    counts: collections.Counter[str] = collections.Counter()
    for node in edge_program.graph_module.graph.nodes:
        if node.op != "call_function":
            continue
        name = getattr(node.target, "__name__", str(node.target))
        if DELEGATE_CALL in name or name in ("getitem", "alloc", "view") or name.startswith("_operator"):
            continue
        counts[str(node.target).removeprefix("aten.").removeprefix("<EdgeOpOverload: ").split(">")[0]] += 1
    return dict(counts.most_common())


def _layout(op: str) -> bool:
    # A copy that only moves or relabels elements (views, permutes, expands, dim-order clones): no arithmetic.
    parts = op.split(".")
    name = parts[-2] if len(parts) > 1 else parts[0]  # aten.expand_copy.default: expand_copy
    return name.endswith("_copy") or "clone_dim_order" in name


def _say_fallbacks(label: str, ops: dict[str, int], delegated: int) -> None:
    compute = {op: n for op, n in ops.items() if not _layout(op)}
    copies = sum(n for op, n in ops.items() if _layout(op))
    where = f"outside the XNNPACK delegate ({delegated} delegated partition(s))" if delegated else "(no delegate)"
    if not compute:
        what = f"{copies} layout cop{'y' if copies == 1 else 'ies'} only" if copies else "no op"
        add_note(f"{label}: every computing op in the XNNPACK delegate ({delegated} partition(s)); {what} outside it"
                 if delegated else f"{label}: {what} on ExecuTorch's portable kernels")  # fmt: skip
        return
    shown = ", ".join(f"{op} x{n}" if n > 1 else op for op, n in list(compute.items())[:8])
    more = f" and {len(compute) - 8} more" if len(compute) > 8 else ""
    layout = f" (and {copies} layout copies)" if copies else ""
    add_note(
        f"{label}: {sum(compute.values())} computing op(s) ran on ExecuTorch's portable kernels {where}: "
        f"{shown}{more}{layout}"
    )


def _lower(wrapper: _FlatOutputs, inputs: tuple, delegate: bool) -> tuple[Any, dict[str, int], int, int]:
    # (the ExecuTorch program's bytes, the fallback ops, the delegated partitions, the outputs)
    import executorch.kernels.quantized  # noqa: F401  (the out variants of quantized_decomposed ops: int8 graphs)
    from executorch.exir import to_edge_transform_and_lower

    partitioners = []
    if delegate:
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

        partitioners = [XnnpackPartitioner()]
    with phases.step("executorch: export"):
        exported = attempt(wrapper, lambda w: torch.export.export(w, inputs, strict=False))
    with phases.step("executorch: lower"), cia_ops_kept():
        edge = to_edge_transform_and_lower(exported, partitioner=partitioners)
        program = edge.exported_program()
        delegated = sum(
            1
            for n in program.graph_module.graph.nodes
            if n.op == "call_function" and DELEGATE_CALL in getattr(n.target, "__name__", str(n.target))
        )
        ops = fallback_ops(program)
        outputs = len(program.graph_signature.user_outputs)
        buffer = edge.to_executorch().buffer
    return buffer, ops, delegated, outputs


def _math_attention() -> Any:
    # Attention on its math kernel while a program is exported and lowered: the lowering decomposes
    # scaled_dot_product_attention, and export and decomposition fix each reshape as a view or a copy by the strides
    # they trace.  With the CPU's fused kernel chosen (its output laid out for the transpose after it), a Hugging Face
    # GPT-2 at batch 4 (int8 or float) had a reshape fixed as a view the decomposed attention's layout cannot give
    # ("Cannot view a tensor with shape [4, 16, 64] and strides (64, 256, 1)"), and its lowering failed.  ExecuTorch
    # runs the math kernel either way: what the program computes is the same.  (Restored on leaving, an interrupt too.)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


def _prepare(model: Any, inputs: tuple, *, delegate: bool) -> Any:
    label = "executorch-xnnpack" if delegate else "executorch-portable"
    for i, x in enumerate(inputs):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"ExecuTorch export needs tensor inputs; input {i} is {type(x).__name__}")
    loaded = runtime()
    # Exported from contiguous examples, as the runner feeds them: an ExecuTorch program keeps the dim order of the
    # inputs it was exported with, and reads memory laid out otherwise as if it were (a channels-last image or a
    # transposed operand, fed contiguous, came out wrong: SUSPECT at 3e6x the line on a plain convolution).
    inputs = tuple(x.contiguous() for x in inputs)
    wrapper = _FlatOutputs(model)
    wrapper.record(inputs)
    try:
        with quiet(), torch.no_grad(), _math_attention():
            buffer, ops, delegated, outputs = _lower(wrapper, inputs, delegate)
    except Exception as exc:
        still_interrupted(exc)
        raise RuntimeError(f"{label}: export or lowering failed: {with_root_cause(exc)}") from None
    _say_fallbacks(label, ops, delegated)
    with quiet(), phases.step("executorch: load"):  # (its CPU probe writes to stderr from C++)
        # The method reads its program, and the program the buffer: both kept alive by the runner (a method
        # whose program was collected crashes the process).
        program = loaded.get().load_program(buffer)
        method = program.load_method("forward")
    unflatten = wrapper.rebuild(outputs, label)

    execute = quiet_first(method.execute)  # (the delegate's CPU probe writes from C++ as it first runs)

    def runner(xs: tuple, _keep: tuple = (buffer, program)) -> Any:
        out = execute([x.detach().cpu().contiguous() for x in xs])
        tensors = [t if isinstance(t, torch.Tensor) else torch.as_tensor(t) for t in out]
        return unflatten(tensors)

    return runner


def prepare_xnnpack(model: Any, inputs: tuple) -> Any:
    """Export, lower what XNNPACK takes to its delegate (the rest to portable kernels), load in the runtime."""
    return _prepare(model, inputs, delegate=True)


def prepare_portable(model: Any, inputs: tuple) -> Any:
    """Export and run every op on ExecuTorch's portable kernels (no delegate)."""
    return _prepare(model, inputs, delegate=False)


def run_xnnpack(model: Any, inputs: tuple) -> Any:
    """ExecuTorch with the XNNPACK delegate, once; see :func:`prepare_xnnpack`."""
    return prepare_xnnpack(model, inputs)(inputs)


def run_portable(model: Any, inputs: tuple) -> Any:
    """ExecuTorch on its portable kernels, once; see :func:`prepare_portable`."""
    return prepare_portable(model, inputs)(inputs)


BACKENDS = [
    Backend(
        "executorch-xnnpack",
        run_xnnpack,
        prepare=prepare_xnnpack,
        differentiable=False,
        probe=executorch_reason,
        default=False,
        builtin=True,
        description="torch.export + ExecuTorch, XNNPACK delegate (the rest on portable kernels; forward only)",
    ),
    Backend(
        "executorch-portable",
        run_portable,
        prepare=prepare_portable,
        differentiable=False,
        probe=executorch_reason,
        default=False,
        builtin=True,
        description="torch.export + ExecuTorch, every op on its portable kernels (forward only)",
    ),
]
