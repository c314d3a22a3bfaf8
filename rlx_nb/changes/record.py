"""Snapshot: one environment's run of a model, module by module, streamed to disk.

How
---
1. The model runs once on the backend (the CPU oracle by default) with a hook on every module.  Each module's first
   call is written as it happens: its call (the arguments, tensors as slots) and its inputs, then its outputs.  A
   tensor already written (a module's input is often the module before's output) is stored once, matched by its
   storage while it lives, so the file holds each activation once.
2. With ``reference=True`` the float64 model runs once more (its weights cast one op at a time,
   :func:`~rlx_nb.backends.eager.run_float64_streamed`), and each module's float64 output, less the recorded output,
   is written in float32: the oracle's own round-off there, which :func:`rlx_nb.diff` judges a change against.
3. Arrays go into the zip as they are made (nothing is held; with the reference, each output also to a scratch
   file the float64 pass reads back).  A ``byte_budget`` caps what is written: past it, a module's arrays are left
   out and the file says so.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
import weakref
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlx_nb._support import switches
from rlx_nb._support.copies import module_copy
from rlx_nb._support.hugepages import raw_bytes
from rlx_nb._support.progress import bar
from rlx_nb._support.tree import flatten
from rlx_nb.backends.base import ORACLE, REFERENCE
from rlx_nb.backends.eager import run_float64_streamed
from rlx_nb.backends.registry import get_backend
from rlx_nb.changes import files
from rlx_nb.changes.environment import snapshot_environment
from rlx_nb.changes.ops import OpCall, OpCalls, is_op, resolve, runnable
from rlx_nb.errors import InputError, still_interrupted, writing
from rlx_nb.execution import fingerprints
from rlx_nb.execution.prepare import normalize_inputs, prepare_model
from rlx_nb.localization.capture import CallModule, OpModule, Slot, called_parent
from rlx_nb.report.files import json_value

_DTYPES = {torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool}  # fmt: skip


class Unwritable(Exception):
    """A call argument a snapshot cannot write as data (an object, a callable): the module cannot be replayed."""


def encode(x: Any, tensors: list[torch.Tensor]) -> dict:
    """``x`` (a call's arguments) as a JSON template, each tensor appended to ``tensors`` and written as its slot."""
    if isinstance(x, torch.Tensor):
        if x.dtype not in _DTYPES:
            raise Unwritable(f"{x.dtype} tensor")
        tensors.append(x)
        return {"slot": len(tensors) - 1}
    if x is None or isinstance(x, (bool, int, str)):
        return {"value": x}
    if isinstance(x, float):
        return {"float": repr(x)}
    if isinstance(x, torch.dtype):
        name = str(x).removeprefix("torch.")
        if name not in files.schema.DTYPES:
            raise Unwritable(f"dtype {name}")
        return {"dtype": name}
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return {"tuple": [encode(v, tensors) for v in x]}
    if isinstance(x, list):
        return {"list": [encode(v, tensors) for v in x]}
    if isinstance(x, dict) and all(isinstance(k, str) for k in x):
        return {"dict": {k: encode(v, tensors) for k, v in x.items()}}
    raise Unwritable(type(x).__name__)


def template(t: dict) -> Any:
    """The call :func:`encode` wrote, as a captured call's template (tensors as :class:`Slot`): what
    :func:`~rlx_nb.localization.capture.fill` fills and :class:`~rlx_nb.localization.capture.CallModule` replays."""
    ((kind, v),) = t.items()
    if kind == "slot":
        return Slot(v)
    if kind == "value":
        return v
    if kind == "float":
        return float(v)
    if kind == "dtype":
        return getattr(torch, v)
    if kind == "tuple":
        return tuple(template(x) for x in v)
    if kind == "list":
        return [template(x) for x in v]
    return {k: template(x) for k, x in v.items()}


def watched_run(
    base: torch.nn.Module,
    run: Callable[[], Any],
    *,
    failed: str,
    first_call: Callable[[str, tuple, dict], None] | None = None,
    first_output: Callable[[str, Any], None] | None = None,
    op_called: Callable[[OpCall], None] | None = None,
) -> None:
    """``run()`` (a run of ``base``) with every module watched: ``first_call(name, args, kwargs)`` as each module is
    first called, ``first_output(name, output)`` as that call returns, and ``op_called(op)`` with each op a module
    calls itself during its first call (:class:`~rlx_nb.changes.ops.OpCalls`; the hooks' own tensor work is not the
    model's); without gradients, the model's buffers put back after (:func:`same_state`), the hooks removed.  A
    failure is an :class:`InputError` starting with ``failed``."""
    called: set[str] = set()
    returned: set[str] = set()
    recorder = OpCalls(op_called) if op_called is not None else None
    quiet = recorder.paused if recorder is not None else contextlib.nullcontext

    def pre(name: str):
        def hook(module, args, kwargs):
            if name not in called:
                called.add(name)
                with quiet():
                    first_call(name, args, kwargs)

        return hook

    def post(name: str):
        def hook(module, args, out):
            if name in called and name not in returned:
                returned.add(name)
                with quiet():
                    first_output(name, out)

        return hook

    handles = []
    for name, module in base.named_modules():
        if first_call is not None:
            handles.append(module.register_forward_pre_hook(pre(name), with_kwargs=True))
        if first_output is not None:
            handles.append(module.register_forward_hook(post(name)))
    if first_call is None:  # (every module counts as called: its first return is its first call's)
        called.update(name for name, _ in base.named_modules())
    try:
        with torch.no_grad(), same_state(base), recorder.attached(base) if recorder else contextlib.nullcontext():
            run()
    except Exception as exc:
        still_interrupted(exc)
        raise InputError(f"{failed}: {type(exc).__name__}: {exc}") from None
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def same_state(base: torch.nn.Module) -> Iterator[None]:
    """Around one run: the model's buffers put back as they were after it (a model that steps a counter or a running
    statistic in forward gives every run the state the first one saw)."""
    kept = {name: b.detach().clone() for name, b in base.named_buffers()}
    try:
        yield
    finally:
        with torch.no_grad():
            for name, b in base.named_buffers():
                if name in kept and b.shape == kept[name].shape:
                    b.copy_(kept[name])


class Sink:
    """Arrays written into the snapshot's zip as they come (streamed, no scratch copy), each tensor once, under a
    budget; with ``keep`` (a folder), those put with ``keep=True`` also go there as ``.npy`` files, to be read back
    (the float64 reference's pass reads each recorded output).

    A tensor seen before (a module's output passed on as the next one's input, or a view of it laid out the same)
    is matched by its storage, offset, layout and version while it is alive (a weak reference: nothing is held), so
    it costs no pass over its bytes.  (Hashing every activation's bytes took 0.42 s of a 1.9 s snapshot of GPT-2
    small; writing each array to a scratch file and then copying it into the zip, 0.2 s.)"""

    def __init__(self, zf: zipfile.ZipFile, budget: int | None, keep: Path | None = None) -> None:
        self.zf, self.budget, self.keep = zf, budget, keep
        self.bytes = 0
        self.declared: dict[str, dict] = {}
        self.kept: dict[str, Path] = {}
        self.left_out = 0
        self._seen: dict[tuple, tuple[weakref.ref, str]] = {}

    def put(self, t: torch.Tensor, *, keep: bool = False) -> str | None:
        """The entry ``t`` is stored under (the one it was stored under if seen before); None past the budget."""
        given, t = t, t.detach()
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device,
               t._version)  # fmt: skip
        seen = self._seen.get(key)
        if seen is not None and seen[0]() is not None:  # (alive: its storage cannot have been reused)
            entry = seen[1]
        else:
            entry = self._write(t)
            if entry is not None:
                self._seen[key] = (weakref.ref(given), entry)
        if entry is not None and keep and self.keep is not None and entry not in self.kept:
            self.kept[entry] = self.keep / f"{len(self.kept)}.npy"
            np.save(self.kept[entry], _array(t), allow_pickle=False)
        return entry

    def _write(self, t: torch.Tensor) -> str | None:
        if self.budget is not None and self.bytes + t.nbytes > self.budget:
            self.left_out += 1
            return None
        entry = f"arrays/{len(self.declared)}.npy"
        with self.zf.open(entry, "w", force_zip64=True) as f:
            np.lib.format.write_array(f, _array(t), allow_pickle=False)
        self.bytes += t.nbytes
        self.declared[entry] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
        return entry

    def read(self, entry: str) -> np.ndarray:
        """An array put with ``keep=True``, read back from its ``.npy`` file."""
        return np.load(self.kept[entry], mmap_mode="r", allow_pickle=False)

    def tensor(self, entry: str) -> torch.Tensor:
        """A tensor put with ``keep=True``, read back as its own tensor in its own dtype."""
        t = torch.from_numpy(np.array(self.read(entry)))
        return t.to(torch.bfloat16) if self.declared[entry]["dtype"] == "bfloat16" else t


