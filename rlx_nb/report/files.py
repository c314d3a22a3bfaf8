"""Save and load run results safely: a zip of ``.npy`` arrays and one JSON document, no pickle anywhere.

Format ``rlx_nb.report.report`` version 2 (file extension ``.rlxnb`` by convention)::

    meta.json          {"format": "rlx_nb.report", "version": 2, "label", "backward", "environment",
                        "fingerprints": {"inputs", "model"}, "rule", "tol_rel",
                        "runs": {"oracle": RUN, "reference": RUN, "candidates": {name: RUN}}}
    arrays/<n>.npy     one per array output, numpy's own format, read with allow_pickle=False

    RUN = {"backend", "status", "message", "seconds", "grad_status", "grad_message", "compute_dtype",
           "reduction_lengths", "notes", "detail",
           "outputs": {name: {"array": "arrays/<n>.npy", "dtype", "shape"} | {"value": <JSON value>, "dtype"}}}

``notes`` (what the backend said about its run) and ``detail`` (a failed run's whole error) are
optional: files written before them read as empty.  ``runs.discrete`` (optional) holds, per run, the part
of its gradients that flipped ReLU inputs explain (:mod:`rlx_nb.execution.discrete`).

Version 1 files are read too, without their precision anchors' gradients: before version 2 the
anchors' emulated rounding stopped gradients, so those were zeros (as a budget they would excuse
anything).  Arrays are read lazily, on first access.  Loading anything else — a truncated or corrupted file,
another version, an object array, a pickle wearing the right extension — raises
:class:`ReportFormatError` and never executes code.
"""

from __future__ import annotations

import ast
import io
import json
import math
import re
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from rlx_nb.comparison.tables import record_fields, record_from_row, record_row
from rlx_nb.errors import ReportFormatError, writing
from rlx_nb.execution.results import GRAD_PREFIX, BackendRun, Leaf, RunResults
from rlx_nb.report import schema

FORMAT = "rlx_nb.report"
VERSION = 2
READS = (1, 2)
SUFFIX = ".rlxnb"
_MAX_META = 64 << 20


def json_value(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else repr(v)
    if isinstance(v, dict):  # e.g. environment["nondeterministic"], a merged report's per-node environments
        return {str(k): json_value(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_value(x) for x in v]
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


def _counts(value: Any, where: str) -> dict[str, int]:
    # environment["matmul_ops"] as saved: a JSON object of counts of the model's matmul and convolution calls.
    if not isinstance(value, dict) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value.values()
    ):
        raise _fail(where, f"environment.matmul_ops must be an object of counts, got {value!r:.80}")
    return {str(k): v for k, v in value.items()}


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
        _write_zip(path, results, rule=rule, tol_rel=tol_rel, records=records)
        return path
    path = Path(path)
    if not path.suffix:
        path = path.with_suffix(SUFFIX)
    with writing(path, "the report"):
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_zip(path, results, rule=rule, tol_rel=tol_rel, records=records)
    return path


def _write_zip(target: Any, results: RunResults, *, rule: str, tol_rel: float | None, records: list | None) -> None:
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
                    outputs[name] = {"value": json_value(leaf.value), "dtype": leaf.dtype}
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
            "environment": json_value(dict(results.environment)),
            "fingerprints": dict(results.fingerprints),
            "rule": rule,
            "tol_rel": tol_rel,
            "records": [record_row(r) for r in records] if records is not None else None,
            "runs": {
                "oracle": write_run(results.oracle),
                "reference": write_run(results.reference),
                "candidates": {name: write_run(run) for name, run in results.candidates.items()},
                "anchors": {str(bits): write_run(run) for bits, run in results.anchors.items()},
                "sequential": write_run(results.sequential) if results.sequential is not None else None,
                "trials": {name: write_run(run) for name, run in results.trials.items()},
                "discrete": {name: write_run(run) for name, run in results.discrete.items()},
            },
        }
        zf.writestr("meta.json", json.dumps(meta))


def _fail(path: Any, why: str, what: str = "report") -> ReportFormatError:
    return ReportFormatError(f"cannot load {what} {str(path)!r}: {why}")


