"""A snapshot on disk: a zip of ``.npy`` arrays and one JSON document, under a report's rules (no pickle anywhere).

Format ``rlx_nb.snapshot`` version 1 (file extension ``.rlxsnap`` by convention)::

    meta.json        {"format": "rlx_nb.snapshot", "version": 1, "label", "backend", "alone", "keyword",
                      "environment", "fingerprints", "byte_budget", "bytes", "seconds",
                      "modules": [MODULE, ...], "arrays": {entry: {"dtype", "shape"}}}
    arrays/<n>.npy   one per distinct tensor (a module's input that is another's output is stored once)

    MODULE = {"name", "order", "depth", "parent", "call": TEMPLATE | null, "why",
              "inputs": [entry | null, ...], "outputs": {leaf: entry}, "reference": {leaf: entry}, "op"?}

An entry with ``op`` (``ops=True``) is one of its parent module's own torch function calls, named
``"<module> :: F.softmax"``; ``op`` is the function's public name (``F.softmax``), resolved back to the function
when it runs alone (never unpickled).

``alone`` (optional, false when absent) says the outputs are each module's run alone on the backend, fed the
oracle's inputs (a backend that compiles or exports the whole model), not its outputs in one run.
``call`` is the module's call as it was made, its tensors as slots into ``inputs`` (null where it held something a
snapshot cannot write, ``why`` says what); ``reference`` is the float64 model's value of each output leaf, less the
output, rounded to float32 (the oracle's own round-off there, elementwise).  An entry is null where the byte budget
was spent.  Loading anything else -- a truncated or corrupted file, another version, an object array, a pickle
wearing the right extension -- raises :class:`~rlx_nb.errors.ReportFormatError` and never executes code.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from rlx_nb.changes.pure_ops import PURE_OPS
from rlx_nb.errors import ReportFormatError
from rlx_nb.report import files as report_files
from rlx_nb.report import schema

FORMAT = "rlx_nb.snapshot"
VERSION = 1
SUFFIX = ".rlxsnap"

_TEMPLATE_DEPTH = 32


def _fail(where: Any, why: str) -> ReportFormatError:
    return report_files._fail(where, why, "snapshot")


class Stored:
    """The arrays of one snapshot file, each checked on load and read on first use."""

    def __init__(self, zf: zipfile.ZipFile, declared: dict, where: Any) -> None:
        self.zf, self.where = zf, where
        self.declared = declared
        self._loaders: dict[str, Any] = {}
        names = set(zf.namelist())
        for entry, spec in declared.items():
            if entry not in names:
                raise _fail(where, f"arrays[{entry!r}] is not an entry of the file")
            spec = schema.mapping(spec, f"arrays[{entry!r}]")
            shape = schema.shape(spec.get("shape"), f"arrays[{entry!r}].shape")
            schema.one_of(spec.get("dtype"), schema.DTYPES, f"arrays[{entry!r}].dtype")
            self._loaders[entry] = report_files.checked_array(
                zf, entry, shape, where, what="snapshot", kinds="biuf", old_scalars=False, declared=spec["dtype"]
            )

    def __contains__(self, entry: Any) -> bool:
        return entry in self._loaders

    def array(self, entry: str) -> np.ndarray:
        return self._loaders[entry]()


def read(source: str | Path) -> tuple[dict, Stored]:
    """``(meta, arrays)`` of a snapshot file, every field checked (:func:`check_meta`) and every array's header."""
    where = source
    zf, meta = report_files.open_zip(source, where, "snapshot")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        hint = " (a report: rlx_nb.load_report reads it)" if found == report_files.FORMAT else ""
        raise _fail(where, f"format is {found!r}, not {FORMAT!r}{hint}")
    if meta.get("version") != VERSION or isinstance(meta.get("version"), bool):
        raise _fail(where, f"version {meta.get('version')!r} is not supported (this rlx_nb reads version {VERSION})")
    try:
        check_meta(meta)
        stored = Stored(zf, meta["arrays"], where)
        for m in meta["modules"]:
            for entry in [*m["inputs"], *m["outputs"].values(), *m["reference"].values()]:
                if entry is not None and entry not in stored:
                    raise schema.fail(f"modules[{m['name']!r}]", "entries listed in arrays", entry)
    except ReportFormatError as exc:
        raise _fail(where, str(exc).removeprefix(f"cannot load snapshot {str(where)!r}: ")) from None
    except Exception as exc:
        raise _fail(where, f"meta.json is malformed ({type(exc).__name__}: {exc})") from None
    return meta, stored