def _array(t: torch.Tensor) -> np.ndarray:
    # A tensor's values as a numpy array on its own bytes (bfloat16 as float32: numpy has none; the dtype name keeps it).
    t = (t.float() if t.dtype == torch.bfloat16 else t).to("cpu").contiguous()
    kind = np.dtype(str(t.dtype).removeprefix("torch."))
    arr = np.frombuffer(raw_bytes(t), dtype=kind) if t.numel() else np.zeros(0, dtype=kind)
    return arr.reshape(tuple(t.shape))


def snapshot(
    model: Any,
    inputs: Any,
    path: str | Path,
    *,
    backend: str = ORACLE,
    params: dict[str, torch.Tensor] | None = None,
    reference: bool = False,
    byte_budget: int | None = None,
    label: str | None = None,
    ops: bool = False,
    progress: bool | None = None,
) -> Path:
    """Record this environment's run of ``model`` on ``inputs``, module by module, to ``path`` (a ``.rlxsnap`` file).

    What :func:`rlx_nb.diff` compares another environment against: each module's first call (its inputs) and its
    outputs on ``backend``, each module's float64 value (``reference``), this environment (versions, CPU features,
    BLAS and oneDNN, threads, dispatch variables, rlx_nb's switches) and the model's and inputs' fingerprints.

    Parameters
    ----------
    model, inputs, params
        As for :func:`rlx_nb.backend_divergence`.
    path : str or Path
        The file to write; ``.rlxsnap`` is appended when it has no suffix.
    backend : str
        Where to run: the CPU oracle (default) or another backend.  One that runs the model eagerly (hooks fire on
        it: ``cpu-nomkldnn``, ``cuda``, a fault...) is recorded in one run.  One that compiles or exports the whole
        model (``cpu-inductor``, ``onnxruntime``, ExecuTorch, LiteRT...) has no module boundaries in its run: each
        module is run on it *alone*, fed the inputs it had in the oracle's run, and those outputs are recorded (a
        compile or an export per module: seconds each).  A diff on the same backend's next version then tells
        which module's kernels changed (local changes only).
    reference : bool
        Also record each module's float64 value (one more forward, in float64, and as many bytes again): a diff of
        two snapshots needs it in one of them.  Off by default: a diff against the model computes it there (the
        float64 model is the same function in both environments, to float64's round-off), and the float64 forward
        costs 2-5x the snapshot's own (bench/changes.py).
    byte_budget : int, optional
        The most bytes of arrays to write.  By default every distinct activation is written once (about the
        model's activations; as much again with the reference); past a budget, later modules' arrays are left
        out (their rows in a diff say so).
    label : str, optional
        A name for this environment (default: the host and torch version).
    ops : bool
        Also record each module's own torch function calls (``F.softmax``, ``torch.matmul``, ``Tensor.__add__``...;
        data movement and in-place ops left out), each as an entry named ``"<module> :: F.softmax"`` with its inputs
        and output: a diff then descends from a module past the line into its ops, as :func:`rlx_nb.localize`
        does.  Off by default: it writes every op's output (several times the activations; ``byte_budget``
        bounds it).
    progress : bool, optional
        A progress bar over the modules run alone (a backend that compiles or exports the whole model).

    Returns
    -------
    Path
        The file written.
    """
    if byte_budget is not None and (isinstance(byte_budget, bool) or not isinstance(byte_budget, int)
                                    or byte_budget < 0):  # fmt: skip
        raise InputError(f"byte_budget must be a whole number of bytes >= 0 or None, got {byte_budget!r}")
    for flag, value in (("reference", reference), ("ops", ops)):
        if not isinstance(value, bool):
            raise InputError(f"{flag} must be True or False, got {value!r}")
    chosen = get_backend(backend)
    if backend == REFERENCE:
        raise InputError(f"{backend!r} is the float64 reference, which every snapshot records with reference=True")
    reason = chosen.unavailable_reason()
    if reason:
        raise InputError(f"backend {backend!r} is not available here: {reason}")
    path = Path(path)
    for where in (path, path if path.suffix else path.with_suffix(files.SUFFIX)):
        if where.is_dir():  # (said before the model runs, not after)
            raise InputError(f"the snapshot's path {str(where)!r} is a folder; give a file to write, e.g. "
                             f"{str(where / 'run.rlxsnap')!r}")  # fmt: skip
    if not path.suffix:
        path = path.with_suffix(files.SUFFIX)
    env = snapshot_environment()
    with writing(path, "the snapshot"):
        path.parent.mkdir(parents=True, exist_ok=True)
        alone = not chosen.hookable  # (each module alone on it, fed the oracle's inputs: _record_alone)
        scratch = Path(tempfile.mkdtemp(prefix=".rlx_nb-snapshot-", dir=path.parent)) if reference or alone else None
        partial = path.with_name(f".{path.name}.partial")  # (renamed to path once whole: never a half-written file)
        zf = zipfile.ZipFile(partial, "w", compression=zipfile.ZIP_STORED, allowZip64=True)
    try:
        with zf, writing(path, "the snapshot"):
            with switches.exclusive():
                args, keys = normalize_inputs(inputs)
                base = prepare_model(model, params, keys)
                sink = Sink(zf, byte_budget, keep=scratch)
                seconds = {}
                start = time.perf_counter()
                if alone:
                    modules = _record_alone(base, args, chosen, sink, reference=reference, progress=progress, ops=ops)
                else:
                    modules = _record(base, args, chosen, sink, ops=ops)
                seconds["forward"] = time.perf_counter() - start
                if reference and not alone:
                    start = time.perf_counter()
                    _record_reference(base, args, modules, sink, ops=ops)
                    seconds["reference"] = time.perf_counter() - start
            weights = dict(base.state_dict())
            meta = {
                "format": files.FORMAT,
                "version": files.VERSION,
                "label": label or f"{env.get('host')} torch {torch.__version__}",
                "backend": backend,
                "alone": alone,
                "keyword": keys is not None,
                "environment": json_value(env),
                "fingerprints": {
                    "inputs": fingerprints.quick_fingerprint(args),
                    "model": fingerprints.quick_fingerprint(weights),
                    "input_structure": fingerprints.structure(args),
                    "model_structure": fingerprints.structure(weights),
                },
                "byte_budget": byte_budget,
                "bytes": sink.bytes,
                "seconds": seconds,
                "modules": list(modules.values()),
                "arrays": sink.declared,
            }
            zf.writestr("meta.json", json.dumps(meta))
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    return path


