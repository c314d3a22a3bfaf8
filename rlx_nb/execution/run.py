"""Run one model on the oracle, the fp64 reference and candidate backends.

The result, :class:`RunResults`, holds only plain numpy outputs and
metadata, so it can be saved, loaded or gathered before any comparison runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from rlx_nb._support import copies, switches
from rlx_nb._support import meter as phases
from rlx_nb._support.meter import rss_bytes
from rlx_nb._support.progress import bar
from rlx_nb._support.tree import map_tensors
from rlx_nb.backends.base import ORACLE, REFERENCE, Backend
from rlx_nb.backends.eager import run_eager, run_float64_streamed
from rlx_nb.backends.emulated import emulate
from rlx_nb.backends.float64_kernels import Float64Kernels
from rlx_nb.backends.litert_runtime import forget_conversions
from rlx_nb.backends.onnx import forget_exports
from rlx_nb.backends.registry import get_backend, resolve_backends
from rlx_nb.backends.sequential import CountCalls, SequentialSums
from rlx_nb.errors import InputError
from rlx_nb.execution import cache as preparations
from rlx_nb.execution import fingerprints, interrupted
from rlx_nb.execution.dtypes import dtype_hint, float32_default, say_narrowed
from rlx_nb.execution.environment import environment as probe_environment
from rlx_nb.execution.execute import Given, Task, execute
from rlx_nb.execution.memory import Memory
from rlx_nb.execution.prepare import (
    PrivateInputs,
    PrivateModel,
    no_meta_inputs,
    normalize_inputs,
    prepare_model,
    trim,
)
from rlx_nb.execution.results import (
    OK,
    SKIPPED,
    BackendRun,
    Fingerprints,
    RunResults,
    nondeterministic,
)
from rlx_nb.numerics import formats


def _helper_backend(name: str, fn: Callable[[Any, tuple], Any], **kw: Any) -> Backend:
    """One of rlx_nb's own helper runs: eager on the CPU, hookable, run on the calling thread (Backend.on_caller)."""
    return Backend(name, fn, builtin=True, hookable=True, on_caller=True, **kw)


STREAMED = _helper_backend(REFERENCE, run_float64_streamed, compute_dtype="float64")
STREAMS = (
    "fp64 reference streamed: each weight cast to float64 where its op used it (one forward over the whole "
    "sequence uses each once)"
)
"""The fp64 reference's note where the model asks for it streamed (:attr:`rlx_nb.generation.decode.Decode.streams_reference`):
one cast per weight and none back, instead of lending the whole model in float64."""
ANCHORS_CHEAP_S = 0.1
"""An oracle run this short (seconds) makes the precision anchors cheap: they always run.  Past it they run
only where a verdict needs them (:func:`run`'s ``on_backend``)."""