MAX_EXPANSION = 64
"""A compressed entry may inflate to at most this many times its stored size (past 64 MB): rlx_nb writes
arrays uncompressed, and a small file declaring a huge array must not allocate it (a 1 MB file inflating
to 1 GiB took 15 s and 1.3 GB before it was refused)."""
_SMALL = 64 << 20


def check_entry(info: zipfile.ZipInfo, where: Any, what: str = "report") -> None:
    """Before reading a zip entry of a report (or a snapshot, ``what``): its inflated size against its stored size."""
    if info.compress_type == zipfile.ZIP_STORED and info.file_size != info.compress_size:
        raise _fail(where, f"{info.filename!r} declares {info.file_size} bytes but stores {info.compress_size}", what)
    if info.file_size > _SMALL and info.file_size > MAX_EXPANSION * max(info.compress_size, 1):
        raise _fail(
            where,
            f"{info.filename!r} would inflate from {info.compress_size} to {info.file_size} bytes, more than "
            f"{MAX_EXPANSION}x: refused before allocating it",
            what,
        )


def open_zip(source: Any, where: Any, what: str = "report") -> tuple[zipfile.ZipFile, Any]:
    """``(the zip, its meta.json parsed)`` of a report (or a snapshot, ``what``): a file that is not a readable zip,
    has no meta.json, or one past :data:`_MAX_META` bytes or not JSON, is a :class:`ReportFormatError`."""
    try:
        zf = zipfile.ZipFile(source)
    except FileNotFoundError:
        raise _fail(where, "no such file", what) from None
    except Exception as exc:  # BadZipFile, OSError, NotImplementedError (bogus zip versions), ...
        raise _fail(where, f"not an rlx_nb {what} (not a readable zip: {type(exc).__name__}: {exc})", what) from None
    try:
        info = zf.getinfo("meta.json")
        check_entry(info, where, what)
        if info.file_size > _MAX_META:
            raise _fail(where, f"meta.json is {info.file_size} bytes, more than the {_MAX_META} allowed", what)
        return zf, json.loads(zf.read("meta.json"))
    except KeyError:
        raise _fail(where, f"no meta.json: not an rlx_nb {what}", what) from None
    except ReportFormatError:
        raise
    except Exception as exc:
        raise _fail(where, f"meta.json is unreadable ({type(exc).__name__}: {exc})", what) from None


def load_results(source: str | Path | bytes | memoryview) -> tuple[RunResults, dict]:
    """Read results saved by :func:`save_results`; returns ``(results, meta)``.  Arrays load lazily.

    Every field is checked first (:mod:`rlx_nb.report.schema`), and every array's stored header (dtype, shape,
    bytes) against what ``meta.json`` declares, so anything malformed is a :class:`ReportFormatError`
    here and no array is ever allocated at a size its bytes do not back.
    """
    in_memory = isinstance(source, (bytes, bytearray, memoryview))
    where = "<bytes>" if in_memory else source
    zf, meta = open_zip(io.BytesIO(source) if in_memory else source, where)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise _fail(where, f"format is {meta.get('format') if isinstance(meta, dict) else None!r}, not {FORMAT!r}")
    if meta.get("version") not in READS or isinstance(meta.get("version"), bool):
        raise _fail(
            where,
            f"version {meta.get('version')!r} is not supported (this rlx_nb reads versions {', '.join(map(str, READS))})",
        )
    try:
        results = _results(zf, meta, where)
    except ReportFormatError as exc:
        raise _fail(where, str(exc).removeprefix(f"cannot load report {str(where)!r}: ")) from None
    except Exception as exc:
        raise _fail(where, f"meta.json is malformed ({type(exc).__name__}: {exc})") from None
    if meta["version"] == 1:  # its anchors' gradients are the zeros of the old rounding (see above)
        for anchor in results.anchors.values():
            anchor.outputs = {n: leaf for n, leaf in anchor.outputs.items() if not n.startswith(GRAD_PREFIX)}
    return results, meta