def _record(
    base: torch.nn.Module, args: tuple, backend: Any, sink: Sink, *, outputs: bool = True, ops: bool = False
) -> dict[str, dict]:
    # One run on the backend: each module's first call and outputs, written as they happen (``outputs=False``: the
    # calls only, their inputs kept to be read back, for _record_alone); with ``ops``, each module's own torch
    # function calls too (rlx_nb.changes.ops), as entries named "<module> :: F.softmax".
    modules: dict[str, dict] = {}

    def write_call(entry: dict, a: tuple, kw: dict) -> None:
        tensors: list[torch.Tensor] = []
        try:
            entry["call"] = encode((tuple(a), dict(kw)), tensors)
        except Unwritable as exc:
            entry["why"] = f"its call passes a {exc}, which a snapshot cannot write: it cannot run alone"
            return
        entry["inputs"] = [sink.put(t, keep=not outputs) for t in tensors]
        if any(e is None for e in entry["inputs"]):
            entry["call"], entry["why"] = None, "its inputs were past the byte budget: it cannot run alone"

    def first_call(name: str, a: tuple, kw: dict) -> None:
        modules[name] = {"name": name, "order": len(modules), "depth": 0, "parent": None, "call": None, "why": "",
                         "inputs": [], "outputs": {}, "reference": {}}  # fmt: skip
        write_call(modules[name], a, kw)

    def first_output(name: str, out: Any) -> None:
        for leaf_name, leaf in flatten(out):
            if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
                modules[name]["outputs"][leaf_name] = sink.put(leaf, keep=True)

    def seen_op(op: OpCall) -> None:
        entry = modules[op.name] = {"name": op.name, "order": len(modules), "depth": 0, "parent": op.module,
                                    "op": op.label, "call": None, "why": "", "inputs": [], "outputs": {},
                                    "reference": {}}  # fmt: skip
        cannot = runnable(op.func)
        if cannot is not None:
            entry["why"] = f"{cannot}: it cannot run alone"
        else:
            write_call(entry, op.args, op.kwargs)
        if outputs:
            entry["outputs"]["out"] = sink.put(op.out, keep=True)

    watched_run(base, lambda: backend.fn(base, args), failed=f"the model failed on {backend.name!r}",
                first_call=first_call, first_output=first_output if outputs else None,
                op_called=seen_op if ops else None)  # fmt: skip
    for name, entry in modules.items():
        if name and not is_op(name):
            entry["parent"] = called_parent(name, modules)
        if entry["parent"] is not None:
            entry["depth"] = modules[entry["parent"]]["depth"] + 1
        if any(e is None for e in entry["outputs"].values()) and not entry["why"]:
            entry["why"] = "some of its outputs were past the byte budget"
    return modules


