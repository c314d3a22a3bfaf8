"""Running one backend: its copy of the model, a timeout, the forward and the backward, its outputs as leaves.

:func:`execute` never raises for a backend's failure (it is an ``error`` row); interrupts propagate.
:func:`rlx_nb.execution.run.run` calls it for the oracle, the reference, the helper runs and every candidate.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from rlx_nb._support import meter as phases
from rlx_nb._support import switches
from rlx_nb._support.hugepages import weights_bytes
from rlx_nb._support.meter import rss_bytes
from rlx_nb._support.tree import flatten
from rlx_nb.backends.base import Backend
from rlx_nb.backends.notes import add_note, collecting
from rlx_nb.errors import InputError, NotApplicable, describe_error, error_detail, still_interrupted
from rlx_nb.execution import cache as preparations
from rlx_nb.execution.prepare import PrivateModel, fresh_leaves, named_params, user_name
from rlx_nb.execution.results import ERROR, GRAD_PREFIX, OK, SKIPPED, BackendRun, to_leaf


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
    private: PrivateModel | Given,
    args: tuple,
    task: Task,
    *,
    measure_reductions: bool = False,
    timeout_s: float | None = None,
    scope: Callable[[], Any] | None = None,
    saved: dict[str, Any] | None = None,
) -> BackendRun:
    """Run one backend on its copy of the model (``private.copy_for``); never raises for a backend failure.

    The run gets new leaf tensors over ``args``' storage, not copies: ``args`` must be the caller's private
    copy (:func:`run` keeps one in :class:`~rlx_nb.execution.prepare.PrivateInputs`).  With ``timeout_s``, an exported,
    device or registered backend runs in a worker thread; one still running after that long becomes an error
    row and its thread is abandoned (Python cannot kill a thread): the switches are put back to ``saved`` (the
    run's snapshot, :mod:`rlx_nb._support.switches`) at once, and the thread can no longer flip one.  rlx_nb's own CPU
    runs (:attr:`Backend.on_caller`) stay on the calling thread, stopped at their next Python step once past
    ``timeout_s``.  ``scope`` is a context manager factory entered around the forward and the backward.

    ``KeyboardInterrupt`` and ``SystemExit``, raised by the backend or by the user while it runs, are
    never a row: they propagate (after the thread is abandoned and the switches restored).
    """
    reason = backend.unavailable_reason()
    if reason is not None:
        # (a skipped row: nothing about the backend was judged, and the reason says how to make it live)
        return BackendRun(
            backend.name, SKIPPED, {}, f"not available here: {reason}", compute_dtype=backend.compute_dtype
        )

    def go() -> BackendRun:
        with scope() if scope is not None else contextlib.nullcontext():
            return _execute(backend, private, args, task, measure_reductions)

    if timeout_s is None:
        return go()
    if backend.on_caller:
        return _on_caller(go, backend, timeout_s)
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
    except BaseException:  # Ctrl-C (or any exception) while waiting: the backend stopped, switches restored
        switches.abandon(thread, saved if saved is not None else {}, wait_s=STOP_WAIT_S)
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
            abandoned=True,
        )
    return box[0]


STOP_WAIT_S = 10.0
"""How long an interrupt waits for the backend it stops to unwind (it stops at its next Python step; an export
restores the output it redirected and deletes its files) before it propagates."""


class _TimedOut(BaseException):
    """Raised into the calling thread when a run on it passes its timeout (a BaseException: a model's own
    ``except Exception`` does not swallow it)."""


def _on_caller(go: Callable[[], BackendRun], backend: Backend, timeout_s: float) -> BackendRun:
    # The run on the calling thread (Backend.on_caller); past ``timeout_s`` a watchdog raises _TimedOut
    # in it, which lands at its next Python step (a decode's next step, a model's next module).
    caller = threading.get_ident()
    lock = threading.Lock()
    state = {"done": False, "fired": False}

    def fire() -> None:
        with lock:
            if not state["done"]:
                state["fired"] = True
                switches.raise_in(caller, _TimedOut)

    watchdog = threading.Timer(timeout_s, fire)
    watchdog.daemon = True
    start = time.perf_counter()
    try:
        watchdog.start()
        try:
            return go()
        finally:
            with lock:
                state["done"] = True
                watchdog.cancel()
                if state["fired"]:  # (fired after the run's last Python step: never let it land elsewhere)
                    switches.raise_in(caller, None)
    except _TimedOut:
        return BackendRun(
            backend.name,
            ERROR,
            {},
            f"timed out after {timeout_s:g} s (raise timeout_s if it is only slow); stopped at its next Python step",
            time.perf_counter() - start,
            compute_dtype=backend.compute_dtype,
        )


class Given:
    """One model for one run (the fp64 reference's lent copy, :meth:`PrivateModel.lend`)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def copy_for(self, name: str) -> torch.nn.Module:
        return self.model


def _prepared_run(backend: Backend, private: PrivateModel | Given, fresh: tuple, task: Task) -> tuple[Any, Any]:
    # A backend with a prepare step: reuse the preparation an earlier call made for the same model,
    # input shapes and settings (rlx_nb.execution.cache), or make one and keep it.  Returns (model, outputs);
    # the model is None for a forward-only backend (its preparation holds the converted model, not ours).
    k = preparations.key(backend, private.model, fresh, task.backward)
    prep = preparations.lookup(k)
    if prep is not None:
        for p in prep.model.parameters() if prep.model is not None else ():
            p.grad = None
        return prep.model, preparations.run_kept(k, prep, fresh)
    model = private.copy_for(backend.name)
    if task.backward:
        _require_grads(model)
    start = time.perf_counter()
    before = rss_bytes()
    with collecting() as made, phases.step(f"{backend.name}: prepare"):
        runner = backend.prepare(model, fresh)
    with phases.step(f"{backend.name}: first run"):
        out = runner(fresh)
    for note in made:
        add_note(note)
    seconds = time.perf_counter() - start
    kept = model if backend.differentiable else None  # a forward-only runner holds what it needs itself
    # What keeping it costs: what making it added, and the weights it pins (shared with the run's private
    # model, they would outlive it).
    held = max(0, rss_bytes() - before) + (weights_bytes(kept) if kept is not None else 0)
    preparations.store(k, preparations.Preparation(backend.name, kept, runner, made, seconds, time.time(), held))
    return kept, out


def _require_grads(model: torch.nn.Module) -> None:
    for p in model.parameters():
        if p.is_floating_point():
            p.requires_grad_(True)


def _execute(
    backend: Backend, private: PrivateModel | Given, args: tuple, task: Task, measure_reductions: bool
) -> BackendRun:
    fresh = fresh_leaves(args)
    start = time.perf_counter()
    sizes = {} if (task.backward and measure_reductions) else None
    model = None if backend.prepare is not None and sizes is None else private.copy_for(backend.name)
    hooks = _record_output_sizes(model, sizes) if sizes is not None else []
    try:
        with collecting() as notes, torch.enable_grad() if task.backward else torch.no_grad():
            if model is None:
                model, out = _prepared_run(backend, private, fresh, task)
            else:
                if task.backward:
                    _require_grads(model)
                out = backend.fn(model, fresh)
        keep = backend.keeps_outputs_on_device
        weights = _storages(model)
        outputs = {name: to_leaf(v, keep, copy=_holds(v, weights)) for name, v in flatten(out)}
        _remove(hooks)
    except NotApplicable as exc:  # the backend cannot run this kind of model: a skipped row saying why
        _remove(hooks)
        return BackendRun(backend.name, SKIPPED, {}, str(exc), compute_dtype=backend.compute_dtype, notes=notes)
    except Exception as exc:
        still_interrupted(exc)
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
        _backward(run, backend, model, out, fresh=fresh, task=task)
    run.seconds = time.perf_counter() - start
    return run


def _storages(model: torch.nn.Module | None) -> set[int]:
    # Where a run's weights live: an output that is one of them (a model returning a parameter) is copied,
    # since the weights are shared with the other runs (rlx_nb.execution.prepare.PrivateModel).
    if model is None:
        return set()
    return {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers()) if t.device.type == "cpu"}


def _holds(value: Any, storages: set[int]) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.device.type == "cpu"
        and value.untyped_storage().data_ptr() in storages
    )


def _backward(run: BackendRun, backend: Backend, model: torch.nn.Module, out: Any, *, fresh: tuple, task: Task) -> None:
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
        still_interrupted(exc)
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
