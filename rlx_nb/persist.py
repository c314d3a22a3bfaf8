"""Save and load run results safely: a zip of ``.npy`` arrays and one JSON document, no pickle anywhere.

Format ``rlx_nb.report`` version 2 (file extension ``.rlxnb`` by convention)::

    meta.json          {"format": "rlx_nb.report", "version": 2, "label", "backward", "environment",
                        "fingerprints": {"inputs", "model"}, "rule", "tol_rel",
                        "runs": {"oracle": RUN, "reference": RUN, "candidates": {name: RUN}}}
    arrays/<n>.npy     one per array output, numpy's own format, read with allow_pickle=False

    RUN = {"backend", "status", "message", "seconds", "grad_status", "grad_message", "compute_dtype",
           "reduction_lengths", "notes", "detail",
           "outputs": {name: {"array": "arrays/<n>.npy", "dtype", "shape"} | {"value": <JSON value>, "dtype"}}}

``notes`` (what the backend said about its run) and ``detail`` (a failed run's whole error) are
optional: files written before them read as empty.

Version 1 files are read too, without their precision anchors' gradients: before version 2 the
anchors' emulated rounding stopped gradients, so those were zeros (as a budget they would excuse
anything).  Arrays are read lazily, on first access.  Loading anything else — a truncated or corrupted file,
another version, an object array, a pickle wearing the right extension — raises
:class:`ReportFormatError` and never executes code.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import json
import math
import re
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from rlx_nb.errors import ReportFormatError
from rlx_nb.results import GRAD_PREFIX, BackendRun, Leaf, RunResults

FORMAT = "rlx_nb.report"
VERSION = 2
READS = (1, 2)
SUFFIX = ".rlxnb"
_MAX_META = 64 << 20


def _json_value(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else repr(v)
    if isinstance(v, dict):  # e.g. environment["nondeterministic"], a merged report's per-node environments
        return {str(k): _json_value(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_value(x) for x in v]
    return repr(v)  # keeps the information, loses the type: compared as text after loading


def _unstable(value: Any, where: str) -> dict[str, float]:
    # environment["nondeterministic"] as saved: a JSON object of floats ('inf' as text), or, in
    # version-1 files, the dict's repr.
    if isinstance(value, str):
        try:
            value = ast.literal_eval(re.sub(r"(?<=: )inf\b", "1e999", value))
        except (ValueError, SyntaxError):
            raise _fail(where, f"environment.nondeterministic is unreadable: {value[:80]!r}") from None
    if not isinstance(value, dict):
        raise _fail(where, f"environment.nondeterministic must be an object, got {type(value).__name__}")
    try:
        return {str(k): float(v) for k, v in value.items()}
    except (TypeError, ValueError):
        raise _fail(where, f"environment.nondeterministic has a value that is not a number: {value!r:.80}") from None


def save_results(
    results: RunResults,
    path: str | Path | io.BufferedIOBase,
    *,
    rule: str = "budget",
    tol_rel: float | None = None,
    records: list | None = None,
) -> Path:
    """Write ``results`` (and a report's ``records``) to ``path``; ``.rlxnb`` is appended when it has no suffix.

    With the records saved, loading the report reads no array until one is asked for.
    """
    if hasattr(path, "write"):  # a binary file object: write there (gather_report sends the bytes)
        target = path
    else:
        path = Path(path)
        if not path.suffix:
            path = path.with_suffix(SUFFIX)
        path.parent.mkdir(parents=True, exist_ok=True)
        target = path
    counter = iter(range(1 << 62))
    with zipfile.ZipFile(target, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:

        def write_run(run: BackendRun) -> dict:
            outputs = {}
            for name, leaf in run.outputs.items():
                if leaf.is_array:
                    entry = f"arrays/{next(counter)}.npy"
                    with zf.open(entry, "w", force_zip64=True) as f:  # streamed: no extra copy
                        # (np.ascontiguousarray makes a 0-d array 1-d; a scalar output must stay 0-d)
                        value = np.asarray(leaf.value)
                        value = value if value.flags.c_contiguous else np.ascontiguousarray(value)
                        np.lib.format.write_array(f, value, allow_pickle=False)
                    outputs[name] = {"array": entry, "dtype": leaf.dtype, "shape": list(leaf.shape)}
                else:
                    outputs[name] = {"value": _json_value(leaf.value), "dtype": leaf.dtype}
            return {
                "backend": run.backend,
                "status": run.status,
                "message": run.message,
                "seconds": run.seconds,
                "grad_status": run.grad_status,
                "grad_message": run.grad_message,
                "compute_dtype": run.compute_dtype,
                "reduction_lengths": run.reduction_lengths,
                "notes": list(run.notes),
                "detail": run.detail,
                "outputs": outputs,
            }

        meta = {
            "format": FORMAT,
            "version": VERSION,
            "label": results.label,
            "backward": results.backward,
            "environment": _json_value(dict(results.environment)),
            "fingerprints": dict(results.fingerprints),
            "rule": rule,
            "tol_rel": tol_rel,
            "records": [dataclasses.asdict(r) for r in records] if records is not None else None,
            "runs": {
                "oracle": write_run(results.oracle),
                "reference": write_run(results.reference),
                "candidates": {name: write_run(run) for name, run in results.candidates.items()},
                "anchors": {str(bits): write_run(run) for bits, run in results.anchors.items()},
                "sequential": write_run(results.sequential) if results.sequential is not None else None,
            },
        }
        zf.writestr("meta.json", json.dumps(meta))
    return path


def _fail(path: Any, why: str) -> ReportFormatError:
    return ReportFormatError(f"cannot load report {str(path)!r}: {why}")


def load_results(source: str | Path | bytes | memoryview) -> tuple[RunResults, dict]:
    """Read results saved by :func:`save_results`; returns ``(results, meta)``.  Arrays load lazily."""
    in_memory = isinstance(source, (bytes, bytearray, memoryview))
    where = "<bytes>" if in_memory else source
    try:
        zf = zipfile.ZipFile(io.BytesIO(source) if in_memory else source)
    except FileNotFoundError:
        raise _fail(where, "no such file") from None
    except Exception as exc:  # BadZipFile, OSError, NotImplementedError (bogus zip versions), ...
        raise _fail(where, f"not an rlx_nb report (not a readable zip: {type(exc).__name__}: {exc})") from None
    try:
        info = zf.getinfo("meta.json")
        if info.file_size > _MAX_META:
            raise _fail(where, f"meta.json is {info.file_size} bytes, more than the {_MAX_META} allowed")
        meta = json.loads(zf.read("meta.json"))
    except KeyError:
        raise _fail(where, "no meta.json: not an rlx_nb report") from None
    except ReportFormatError:
        raise
    except Exception as exc:
        raise _fail(where, f"meta.json is unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise _fail(where, f"format is {meta.get('format') if isinstance(meta, dict) else None!r}, not {FORMAT!r}")
    if meta.get("version") not in READS:
        raise _fail(
            where,
            f"version {meta.get('version')!r} is not supported (this rlx_nb reads versions {', '.join(map(str, READS))})",
        )
    names = set(zf.namelist())
    try:
        runs = meta["runs"]
        results = RunResults(
            label=str(meta["label"]),
            oracle=_read_run(zf, names, runs["oracle"], where),
            reference=_read_run(zf, names, runs["reference"], where),
            candidates={str(k): _read_run(zf, names, v, where) for k, v in runs["candidates"].items()},
            backward=bool(meta["backward"]),
            environment=dict(meta.get("environment") or {}),
            fingerprints=dict(meta.get("fingerprints") or {}),
            anchors={int(k): _read_run(zf, names, v, where) for k, v in (runs.get("anchors") or {}).items()},
            sequential=_read_run(zf, names, runs["sequential"], where) if runs.get("sequential") else None,
        )
    except ReportFormatError:
        raise
    except Exception as exc:
        raise _fail(where, f"meta.json is malformed ({type(exc).__name__}: {exc})") from None
    if "nondeterministic" in results.environment:  # the verdicts need it as numbers
        results.environment["nondeterministic"] = _unstable(results.environment["nondeterministic"], where)
    if meta["version"] == 1:  # its anchors' gradients are the zeros of the old rounding (see above)
        for anchor in results.anchors.values():
            anchor.outputs = {n: leaf for n, leaf in anchor.outputs.items() if not n.startswith(GRAD_PREFIX)}
    return results, meta


def _read_run(zf: zipfile.ZipFile, names: set[str], spec: dict, where: Any) -> BackendRun:
    outputs = {}
    for name, out in spec["outputs"].items():
        if "array" in out:
            entry = str(out["array"])
            if entry not in names:
                raise _fail(where, f"array {entry!r} of output {name!r} is missing")
            shape = tuple(int(n) for n in out["shape"])
            outputs[str(name)] = Leaf(None, str(out["dtype"]), shape, loader=_array_loader(zf, entry, shape, where))
        else:
            outputs[str(name)] = Leaf(out.get("value"), str(out.get("dtype", "")), None)
    return BackendRun(
        backend=str(spec["backend"]),
        status=str(spec["status"]),
        outputs=outputs,
        message=str(spec.get("message", "")),
        seconds=float(spec.get("seconds", 0.0)),
        grad_status=spec.get("grad_status"),
        grad_message=str(spec.get("grad_message", "")),
        compute_dtype=str(spec.get("compute_dtype", "float32")),
        reduction_lengths={str(k): int(v) for k, v in (spec.get("reduction_lengths") or {}).items()},
        notes=[str(n) for n in spec.get("notes") or []],
        detail=str(spec.get("detail", "")),
    )


def _array_loader(zf: zipfile.ZipFile, entry: str, shape: tuple[int, ...], where: Any):
    def load() -> np.ndarray:
        try:
            with zf.open(entry) as f:
                version = np.lib.format.read_magic(f)
                header = (
                    np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                )(f)
                stored_shape, _, dtype = header
                if dtype.hasobject:
                    raise _fail(where, f"array {entry!r} holds Python objects; refusing to unpickle it")
                # Scalar outputs were written as shape (1,) before that was fixed: read them back 0-d.
                scalar = shape == () and tuple(stored_shape) == (1,)
                if tuple(stored_shape) != shape and not scalar:
                    raise _fail(where, f"array {entry!r} has shape {tuple(stored_shape)}, meta.json says {shape}")
            with zf.open(entry) as f:
                arr = np.lib.format.read_array(f, allow_pickle=False)
            arr = arr.reshape(()) if scalar else arr
        except ReportFormatError:
            raise
        except Exception as exc:
            raise _fail(where, f"array {entry!r} is unreadable ({type(exc).__name__}: {exc})") from None
        return arr

    return load


def records_from_meta(meta: dict, where: Any = "<report>") -> list | None:
    """The saved per-(backend, output) records, or None when the file has none."""
    from rlx_nb.compare import OutputRecord

    raw = meta.get("records")
    if raw is None:
        return None
    fields = {f.name for f in dataclasses.fields(OutputRecord)}
    try:
        out = []
        for r in raw:
            r = {k: v for k, v in r.items() if k in fields}
            for key in ("shape", "worst_index"):
                if r.get(key) is not None:
                    r[key] = tuple(int(i) for i in r[key])
            out.append(OutputRecord(**r))
        return out
    except Exception as exc:
        raise _fail(where, f"saved records are malformed ({type(exc).__name__}: {exc})") from None
