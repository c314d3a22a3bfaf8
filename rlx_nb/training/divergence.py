"""``rlx_nb.training_divergence``: is a training run's drift from the oracle's chaos or a bug, and at which step?"""

from __future__ import annotations

import copy
import gc
import math
import time
from typing import Any

import numpy as np
import torch

from rlx_nb._support import switches
from rlx_nb._support.kept import modes_kept
from rlx_nb._support.progress import bar
from rlx_nb.errors import InputError, RlxError, describe_error, still_interrupted
from rlx_nb.execution.environment import environment
from rlx_nb.execution.prepare import trim
from rlx_nb.execution.results import Leaf
from rlx_nb.numerics.device import same_bits
from rlx_nb.training import paired
from rlx_nb.training import trajectory as tr
from rlx_nb.training.backends import resolve
from rlx_nb.training.ddp import opened
from rlx_nb.training.local import GradsWritten, judge_step, one_step, verdict_of
from rlx_nb.training.report import TrainingReport
from rlx_nb.training.step import State, checked_spec, l2_norm, log_spaced

KEEP_REPORTS = 8
"""By default the local steps past the line keep their reports (and the states they started from) for the first this
many; the others keep their readings only (``keep=`` sets it)."""


def training_divergence(
    model: torch.nn.Module,
    batches: Any,
    loss_fn: Any = None,
    *,
    optimizer: Any,
    steps: int,
    backends: Any = None,
    local_steps: Any = None,
    envelope: int = tr.ENVELOPE_SEEDS,
    seed: int = 0,
    keep: int = KEEP_REPORTS,
    label: str | None = None,
    progress: bool = True,
):
    """Train ``model`` on the oracle (float32 eager) and on each backend from the same state on the same batches,
    ``steps`` steps, and judge each backend twice, on the verdict's one scale: its *trajectory* (loss, gradient norm,
    parameters) against the drift round-off alone makes (the envelope: the oracle trained from initial weights one
    ulp off, on another thread count), and its *local steps* -- at chosen steps, one step from the oracle's exact state,
    against float64's -- down to the phase the error is born in (forward, buffer update, backward, optimizer update).

    A bug is a local step past the line; chaos is local steps within round-off under a drifting trajectory.

    Parameters
    ----------
    model : torch.nn.Module
        As it is (a Hugging Face model too); every run trains its own copy, yours is untouched.
    batches : list, callable or iterable
        Each step's batch: a list (cycled), ``batches(step) -> batch``, or an iterable read as the steps go.
    loss_fn : callable, optional
        ``loss_fn(model, batch) -> loss`` (the forward and the loss).  Default: ``model(**batch).loss`` (a Hugging Face
        model given its labels).
    optimizer : callable
        ``optimizer(params) -> torch.optim.Optimizer``, called once for every run.
    steps : int
        Training steps.
    backends : list, optional
        Training backends (:mod:`rlx_nb.training.backends`): by default ``cpu-nomkldnn``, ``cpu-inductor``,
        ``cpu-inductor-optimizer``, ``threads`` and the optimizer's foreach, for-loop and fused implementations;
        ``ddp`` (DistributedDataParallel over 2 local ranks, :mod:`rlx_nb.training.ddp`), ``cpu-bf16`` (its own
        budget), a differentiable backend of the registry, or one of
        :func:`rlx_nb.register_training_backend`.
    local_steps : list of int, optional
        Steps judged locally besides the default ones (the first, 1, 2, 4, 8 ..., the last, and wherever a
        trajectory first leaves its envelope).
    envelope : int
        The envelope's one-ulp runs (default 2; one more runs on another thread count).
    seed : int
        The random numbers of step ``t`` are ``seed``'s and ``t``'s, in every run.
    keep : int
        How many local steps past the line keep their report and starting state (for ``explore``, ``localize``).

    Returns
    -------
    TrainingReport
        ``steps`` (a frame: per step and backend, the figures and their place on the line), ``local`` (each local
        step's reading), ``lines()``, ``plot()``, ``localize(backend, step)``, ``local_report(backend, step)``,
        ``to_html()``.

    Examples
    --------
    >>> import torch, rlx_nb
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <...>
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    >>> data = [(torch.randn(32, 8), torch.randn(32, 1)) for _ in range(4)]
    >>> loss = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])
    >>> report = rlx_nb.training_divergence(model, data, loss, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
    ...                                     steps=6, backends=["optimizer:foreach"], progress=False)
    >>> report.local.verdict.unique().tolist()
    ['round-off']
    """
    spec = checked_spec(model, batches, loss_fn, optimizer, steps, seed=seed)
    chosen = resolve(backends)
    if isinstance(envelope, bool) or not isinstance(envelope, int) or envelope < 1:
        raise InputError(f"envelope must be a whole number of one-ulp runs >= 1; got {envelope!r}")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
        raise InputError(f"keep must be a whole number of local steps >= 0; got {keep!r}")
    asked = _steps_asked(local_steps, steps)
    label = label or type(model).__name__
    report = TrainingReport(label, spec, [b.name for b in chosen], environment())
    start = time.perf_counter()
    import torch._dynamo.config as dynamo_config

    # (every local step makes its optimizer afresh: a compiled optimizer step compiles again for each, past dynamo's
    # default of 8, after which it would run eagerly under a compiling backend's name)
    with switches.exclusive(), modes_kept(), dynamo_config.patch(recompile_limit=max(64, 4 * spec.steps)), opened():
        try:
            _train(model, spec, chosen, seeds=envelope, asked=asked, keep=keep, report=report, progress=progress)
        except (KeyboardInterrupt, SystemExit) as exc:  # (the steps judged so far are kept)
            _kept_apart(report)
            report.incomplete = f"interrupted at step {len(report.oracle_losses)} of {steps}"
            exc.add_note(f"rlx_nb: {len(report.oracle_losses)} step(s) were judged before the interrupt; "
                         "rlx_nb.interrupted_training() returns their report, marked incomplete")  # fmt: skip
            _KEPT["report"] = report
            raise
    report.seconds = time.perf_counter() - start
    return report