@contextlib.contextmanager
def _reference_scope(counter: CountCalls) -> Iterator[None]:
    # The fp64 reference's forward and backward, counted, with the float64 forms of the ops PyTorch has no float64
    # kernel for around its backward too: autograd runs that after run_float64's own mode has closed, and a
    # mixture-of-experts model's grouped matmuls raised there, leaving every gradient to the fixed tolerance.
    with counter, Float64Kernels():
        yield


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
    memory_budget: float | None = None,
    on_backend: Callable[[RunResults, str], set[str]] | None = None,
) -> RunResults:
    """Run ``model`` on the oracle, the fp64 reference and each candidate backend.

    Returns numpy outputs only; :func:`rlx_nb.compare` turns them into a report.
    The oracle must run: if the model fails on it, that is the user's error
    and raises :class:`~rlx_nb.InputError` with the model's message.  Candidates (and the fp64
    reference) that run longer than ``timeout_s`` become error rows.  With ``check_determinism``
    the oracle's computation runs twice; outputs that differ between the two runs are the model's own
    nondeterminism and are recorded in ``environment["nondeterministic"]`` (the comparison then
    says so instead of blaming a backend).  The second run is a candidate's when one runs the oracle's own
    code (:func:`reruns_oracle`) and gives every output bit for bit; it then runs first of the candidates.

    Memory: every run shares the weights of one private copy of the model (:class:`PrivateModel`), and
    before each phase that needs much more (the fp64 reference, a conversion) what it needs is estimated
    against what is free (``memory_budget`` bytes if given, else what the kernel says is available); a
    phase that would not fit is a row saying so, never a process killed for memory.  Each phase's seconds
    and peak memory are in ``environment["timings"]``.  ``on_backend(results, name)`` is called after
    each candidate with the results so far (a report's early verdicts); it returns what that backend's
    verdict may change with: ``"anchors"`` (it is SUSPECT without the precision anchors, which then run after
    the candidates where they were left out to save time: a large model, fp32 backends only) and
    ``"discrete"`` (its gradients are SUSPECT: :mod:`rlx_nb.execution.discrete` then accounts for ReLU inputs within
    round-off of their thresholds that flipped, in ``results.discrete``).
    """
    told = progress if callable(progress) else (lambda _: None)
    running = [ORACLE]  # (what runs now: an interrupt before any backend finished says it)

    def say(name: str) -> None:
        running[0] = name
        told(name)

    candidates = resolve_backends(backends)
    meter = phases.Meter()
    with switches.exclusive(say) as saved, phases.measuring(meter), _exports_deleted(), contextlib.ExitStack() as stack:
        stack.push(lambda kind, exc, _tb: interrupted.nothing_finished(exc, running[0]))
        cast, narrowed = float32_default(inputs, saved), say_narrowed(model)
        args, keys = normalize_inputs(inputs)
        with meter.phase("private copy"):
            private = PrivateModel(lambda: prepare_model(model, params, keys))
            stack.enter_context(copies.releasing(private.release))  # (a backend working from a file may free it)
        input_names = keys or [f"input[{i}]" for i in range(len(args))]
        no_meta_inputs(args, input_names)
        grad_inputs = [i for i, x in enumerate(args) if isinstance(x, torch.Tensor) and x.requires_grad]
        if grad_inputs and not backward:
            args = map_tensors(lambda t: t.detach(), args)
        task = Task(backward, loss, tuple(grad_inputs), tuple(input_names))
        call = _Call(private, PrivateInputs(args, cast=cast), task, candidates, meter=meter,
                     memory=Memory(private.model, memory_budget), saved=saved, say=say, timeout_s=timeout_s)  # fmt: skip
        call.what = {"label": label or default_label(model), "cast": cast, "model": model, "narrowed": narrowed,
                     "prints": Fingerprints(fingerprints.later(args, model, params))}  # fmt: skip
        call.run_oracle(inputs)
        call.run_helpers(anchors_now=on_backend is None or call.anchors_cheap())
        try:
            with bar("rlx_nb backends", total=len(candidates), unit="backend", enabled=progress is not False) as shown, \
                    _showing_phases(meter, shown):  # fmt: skip
                if check_determinism:
                    call.check_determinism(shown)
                call.run_candidates(shown, on_backend)
            call.run_late_helpers()
        except (KeyboardInterrupt, SystemExit) as exc:
            interrupted.keep(call.interrupted(exc), exc)
            raise
        return call.results()


