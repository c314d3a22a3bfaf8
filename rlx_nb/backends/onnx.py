"""ONNX Runtime: export with ``torch.onnx.export``, run on ORT's CPU provider (forward only)."""

from __future__ import annotations

import gc
import importlib.util
import sys
import tempfile
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rlx_nb._support import meter as phases
from rlx_nb._support.copies import shared_copy
from rlx_nb._support.decomp_tables import cia_ops_kept
from rlx_nb._support.quiet import quiet
from rlx_nb._support.tree import Opaque, flatten
from rlx_nb.backends.base import Backend
from rlx_nb.backends.notes import add_note
from rlx_nb.errors import still_interrupted, with_root_cause


def onnxruntime_reason() -> str | None:
    missing = [m for m in ("onnxruntime", "onnx") if importlib.util.find_spec(m) is None]
    if missing:
        return f"not installed: {' '.join(missing)} (pip install 'rlx_nb[onnx]')"
    return None


class _FlatOutputs(torch.nn.Module):
    # Export needs a flat tuple of tensors.  The first call runs eagerly and fixes the outputs: their
    # names and non-tensor leaves, to rebuild the structure after the runtime runs.  Later calls (the
    # exporters' traces) return the tensors at those names only: under tracing a number the model keeps
    # in an object (a sliding-window cache's length) can be a tensor, and it is not one of its outputs.
    # An output that is not a tensor under tracing (a cache the model builds only when not exported)
    # is left out of the graph and named in ``dropped``.
    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model
        self.leaves: list[tuple[str, Any]] | None = None
        self.dropped = _Shared()

    def forward(self, *args: Any) -> tuple:
        leaves = flatten(self.model(*args))
        if self.leaves is None:
            self.leaves = leaves
            return tuple(v for _, v in leaves if isinstance(v, torch.Tensor))
        traced = dict(leaves)
        wanted = [n for n, v in self.leaves if isinstance(v, torch.Tensor)]
        # Kept over calls: an exporter may also run the model untraced after its trace (every output there).
        self.dropped.extend(n for n in wanted if n not in self.dropped and not isinstance(traced.get(n), torch.Tensor))
        return tuple(traced[n] for n in wanted if isinstance(traced.get(n), torch.Tensor))

    def record(self, inputs: tuple) -> Any:
        """Run the model eagerly once (no gradients) to fix the output names; returns what the model returned."""
        with torch.no_grad():
            out = self.model(*inputs)
        self.leaves = flatten(out)
        return out

    def kept(self) -> list[str]:
        """The names of the tensor outputs a converted graph returns, in order (those the trace left out dropped)."""
        return [n for n, v in self.leaves or [] if isinstance(v, torch.Tensor) and n not in self.dropped]

    def rebuild(self, count: int, what: str) -> Callable[[list[torch.Tensor]], dict[str, Any]]:
        """``unflatten(tensors)`` for a converted graph with ``count`` outputs: the model's named leaves, with
        an :class:`~rlx_nb._support.tree.Opaque` marker (not compared) for each output the conversion left out."""
        leaves = list(self.leaves or [])
        kept = self.kept()
        if count != len(kept):
            raise RuntimeError(
                f"{what} has {count} output(s) where the model returns {len(kept)} tensor(s) "
                f"({', '.join(kept[:4])}{', ...' if len(kept) > 4 else ''}): the conversion dropped or added "
                "outputs, so its results cannot be matched to the model's"
            )
        if not kept:
            raise RuntimeError(f"{what} returns none of the model's tensor outputs")
        dropped = set(self.dropped)
        if dropped:
            add_note(
                f"{what} leaves out {len(dropped)} output(s) that are not tensors when the model is traced for "
                f"export ({', '.join(sorted(dropped)[:4])}{', ...' if len(dropped) > 4 else ''}): not compared"
            )
        missing = Opaque("not exported")

        def unflatten(tensors: list[torch.Tensor]) -> dict[str, Any]:
            it = iter(tensors)
            return {
                name: (missing if name in dropped else next(it)) if isinstance(v, torch.Tensor) else v
                for name, v in leaves
            }

        return unflatten


