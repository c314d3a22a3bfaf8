"""Run one model on the oracle, the fp64 reference and candidate backends.

The result, :class:`RunResults`, holds only plain numpy outputs and
metadata, so it can be saved, loaded or gathered before any comparison runs.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import time
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch

from rlx_nb import fingerprints, interrupted, preparations, switches
from rlx_nb.backends import ORACLE, REFERENCE, Backend, get_backend, resolve_backends
from rlx_nb.backends.eager import run_eager
from rlx_nb.backends.emulated import emulate
from rlx_nb.backends.notes import add_note, collecting
from rlx_nb.environment import environment as probe_environment
from rlx_nb.errors import InputError, describe_error, error_detail
from rlx_nb.prepare import (
    PrivateInputs,
    dtype_hint,
    float32_default,
    fresh_leaves,
    named_params,
    normalize_inputs,
    prepare_model,
    user_name,
)
from rlx_nb.progress import bar
from rlx_nb.reassoc import CountCalls, SequentialSums
from rlx_nb.results import (
    ERROR,
    GRAD_PREFIX,
    OK,
    SKIPPED,
    BackendRun,
    Fingerprints,
    RunResults,
    nondeterministic,
    to_leaf,
)
from rlx_nb.tree import flatten, map_tensors

ANCHOR_BITS = (8, 11)


@functools.lru_cache(maxsize=256)
def loss_weight(name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Fixed random weights for one output: the default loss is ``sum(out * w)`` over outputs.

    Random weights (not a plain sum) keep gradients generic: the sum of a
    softmax is constant, so its gradient would be zero.  Seeded by the
    output's name, so every backend and every node uses the same weights.
    """
    w = np.random.default_rng(zlib.crc32(name.encode())).standard_normal(shape)
    w.setflags(write=False)
    return w


def _default_loss(out: Any) -> torch.Tensor | None:
    total = None
    for name, leaf in flatten(out):
        if not isinstance(leaf, torch.Tensor) or not leaf.requires_grad or not leaf.is_floating_point():
            continue
        w = torch.tensor(loss_weight(name, tuple(leaf.shape)), dtype=leaf.dtype, device=leaf.device)
        term = (leaf * w).sum()
        total = term if total is None else total + term.to(total.dtype)
    return total


@dataclasses.dataclass(frozen=True)
class Task:
    """What every run of one call does: a backward or not, with which loss, which inputs get gradients."""

    backward: bool = False
    loss: Callable[[Any], torch.Tensor] | None = None
    grad_inputs: tuple[int, ...] = ()
    input_names: tuple[str, ...] = ()


def execute(
    backend: Backend,
    base: torch.nn.Module,
    args: tuple,
    task: Task,
    *,
    measure_reductions: bool = False,
    timeout_s: float | None = None,
    scope: Callable[[], Any] | None = None,
    saved: dict[str, Any] | None = None,
) -> BackendRun:
    """Run one backend on a fresh copy of the model; never raises for a backend failure.

    The run gets new leaf tensors over ``args``' storage, not copies: ``args`` must be the
    caller's private copy (:func:`run` keeps one in :class:`~rlx_nb.prepare.PrivateInputs`).  With
    ``timeout_s``, the backend runs in a worker thread; one still running after that long
    becomes an error row and its thread is abandoned (Python cannot kill a thread): the switches are
    put back to ``saved`` (the run's snapshot, :mod:`rlx_nb.switches`) at once, and the thread can no
    longer flip one.  ``scope`` is a context manager factory entered around the forward and the backward.

    ``KeyboardInterrupt`` and ``SystemExit``, raised by the backend or by the user while it runs, are
    never a row: they propagate (after the thread is abandoned and the switches restored).
    """
    reason = backend.unavailable_reason()
    if reason is not None:
        return BackendRun(backend.name, ERROR, {}, f"not available here: {reason}", compute_dtype=backend.compute_dtype)

    def go() -> BackendRun:
        with scope() if scope is not None else contextlib.nullcontext():
            return _execute(backend, base, args, task, measure_reductions)

    if timeout_s is None:
        return go()
    box: list[BackendRun] = []
    raised: list[BaseException] = []

    def target() -> None:
        try:
            box.append(go())
        except BaseException as exc:  # an interrupt or exit inside the backend: the caller re-raises it
            raised.append(exc)

    thread = switches.worker(target, name=f"rlx_nb:{backend.name}")
    thread.start()
    try:
        thread.join(timeout_s)
    except BaseException:  # Ctrl-C (or any exception) while waiting: leave the backend behind, switches restored
        switches.abandon(thread, saved if saved is not None else {})
        raise
    if raised:
        raise raised[0]
    if thread.is_alive() or not box:
        switches.abandon(thread, saved if saved is not None else {})
        return BackendRun(
            backend.name,
            ERROR,
            {},
            f"timed out after {timeout_s:g} s (raise timeout_s if it is only slow); its thread was abandoned "
            "and every switch it may have changed restored",
            float(timeout_s),
            compute_dtype=backend.compute_dtype,
        )
    return box[0]


