"""The two entry points the RLX runtime's diagnostic had, in Python form."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from rlx_nb._support.progress import Board
from rlx_nb.comparison.compare import compare
from rlx_nb.comparison.context import OutputContext, contexts
from rlx_nb.errors import InputError, RlxError
from rlx_nb.execution import interrupted
from rlx_nb.execution.results import GENERATION_KEY, RunResults
from rlx_nb.execution.run import default_label, run
from rlx_nb.execution.source import WeakSource
from rlx_nb.generation.decode import Decode
from rlx_nb.generation.report import GenerationReport, load_generation, progress_line
from rlx_nb.report.report import DivergenceReport, read_report
from rlx_nb.verdict.rule import check_rule


def backend_divergence(
    model: Any,
    inputs: Any,
    *,
    params: Mapping[str, torch.Tensor] | None = None,
    backends: str | Iterable[str] | None = None,
    tol_rel: float | None = None,
    backward: bool = False,
    loss: Callable[[Any], torch.Tensor] | None = None,
    label: str | None = None,
    rule: str = "budget",
    progress: bool | Callable[[str], None] | None = None,
    timeout_s: float | None = 600.0,
    check_determinism: bool = True,
    memory_budget: float | None = None,
) -> DivergenceReport:
    """Run ``model`` on the CPU oracle and on every other backend, and judge each one's gap.

    Parameters
    ----------
    model : torch.nn.Module or callable
        Run on a private copy (eval mode, float32, CPU); the original is untouched.
    inputs : Tensor, tuple or dict
        Positional arguments (a tensor or a tuple) or keyword arguments (a dict).
    params : mapping, optional
        ``name -> tensor`` loaded into the copy before running (the seed's ``set_param``).
    backends : None, str or list of str
        ``None`` runs every live default backend; a comma-separated string or a
        list picks some (opt-in ones such as ``cpu-bf16`` and ``fault:*`` too).
    tol_rel : float, optional
        The fixed rule's threshold on ``max_rel``; defaults to 2e-3 for
        forward outputs and 1e-2 for gradients.
    backward : bool
        Also compare gradients w.r.t. parameters and to inputs that require
        grad, as outputs named ``grad:<name>``.
    loss : callable, optional
        ``loss(outputs) -> scalar`` for the backward; defaults to
        ``sum(out * w)`` over floating outputs with fixed random ``w``.
    label : str, optional
        Name in the report lines; defaults to the model's class name.
    rule : {"budget", "fixed"}
        The verdict in charge; both are always computed and shown.
    progress : None, bool or callable
        ``None`` (default): progress bars (tqdm; a widget in Jupyter) appear on
        steps that take more than two seconds.  ``True`` also prints each
        backend's name to stderr as it starts; a callable receives the name
        instead.  ``False``: no bars and no messages (quiet CI logs).
    timeout_s : float or None
        Per-backend limit (default 600 s); a backend still running then is an
        ``error`` row and the others keep going.  ``None``: no limit.  Exported,
        device and registered backends run in a worker thread, abandoned at the
        limit; rlx_nb's own CPU backends (eager, autocast, faults, Inductor) run on
        the calling thread, as the oracle does, and stop at their next Python step.
    check_determinism : bool
        Check that the oracle's outputs repeat on a second run; outputs that
        differ are the model's own nondeterminism and get the verdict
        ``nondeterministic``, not SUSPECT.  The second run is ``cpu-nomkldnn``'s
        (or ``cpu-nnpack``'s) when it is a candidate and repeats every output bit
        for bit (the same eager float32 code, no kernel the switch changes), else
        the oracle once more.  ``False`` saves that model run; the model's
        nondeterminism is then not measured, and any would count against the
        backends.
    memory_budget : float, optional
        Bytes the call may use beyond what the process holds when it starts (``float("inf")``: no limit, no phase
        skipped).  By default, what the kernel says is available.  Before each phase that needs much memory (the fp64 reference, a
        conversion) its need is estimated against this; one that would not fit becomes a ``skipped``
        row saying so (kept preparations of earlier calls are dropped first), never a killed kernel.

    Returns
    -------
    DivergenceReport

    Examples
    --------
    >>> import torch, rlx_nb
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    >>> report = rlx_nb.backend_divergence(model, torch.randn(4, 8), backends=["cpu-nomkldnn"])
    >>> report.suspects
    []
    """
    check_rule(rule)
    if tol_rel is not None and not (isinstance(tol_rel, (int, float)) and tol_rel > 0):
        raise InputError(f"tol_rel must be a positive number, got {tol_rel!r}")
    if timeout_s is not None and not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise InputError(f"timeout_s must be a positive number of seconds or None, got {timeout_s!r}")
    if memory_budget is not None and not (
        isinstance(memory_budget, (int, float)) and not isinstance(memory_budget, bool) and memory_budget > 0
    ):
        raise InputError(f"memory_budget must be a positive number of bytes or None, got {memory_budget!r}")
    if loss is not None and not callable(loss):
        raise InputError(f"loss must be a callable loss(outputs) -> scalar tensor, got {type(loss).__name__}")
    say = progress if callable(progress) else (_print_progress if progress is True else progress)
    early = EarlyVerdicts(rule=rule, tol_rel=tol_rel, shown=progress is not False, line=_generation_line(model))
    try:
        results = run(
            model,
            inputs,
            params=params,
            backends=backends,
            backward=backward,
            loss=loss,
            label=label,
            progress=say,
            timeout_s=timeout_s,
            check_determinism=check_determinism,
            memory_budget=memory_budget,
            on_backend=early.judge,
        )
    except RlxError as exc:
        # The caller's context first, and no traceback through rlx_nb's internals.
        raise type(exc)(f"backend_divergence({label or default_label(model)}): {exc}") from None
    finally:
        early.board.close()
    try:
        source = WeakSource(model, inputs, params)
        report = DivergenceReport(results, early.records(results), rule=rule, tol_rel=tol_rel, source=source)
    except (KeyboardInterrupt, SystemExit) as exc:  # every backend ran: keep them for interrupted_report()
        interrupted.keep(results, exc)
        raise
    return report


def interrupted_report(*, rule: str = "budget") -> DivergenceReport | GenerationReport | None:
    """The report of the backends that had finished when the last call was interrupted (Ctrl-C), or ``None``.

    A :class:`~rlx_nb.GenerationReport` where the call was :func:`rlx_nb.generation_divergence` and the oracle had
    decoded; ``None`` also where the interrupt came before any backend had finished.

    An interrupt is never swallowed: it propagates (every switch restored), with a note saying this
    function has what finished.  The report is marked incomplete: ``report.incomplete`` and its last text
    line say which backends did not run.  It is kept until the next interrupt
    (``rlx_nb.execution.interrupted.clear()`` drops it).

    Examples
    --------
    >>> import rlx_nb
    >>> rlx_nb.execution.interrupted.clear(); rlx_nb.interrupted_report() is None
    True
    """
    check_rule(rule)
    results = interrupted.latest()
    if results is None:
        return None
    report = DivergenceReport.from_results(results, rule=rule, progress=False)
    return GenerationReport(report) if GENERATION_KEY in results.environment else report


def load_report(path: str | Path) -> DivergenceReport | GenerationReport:
    """Read a report saved by ``report.save`` (or ``rlx-nb check --save``): a :class:`~rlx_nb.GenerationReport` where
    the file holds a generation's tokens, else a :class:`~rlx_nb.DivergenceReport`; arrays are read lazily.

    Every field is checked on load: anything that is not a readable report of this version raises
    :class:`~rlx_nb.ReportFormatError`; nothing is unpickled or executed.

    Examples
    --------
    >>> import tempfile, torch, rlx_nb
    >>> r = rlx_nb.backend_divergence(torch.nn.Linear(2, 2), torch.ones(1, 2), backends=["cpu-nomkldnn"])
    >>> rlx_nb.load_report(r.save(tempfile.mkdtemp() + "/r")).lines() == r.lines()
    True
    """
    return load_generation(read_report(path), path)


class EarlyVerdicts:
    """Each backend judged as soon as it has run: its line shown while the next runs (a long call says what it
    found so far, :class:`rlx_nb._support.progress.Board`), its records kept for the report (nothing compared twice)."""

    def __init__(
        self, *, rule: str, tol_rel: float | None, shown: bool, line: Callable[[DivergenceReport], str] | None = None
    ) -> None:
        self.rule, self.tol_rel = rule, tol_rel
        self.line = line or (lambda early: early.lines()[0])  # (a generation's says where its tokens part)
        self.board = Board(enabled=shown)
        self.by_backend: dict[str, list] = {}
        self.without_anchors: set[str] = set()
        self.again: set[str] = set()
        self._contexts: tuple[tuple, list[OutputContext]] | None = None

    def contexts(self, results: RunResults) -> list[OutputContext] | None:
        """The output contexts every backend is judged against (the oracle's, the sequential and the anchor
        runs' statistics), built once while those runs stay the same objects; ``None`` (built by the
        comparison) once a discrete account is part of them."""
        if results.discrete:
            return None
        runs = (results.oracle, results.reference, results.sequential, *sorted(results.anchors.items()))
        held = self._contexts
        if (
            held is None
            or len(held[0]) != len(runs)
            or any(not _same(a, b) for a, b in zip(held[0], runs, strict=True))
        ):
            self._contexts = held = (runs, list(contexts(results)))
        return held[1]

    def judge(self, results: RunResults, name: str) -> set[str]:
        """Judge backend ``name``; what its verdict may change with: ``"anchors"`` (it is SUSPECT without the
        precision anchors, which widen budgets), ``"discrete"`` (a gradient is SUSPECT: ReLU flips may explain
        it, :mod:`rlx_nb.execution.discrete`)."""
        alone = dataclasses.replace(results, candidates={name: results.candidates[name]})
        records = compare(alone, tol_rel=self.tol_rel, rule=self.rule, progress=False, outputs=self.contexts(results))
        self.by_backend[name] = records
        early = DivergenceReport(alone, records, rule=self.rule, tol_rel=self.tol_rel)
        self.board.add(lambda: f"rlx_nb: {self.line(early)}")  # (made only if shown)
        wants = set()
        if not results.anchors:
            self.without_anchors.add(name)
            if any(r.suspect for r in records):
                wants.add("anchors")
        if any(r.suspect and r.kind == "grad" for r in records):
            wants.add("discrete")
            self.again.add(name)
        return wants

    def records(self, results: RunResults) -> list:
        again = set(self.without_anchors) if results.anchors else set()  # (effective bits too)
        if results.discrete:  # flips accounted for: judge again what they may change
            again |= self.again
        for name in again:
            self.by_backend.pop(name, None)
        missing = [n for n in results.candidates if n not in self.by_backend]
        if missing:  # (not judged early: compare them now)
            rest = dataclasses.replace(results, candidates={n: results.candidates[n] for n in missing})
            shared = self.contexts(results)
            for rec in compare(rest, tol_rel=self.tol_rel, rule=self.rule, progress=False, outputs=shared):
                self.by_backend.setdefault(rec.backend, []).append(rec)
        return [rec for name in results.candidates for rec in self.by_backend[name]]


def _same(a: Any, b: Any) -> bool:
    # The same run object (or the same anchor, as a (bits, run) pair); None as None.
    if isinstance(a, tuple) and isinstance(b, tuple):
        return a[0] == b[0] and a[1] is b[1]
    return a is b


def _generation_line(model: Any) -> Callable[[DivergenceReport], str] | None:
    # A generation's decode (rlx_nb.generation.divergence): its backends' early lines in a generation report's words, read
    # against the oracle's tokens (held once the oracle has decoded, before any backend is judged).
    tokens = getattr(model, "tokens", None) if isinstance(model, Decode) else None
    if tokens is None:
        return None

    def line(early: DivergenceReport) -> str:
        return early.lines()[0] if tokens.value is None else progress_line(early, tokens.value)

    return line


def _print_progress(name: str) -> None:
    print(f"rlx_nb: running {name} ...", file=sys.stderr, flush=True)


def report_backend_divergence(label: str, model: Any, inputs: Any, **kwargs: Any) -> bool:
    """Print one line per backend to stderr; return True if any backend is SUSPECT.

    A CPU-only node (nothing to compare) prints that and returns False, as
    the RLX runtime's ``report_backend_divergence`` does.  Keyword arguments
    go to :func:`backend_divergence`.

    Examples
    --------
    >>> import torch, rlx_nb
    >>> rlx_nb.report_backend_divergence("lin", torch.nn.Linear(2, 2), torch.ones(1, 2), backends=["cpu"])
    False
    """
    report = backend_divergence(model, inputs, label=label, **kwargs)
    for line in report.lines():
        print(line, file=sys.stderr)
    return report.any_suspect