class _Shared(list):
    # The outputs a trace left out.  torch.export puts back copies of the module attributes a trace
    # changed, and a failed route's copy of the wrapper must report to the same list: copies are itself.
    def __copy__(self) -> _Shared:
        return self

    def __deepcopy__(self, memo: dict) -> _Shared:
        return self


DYNAMO_FIRST_PARAMS = 20_000_000
"""From this many parameters the dynamo exporter is tried first: it has a fixed cost of ~0.5 s, but at real
sizes it is the faster one (GPT-2 small: 4.2 s against the TorchScript exporter's 9.5 s, measured here)."""


class Exported:
    """An ONNX file in a temporary directory (weights as external data: no 2 GB limit, nothing in memory),
    and the outputs its trace left out.  Kept while a run needs it (:func:`exported`), deleted after."""

    def __init__(self, directory: tempfile.TemporaryDirectory, dropped: list[str], weights: list[torch.Tensor]) -> None:
        self.directory = directory
        self.path = Path(directory.name) / "model.onnx"
        self.dropped = list(dropped)
        self._weights = [weakref.ref(t) for t in weights]

    def holds_the_same_weights(self) -> bool:
        """Whether the tensors it was exported from are still alive: a key's storage address is that storage only
        while it lives (a module copied, run alone and freed leaves its address to the next module's copy)."""
        return all(w() is not None for w in self._weights)


_EXPORTS: dict[tuple, Exported] = {}


def _weights_key(model: torch.nn.Module, inputs: tuple) -> tuple:
    # Copies of one private model share its weights' storage (rlx_nb._support.copies.shared_copy): the same storage,
    # the same structure and the same input shapes are the same export.  The structure is every submodule's type and
    # settings, and what a module replaying one call or op holds (two parameterless modules, a GELU and a Tanh, on
    # inputs of one shape, were one export).
    tensors = [*model.parameters(), *model.buffers()]
    return (
        type(model),
        getattr(model, "export_key", None),  # what else changes the graph (a fault injected while tracing)
        tuple((n, type(m).__qualname__, m.extra_repr()) for n, m in model.named_modules()),
        repr(getattr(model, "func", None)),  # (an op replayed alone: OpModule)
        repr(getattr(model, "template", None)),  # (the call it replays: its non-tensor arguments)
        tuple((t.data_ptr(), tuple(t.shape), t.dtype) for t in tensors),
        tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else repr(x) for x in inputs),
    )


