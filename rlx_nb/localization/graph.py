"""A localization on the model's graph: per-node error as node data for Google's Model Explorer.

`ai-edge-model-explorer <https://github.com/google-ai-edge/model-explorer>`_ draws a PyTorch model from its
``torch.export`` graph, one node per aten op, grouped by the module that ran it.  :func:`node_data` gives
each node the place on the SUSPECT line (1.0 is the line) of the innermost module checked around it -- or of
the op row, where the search narrowed the culprit to a torch function of that module -- and colours it the
way every rlx_nb figure does: red past the line, blue below it.  The file is Model Explorer's node-data JSON
(``{graph id: {"results": {node id: {"value": ..., "bgColor": ...}}, "thresholds": [...]}}``), read by its
``config().add_node_data_from_path``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from rlx_nb.errors import writing
from rlx_nb.plot.style import SUSPECT_COLOUR

GRAPH_ID = "graph"
"""The id Model Explorer's PyTorch adapter gives the exported program's graph."""
BELOW_LINE = "#c6d6ec"
"""A node within round-off: the blue side of the figures' scale (red is SUSPECT only)."""


def exported(model: torch.nn.Module, args: tuple, kwargs: dict | None = None) -> Any:
    """``torch.export.export`` of the model in eval mode (what Model Explorer draws)."""
    return torch.export.export(model.eval(), args, kwargs or {}, strict=False)


def module_of(node: Any) -> str | None:
    """The qualified name of the innermost module that ran an fx node ("" for the root, None for no module)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    return _clean(path)


def node_data(program: Any, frame: Any, *, strip: str = "") -> dict[str, Any]:
    """Model Explorer node data for ``program`` (an ExportedProgram) from a localization's ``frame``.

    ``strip`` is a prefix the search's module names lack (rlx_nb's keyword adapter wraps a model taking keyword
    inputs under ``model.``).  Nodes outside every checked module get no value.
    """
    modules = {str(r.name): float(r.local_line) for r in frame.itertuples() if r.kind == "module"}
    ops = {}
    for r in frame.itertuples():
        if r.kind == "op" and " :: " in str(r.name):
            where, op = str(r.name).split(" :: ", 1)
            ops[(where, op.rsplit(".", 1)[-1].lower())] = float(r.local_line)
    results = {}
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        path = module_of(node)
        if path is None:
            continue
        path = (
            path.removeprefix(strip)
            if strip and path.startswith(strip)
            else ("" if path == strip.rstrip(".") else path)
        )
        value = _op_value(ops, path, str(node.target))
        if value is None:
            value = _innermost(modules, path)
        if value is None or not math.isfinite(value):
            continue
        results[node.name] = {"value": value, "bgColor": SUSPECT_COLOUR if value > 1.0 else BELOW_LINE}
    return {
        GRAPH_ID: {
            "results": results,
            "thresholds": [{"value": 1.0, "bgColor": BELOW_LINE}, {"value": 1e300, "bgColor": SUSPECT_COLOUR}],
        }
    }


def write(data: dict[str, Any], path: str | Path) -> Path:
    """Write node data to ``path`` (``.json`` appended when it has no suffix)."""
    path = Path(path)
    if not path.suffix:
        path = path.with_suffix(".json")
    with writing(path, "the Model Explorer node data"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1))
    return path


def _op_value(ops: dict, path: str, target: str) -> float | None:
    target = target.lower()
    for (where, op), value in ops.items():
        if _clean(where) == path and op in target:
            return value
    return None


def _innermost(modules: dict[str, float], path: str) -> float | None:
    # The innermost checked module around ``path`` (its own name, then each parent).
    parts = path.split(".") if path else []
    for k in range(len(parts), -1, -1):
        name = ".".join(parts[:k])
        if name in modules or (name == "" and "<root>" in modules):
            return modules.get(name, modules.get("<root>"))
    return None


def _clean(path: str) -> str:
    # torch.export's module paths ("L['self'].layers[0]" in some versions, "layers.0" in others) as dotted names.
    path = path.replace("L['self']", "").replace("L__self___", "").replace("[", ".").replace("]", "").strip(".")
    return path.replace("'", "")
