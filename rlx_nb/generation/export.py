"""A decode on an exported runtime: the prefill and the decode step exported with the cache as inputs and outputs.

What an engineer deploying a language model through ONNX does: two graphs from the Hugging Face model,

- the *prefill*: ``input_ids`` (the prompt) -> the last position's logits and every layer's keys and values;
- the *decode step*: one token and every layer's past keys and values (their length a dynamic axis) -> the
  logits and the keys and values with that token appended,

exported with ``torch.onnx.export`` (the dynamo exporter) and run by ONNX Runtime, or converted and compiled by
OpenVINO (f32 hint) from the same ONNX files.  The runtime keeps its own cache: each step is fed the keys and
values its own previous step returned, so error grows through the cache as it does in deployment; the token
fed is the oracle's (teacher forcing) or the runtime's own argmax (``free``).

A model whose cache is not keys and values per layer (a state-space model), a user's step function, or a model
the exporter cannot trace is a ``skipped`` row saying what stopped the export.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlx_nb._support import meter as phases
from rlx_nb.backends.notes import add_note
from rlx_nb.errors import NotApplicable, still_interrupted, with_root_cause
from rlx_nb.generation.decode import hf_step, last_logits, step_name


def _layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # Every layer's (keys, values) of a Hugging Face cache, or NotApplicable.
    layers = getattr(cache, "layers", None)
    pairs = []
    for layer in layers or ():
        k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor) or k.dim() != 4:
            break
        pairs.append((k, v))
    if not layers or len(pairs) != len(layers):
        raise NotApplicable(
            f"this model's cache ({type(cache).__name__}) is not keys and values per layer, which the exported "
            "decode step takes as inputs and outputs"
        )
    if any(getattr(layer, "is_sliding", False) for layer in layers):
        raise NotApplicable(
            "this model's cache has sliding-window layers (their length stops growing), which the exported decode "
            "step with a growing cache does not model"
        )
    return pairs


class _Prefill(torch.nn.Module):
    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> tuple:
        logits, cache = hf_step(self.model, input_ids, None)
        return (last_logits(logits), *[t for pair in _layers(cache) for t in pair])


class _Step(torch.nn.Module):
    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, *past: torch.Tensor) -> tuple:
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        for i in range(len(past) // 2):
            cache.update(past[2 * i], past[2 * i + 1], i)
        logits, new = hf_step(self.model, input_ids, cache)
        return (last_logits(logits), *[t for pair in _layers(new) for t in pair])


def _export(module: torch.nn.Module, args: tuple, path: Path, dynamic: Any, names: list[str]) -> None:
    from rlx_nb._support.decomp_tables import cia_ops_kept
    from rlx_nb._support.quiet import quiet

    with quiet(), cia_ops_kept():  # (its progress, warnings and log records: this thread's only)
        program = torch.onnx.export(module, args, dynamo=True, dynamic_shapes=dynamic, input_names=names,
                                    optimize=True, verbose=False)  # fmt: skip
    program.save(str(path), external_data=True)


def export_decode(decode: Any, prompt: torch.Tensor, directory: Path) -> tuple[Path, Path, int]:
    """Export ``decode.model``'s prefill and decode step to ONNX files in ``directory``: (prefill, step, layers)."""
    if decode.step is not None:
        raise NotApplicable("a decode through a user's step function has no cache interface to export")
    model = decode.model
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        raise NotApplicable("an encoder-decoder model's decode step is not exported")
    with torch.no_grad():
        first = _Prefill(model)(prompt)  # (raises NotApplicable for a cache of another kind)
    past = first[1:]
    try:
        prefill, step = directory / "prefill.onnx", directory / "step.onnx"
        with phases.step("ONNX export of the prefill"):
            _export(_Prefill(model), (prompt,), prefill, None, ["input_ids"])
        length = torch.export.Dim("past", min=1, max=1 << 16)
        dynamic = ({}, tuple({2: length} for _ in past))
        names = ["input_ids", *[f"past.{i // 2}.{'kv'[i % 2]}" for i in range(len(past))]]
        with phases.step("ONNX export of the decode step"):
            _export(_Step(model), (prompt[:, -1:], *past), step, dynamic, names)
    except NotApplicable:
        raise
    except Exception as exc:
        still_interrupted(exc)
        raise NotApplicable(f"the decode step did not export to ONNX ({with_root_cause(exc)[:600]})") from exc
    return prefill, step, len(past) // 2