def _results(zf: zipfile.ZipFile, meta: dict, where: Any) -> RunResults:
    runs = schema.mapping(meta.get("runs"), "runs")
    candidates = schema.mapping(runs.get("candidates"), "runs.candidates")
    anchors = schema.mapping(runs.get("anchors") or {}, "runs.anchors")
    trials = schema.mapping(runs.get("trials") or {}, "runs.trials")
    if any(not k.isdigit() or not 1 <= int(k) <= 53 for k in anchors):
        raise schema.fail("runs.anchors", "keyed by mantissa bits (1-53)", list(anchors))
    environment = schema.mapping(meta.get("environment") or {}, "environment")
    rule, tol = meta.get("rule"), meta.get("tol_rel")
    if rule is not None:
        schema.one_of(rule, ("budget", "fixed"), "rule")
    if tol is not None:
        schema.number(tol, "tol_rel", finite=True, low=0.0)
    if not isinstance(meta.get("backward"), bool):
        raise schema.fail("backward", "true or false", meta.get("backward"))
    reader = _Reader(zf, where)
    results = RunResults(
        label=schema.string(meta.get("label"), "label"),
        oracle=reader.run(runs.get("oracle"), "runs.oracle"),
        reference=reader.run(runs.get("reference"), "runs.reference"),
        candidates={k: reader.run(v, f"runs.candidates[{k!r}]") for k, v in candidates.items()},
        backward=meta["backward"],
        environment=dict(environment),
        fingerprints=schema.fingerprints(meta.get("fingerprints")),
        anchors={int(k): reader.run(v, f"runs.anchors[{k!r}]") for k, v in anchors.items()},
        sequential=reader.run(runs["sequential"], "runs.sequential") if runs.get("sequential") else None,
        trials={str(k): reader.run(v, f"runs.trials[{k!r}]") for k, v in trials.items()},
        discrete={
            k: reader.run(v, f"runs.discrete[{k!r}]")
            for k, v in schema.mapping(runs.get("discrete") or {}, "runs.discrete").items()
        },
    )
    if "nondeterministic" in results.environment:  # the verdicts need it as numbers
        results.environment["nondeterministic"] = _unstable(results.environment["nondeterministic"], where)
    if "matmul_ops" in results.environment:  # and this as counts (a uniformly less accurate convolution's reading)
        results.environment["matmul_ops"] = _counts(results.environment["matmul_ops"], where)
    return results


class _Reader:
    # Runs read from one zip: each array's header is checked against meta.json now, its data read lazily.
    def __init__(self, zf: zipfile.ZipFile, where: Any) -> None:
        self.zf, self.where = zf, where
        self.names = set(zf.namelist())

    def run(self, spec: Any, at: str) -> BackendRun:
        checked = schema.run(spec, at)
        outputs = {}
        for name, out in checked["outputs"].items():
            if "array" in out:
                entry = out["array"]
                if entry not in self.names:
                    raise schema.fail(f"{at}.outputs[{name!r}].array", "an entry of the file", entry)
                loader = checked_array(self.zf, entry, out["shape"], self.where, declared=out["dtype"])
                outputs[name] = Leaf(None, out["dtype"], out["shape"], loader=loader)
            else:
                outputs[name] = Leaf(out["value"], out["dtype"], None)
        return BackendRun(**{k: v for k, v in checked.items() if k != "outputs"}, outputs=outputs)