class _Call:
    """One call's runs, one method per phase, in the order :func:`run` calls them: the oracle; the helper runs (the
    fp64 reference, the sequential sums, the precision anchors where cheap); the determinism check; the candidates;
    the helpers a verdict turned out to need (the anchors, the discrete events).  ``results()`` holds them."""

    def __init__(self, private: PrivateModel, inputs_: PrivateInputs, task: Task, candidates: list[Backend], *,
                 meter: phases.Meter, memory: Memory, saved: dict[str, Any], say: Callable[[str], None],
                 timeout_s: float | None) -> None:  # fmt: skip
        self.private, self.inputs_, self.task, self.candidates = private, inputs_, task, candidates
        self.meter, self.memory, self.saved, self.say, self.timeout_s = meter, memory, saved, say, timeout_s
        self.what: dict[str, Any] = {}
        # The fp64 reference runs under this dispatch mode, which counts the matmul-like calls the precision
        # anchors would round (without any, the anchors would only repeat the oracle, so they are not run) and
        # the reductions a plain sequential kernel would sum in another order.  A dispatch mode sees the ops
        # the model's own run executes and changes none of them: a torch-function mode would not do, because
        # it turns off PyTorch's inference fast paths (nn.TransformerEncoderLayer, nn.MultiheadAttention).
        # Counted there, not in an oracle run: the oracle's runs are timed like a backend's and stay as they
        # are, and the reference is a helper run like the ones the counts decide (a decode's helpers compute
        # every step at once: rlx_nb.generation.decode), so it sees their ops, in float64.
        self.counter = CountCalls(dtypes=(torch.float32, torch.float64))
        self.oracle = self.reference = BackendRun(REFERENCE, SKIPPED, {}, "not run")
        self.sequential: BackendRun | None = None
        self.anchors: dict[int, BackendRun] = {}
        self.anchors_now = True
        self.unstable: dict[str, float] = {}  # (the determinism check's: filled before the candidates are judged)
        self.runs: dict[str, BackendRun] = {}
        self.early: dict[str, BackendRun] = {}  # (candidates run first, as the determinism check)
        self.wanted: dict[str, set[str]] = {}  # what each backend's verdict may change with (on_backend)
        self.discrete: dict[str, BackendRun] = {}
        self.notes: list[str] = []  # (the streamed reference's)
        self.determinism = ""  # (its line, once the check has run)

    # -- the phases ----------------------------------------------------------------------------------------------

    def run_oracle(self, inputs: Any) -> None:
        """The oracle: it must run (the user's model as it is), forward and, with a backward, backward."""
        self.say(ORACLE)
        self.oracle = self.go(get_backend(ORACLE), "oracle", measure_reductions=True)
        if self.oracle.status != OK:
            raise InputError(f"the model fails on the CPU oracle, so nothing can be compared: {self.oracle.message}"
                             f"{dtype_hint(inputs)}")  # fmt: skip
        if self.task.backward and self.oracle.grad_status != OK:
            raise InputError(f"backward=True but the oracle's backward did not run: {self.oracle.grad_message}")

    def anchors_cheap(self) -> bool:
        # The anchors only widen an fp32 backend's budget (and read its effective bits); a reduced-precision
        # backend's budget is its anchor.  On a large model (an oracle run past ANCHORS_CHEAP_S) they wait
        # until some backend is SUSPECT without them (on_backend says so), or one computes in reduced precision.
        return self.meter.phases["oracle"]["seconds"] <= ANCHORS_CHEAP_S or any(
            b.compute_dtype not in ("float32", "float64") for b in self.candidates
        )

    def run_helpers(self, *, anchors_now: bool) -> None:
        """The fp64 reference (counting what the other helpers would change), the sequential sums where the model
        sums anything, and the precision anchors where they are cheap or needed at once."""
        counter, backward = self.counter, self.task.backward
        self.say(REFERENCE)
        scope = (lambda: _reference_scope(counter)) if backward else lambda: counter
        self.reference = self.go(get_backend(REFERENCE), "fp64 reference", helper=True, timeout_s=self.timeout_s,
                                 scope=scope)  # fmt: skip
        if counter.calls != 0:
            self.say("sequential")
            self.sequential = self.go(_helper_backend("sequential", run_eager), "sequential sums", helper=True,
                                      timeout_s=self.timeout_s, scope=SequentialSums)  # fmt: skip
        self.anchors_now = anchors_now
        if counter.matmuls != 0 and anchors_now:
            self.run_anchors()

    def run_anchors(self) -> None:
        for bits in formats.ANCHOR_BITS:
            anchor = _helper_backend(f"anchor:{bits}", emulate(bits, results=True))
            self.anchors[bits] = self.go(anchor, f"anchor {bits} bits", helper=True, timeout_s=self.timeout_s)

    def check_determinism(self, shown: Any) -> None:
        """The determinism check: a second run of the oracle's computation.  A candidate that runs the same eager
        float32 code on the CPU (cpu-nomkldnn: a kernel switch turned) is such a run wherever the switch changes no
        kernel this model uses: it runs first of the candidates (into ``early``), and where it gives every output
        bit for bit it is the check (a model that does not repeat itself would give that run other bits too); else
        the oracle runs again.  Fills ``unstable``."""
        for second in (b for b in self.candidates if reruns_oracle(b)):
            self.say(second.name)
            shown.set_postfix_str(second.name)
            self.early[second.name] = run = self.go(second, second.name, timeout_s=self.timeout_s)
            if same_bits(self.oracle, run, self.task.backward):
                self.early[second.name] = _shared_outputs(self.oracle, run)
                self.determinism = (f"oracle, again: not run; {second.name} (the same eager float32 code, one switch "
                                    "turned) gave every output of the oracle bit for bit, so it was the determinism "
                                    "check (check_determinism=True)")  # fmt: skip
                return
        self.unstable.update(nondeterministic(self.oracle, self.go(get_backend(ORACLE), "determinism rerun")))
        self.determinism = "oracle, again: the model's own nondeterminism (check_determinism=True)"

    def run_candidates(self, shown: Any, on_backend: Callable[[RunResults, str], set[str]] | None) -> None:
        """Every candidate in turn (one run first as the determinism check is taken as it is), each judged as it
        lands (``on_backend``: what its verdict may change with)."""
        for backend in self.candidates:
            self.say(backend.name)
            shown.set_postfix_str(backend.name)  # compiling backends (inductor, ONNX export) show here
            ran = self.early.pop(backend.name, None)
            self.runs[backend.name] = (
                ran if ran is not None else self.go(backend, backend.name, timeout_s=self.timeout_s)
            )
            preparations.fit(self.memory.keep_bytes)
            trim()
            if on_backend is not None:
                self.wanted[backend.name] = on_backend(self.results(), backend.name)
            shown.update()

    def run_late_helpers(self) -> None:
        """The helpers a verdict turned out to need: the anchors (a backend SUSPECT without them), the discrete
        events (a gradient SUSPECT: ReLU inputs within round-off of their thresholds that flipped)."""
        if any("anchors" in w for w in self.wanted.values()) and not self.anchors and self.counter.matmuls != 0:
            self.run_anchors()
        flipping = [name for name, w in self.wanted.items() if "discrete" in w]
        if flipping and self.task.backward:
            self.say("discrete events")
            with self.meter.phase("discrete events"):
                self.discrete.update(_discrete_events(self.private, self.inputs_.args, self.task, oracle=self.oracle,
                                                      reference=self.reference, sequential=self.sequential,
                                                      runs=self.runs, flipping=flipping))  # fmt: skip

    def interrupted(self, exc: BaseException) -> RunResults:
        """What had finished when ``exc`` stopped the call, marked incomplete."""
        if self.determinism:  # (a run made first as the determinism check, once the check is complete)
            self.runs.update(self.early)
        left = [b.name for b in self.candidates if b.name not in self.runs]
        why = f"interrupted ({type(exc).__name__}) while {left[0]} ran" if left else "interrupted"
        why += f"; not run: {', '.join(left[1:])}" if len(left) > 1 else ""
        return self.results(why)

    # -- one run, and what the call holds ------------------------------------------------------------------------

    def go(self, backend: Backend, phase: str, *, helper: bool = False, **kw: Any) -> BackendRun:
        """One run, measured, after its memory need is checked; ``helper``: one of rlx_nb's own helper runs
        (phases.helper_run), whose values matter, not their path (a model whose reference uses each weight once
        streams it: rlx_nb.generation.decode.Decode.streams_reference)."""
        private, memory, saved = self.private, self.memory, self.saved
        streams = (backend.name == REFERENCE and not self.task.backward and not private.whole
                   and getattr(private.model, "streams_reference", False))  # fmt: skip
        short = memory.shortfall(backend, phase, streamed=streams)
        streamed = STREAMS if streams and not short else ""
        if short and backend.name == REFERENCE and not streams:
            streamed, short = self._streamable(short)
        if short:
            return BackendRun(backend.name, SKIPPED, {}, short, compute_dtype=backend.compute_dtype)
        before, args = rss_bytes(), self.inputs_.args
        with self.meter.phase(phase), phases.helper_run(helper):
            if streamed:  # the float32 weights as they are, each op's cast to float64 where it runs
                result = execute(STREAMED, private, args, self.task, saved=saved, **kw)
                result.notes.append(streamed)
            elif backend.name == REFERENCE:  # the weights lent, cast to float64 one by one, cast back after
                lent, pairs = private.lend()
                result = execute(backend, Given(lent), args, self.task, saved=saved, **kw)
                del lent
                private.reclaim(pairs, finished=not result.abandoned)
            else:
                result = execute(backend, private, args, self.task, saved=saved, **kw)
                # (rlx_nb's own eager helper runs write only where the model does: the oracle's check says)
                if phase == "oracle" or backend in self.candidates:
                    wrote = private.after(backend.name, oracle=phase == "oracle")
                    if wrote:
                        result.notes.append(wrote)
        left = switches.restore(saved)  # what the backend left changed (a user's backend, an abandoned one)
        if left:
            result.notes.append(f"left process-wide switches changed: {switches.describe_changes(left)}")
        self.inputs_.after(result)
        memory.measured(backend, phase, self.meter, before)
        return result

    def _streamable(self, short: str) -> tuple[str, str]:
        # (note, shortfall): the streamed reference where the weights in float64 do not fit
        if self.task.backward or self.private.whole:
            why = (
                "a backward keeps every weight's float64 copy" if self.task.backward else "the model writes its tensors"
            )
            return "", f"{short}; not streamed either: {why}"
        again = self.memory.shortfall(get_backend(REFERENCE), "fp64 reference", streamed=True)
        if again:
            return "", again
        self.notes.append("fp64 reference streamed: its weights in float64 did not fit, so each op's were cast "
                          "where it ran (the same float64 arithmetic, one op's weights at a time)")  # fmt: skip
        need = short.replace("not run for memory: ", "").split(";")[0]
        return f"streamed, one op's weights in float64 at a time: {need}", ""

    def _extra_runs(self) -> list[str]:
        # What each helper run was for, in the report's words.
        counter = self.counter
        lines = ["fp64 reference: every verdict's yardstick", *([self.determinism] if self.determinism else []),
                 *self.notes]  # fmt: skip
        if self.sequential is not None:
            lines.append(f"sequential sums: a second legitimate error ({counter.calls} reductions whose order may "
                         "change)")  # fmt: skip
        if self.anchors:
            lines.append(f"precision anchors ({', '.join(f'{b} bits' for b in self.anchors)}): effective precision, "
                         f"for {counter.matmuls} matmul/conv calls" + ("" if self.anchors_now else ", run because a "
                         "backend was SUSPECT without them"))  # fmt: skip
        elif counter.matmuls != 0 and not self.anchors_now:
            lines.append("precision anchors not run: every backend is within its budget without them (they can only "
                         "widen an fp32 budget) and they cost about 3 oracle runs on this model; effective bits are "
                         "read from the oracle's error alone")  # fmt: skip
        return lines

    def results(self, incomplete: str = "") -> RunResults:
        """Every run so far, as plain data (saved, loaded, merged before anything is compared)."""
        what, seq = self.what, self.sequential
        failed = _why(seq) if seq is not None else ""
        return RunResults(
            label=what["label"],
            oracle=self.oracle,
            reference=self.reference,
            candidates=dict(self.runs),
            backward=self.task.backward,
            environment={
                **probe_environment(),
                **({"sequential_failed": failed} if failed else {}),
                **({"inputs_cast": what["cast"]} if what["cast"] else {}),
                **({"weights_cast": what["narrowed"]} if what["narrowed"] else {}),
                **({"incomplete": incomplete} if incomplete else {}),
                "nondeterministic": self.unstable,
                "extra_runs": self._extra_runs(),
                "backends": {b.name: b.description for b in self.candidates},
                "model_was_training": bool(getattr(what["model"], "training", False)),
                "timings": self.meter.as_dict(),
                "matmul_ops": dict(self.counter.ops),
                "memory": self.memory.describe(),
            },
            fingerprints=what["prints"],
            anchors={b: a for b, a in self.anchors.items() if a.status == OK},
            # (grads may be missing from a sequential run whose backward failed)
            sequential=seq if seq is not None and seq.status == OK else None,
            discrete=dict(self.discrete),
        )