def check_meta(meta: dict) -> None:
    """Every field of a snapshot's ``meta.json`` holds what it may (raises :class:`schema.Malformed` naming it)."""
    schema.string(meta.get("label"), "label")
    schema.string(meta.get("backend"), "backend")
    if not isinstance(meta.get("keyword"), bool):
        raise schema.fail("keyword", "true or false", meta.get("keyword"))
    if not isinstance(meta.setdefault("alone", False), bool):
        raise schema.fail("alone", "true or false", meta.get("alone"))
    schema.mapping(meta.get("environment"), "environment")
    meta["fingerprints"] = schema.fingerprints(meta.get("fingerprints"))
    if meta.get("byte_budget") is not None:
        schema.integer(meta["byte_budget"], "byte_budget")
    schema.integer(meta.get("bytes"), "bytes")
    for k, v in schema.mapping(meta.get("seconds"), "seconds").items():
        schema.number(v, f"seconds[{k!r}]", finite=True, low=0.0)
    schema.mapping(meta.get("arrays"), "arrays")
    modules = meta.get("modules")
    if not isinstance(modules, list):
        raise schema.fail("modules", "a list", modules)
    names = set()
    for i, m in enumerate(modules):
        at = f"modules[{i}]"
        schema.mapping(m, at)
        name = schema.string(m.get("name"), f"{at}.name")
        if name in names:
            raise schema.fail(f"{at}.name", "a name no other module has", name)
        names.add(name)
        schema.integer(m.get("order"), f"{at}.order")
        schema.integer(m.get("depth"), f"{at}.depth")
        if m.get("parent") is not None:
            schema.string(m["parent"], f"{at}.parent")
        schema.string(m.get("why"), f"{at}.why")
        if m.get("op") is not None:  # (an op's entry, ops=True: its function's public name, resolved on use)
            schema.string(m["op"], f"{at}.op")
            if m.get("call") is not None and m["op"] not in PURE_OPS:  # (a recorder writes no call for those)
                raise schema.fail(f"{at}.op", "an op on rlx_nb's list of pure tensor computations (PURE_OPS)", m["op"])
        inputs = m.get("inputs")
        if not isinstance(inputs, list) or not all(e is None or isinstance(e, str) for e in inputs):
            raise schema.fail(f"{at}.inputs", "a list of entries (or null)", inputs)
        for key in ("outputs", "reference"):
            leaves = schema.mapping(m.get(key), f"{at}.{key}")
            if not all(e is None or isinstance(e, str) for e in leaves.values()):
                raise schema.fail(f"{at}.{key}", "entries (or null) by output name", leaves)
        if m.get("call") is not None:
            check_template(m["call"], len(inputs), f"{at}.call")


def check_template(t: Any, slots: int, where: str, depth: int = 0) -> None:
    """A call template (:mod:`rlx_nb.changes.record`) as written: slots in range, only the kinds it writes."""
    if depth > _TEMPLATE_DEPTH or not isinstance(t, dict) or len(t) != 1:
        raise schema.fail(where, "a template node (one of slot, value, float, dtype, list, tuple, dict)", t)
    ((kind, v),) = t.items()
    if kind == "slot":
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < slots:
            raise schema.fail(where, f"a slot below {slots}", v)
    elif kind == "value":
        if v is not None and not isinstance(v, (bool, int, str)):
            raise schema.fail(where, "null, a boolean, an integer or a string", v)
    elif kind == "float":
        schema.string(v, where)
        float(v)
    elif kind == "dtype":
        schema.one_of(v, schema.DTYPES, where)
    elif kind in ("list", "tuple"):
        if not isinstance(v, list):
            raise schema.fail(where, "a list", v)
        for i, x in enumerate(v):
            check_template(x, slots, f"{where}[{i}]", depth + 1)
    elif kind == "dict":
        for k, x in schema.mapping(v, where).items():
            check_template(x, slots, f"{where}[{k!r}]", depth + 1)
    else:
        raise schema.fail(where, "a template node (one of slot, value, float, dtype, list, tuple, dict)", kind)


__all__ = ["FORMAT", "SUFFIX", "VERSION", "Stored", "check_meta", "read"]
