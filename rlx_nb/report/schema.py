"""What each field of a saved report's ``meta.json`` may hold, checked before anything uses it.

A ``.rlxnb`` file may come from anyone: a colleague, a CI artefact, a vendor.  :mod:`rlx_nb.report.files`
passes every part of its JSON through here on load -- types, ranges, the verdicts and formats rlx_nb
knows, shapes that fit in memory, records that name outputs the runs have -- so a malformed file is a
:class:`~rlx_nb.errors.ReportFormatError` at ``load_report``, never a traceback later in a view (a
``"max_abs": "abc"`` used to crash ``rlx-nb show`` with exit code 1, the SUSPECT code).  Declared array
shapes are checked against the stored bytes in :mod:`rlx_nb.report.files`, before any array is allocated.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any

from rlx_nb.errors import ReportFormatError
from rlx_nb.numerics import formats

STATUSES = ("ok", "error", "skipped")
VERDICTS = ("round-off", "SUSPECT", "error", "skipped", "nondeterministic")
KINDS = ("forward", "grad")
COMPUTE_DTYPES = (*formats.FORMATS, formats.INT8)
"""What a run computes in: a float format, or int8 (an int8 runtime, :mod:`rlx_nb.int8`)."""
DTYPES = (
    "float64", "float32", "float16", "bfloat16", "complex64", "complex128", "complex32", "bool",
    "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
)  # fmt: skip
"""Dtype names an array output may declare (torch's, as :func:`rlx_nb.execution.results.to_leaf` writes them)."""
MAX_DIMS = 64
MAX_ELEMENTS = 1 << 48


class Malformed(ReportFormatError):
    """One field of a report does not hold what it may; the message names the field and the value."""


def fail(where: str, what: str, value: Any) -> Malformed:
    shown = repr(value)
    return Malformed(f"{where} must be {what}, got {shown[:80] + ('...' if len(shown) > 80 else '')}")


def string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise fail(where, "a string", value)
    return value


def one_of(value: Any, allowed: tuple[str, ...], where: str) -> str:
    if value not in allowed:
        raise fail(where, f"one of {', '.join(allowed)}", value)
    return value


def integer(value: Any, where: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise fail(where, f"an integer >= {low}", value)
    return value


def number(value: Any, where: str, *, finite: bool = False, low: float | None = None) -> float:
    # JSON numbers; the text forms 'nan' / 'inf' that rlx_nb writes for non-finite ones are numbers too.
    if isinstance(value, str) and value in ("nan", "inf", "-inf"):
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise fail(where, "a number", value)
    value = float(value)
    if (finite and not math.isfinite(value)) or (low is not None and not value >= low):
        raise fail(where, "a finite number" + (f" >= {low:g}" if low is not None else ""), value)
    return value


def mapping(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise fail(where, "an object", value)
    return value


def strings(value: Any, where: str) -> list[str]:
    if not isinstance(value, list):
        raise fail(where, "a list of strings", value)
    return [string(v, f"{where}[{i}]") for i, v in enumerate(value)]


def shape(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > MAX_DIMS:
        raise fail(where, f"a list of at most {MAX_DIMS} non-negative integers", value)
    dims = tuple(integer(v, f"{where}[{i}]") for i, v in enumerate(value))
    if math.prod(dims) > MAX_ELEMENTS:
        raise fail(where, f"a shape of at most {MAX_ELEMENTS} elements", value)
    return dims


def output(spec: Any, where: str) -> dict:
    """One output of a run: an array (entry, dtype, shape) or a plain JSON value."""
    spec = mapping(spec, where)
    dtype = string(spec.get("dtype", ""), f"{where}.dtype")
    if "array" in spec:
        return {
            "array": string(spec["array"], f"{where}.array"),
            "dtype": one_of(dtype, DTYPES, f"{where}.dtype"),
            "shape": shape(spec.get("shape"), f"{where}.shape"),
        }
    return {"value": spec.get("value"), "dtype": dtype}


def run(spec: Any, where: str) -> dict:
    """One run (the oracle, the reference, a candidate, an anchor, the sequential run)."""
    spec = mapping(spec, where)
    grad_status = spec.get("grad_status")
    return {
        "backend": string(spec.get("backend"), f"{where}.backend"),
        "status": one_of(spec.get("status"), STATUSES, f"{where}.status"),
        "message": string(spec.get("message", ""), f"{where}.message"),
        "seconds": number(spec.get("seconds", 0.0), f"{where}.seconds", low=0.0),
        "grad_status": None if grad_status is None else one_of(grad_status, STATUSES, f"{where}.grad_status"),
        "grad_message": string(spec.get("grad_message", ""), f"{where}.grad_message"),
        "compute_dtype": one_of(spec.get("compute_dtype", "float32"), COMPUTE_DTYPES, f"{where}.compute_dtype"),
        "reduction_lengths": {
            k: integer(v, f"{where}.reduction_lengths[{k!r}]", low=1)
            for k, v in mapping(spec.get("reduction_lengths") or {}, f"{where}.reduction_lengths").items()
        },
        "notes": strings(spec.get("notes") or [], f"{where}.notes"),
        "detail": string(spec.get("detail", ""), f"{where}.detail"),
        "outputs": {
            k: output(v, f"{where}.outputs[{k!r}]") for k, v in mapping(spec.get("outputs"), f"{where}.outputs").items()
        },
    }


def fingerprints(value: Any) -> dict[str, str | None]:
    found = mapping(value or {}, "fingerprints")
    return {k: None if v is None else string(v, f"fingerprints[{k!r}]") for k, v in found.items()}


# -- records --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Field:
    name: str
    kind: Any  # str, float, int, bool, "shape", "str?" (a str or None)
    required: bool = False


def _fields(columns: list[tuple[str, Any, bool]]) -> list[_Field]:
    out = []
    for name, hint, required in columns:
        args = set(typing.get_args(hint))
        if hint in (str, float, int, bool):
            kind = hint
        elif args == {str, type(None)}:
            kind = "str?"
        elif type(None) in args and any(typing.get_origin(a) is tuple for a in args):
            kind = "shape"
        else:  # pragma: no cover - a new field type must be taught here
            raise TypeError(f"no schema for a record's {name}: {hint}")
        out.append(_Field(name, kind, required))
    return out


def record(raw: Any, where: str, fields: list[_Field]) -> dict[str, Any]:
    """One saved record's fields, typed as the record class declares them; unknown keys are ignored."""
    raw = mapping(raw, where)
    out: dict[str, Any] = {}
    for f in fields:
        if f.name not in raw:
            continue  # the record class's default (files from before a field existed)
        v, at = raw[f.name], f"{where}.{f.name}"
        if f.kind is float:
            out[f.name] = number(v, at)
        elif f.kind is int:
            out[f.name] = integer(v, at, low=-1)
        elif f.kind is bool:
            if not isinstance(v, bool):
                raise fail(at, "true or false", v)
            out[f.name] = v
        elif f.kind is str:
            out[f.name] = string(v, at)
        elif f.kind == "str?":
            out[f.name] = None if v is None else string(v, at)
        else:
            out[f.name] = None if v is None else shape(v, at)
    for key in ("verdict", "verdict_fixed"):
        if key in out:
            one_of(out[key], VERDICTS, f"{where}.{key}")
    if out.get("verdict_budget") is not None:
        one_of(out["verdict_budget"], VERDICTS, f"{where}.verdict_budget")
    if "kind" in out:
        one_of(out["kind"], KINDS, f"{where}.kind")
    if "compute_dtype" in out:
        one_of(out["compute_dtype"], COMPUTE_DTYPES, f"{where}.compute_dtype")
    dims, worst = out.get("shape"), out.get("worst_index")
    if worst is not None and (
        dims is None or len(worst) != len(dims) or any(i >= n for i, n in zip(worst, dims, strict=True))
    ):
        raise fail(f"{where}.worst_index", f"an index inside the shape {dims}", list(worst))
    return out


def records(
    raw: Any, columns: tuple[tuple[str, Any, bool], ...], outputs: dict[str, set[str]], oracle: dict[str, Any]
) -> list[dict]:
    """Every saved record, checked against the runs: its backend is a candidate, its output one that run or
    the oracle has, its shape the oracle's.  ``columns``: ``(name, type, required)`` of a record's flat row
    (:func:`rlx_nb.comparison.tables.record_fields`); ``outputs``: each candidate's output names; ``oracle``: the oracle's
    output shapes (``None`` for plain values)."""
    if not isinstance(raw, list):
        raise fail("records", "a list", raw)
    fields = _fields(columns)
    out = []
    for i, item in enumerate(raw):
        where = f"records[{i}]"
        r = record(item, where, fields)
        absent = [f.name for f in fields if f.name not in r and f.required]
        if absent:
            raise fail(where, f"a record with {', '.join(absent)}", item)
        backend, name = r["backend"], r["output"]
        if backend not in outputs:
            raise fail(f"{where}.backend", f"a candidate of this report ({', '.join(outputs) or 'none'})", backend)
        if name is not None and name not in oracle and name not in outputs[backend] and not name.endswith("*"):
            raise fail(f"{where}.output", f"an output of {backend!r} or of the oracle", name)
        if name in oracle and r.get("shape") is not None and oracle[name] is not None and r["shape"] != oracle[name]:
            raise fail(f"{where}.shape", f"the oracle's shape of {name!r}, {list(oracle[name])}", list(r["shape"]))
        out.append(r)
    missing = [b for b in outputs if not any(r["backend"] == b for r in out)]
    if missing:
        raise fail("records", f"records for every candidate (none for {', '.join(missing)})", f"{len(out)} records")
    return out