@contextlib.contextmanager
def _showing_phases(meter: phases.Meter, shown: Any) -> Iterator[None]:
    # The bar names the phase a backend is in (its compile, its export, its first run), not only the backend: a
    # long call says what takes long.
    meter.on_start = shown.set_postfix_str
    try:
        yield
    finally:
        meter.on_start = None


@contextlib.contextmanager
def _exports_deleted() -> Any:
    # The run's ONNX files (one export shared by ONNX Runtime and OpenVINO) live as long as the run.
    try:
        yield
    finally:
        forget_exports()
        forget_conversions()


def _discrete_events(
    private: PrivateModel,
    args: tuple,
    task: Task,
    *,
    oracle: BackendRun,
    reference: BackendRun,
    sequential: BackendRun | None,
    runs: dict[str, BackendRun],
    flipping: list[str],
) -> dict[str, BackendRun]:
    # ReLU inputs within round-off of their thresholds that flipped, for the backends whose gradients were
    # SUSPECT, the oracle and the sequential run (rlx_nb.execution.discrete).
    import numpy as np

    from rlx_nb.execution import discrete as dx

    grads = {n for n in oracle.outputs if n.startswith("grad:")}
    scales = {ORACLE: 1.0, "sequential": 1.0, **{n: formats.scale_of(runs[n].compute_dtype) for n in flipping}}
    found = dx.analyse(
        private.copy_for("discrete events"),
        args,
        loss=task.loss,
        grad_inputs=task.grad_inputs,
        input_names=task.input_names,
        scale=max(scales.values()),
        outputs=grads,
    )
    if found is None or not found.units:
        return {}
    weights = {}
    for name in found.reference:
        ref, got = reference.outputs.get(name), oracle.outputs.get(name)
        if ref is None or got is None or not ref.is_array or ref.value.shape != found.reference[name].shape:
            return {}
        if not np.allclose(ref.value, found.reference[name], rtol=1e-12, atol=0.0):
            return {}  # (the analysis did not reproduce the reference: nothing is credited)
        rms = float(np.sqrt(np.mean((got.value.astype(np.float64) - ref.value) ** 2))) if ref.value.size else 0.0
        weights[name] = 1.0 / max(rms, 2.0**-24 * float(np.abs(ref.value).max(initial=0.0)), 1e-300)
    candidates = {ORACLE: oracle, "sequential": sequential, **{n: runs[n] for n in flipping}}
    return dx.account(found, candidates, weights, scales)