def _record_alone(
    base: torch.nn.Module, args: tuple, backend: Any, sink: Sink, *, reference: bool, progress: bool | None, ops: bool
) -> dict[str, dict]:
    # A backend that compiles or exports the whole model: the oracle's run gives each module's first call (its inputs,
    # kept to be read back); then each module alone, fed those inputs, runs on the backend, and its outputs are what
    # the snapshot records (with the float64 module's on the same inputs, less them: its round-off there).
    modules = _record(base, args, get_backend(ORACLE), sink, outputs=False, ops=ops)
    named = dict(base.named_modules())
    with bar(f"rlx_nb snapshot {backend.name}", total=len(modules), unit="module", enabled=progress) as shown:
        for entry in modules.values():
            shown.update()
            if entry["call"] is None:
                continue
            tensors = tuple(sink.tensor(e) for e in entry["inputs"])
            try:
                with torch.no_grad():
                    out = backend.fn(alone(entry, named), tensors)
            except Exception as exc:
                still_interrupted(exc)
                entry["why"] = f"it failed alone on {backend.name}: {type(exc).__name__}: {exc}"[:300]
                continue
            leaves = {k: v for k, v in flatten(out) if isinstance(v, torch.Tensor) and v.is_floating_point()}
            for leaf_name, leaf in leaves.items():
                entry["outputs"][leaf_name] = sink.put(leaf)
            if reference:
                exact = dict(flatten(run_float64_streamed(alone(entry, named, copy=False), tensors)))
                for leaf_name, leaf in leaves.items():
                    ref = exact.get(leaf_name)
                    if isinstance(ref, torch.Tensor) and ref.shape == leaf.shape and entry["outputs"][leaf_name]:
                        residual = (ref.detach().double() - leaf.detach().to("cpu").double()).float()
                        entry["reference"][leaf_name] = sink.put(residual)
            if any(e is None for e in entry["outputs"].values()) and not entry["why"]:
                entry["why"] = "some of its outputs were past the byte budget"
    return modules