def _prepared_run(backend: Backend, base: torch.nn.Module, fresh: tuple, task: Task) -> tuple[Any, Any]:
    # A backend with a prepare step: reuse the preparation an earlier call made for the same model,
    # input shapes and settings (rlx_nb.preparations), or make one and keep it.  Returns (model, outputs).
    k = preparations.key(backend, base, fresh, task.backward)
    prep = preparations.lookup(k)
    if prep is not None:
        for p in prep.model.parameters():
            p.grad = None
        for note in prep.notes:
            add_note(note)
        add_note(
            f"reused the preparation an earlier call made {time.time() - prep.made_at:.0f} s ago "
            f"({prep.seconds:.2f} s to make); rlx_nb.clear_preparations() drops it"
        )
        try:
            return prep.model, prep.runner(fresh)
        except Exception:
            preparations.forget(k)  # never reuse a preparation that failed
            raise
    model = copy.deepcopy(base)
    if task.backward:
        _require_grads(model)
    start = time.perf_counter()
    with collecting() as made:
        runner = backend.prepare(model, fresh)
        out = runner(fresh)
    for note in made:
        add_note(note)
    seconds = time.perf_counter() - start
    preparations.store(k, preparations.Preparation(backend.name, model, runner, made, seconds, time.time()))
    return model, out


def _require_grads(model: torch.nn.Module) -> None:
    for p in model.parameters():
        if p.is_floating_point():
            p.requires_grad_(True)


def _execute(backend: Backend, base: torch.nn.Module, args: tuple, task: Task, measure_reductions: bool) -> BackendRun:
    fresh = fresh_leaves(args)
    start = time.perf_counter()
    sizes = {} if (task.backward and measure_reductions) else None
    model = None if backend.prepare is not None and sizes is None else copy.deepcopy(base)
    hooks = _record_output_sizes(model, sizes) if sizes is not None else []
    try:
        with collecting() as notes, torch.enable_grad() if task.backward else torch.no_grad():
            if model is None:
                model, out = _prepared_run(backend, base, fresh, task)
            else:
                if task.backward:
                    _require_grads(model)
                out = backend.fn(model, fresh)
        keep = backend.keeps_outputs_on_device
        outputs = {name: to_leaf(v, keep) for name, v in flatten(out)}
        _remove(hooks)
    except Exception as exc:
        _remove(hooks)
        return BackendRun(
            backend.name,
            ERROR,
            {},
            describe_error(exc),
            time.perf_counter() - start,
            compute_dtype=backend.compute_dtype,
            notes=notes,
            detail=error_detail(exc),
        )
    run = BackendRun(backend.name, OK, outputs, seconds=0.0, compute_dtype=backend.compute_dtype, notes=notes)
    if sizes is not None:
        run.reduction_lengths = _reduction_lengths(model, sizes)
    if task.backward:
        _backward(run, backend, model, out, fresh, task)
    run.seconds = time.perf_counter() - start
    return run