def exported(wrapper: _FlatOutputs, inputs: tuple, names: list[str]) -> Exported:
    """The model exported to ONNX once per run: ONNX Runtime and OpenVINO's ONNX route read the same file.

    TorchScript exporter first below :data:`DYNAMO_FIRST_PARAMS` parameters (fast on small models), the
    dynamo exporter first above; if both fail, both errors are said.  The graph's outputs are named
    ``output_0``, ``output_1``, ... in the model's order (without names the dynamo exporter can merge
    outputs a model writes in place, such as a Mamba cache's states).
    """
    key = _weights_key(wrapper.model, inputs)
    found = _EXPORTS.get(key)
    if found is not None and not found.holds_the_same_weights():
        found.directory.cleanup()
        del _EXPORTS[key]
        found = None
    if found is not None:
        wrapper.dropped[:] = found.dropped
        return found
    outputs = [f"output_{k}" for k in range(sum(isinstance(v, torch.Tensor) for _, v in wrapper.leaves or []))]
    params = sum(p.numel() for p in wrapper.parameters())
    routes = [True, False] if params >= DYNAMO_FIRST_PARAMS else [False, True]
    directory = tempfile.TemporaryDirectory(prefix="rlx_nb-onnx-")
    path = str(Path(directory.name) / "model.onnx")

    def export(w: torch.nn.Module, dynamo: bool) -> None:
        extra = {"verbose": False, "external_data": True} if dynamo else {}
        torch.onnx.export(w, inputs, path, dynamo=dynamo, input_names=names, output_names=outputs, **extra)

    errors = {}
    with quiet(), phases.step("ONNX export"), cia_ops_kept():
        for dynamo in routes:
            try:
                wrapper.dropped.clear()
                attempt(wrapper, lambda w, dynamo=dynamo: export(w, dynamo))
                break
            except Exception as exc:
                still_interrupted(exc)
                errors["dynamo" if dynamo else "TorchScript"] = exc
                for leftover in Path(directory.name).iterdir():
                    leftover.unlink()
        else:
            directory.cleanup()
            raise RuntimeError(
                "ONNX export failed: "
                + "; ".join(f"{name} exporter: {with_root_cause(e)}" for name, e in errors.items())
            ) from None
    weights = [*wrapper.model.parameters(), *wrapper.model.buffers()]
    _forget_exporter_graphs(collect=sum(t.numel() * t.element_size() for t in weights) >= COLLECT_AFTER_BYTES)
    done = Exported(directory, list(wrapper.dropped), weights)
    _EXPORTS[key] = done
    return done


COLLECT_AFTER_BYTES = 64 << 20
"""From this many bytes of weights an export is followed by a garbage collection, so that the exporter's graphs
(reference cycles holding the weights) are freed at once.  Below it the collector's own schedule frees them: a
collection walks the whole heap, 0.1 s in a fresh process and about a second in a long-lived one, and a
localization exports a module at a time."""


def _forget_exporter_graphs(*, collect: bool) -> None:
    # onnxscript's rewrite rules (module-level objects the dynamo exporter's optimizer runs) keep the last
    # graph they matched on their matchers, and that graph's initializers are the model's own weights: after
    # an export every weight stays alive until the next export.  Let go of those references (best effort:
    # an onnxscript without these classes is left alone), and collect the cycles now where they are large.
    found = sys.modules.get("onnxscript.rewriter._rewrite_rule")
    rule_type, set_type = getattr(found, "RewriteRule", None), getattr(found, "RewriteRuleSet", None)
    if rule_type is None or set_type is None:
        return

    def rules(value: Any) -> list:
        if isinstance(value, set_type):
            return list(value.rules)
        if isinstance(value, rule_type):
            return [value]
        if isinstance(value, (list, tuple)):
            return [v for v in value if isinstance(v, rule_type)]
        return []

    for name, module in list(sys.modules.items()):
        if not name.startswith("onnxscript.") or module is None:
            continue
        for value in list(vars(module).values()):
            for rule in rules(value):
                matcher = getattr(rule, "_matcher", None)
                for attr in ("_graph", "_tracer", "_current_node", "_match"):
                    if matcher is not None and getattr(matcher, attr, None) is not None:
                        setattr(matcher, attr, None)
    if collect:
        gc.collect()


def forget_exports() -> None:
    """Delete the run's ONNX files (at the end of every run)."""
    while _EXPORTS:
        _, found = _EXPORTS.popitem()
        found.directory.cleanup()


def attempt(wrapper: _FlatOutputs, convert: Callable[[_FlatOutputs], Any]) -> Any:
    """``convert`` a copy of ``wrapper``, leaving the original as it was for the next route if it fails.

    A failed conversion can leave state behind on the model it traced (after a failed TorchScript
    export, the dynamo exporter drops a Mamba model's cache outputs).
    """
    trial = _FlatOutputs(shared_copy(wrapper.model))  # the modules copied, not the weights
    trial.leaves, trial.dropped = wrapper.leaves, wrapper.dropped
    wrapper.dropped.clear()  # shared with the copy
    return convert(trial)


