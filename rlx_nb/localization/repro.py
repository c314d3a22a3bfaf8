"""Repro: a standalone reproduction of the culprit op, written without pickle and run without rlx_nb's internals."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlx_nb.errors import InputError, writing
from rlx_nb.localization.capture import Slot


def _resolve_func(label: str) -> str:
    # The import path the repro script uses to find the function again.
    kind, _, name = label.partition(".")
    return {"F": "torch.nn.functional", "Tensor": "torch.Tensor", "torch": "torch"}[kind] + "." + name


_SCRIPT = '''\
"""Standalone reproduction written by rlx_nb.localize: {label} on {backend} vs the CPU oracle."""

import json
import pathlib
import sys

import numpy as np
import torch

import rlx_nb
from rlx_nb.localization.capture import OpModule
from rlx_nb.localization.repro import resolve_function, template_from_json

here = pathlib.Path(__file__).parent
case = json.loads((here / "case.json").read_text())
with np.load(here / "inputs.npz", allow_pickle=False) as data:
    tensors = [torch.from_numpy(data[f"t{{i}}"]) for i in range(len(data.files))]
func = resolve_function(case["function"])
op = OpModule(func, template_from_json(case["template"]))
if case["backward"]:
    tensors = [t.requires_grad_(t.is_floating_point()) for t in tensors]
report = rlx_nb.backend_divergence(op, tuple(tensors), backends=[case["backend"]], backward=case["backward"],
                                   label=case["label"])
print(report)
sys.exit(1 if report.any_suspect else 0)
'''


def write_repro(
    path: Path, *, func: Callable, label: str, template: Any, tensors: list[torch.Tensor], backend: str, backward: bool
) -> Path:
    """Write ``inputs.npz``, ``case.json`` and ``repro.py`` under ``path``; return the script."""
    with writing(path, "the repro"):
        return _write_repro(path, func=func, label=label, template=template, tensors=tensors, backend=backend,
                            backward=backward)  # fmt: skip


def _write_repro(
    path: Path, *, func: Callable, label: str, template: Any, tensors: list[torch.Tensor], backend: str, backward: bool
) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    arrays = {f"t{i}": t.detach().cpu().numpy() for i, t in enumerate(tensors)}
    np.savez(path / "inputs.npz", **arrays)
    case = {
        "format": "rlx_nb.repro/1",
        "function": _resolve_func(label),
        "label": label,
        "backend": backend,
        "backward": backward,
        "template": template_to_json(template),
    }
    (path / "case.json").write_text(json.dumps(case, indent=2))
    script = path / "repro.py"
    script.write_text(_SCRIPT.format(label=label, backend=backend))
    return script


def resolve_function(path: str) -> Callable:
    """The torch function named by ``path`` (``torch.nn.functional.softmax``, ``torch.Tensor.matmul``).

    Only names under ``torch`` are accepted: a repro case never runs code of its own.
    """
    import importlib

    owner, _, name = path.rpartition(".")
    if not owner.startswith("torch") or not name.isidentifier():
        raise InputError(f"repro function {path!r} is not a torch function")
    obj = torch.Tensor if owner == "torch.Tensor" else importlib.import_module(owner)
    func = getattr(obj, name, None)
    if not callable(func):
        raise InputError(f"{path!r} does not name a callable")
    return func


def template_to_json(template: Any) -> Any:
    """A JSON form of a call template (tensor slots, lists, tuples, dicts, plain values)."""
    if isinstance(template, Slot):
        return {"__slot__": template.i}
    if isinstance(template, dict):
        return {"__dict__": {k: template_to_json(v) for k, v in template.items()}}
    if isinstance(template, (list, tuple)):
        return {"__tuple__" if isinstance(template, tuple) else "__list__": [template_to_json(v) for v in template]}
    if isinstance(template, torch.dtype):
        return {"__dtype__": str(template).removeprefix("torch.")}
    if template is None or isinstance(template, (bool, int, float, str)):
        return template
    raise InputError(f"cannot write a repro for an argument of type {type(template).__name__}: {template!r:.80}")


def template_from_json(obj: Any) -> Any:
    """The inverse of :func:`template_to_json`."""
    if isinstance(obj, dict):
        if "__slot__" in obj:
            return Slot(int(obj["__slot__"]))
        if "__dict__" in obj:
            return {k: template_from_json(v) for k, v in obj["__dict__"].items()}
        if "__tuple__" in obj:
            return tuple(template_from_json(v) for v in obj["__tuple__"])
        if "__list__" in obj:
            return [template_from_json(v) for v in obj["__list__"]]
        if "__dtype__" in obj:
            return getattr(torch, obj["__dtype__"])
    return obj