def _record_reference(
    base: torch.nn.Module, args: tuple, modules: dict[str, dict], sink: Sink, *, ops: bool = False
) -> None:
    # The float64 model, once: each module's (and op's) float64 output less the recorded one, in float32.
    def residual(name: str, leaves: Any) -> None:
        recorded = modules[name]["outputs"] if name in modules else {}
        for leaf_name, leaf in leaves:
            entry = recorded.get(leaf_name)
            if entry is None or not isinstance(leaf, torch.Tensor) or not leaf.is_floating_point():
                continue
            old = sink.read(entry)
            if tuple(old.shape) != tuple(leaf.shape):
                continue  # (the float64 model took another path: no reference for this leaf)
            r = np.asarray(leaf.detach().to("cpu", torch.float64).numpy() - old.astype(np.float64))
            modules[name]["reference"][leaf_name] = sink.put(torch.from_numpy(r.astype(np.float32)))

    watched_run(base, lambda: run_float64_streamed(base, args), failed="the float64 reference failed",
                first_output=lambda name, out: residual(name, flatten(out)),
                op_called=(lambda op: residual(op.name, [("out", op.out)])) if ops else None)  # fmt: skip


def alone(entry: dict, named: dict[str, torch.nn.Module], *, copy: bool = True) -> torch.nn.Module:
    """What runs one recorded entry alone: its op (:class:`OpModule` of the function its name resolves to), or its
    module (``copy``: a private copy, in eval mode) replaying the recorded call."""
    call = template(entry["call"])
    if entry.get("op"):
        return OpModule(resolve(entry["op"]), call)
    module = named[entry["name"]]
    return CallModule(module_copy(module, {}), call).eval() if copy else CallModule(module, call)


__all__ = ["alone", "encode", "same_state", "snapshot", "template", "watched_run"]