_KEPT: dict[str, Any] = {"report": None}


def interrupted_training():
    """The report of the last :func:`training_divergence` an interrupt stopped (its steps so far), or None."""
    return _KEPT["report"]


def _steps_asked(local_steps: Any, steps: int) -> set[int]:
    if local_steps is None:
        return set()
    try:
        asked = {int(s) for s in local_steps}
    except (TypeError, ValueError):
        raise InputError(f"local_steps must be a list of step numbers; got {local_steps!r}") from None
    bad = sorted(s for s in asked if not 0 <= s < steps)
    if bad:
        raise InputError(f"local_steps {bad} are outside the {steps} steps (0 to {steps - 1})")
    return asked


def _train(model: torch.nn.Module, spec: Any, chosen: list, *, seeds: int, asked: set[int], keep: int, report: Any,
           progress: bool) -> None:  # fmt: skip
    base = copy.deepcopy(model)
    shapes = {n: tuple(p.shape) for n, p in base.named_parameters()}
    judged_at = log_spaced(spec.steps, asked)
    env32, env16 = tr.Envelope(), tr.Envelope()
    earlier: int | None = None  # (the step judged before: where a first step past the line is searched from)
    with bar(f"rlx_nb training {report.label}", total=2 * spec.steps, unit="step", enabled=progress) as shown:
        # The envelope's runs first, side by side, their figures kept (module docstring of trajectory.py) ...
        shown.set_postfix_str("the envelope (round-off's drift)")
        bf16 = any(b.compute_dtype == "bfloat16" for b in chosen)
        drifts32, drifts16 = _envelope_pass(base, spec, seeds=seeds, bf16=bf16, shapes=shapes, shown=shown)
        gc.collect()
        trim()  # (the envelope's runs are let go: what the allocator keeps of them goes back to the system)
        # ... then the oracle and the backends.
        first = copy.deepcopy(base)
        oracle = tr.Run("cpu", first, spec.optimizer(list(first.parameters())))
        # (the state the oracle starts from: where a first step past the line is searched from, and a kept local
        # step's state trained again -- the caller's own model, untouched (every run starts from a copy of it) until
        # the call returns; a report that keeps a step keeps its own copy: _kept_apart)
        initial = State(model, oracle.optimizer.state_dict())
        runs = []
        for b in chosen:
            m = copy.deepcopy(base)
            try:
                runs.append(tr.Run(b.name, b.prepared(m), b.make_optimizer(spec.optimizer, list(m.parameters())), b))
            except RlxError as exc:
                report.failed[b.name] = str(exc)
        del base
        shown.set_postfix_str("the oracle and the backends")
        for step in range(spec.steps):
            batch = spec.batch(step)
            # (judged here: the chosen steps, and the step after a trajectory first leaves its envelope)
            due = [
                r.backend for r in runs if not r.error and (step in judged_at or report.leaving.get(r.name) == step - 1)
            ]
            given = _tensors(batch)
            ref = None
            if due:  # (judged from the oracle's live state, its own step the trajectory's: _live_judge)
                shown.set_postfix_str(f"local step {step}")
                before = set(report.suspects)
                ref = _live_judge(oracle, spec, step, batch, backends=due, keep=keep, report=report, initial=initial)
                trim()
                for b in due:
                    if b.name in report.suspects and b.name not in before and earlier is not None:
                        shown.set_postfix_str(f"{b.name}: the first step past the line")
                        _first_past(spec, b, report, p=earlier, initial=initial, s=step, keep=keep)
                earlier = step
            ref = ref or oracle.step(spec, step, batch)
            _still_the_same(oracle.model, shapes, given, batch, step)
            report.oracle_losses.append(ref[0])
            env32.grow(drifts32[step].against(ref))
            if drifts16:
                env16.grow(drifts16[step].against(ref))
            scale = l2_norm([p.detach() for p in oracle.model.parameters()])  # (the oracle's, once a step)
            for run in runs:
                if run.error:
                    continue
                got = _step(run, spec, step, batch)
                if run.error:
                    report.failed[run.name] = run.error
                    continue
                env = env16 if run.backend.compute_dtype == "bfloat16" else env32
                diffs = tr.figures(*got, tr.distance(run, oracle, scale), ref)
                place, which = tr.line(diffs, env, ref)
                report.add_step(step, run.name, got=got, ref=ref, diffs=diffs, env=env, place=place, which=which)
                if place > 1 and run.name not in report.leaving:
                    report.leaving[run.name] = step
            shown.update()
    _kept_apart(report)