def reruns_oracle(backend: Backend) -> bool:
    """Whether ``backend`` runs the oracle's own code: rlx_nb's eager CPU float32 runs of the model with a kernel
    switch turned (``cpu-nomkldnn``, ``cpu-nnpack``), not a fault, a format, a compiler or a user's backend."""
    return (
        backend.builtin
        and backend.hookable
        and backend.device == "cpu"
        and backend.compute_dtype == "float32"
        and not backend.name.startswith("fault:")
    )


def same_bits(oracle: BackendRun, other: BackendRun, backward: bool) -> bool:
    """Whether ``other`` ran and gave every array output of the oracle (and, with ``backward``, every gradient)
    bit for bit."""
    if other.status != OK or (backward and other.grad_status != OK):
        return False
    for name, leaf in oracle.outputs.items():
        mine = other.outputs.get(name)
        if leaf.is_array and (mine is None or not mine.is_array or mine.dtype != leaf.dtype):
            return False
    return not nondeterministic(oracle, other, any_only=True)


def _shared_outputs(oracle: BackendRun, same: BackendRun) -> BackendRun:
    # A run that gave the oracle's outputs bit for bit holds the oracle's arrays, not a second copy of them (kept
    # with the other candidates' until the report is built).
    outputs = {name: oracle.outputs[name] if leaf.is_array and name in oracle.outputs else leaf
               for name, leaf in same.outputs.items()}  # fmt: skip
    return dataclasses.replace(same, outputs=outputs)


def _why(run: BackendRun) -> str:
    # Why a helper run (or its backward) failed, or "" when it did not.
    if run.status != OK:
        return run.message
    return run.grad_message if run.grad_status not in (None, OK) else ""


def default_label(model: Any) -> str:
    """A report's label when none is given: the model's class name (a function's name)."""
    return type(model).__name__ if isinstance(model, torch.nn.Module) else getattr(model, "__name__", "model")