def checked_array(
    zf: zipfile.ZipFile,
    entry: str,
    shape: tuple[int, ...],
    where: Any,
    *,
    what: str = "report",
    kinds: str = "biufc",
    old_scalars: bool = True,
    declared: str | None = None,
):
    """A loader of one ``.npy`` entry, its stored header checked now against the ``shape`` declared for it: numbers
    of ``kinds`` (numpy's kind letters), that shape, and exactly the bytes those elements take, so nothing is ever
    allocated at a size its bytes do not back; with ``declared`` (a dtype name meta.json gives), the dtype rlx_nb
    stores that one as (:data:`STORED_AS`).  Anything else is a :class:`ReportFormatError` naming the ``what``.
    ``old_scalars``: a scalar stored as shape (1,) (reports written before that was fixed) is read back 0-d."""
    info = zf.getinfo(entry)
    check_entry(info, where, what)
    try:
        with zf.open(entry) as f:
            dtype, stored, offset = _npy_header(f)
    except ReportFormatError:
        raise
    except Exception as exc:
        raise _fail(where, f"array {entry!r} is unreadable ({type(exc).__name__}: {exc})", what) from None
    if dtype.hasobject or dtype.kind not in kinds or dtype.fields is not None:
        raise _fail(where, f"array {entry!r} holds {dtype}, not numbers; refusing to read it", what)
    if declared is not None and dtype.newbyteorder("=") != _stored_as(declared):
        raise _fail(where, f"array {entry!r} holds {dtype}, but meta.json declares it {declared}", what)
    # Scalar outputs were written as shape (1,) before that was fixed: read them back 0-d.
    if stored != shape and not (old_scalars and shape == () and stored == (1,)):
        raise _fail(where, f"array {entry!r} has shape {stored}, meta.json says {shape}", what)
    if offset + math.prod(stored) * dtype.itemsize != info.file_size:
        raise _fail(
            where,
            f"array {entry!r} declares {math.prod(stored)} {dtype} elements, but its entry holds "
            f"{info.file_size - offset} bytes of data",
            what,
        )
    return _array_loader(zf, entry, shape, where, what)


STORED_AS = {"bfloat16": "float32"}
"""The numpy dtype rlx_nb writes an array of each dtype name as, where it is not the same name (numpy has no
bfloat16: its values are written in float32, exactly)."""


def _stored_as(declared: str) -> np.dtype | None:
    try:
        return np.dtype(STORED_AS.get(declared, declared))
    except TypeError:  # (a dtype numpy has none of, complex32: rlx_nb never writes one)
        return None


def _npy_header(f: Any) -> tuple[np.dtype, tuple[int, ...], int]:
    # (dtype, shape, data offset) of an .npy stream, without reading its data.
    version = np.lib.format.read_magic(f)
    read = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}.get(version)
    if read is None:
        raise ValueError(f"npy format version {version} is not one rlx_nb writes")
    stored, fortran, dtype = read(f)
    if fortran and len(stored) > 1:
        raise ValueError("Fortran-ordered arrays are not written by rlx_nb")
    return dtype, tuple(int(n) for n in stored), f.tell()


def _array_loader(zf: zipfile.ZipFile, entry: str, shape: tuple[int, ...], where: Any, what: str):
    # The header was checked on load (checked_array): the data is exactly the declared elements.
    def load() -> np.ndarray:
        try:
            with zf.open(entry) as f:
                arr = np.lib.format.read_array(f, allow_pickle=False)
        except Exception as exc:
            raise _fail(where, f"array {entry!r} is unreadable ({type(exc).__name__}: {exc})", what) from None
        return arr.reshape(()) if shape == () else arr

    return load


def records_from_meta(meta: dict, where: Any = "<report>", results: RunResults | None = None) -> list | None:
    """The saved per-(backend, output) records, or None when the file has none.

    With ``results`` (the runs read from the same file), each record is checked against them
    (:func:`rlx_nb.report.schema.records`): its backend is a candidate, its output one the runs have.
    """
    raw = meta.get("records")
    if raw is None:
        return None
    try:
        if results is not None:
            outputs = {name: set(run.outputs) for name, run in results.candidates.items()}
            oracle = {name: leaf.shape for name, leaf in results.oracle.outputs.items()}
        else:
            outputs = {
                r.get("backend"): set() for r in raw if isinstance(r, dict) and isinstance(r.get("backend"), str)
            }
            oracle = {}
        return [record_from_row(r) for r in schema.records(raw, record_fields(), outputs, oracle)]
    except ReportFormatError as exc:
        raise _fail(where, f"saved records are malformed: {exc}") from None
    except Exception as exc:
        raise _fail(where, f"saved records are malformed ({type(exc).__name__}: {exc})") from None