def _backward(run: BackendRun, backend: Backend, model: torch.nn.Module, out: Any, fresh: tuple, task: Task) -> None:
    if not backend.differentiable:
        run.grad_status, run.grad_message = SKIPPED, f"{backend.name} cannot differentiate (forward only)"
        return
    try:
        value = task.loss(out) if task.loss is not None else _default_loss(out)
        if value is None or not isinstance(value, torch.Tensor) or not value.requires_grad:
            run.grad_status = SKIPPED
            run.grad_message = f"{backend.name}'s outputs carry no gradient"
            return
        if value.numel() != 1:
            raise InputError(f"loss must be a scalar tensor, got shape {tuple(value.shape)}")
        value.backward()
    except Exception as exc:
        run.grad_status, run.grad_message, run.detail = ERROR, describe_error(exc), error_detail(exc)
        return
    keep = backend.keeps_outputs_on_device
    for name, p in named_params(model):
        if p.grad is not None:
            run.outputs[GRAD_PREFIX + name] = to_leaf(p.grad, keep)
    for i in task.grad_inputs:
        g = fresh[i].grad
        if g is not None:
            run.outputs[GRAD_PREFIX + task.input_names[i]] = to_leaf(g, keep)
    run.grad_status = OK


def _record_output_sizes(model: torch.nn.Module, sizes: dict[str, int]) -> list:
    # Each module's output size (its first tensor output), for the reduction lengths below.
    def hook(name):
        def fn(module, args, out):
            leaves = [v for _, v in flatten(out) if isinstance(v, torch.Tensor)]
            if leaves:
                sizes[name] = max(sizes.get(name, 0), leaves[0].numel())

        return fn

    return [m.register_forward_hook(hook(n)) for n, m in model.named_modules()]


def _remove(hooks: list) -> None:
    for h in hooks:
        h.remove()