def _kept_apart(report: Any) -> None:
    # The kept local steps' states are trained again from the caller's model (:class:`Replayed`), which is theirs
    # until the call returns (or is interrupted); after it, from a copy of it the report keeps (the caller may train
    # their model on).
    replays = [state for _, state, _ in report.kept.values() if isinstance(state, Replayed)]
    if replays:
        own = replays[0].initial.copy()
        for state in replays:
            state.initial = own


def _envelope_pass(base: torch.nn.Module, spec: Any, *, seeds: int, bf16: bool, shapes: dict[str, tuple],
                   shown: Any) -> tuple[list[tr.Drift], list[tr.Drift]]:  # fmt: skip
    # The envelope's runs trained side by side, each step's figures kept (the runs are let go after).  Where the run
    # on another thread count leaves cores idle, a one-ulp run steps beside it (paired.py); a step of the pair that
    # drew random numbers starts the envelope again, one run at a time.
    drifts = _envelope_once(base, spec, seeds=seeds, bf16=bf16, shapes=shapes, shown=shown, pairing=True)
    if drifts is None:
        drifts = _envelope_once(base, spec, seeds=seeds, bf16=bf16, shapes=shapes, shown=shown, pairing=False)
    return drifts


def _envelope_once(base: torch.nn.Module, spec: Any, *, seeds: int, bf16: bool, shapes: dict[str, tuple],
                   shown: Any, pairing: bool) -> tuple[list[tr.Drift], list[tr.Drift]] | None:  # fmt: skip
    # One pass of the envelope's runs; None where a step of the pair drew random numbers (its progress taken back).
    runs32 = tr.envelope_runs(base, spec, seeds, threads=True)
    runs16 = tr.bf16_envelope(base, spec, seeds) if bf16 else []
    pair = paired.pair_of(runs32, base) if pairing else None
    drifts32: list[tr.Drift] = []
    drifts16: list[tr.Drift] = []
    for step in range(spec.steps):
        batch = spec.batch(step)
        given = _tensors(batch)
        both = paired.step_pair(pair, spec, step, batch, _step) if pair is not None else {}
        if both is None:
            shown.update(-step)
            return None
        got32 = []
        for k, run in enumerate(runs32):
            got32.append(both[run.name] if run.name in both else _step(run, spec, step, batch))
            if k == 0:
                _still_the_same(run.model, shapes, given, batch, step)
        drifts32.append(tr.drift(runs32, got32))
        if runs16:
            drifts16.append(tr.drift(runs16, [_step(run, spec, step, batch) for run in runs16], anchor=runs32[0]))
        shown.update()
    return drifts32, drifts16


