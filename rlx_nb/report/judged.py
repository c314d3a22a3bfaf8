"""One call's comparison as it runs: every backend judged as soon as it has run, then the report.

:func:`judged_report` is what :func:`rlx_nb.backend_divergence` and :func:`rlx_nb.generation_divergence` share: the
options checked, :func:`rlx_nb.run` with each candidate judged as it lands (its line shown while the next runs), and
the :class:`~rlx_nb.report.report.DivergenceReport` built from the records already made.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from rlx_nb._support.progress import Board
from rlx_nb.backends.base import Backend
from rlx_nb.comparison.compare import compare
from rlx_nb.comparison.context import OutputContext, contexts
from rlx_nb.errors import InputError, RlxError
from rlx_nb.execution import interrupted
from rlx_nb.execution.memory import check_budget
from rlx_nb.execution.results import RunResults
from rlx_nb.execution.run import default_label, run
from rlx_nb.execution.source import WeakSource
from rlx_nb.report.report import DivergenceReport
from rlx_nb.verdict.rule import check_rule


@dataclasses.dataclass(frozen=True)
class CallOptions:
    """A call's options, as :func:`rlx_nb.backend_divergence` documents them."""

    params: Mapping[str, torch.Tensor] | None = None
    backends: str | Iterable[Any] | None = None
    tol_rel: float | None = None
    backward: bool = False
    loss: Callable[[Any], torch.Tensor] | None = None
    label: str | None = None
    rule: str = "budget"
    progress: bool | Callable[[str], None] | None = None
    timeout_s: float | None = 600.0
    check_determinism: bool = True
    memory_budget: float | None = None

    def check(self) -> None:
        """An :class:`~rlx_nb.InputError` naming the first option that cannot be used, and what is allowed."""
        check_rule(self.rule)
        tol, timeout, budget = self.tol_rel, self.timeout_s, self.memory_budget
        if tol is not None and not (isinstance(tol, (int, float)) and tol > 0):
            raise InputError(f"tol_rel must be a positive number, got {tol!r}")
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
            raise InputError(f"timeout_s must be a positive number of seconds or None, got {timeout!r}")
        check_budget(budget)
        if self.loss is not None and not callable(self.loss):
            raise InputError(f"loss must be a callable loss(outputs) -> scalar tensor, got {type(self.loss).__name__}")


def judged_report(
    model: Any,
    inputs: Any,
    options: CallOptions,
    *,
    entry: str,
    line: Callable[[DivergenceReport], str] | None = None,
) -> DivergenceReport:
    """Run ``model`` with ``options``, each backend judged as it lands, and return the report.  ``entry`` names the
    public function in errors (``backend_divergence(Model): ...``); ``line`` is a backend's early line (default:
    its report line; a generation's says where the tokens part)."""
    options.check()
    progress = options.progress
    say = progress if callable(progress) else (_print_progress if progress is True else progress)
    early = EarlyVerdicts(rule=options.rule, tol_rel=options.tol_rel, shown=progress is not False, line=line)
    try:
        results = run(model, inputs, params=options.params, backends=options.backends, backward=options.backward,
                      loss=options.loss, label=options.label, progress=say, timeout_s=options.timeout_s,
                      check_determinism=options.check_determinism, memory_budget=options.memory_budget,
                      on_backend=early.judge)  # fmt: skip
    except RlxError as exc:
        # The caller's context first, and no traceback through rlx_nb's internals.
        raise type(exc)(f"{entry}({options.label or default_label(model)}): {exc}") from None
    finally:
        early.board.close()
    try:
        source = WeakSource(model, inputs, options.params)
        records = early.records(results)
        report = DivergenceReport(results, records, rule=options.rule, tol_rel=options.tol_rel, source=source)
        given = [] if options.backends is None or isinstance(options.backends, str) else options.backends
        report.backend_objects = {b.name: b for b in given if isinstance(b, Backend)}  # for report.localize
        return report
    except (KeyboardInterrupt, SystemExit) as exc:  # every backend ran: keep them for interrupted_report()
        interrupted.keep(results, exc)
        raise


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
        early, line = DivergenceReport(alone, records, rule=self.rule, tol_rel=self.tol_rel), self.line
        # (made only if shown; the board's line holds no reference back to self: no cycle keeps this call's
        # outputs alive after it returns, until the collector runs)
        self.board.add(lambda: f"rlx_nb: {line(early)}")
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


def _print_progress(name: str) -> None:
    print(f"rlx_nb: running {name} ...", file=sys.stderr, flush=True)


__all__ = ["CallOptions", "EarlyVerdicts", "judged_report"]