_KEPT: dict[str, Any] = {}
"""The last decode export (one run's ONNX Runtime and OpenVINO share it): its key, directory and files."""


def _key(decode: Any, prompt: torch.Tensor) -> tuple:
    # What an export depends on: the model's class and weights (their storage: every private copy of one run
    # shares it) and the prompt's shape.
    weights = tuple((n, t.data_ptr(), tuple(t.shape), str(t.dtype)) for n, t in decode.model.state_dict().items())
    return (type(decode.model).__name__, weights, tuple(prompt.shape))


def shared_export(decode: Any, prompt: torch.Tensor) -> tuple[Path, Path, int]:
    """:func:`export_decode` once per model and prompt shape, kept until :func:`forget` (or the next export)."""
    key = _key(decode, prompt)
    if _KEPT.get("key") != key:
        forget()
        tmp = tempfile.TemporaryDirectory(prefix="rlx_nb_decode_")
        try:
            files = export_decode(decode, prompt, Path(tmp.name))
        except BaseException:
            tmp.cleanup()
            raise
        _KEPT.update(key=key, directory=tmp, files=files)
        _KEPT["fresh"] = True
    else:
        _KEPT["fresh"] = False
    return _KEPT["files"]


def forget() -> None:
    """Delete the kept export's files."""
    directory = _KEPT.pop("directory", None)
    _KEPT.clear()
    if directory is not None:
        directory.cleanup()


def exported_decode(runtime: str) -> Callable[[Any, tuple], Any]:
    """``fn(decode, inputs)`` for ``runtime`` ``"onnxruntime"``, ``"openvino"`` (f32 hint) or
    ``"openvino-default"`` (its own settings): export (or reuse this run's export of the same model), then decode
    there."""

    def fn(decode: Any, inputs: tuple) -> Any:
        (ids,) = inputs
        ids = decode.fed(ids)  # (the oracle's tokens, where the decode holds them)
        p = decode.prompt_len
        prefill_path, step_path, n_layers = shared_export(decode, ids[:, :p])
        reused = not _KEPT.get("fresh", True)
        prefill, step = _sessions(runtime, prefill_path, step_path)
        out: dict[str, torch.Tensor] = {}
        results = prefill({"input_ids": ids[:, :p].numpy()})
        for k in range(decode.steps):
            logits = np.asarray(results[0])
            out[step_name(k)] = torch.from_numpy(logits.copy())
            if k + 1 == decode.steps:
                break
            token = logits.argmax(-1)[:, None] if decode.free else ids[:, p + k : p + k + 1].numpy()
            feed = {"input_ids": token.astype(np.int64)}
            feed.update({f"past.{i // 2}.{'kv'[i % 2]}": np.asarray(results[1 + i]) for i in range(2 * n_layers)})
            results = step(feed)
        add_note(f"{runtime}: the prefill and the decode step exported to ONNX (torch.onnx, dynamo), the cache as "
                 f"inputs and outputs (its length a dynamic axis){'; the export this run made already' if reused else ''}; "
                 f"1 prefill and {decode.steps - 1} steps ran, each fed the keys and values its own previous step "
                 "returned")  # fmt: skip
        return out

    return fn


def _sessions(runtime: str, prefill: Path, step: Path) -> tuple[Callable, Callable]:
    # (run prefill, run step): feeds -> list of numpy outputs in the graph's order.
    if runtime == "onnxruntime":
        import onnxruntime as ort

        from rlx_nb.backends.onnx import session_options

        options = session_options()
        a = ort.InferenceSession(str(prefill), options, providers=["CPUExecutionProvider"])
        b = ort.InferenceSession(str(step), options, providers=["CPUExecutionProvider"])
        return (lambda feed: a.run(None, feed)), (lambda feed: b.run(None, feed))
    from rlx_nb.backends.openvino import openvino_module

    core = openvino_module().Core()
    config = {"INFERENCE_PRECISION_HINT": "f32"} if runtime == "openvino" else {}  # (openvino-default: its own)
    a = core.compile_model(core.read_model(str(prefill)), "CPU", config)
    b = core.compile_model(core.read_model(str(step)), "CPU", config)

    def run(compiled: Any) -> Callable:
        def go(feed: dict) -> list:
            result = compiled(feed)
            return [result[o] for o in compiled.outputs]

        return go

    return run(a), run(b)