def _tensors(batch: Any) -> list[torch.Tensor]:
    # Copies of a batch's tensors, to see whether a step changed them in place.
    leaves = torch.utils._pytree.tree_leaves(batch)
    return [t.detach().clone() for t in leaves if isinstance(t, torch.Tensor)]


def _still_the_same(model: torch.nn.Module, shapes: dict[str, tuple], given: list[torch.Tensor], batch: Any,
                    step: int) -> None:  # fmt: skip
    # Every run of a step must see the same model and the same batch: a model whose parameters change shape (or
    # number) between steps, or a loss that changes its batch in place, makes the runs incomparable.
    now = {n: tuple(p.shape) for n, p in model.named_parameters()}
    if now != shapes:
        changed = sorted(n for n in set(now) | set(shapes) if now.get(n) != shapes.get(n))
        raise InputError(
            f"the model's parameters changed between steps (at step {step}: "
            + ", ".join(f"{n} {shapes.get(n, 'absent')} -> {now.get(n, 'absent')}" for n in changed[:4])
            + "): every run trains the same parameters from the same state, so their shapes must stay as they are"
        )
    after = [t for t in torch.utils._pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)]
    if len(after) != len(given) or any(not same_bits(a.detach(), g) for a, g in zip(after, given, strict=False)):
        raise InputError(
            f"step {step} changed its batch in place (the loss or the model wrote into a tensor of it): every run of "
            "a step must see the same batch; clone what loss_fn modifies, or give batches(step) that makes a new one"
        )


def _first_past(spec: Any, backend: Any, report: Any, *, p: int, initial: State, s: int, keep: int) -> None:
    # ``backend``'s local step ``s`` is past the line and ``p`` (the step judged before it) was not: the oracle is run
    # again from its initial state to ``p`` (its steps are deterministic: the same state, bit for bit) and the steps
    # between bisected, each judged, to the first past the line.
    start = time.perf_counter()
    state = Replayed(initial, spec, p).resolved()
    report.local_seconds += time.perf_counter() - start
    lo, hi = p, s
    while hi - lo > 1:
        start = time.perf_counter()
        mid = (lo + hi) // 2
        there = Replayed(state, spec, mid, since=p).resolved()
        report.local_seconds += time.perf_counter() - start  # (the oracle's steps again; the judging counts its own)
        _judge_local(there, spec, mid, spec.batch(mid), backends=[backend], keep=keep, report=report, kept=there)
        past = any(
            r["backend"] == backend.name and r["step"] == mid and r["verdict"] == "SUSPECT" for r in report._local
        )
        lo, hi = (lo, mid) if past else (mid, hi)


def _step(run: Any, spec: Any, step: int, batch: Any) -> tuple[float, float]:
    # One step of a run; a backend that fails is stopped and says why (the others go on).
    try:
        return run.step(spec, step, batch)
    except RlxError as exc:
        run.error = str(exc)
    except Exception as exc:
        still_interrupted(exc)
        run.error = f"step {step} failed: {describe_error(exc)}"
    return math.nan, math.nan