def _reduction_lengths(model: torch.nn.Module, sizes: dict[str, int]) -> dict[str, int]:
    # A parameter's gradient sums one term per use: about (module output size)
    # / (its leading dimension) terms per element -- batch rows for a Linear,
    # N*H*W for a conv or BatchNorm channel, tokens for a LayerNorm.
    lengths = {}
    for mod_name, module in model.named_modules():
        out = sizes.get(mod_name)
        if not out:
            continue
        for p_name, p in module.named_parameters(recurse=False):
            full = user_name(model, f"{mod_name}.{p_name}" if mod_name else p_name)
            lead = p.shape[0] if p.dim() else 1
            lengths[GRAD_PREFIX + full] = max(1, out // max(1, lead))
    return lengths


def run(
    model: Any,
    inputs: Any,
    *,
    params: Mapping[str, torch.Tensor] | None = None,
    backends: str | Iterable[str] | None = None,
    backward: bool = False,
    loss: Callable[[Any], torch.Tensor] | None = None,
    label: str | None = None,
    progress: Callable[[str], None] | bool | None = None,
    timeout_s: float | None = 600.0,
    check_determinism: bool = True,
    effective_precision: bool = True,
) -> RunResults:
    """Run ``model`` on the oracle, the fp64 reference and each candidate backend.

    Returns numpy outputs only; :func:`rlx_nb.compare` turns them into a report.
    The oracle must run: if the model fails on it, that is the user's error
    and raises :class:`~rlx_nb.InputError` with the model's message.  Candidates (and the fp64
    reference) that run longer than ``timeout_s`` become error rows.  With ``check_determinism``
    the oracle runs twice; outputs that differ between the two runs are the model's own
    nondeterminism and are recorded in ``environment["nondeterministic"]`` (the comparison then
    says so instead of blaming a backend).
    """
    say = progress if callable(progress) else (lambda _: None)
    candidates = resolve_backends(backends)
    with switches.exclusive(say) as saved:
        cast = float32_default(inputs, saved)
        args, keys = normalize_inputs(inputs)
        base = prepare_model(model, params, keys)
        input_names = keys or [f"input[{i}]" for i in range(len(args))]
        grad_inputs = [i for i, x in enumerate(args) if isinstance(x, torch.Tensor) and x.requires_grad]
        if grad_inputs and not backward:
            args = map_tensors(lambda t: t.detach(), args)
        task = Task(backward, loss, tuple(grad_inputs), tuple(input_names))
        inputs_ = PrivateInputs(args, cast=cast)

        def go(backend: Backend, **kw: Any) -> BackendRun:
            result = execute(backend, base, inputs_.args, task, saved=saved, **kw)
            left = switches.restore(saved)  # what the backend left changed (a user's backend, an abandoned one)
            if left:
                result.notes.append(f"left process-wide switches changed: {switches.describe_changes(left)}")
            inputs_.after(result)
            return result

        # A run under this dispatch mode counts the matmul-like calls the precision anchors would round
        # (without any, the anchors would only repeat the oracle, so they are not run) and the reductions a
        # plain sequential kernel would sum in another order.  A dispatch mode sees the ops the model's own
        # run executes and changes none of them: a torch-function mode would not do, because it turns off
        # PyTorch's inference fast paths (nn.TransformerEncoderLayer, nn.MultiheadAttention).
        counter = CountCalls()
        say(ORACLE)
        # Without a second run to count in, the oracle's own run counts.
        oracle = go(get_backend(ORACLE), measure_reductions=True, scope=None if check_determinism else lambda: counter)
        if oracle.status != OK:
            raise InputError(
                f"the model fails on the CPU oracle, so nothing can be compared: {oracle.message}{dtype_hint(inputs)}"
            )
        if backward and oracle.grad_status != OK:
            raise InputError(f"backward=True but the oracle's backward did not run: {oracle.grad_message}")
        unstable = {}
        if check_determinism:
            unstable = nondeterministic(oracle, go(get_backend(ORACLE), scope=lambda: counter))
        say(REFERENCE)
        reference = go(get_backend(REFERENCE), timeout_s=timeout_s)
        sequential = None
        if counter.calls != 0:
            say("sequential")
            sequential = go(Backend("sequential", run_eager, hookable=True), timeout_s=timeout_s, scope=SequentialSums)
        failed = _why(sequential) if sequential is not None else ""
        anchors = {}
        if effective_precision and counter.matmuls != 0:
            for bits in ANCHOR_BITS:
                anchor = Backend(f"anchor:{bits}", emulate(bits, results=True), hookable=True)
                anchors[bits] = go(anchor, timeout_s=timeout_s)
        extra = ["fp64 reference: every verdict's yardstick"]
        if check_determinism:
            extra.append("oracle, again: the model's own nondeterminism (check_determinism=True)")
        if sequential is not None:
            extra.append(
                f"sequential sums: a second legitimate error ({counter.calls} reductions whose order may change)"
            )
        if anchors:
            extra.append(f"precision anchors ({', '.join(f'{b} bits' for b in anchors)}): effective precision, "
                         f"for {counter.matmuls} matmul/conv calls")  # fmt: skip
        prints = Fingerprints(fingerprints.later(args, model, params))

        def results(runs: dict[str, BackendRun], incomplete: str = "") -> RunResults:
            return RunResults(
                label=label or _default_label(model),
                oracle=oracle,
                reference=reference,
                candidates=runs,
                backward=backward,
                environment={
                    **probe_environment(),
                    **({"sequential_failed": failed} if failed else {}),
                    **({"inputs_cast": cast} if cast else {}),
                    **({"incomplete": incomplete} if incomplete else {}),
                    "nondeterministic": unstable,
                    "extra_runs": extra,
                    "backends": {b.name: b.description for b in candidates},
                    "model_was_training": bool(getattr(model, "training", False)),
                },
                fingerprints=prints,
                anchors={b: a for b, a in anchors.items() if a.status == OK},
                # (grads may be missing from a sequential run whose backward failed)
                sequential=sequential if sequential is not None and sequential.status == OK else None,
            )

        runs: dict[str, BackendRun] = {}
        try:
            with bar("rlx_nb backends", total=len(candidates), unit="backend", enabled=progress is not False) as shown:
                for backend in candidates:
                    say(backend.name)
                    shown.set_postfix_str(backend.name)  # compiling backends (inductor, ONNX export) show here
                    runs[backend.name] = go(backend, timeout_s=timeout_s)
                    shown.update()
        except (KeyboardInterrupt, SystemExit) as exc:
            left = [b.name for b in candidates if b.name not in runs]
            why = f"interrupted ({type(exc).__name__}) while {left[0]} ran" if left else "interrupted"
            why += f"; not run: {', '.join(left[1:])}" if len(left) > 1 else ""
            interrupted.keep(results(dict(runs), why), exc)
            raise
        return results(runs)


def _why(run: BackendRun) -> str:
    # Why a helper run (or its backward) failed, or "" when it did not.
    if run.status != OK:
        return run.message
    return run.grad_message if run.grad_status not in (None, OK) else ""


def _default_label(model: Any) -> str:
    return type(model).__name__ if isinstance(model, torch.nn.Module) else getattr(model, "__name__", "model")