def session_options() -> Any:
    """ONNX Runtime's session options as rlx_nb makes every session: its log quiet, and its intra-op threads as many as
    torch runs on in this process (ORT's own default is one per core, spinning while it waits: beside a process that
    set torch to fewer threads, its idle threads took the cores that process had left to others)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = torch.get_num_threads()
    return options


def prepare_onnxruntime(model: Any, inputs: tuple, *, optimize: bool = True) -> Any:
    """Export to ONNX (TorchScript exporter, falling back to the dynamo one) and open an ORT session.

    ``optimize``: ORT's graph optimizations all on (``ORT_ENABLE_ALL``: constant folding, node fusions, layout
    changes), or all off (``ORT_DISABLE_ALL``: each ONNX node on its own kernel), from the same file.

    Returns ``runner(inputs)``, which runs the session on new inputs of the same shapes and returns a
    dict of named leaves in the same order and with the same names as the model's own outputs flatten
    to, so it compares one to one.
    """
    import onnxruntime as ort

    for i, x in enumerate(inputs):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"ONNX export needs tensor inputs; input {i} is {type(x).__name__}")
    wrapper = _FlatOutputs(model)
    wrapper.record(tuple(inputs))
    names = [f"input_{i}" for i in range(len(inputs))]
    onnx_file = exported(wrapper, tuple(inputs), names)
    options = session_options()
    level = ort.GraphOptimizationLevel
    options.graph_optimization_level = level.ORT_ENABLE_ALL if optimize else level.ORT_DISABLE_ALL
    with phases.step("onnxruntime: session"):
        session = ort.InferenceSession(str(onnx_file.path), options, providers=["CPUExecutionProvider"])
    produced = [o.name for o in session.get_outputs()]
    unflatten = wrapper.rebuild(len(produced), "the ONNX export")
    order = _model_order(produced)
    wanted = [i.name for i in session.get_inputs()]

    def runner(xs: tuple) -> Any:
        by_name = dict(zip(names, xs, strict=True))
        results = session.run(None, {n: by_name[n].detach().cpu().numpy() for n in wanted})
        return unflatten([torch.from_numpy(results[k]) for k in order])

    return runner


def _model_order(produced: list[str]) -> list[int]:
    # The session's outputs in the model's order: by the ``output_<k>`` names _export gives them, or as the
    # session lists them where the names are not all of that form.
    ks = [name.removeprefix("output_") for name in produced]
    if all(name.startswith("output_") and k.isdigit() for name, k in zip(produced, ks, strict=True)):
        return sorted(range(len(produced)), key=lambda j: int(ks[j]))
    return list(range(len(produced)))


def run_onnxruntime(model: Any, inputs: tuple) -> Any:
    """Export to ONNX and run with ORT once; see :func:`prepare_onnxruntime`."""
    return prepare_onnxruntime(model, inputs)(inputs)


def prepare_onnxruntime_noopt(model: Any, inputs: tuple) -> Any:
    """The same ONNX file on ORT with every graph optimization off (see :func:`prepare_onnxruntime`)."""
    return prepare_onnxruntime(model, inputs, optimize=False)


def run_onnxruntime_noopt(model: Any, inputs: tuple) -> Any:
    """ORT with graph optimizations off, once."""
    return prepare_onnxruntime_noopt(model, inputs)(inputs)


BACKENDS = [
    Backend(
        "onnxruntime",
        run_onnxruntime,
        prepare=prepare_onnxruntime,
        differentiable=False,
        probe=onnxruntime_reason,
        description="torch.onnx.export + ONNX Runtime CPU provider, graph optimizations all on (forward only)",
        builtin=True,
    ),
    Backend(
        "onnxruntime-noopt",
        run_onnxruntime_noopt,
        prepare=prepare_onnxruntime_noopt,
        differentiable=False,
        probe=onnxruntime_reason,
        default=False,
        description="the same ONNX file with ORT's graph optimizations all off: tells an optimizer bug from a kernel bug",
        builtin=True,
    ),
]