def _live_judge(oracle: Any, spec: Any, step: int, batch: Any, *, backends: list, keep: int, report: Any,
                initial: State) -> tuple[float, float]:  # fmt: skip
    # Step ``step`` judged from the oracle's live state, the oracle's own step of the judge being the trajectory's
    # step itself (the same state, batch and random numbers: the same bits), run once every other run of the judge has
    # started from it: no copy of the oracle's state is made.  A local step kept (past the line) keeps the state it
    # started from as the oracle trained again to it (:class:`Replayed`), and its own copy of the parameters the live
    # model goes on training.  Returns the oracle's loss and gradient norm at the step, as its trajectory step would.
    got: dict[str, Any] = {}

    def own() -> dict[str, torch.Tensor]:
        try:
            loss, norm, outputs = one_step(oracle.model, oracle.optimizer, spec, step, batch,
                                           copy_grads=oracle.copy_grads)  # fmt: skip
        except GradsWritten as written:  # (an optimizer that writes into its gradients: the live state has stepped,
            # the step's gradients are lost; the judge's oracle is run from the state trained again to this step, and
            # the oracle's later live steps copy their gradients)
            oracle.copy_grads = True
            got["ref"] = (written.loss, written.norm)
            model, opt = Replayed(initial, spec, step).resolved().start(spec)
            return one_step(model, opt, spec, step, batch, copy_grads=True)[2]
        except BaseException as exc:
            got["error"] = exc  # (the oracle's own step failed: the trajectory cannot go on, as without a judge)
            raise
        got["ref"] = (loss, norm)
        return outputs

    live = State(oracle.model, oracle.optimizer.state_dict())
    _judge_local(live, spec, step, batch, backends=backends, keep=keep, report=report, oracle=own,
                 kept=Replayed(initial, spec, step))  # fmt: skip
    for p in oracle.model.parameters():  # (as the trajectory's step leaves it: its state only)
        p.grad = None
    if "error" in got:
        raise got["error"]
    return got["ref"]


def _judge_local(state: State, spec: Any, step: int, batch: Any, *, backends: list, keep: int, report: Any,
                 kept: Any, oracle: Any = None) -> None:  # fmt: skip
    start = time.perf_counter()
    local = judge_step(state, spec, step, batch, backends=backends, label=report.label, oracle=oracle)
    report.local_seconds += time.perf_counter() - start
    for b in backends:
        reading = verdict_of(local, b.name)
        report.add_local(b.name, step, reading)
        if reading["verdict"] == "SUSPECT" and len(report.kept) < keep:
            report.kept[(b.name, step)] = (_owned(local), kept, batch)


def _owned(local: Any) -> Any:
    # A kept local report's oracle outputs as copies of their own (the oracle's live step returns its model's
    # parameters, which train on).
    run = local.results.oracle
    run.outputs = {k: Leaf(v.value.copy(), v.dtype, v.shape) if isinstance(v.value, np.ndarray) else v
                   for k, v in run.outputs.items()}  # fmt: skip
    return local


class Replayed:
    """The oracle's state at ``step``, trained again from ``initial`` (its state at step ``since``) when it is first
    asked for (its steps are deterministic: the same state, bit for bit, as the call's oracle had).  A kept local step
    holds one instead of a copy of the state: nothing is kept of a step until a localization asks for it."""

    def __init__(self, initial: State, spec: Any, step: int, *, since: int = 0) -> None:
        self.initial, self.spec, self.step, self.since = initial, spec, step, since
        self._state: State | None = None

    def resolved(self) -> State:
        if self._state is None:
            model, opt = self.initial.start(self.spec)
            for t in range(self.since, self.step):
                tr.Run("cpu", model, opt).step(self.spec, t, self.spec.batch(t))
            self._state = State(model, opt.state_dict())
        return self._state


__all__ = ["KEEP_REPORTS", "interrupted_training", "training_divergence"]
