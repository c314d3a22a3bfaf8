"""The report of a generation (:func:`rlx_nb.generation_divergence`): steps, first divergences, lines, files.

A :class:`GenerationReport` wraps the forward report whose outputs are the steps' logits
(``report.logits``) and the generation's tokens, kept in its environment (``environment["generation"]``) so
a saved report reads back whole (:func:`load_generation`, called by :func:`rlx_nb.load_report`).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from rlx_nb._support.safe import html_text
from rlx_nb.backends.base import Backend
from rlx_nb.backends.registry import lent
from rlx_nb.comparison.tables import Table
from rlx_nb.errors import InputError
from rlx_nb.execution.results import GENERATION_KEY
from rlx_nb.generation.decode import at_step, step_name
from rlx_nb.verdict.types import DISAGREEMENT, NEAR_TIE, SUSPECT, VERDICT_ERROR, VERDICT_SKIPPED
from rlx_nb.verdict.words import on_line

if TYPE_CHECKING:
    from rlx_nb.report.report import DivergenceReport

UNJUDGED = "flip, not judged"
"""A flip at a step without fp64 logits or a budget (the reference or the step's record is missing)."""
NO_LOGITS = "no judged logits from this backend at this step"
"""A step row's reason where the backend ran but the step has no record (its verdict is ``error``)."""


class GenerationReport:
    """Every backend's decode against the oracle's, step by step.

    Attributes
    ----------
    logits : DivergenceReport
        The steps' logits as outputs (``"step 0"``, ``"step 1"``, ...): its records, arrays, explorer and
        HTML are those of any forward report.
    steps : DataFrame
        One row per (backend, step, sequence).
    first_divergence : DataFrame
        Per backend: the first step whose greedy token differs from the oracle's, and whether that is a
        near-tie (round-off) or a real disagreement (SUSPECT).
    """

    def __init__(self, logits: DivergenceReport, *, tokenizer: Any = None) -> None:
        meta = logits.results.environment.get(GENERATION_KEY)
        if not isinstance(meta, dict) or "tokens" not in meta:
            raise InputError("this report is not a generation report (no generation metadata in its environment)")
        self.logits = logits
        self.meta = meta
        self.tokenizer = tokenizer
        self.source: Any = None
        self.backend_objects: dict[str, Backend] = {}
        self.tokens = np.asarray(meta["tokens"], dtype=np.int64)
        self._steps: pd.DataFrame | None = None

    # -- tables -------------------------------------------------------------------------------------

    @property
    def label(self) -> str:
        return self.logits.label

    @property
    def backend_names(self) -> list[str]:
        return list(self.logits.results.candidates)

    @property
    def n_steps(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def has_text(self) -> bool:
        return self.tokenizer is not None or bool(self.meta.get("token_texts"))

    def _text(self, token: int) -> str:
        kept = self.meta.get("token_texts") or {}
        if str(int(token)) in kept:
            return str(kept[str(int(token))])
        if self.tokenizer is None:
            return ""
        try:
            return str(self.tokenizer.decode([int(token)]))
        except Exception:  # a tokenizer that cannot decode one id: no text
            return ""

    @property
    def steps(self) -> pd.DataFrame:
        """One row per (backend, step, sequence): the oracle's and the backend's token, the fp64 top-1/top-2
        gap, the fp64 gap between the two tokens when they differ, the step's round-off allowance for a flip,
        and the step's logits judged (``line`` on the SUSPECT-line scale, ``verdict``, ``reason``)."""
        if self._steps is None:
            self._steps = self._build_steps()
        return self._steps

    def _build_steps(self) -> pd.DataFrame:
        results = self.logits.results
        ref = results.reference
        records = {(r.backend, r.output): r for r in self.logits.records}
        top2: dict[int, np.ndarray] = {}  # step -> each sequence's fp64 top-1 minus top-2 (the same for every backend)
        rows = []
        for name in self.backend_names:
            run = results.candidates[name]
            # A backend that did not run (skipped, or an error) has one record without an output: its verdict
            # and reason stand on each of its step rows, as its report line says.
            status = records.get((name, None))
            for k in range(self.n_steps):
                out = step_name(k)
                rec = records.get((name, out))
                got = run.outputs.get(out) if run.outputs else None
                r = ref.outputs.get(out) if ref is not None and ref.outputs else None
                got_v = got.value if got is not None and got.is_array else None
                ref_v = r.value if r is not None and r.is_array else None
                if ref_v is not None and k not in top2:
                    two = np.partition(ref_v.astype(np.float64), -2, axis=-1)[:, -2:]
                    top2[k] = two[:, 1] - two[:, 0]
                budget = rec.judgement.budget.budget_max if rec is not None else math.nan
                allowance = 2.0 * budget if budget == budget else math.nan
                for b in range(self.tokens.shape[0]):
                    want = int(self.tokens[b, k])
                    tok = int(np.argmax(got_v[b])) if got_v is not None else -1
                    flip = tok >= 0 and tok != want
                    gap = float(ref_v[b, want]) - float(ref_v[b, tok]) if flip and ref_v is not None else math.nan
                    kind = ""
                    if flip and gap == gap and allowance == allowance:
                        kind = NEAR_TIE if abs(gap) <= allowance else DISAGREEMENT
                    rows.append({
                        "backend": name, "step": k, "sequence": b,
                        "oracle_token": want, "backend_token": tok, "flip": flip, "flip_kind": kind,
                        "top2_gap_fp64": float(top2[k][b]) if k in top2 else math.nan, "gap_fp64": gap,
                        "allowance": allowance,
                        "line": rec.judgement.line if rec is not None else math.nan,
                        "verdict": rec.verdict if rec is not None else status.verdict if status else VERDICT_ERROR,
                        "reason": rec.reason if rec is not None else status.reason if status else NO_LOGITS,
                    })  # fmt: skip
        return Table(rows)

    @property
    def first_divergence(self) -> pd.DataFrame:
        """Per backend (the index): the first step whose greedy token differs from the oracle's (``step``,
        ``sequence``, both tokens, their text with a tokenizer), the fp64 gap between the two tokens' logits,
        the step's allowance, and ``kind``: ``"near-tie"`` (round-off), ``"real disagreement"`` (SUSPECT),
        ``"same tokens"`` or the backend's error/skip verdict."""
        rows = []
        table = self.steps
        verdicts = self.verdicts()
        for name in self.backend_names:
            mine = table[table.backend == name]
            status = _status(self.logits, name)
            row: dict[str, Any] = {"backend": name, "step": None, "sequence": None, "oracle_token": None,
                                   "backend_token": None, "gap_fp64": math.nan, "allowance": math.nan}  # fmt: skip
            if status:
                row["kind"] = status
            else:
                flips = mine[mine.flip]
                if flips.empty:
                    row["kind"] = "same tokens"
                else:
                    f = flips.iloc[0]
                    row.update(step=int(f.step), sequence=int(f.sequence), oracle_token=int(f.oracle_token),
                               backend_token=int(f.backend_token), gap_fp64=float(f.gap_fp64),
                               allowance=float(f.allowance), kind=f.flip_kind or UNJUDGED)  # fmt: skip
                    if self.has_text:
                        row.update(oracle_text=self._text(f.oracle_token), backend_text=self._text(f.backend_token))
            row["verdict"] = verdicts[name]
            rows.append(row)
        frame = Table(rows).set_index("backend")
        for column in ("step", "sequence", "oracle_token", "backend_token"):
            frame[column] = frame[column].astype("Int64")
        return frame

    def verdicts(self) -> dict[str, str]:
        """Each backend's generation verdict: SUSPECT when a step's logits are, or a flip is a real disagreement."""
        out = {}
        table = self.steps
        for name in self.backend_names:
            status = _status(self.logits, name)
            if status:
                out[name] = status
                continue
            mine = table[table.backend == name]
            bad = (mine.verdict == SUSPECT).any() or (mine.flip_kind == DISAGREEMENT).any()
            out[name] = SUSPECT if bad else "round-off"
        return out

    @property
    def suspects(self) -> list[str]:
        return [n for n, v in self.verdicts().items() if v == SUSPECT]

    @property
    def any_suspect(self) -> bool:
        return bool(self.suspects)

    @property
    def not_run(self) -> list[str]:
        """The backends that did not run (``error`` or ``skipped``)."""
        return self.logits.not_run

    def judged_nothing(self) -> str:
        """Why this report cannot pass a gate although it names no SUSPECT, or "" (as a forward report's)."""
        return self.logits.judged_nothing()

    @property
    def free(self) -> pd.DataFrame | None:
        """``mode="free"``: per backend, where its own greedy text parts from the oracle's (``parts_at``, None
        when it never does) and both continuations from there; None for a teacher-forced report."""
        runs = self.meta.get("free")
        if not isinstance(runs, dict):
            return None
        rows = []
        for name, toks in runs.items():
            empty = {"backend": name, "parts_at": None, "sequence": None, "oracle": None, "backend_tokens": None}
            if self.has_text:
                empty.update(oracle_text=None, backend_text=None)
            if not toks:
                rows.append(empty)
                continue
            mine = np.asarray(toks, dtype=np.int64)
            differ = np.argwhere(mine != self.tokens)
            if differ.size == 0:
                rows.append(empty)
                continue
            k = int(differ[:, 1].min())
            b = int(differ[differ[:, 1] == k][0, 0])
            row = {"backend": name, "parts_at": k, "sequence": b, "oracle": self.tokens[b, k:].tolist(),
                   "backend_tokens": mine[b, k:].tolist()}  # fmt: skip
            if self.tokenizer is not None:
                row["oracle_text"] = self.tokenizer.decode(self.tokens[b, k:].tolist())
                row["backend_text"] = self.tokenizer.decode(mine[b, k:].tolist())
            elif self.has_text:
                row["oracle_text"] = "".join(self._text(t) for t in self.tokens[b, k:].tolist())
                row["backend_text"] = "".join(self._text(t) for t in mine[b, k:].tolist())
            rows.append(row)
        frame = Table(rows).set_index("backend")
        for column in ("parts_at", "sequence"):
            frame[column] = frame[column].astype("Int64")
        return frame

    # -- words --------------------------------------------------------------------------------------

    def lines(self) -> list[str]:
        """One line per backend, in the seed's form."""
        label = self.label
        if not self.backend_names:
            return [f"[{label}] generation divergence: CPU-only node — nothing to compare"]
        first = self.first_divergence
        verdicts = self.verdicts()
        out = []
        for name in self.backend_names:
            f = first.loc[name]
            verdict = verdicts[name]
            head = f"[{label}] {name} vs cpu: "
            if verdict in (VERDICT_ERROR, VERDICT_SKIPPED):
                rec = _record(self.logits, name, None) or _record(self.logits, name, step_name(0))
                out.append(head + f"{verdict.upper()} — {rec.reason if rec is not None else ''}")
                continue
            mine = self.steps[self.steps.backend == name]
            worst = mine.loc[mine.line.fillna(-1).idxmax()]
            suspect_steps = mine[mine.verdict == SUSPECT]
            if f.kind in (NEAR_TIE, DISAGREEMENT, UNJUDGED):
                within = {
                    NEAR_TIE: "within round-off",
                    UNJUDGED: "not judged: no fp64 logits or budget at that step",
                }.get(f.kind) or f"{abs(f.gap_fp64) / f.allowance:.3g}x the round-off allowance"
                a, b = int(f.oracle_token), int(f.backend_token)
                if self.has_text:
                    pair = f"token {a} {self._text(a)!r} vs {b} {self._text(b)!r}"
                else:
                    pair = f"token {a} vs {b}"
                gap = f"fp64 gap {abs(f.gap_fp64):.2g}, " if f.gap_fp64 == f.gap_fp64 else ""
                head += f"generation parts at step {int(f.step)} ({pair}; {gap}{within})"
            else:
                head += f"same {self.n_steps} tokens"
            if verdict == SUSPECT:
                if not suspect_steps.empty:
                    s = suspect_steps.iloc[0]
                    tail = f"SUSPECT (step {int(s.step)}'s logits: {s.reason})"
                else:
                    tail = "SUSPECT (the flip is no near-tie: the fp64 logits of the two tokens are further apart "
                    tail += "than the legitimate runs' error at that step allows)"
            else:
                tail = f"round-off (explainable), {on_line(float(worst.line))} (worst: step {int(worst.step)})"
            out.append(f"{head} — {tail}")
        for note in ("oracle_note", "tokenizer_note"):
            if self.meta.get(note):
                out.append(f"[{label}] NOTE: {self.meta[note]}")
        if self.logits.incomplete:
            out.append(f"[{label}] INCOMPLETE: {self.logits.incomplete}")
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def __repr__(self) -> str:
        return f"<GenerationReport {self.label}: {self.n_steps} steps, {len(self.backend_names)} backend(s), suspects {self.suspects}>"

    def _repr_html_(self) -> str:
        return "<pre>" + html_text("\n".join(self.lines())) + "</pre>" + self.first_divergence._repr_html_()

    # -- pictures, files, tools ---------------------------------------------------------------------

    def plot(self, ax: Any = None) -> Any:
        """Each backend's logits error per step on the SUSPECT-line scale, flips marked; returns the axes."""
        from rlx_nb.plot.steps import plot_steps

        return plot_steps(self, ax=ax)

    def save(self, path: str | Path) -> Path:
        """Save (the logits report with the generation's tokens); :func:`rlx_nb.load_report` reads it back."""
        return self.logits.save(path)

    def to_html(self, path: str | Path, *, title: str | None = None) -> Path:
        """A self-contained HTML page: the lines, the step plot, the first divergences, then the logits report."""
        from rlx_nb.report import html

        fig = html.page_figure(8.0, 4.2)
        self.plot(ax=fig.add_subplot())
        first = self.first_divergence.reset_index()
        prelude = (
            "<h2>Generation</h2><pre>" + html_text("\n".join(self.lines())) + "</pre>"
            f"<img alt='logits error per step' src='{html.png_uri(fig)}'>"
            "<h3>First divergence per backend</h3>" + html.table_html(first)
        )
        return html.write_html(self.logits, path, title=title or f"rlx_nb generation: {self.label}", prelude=prelude)

    def explorer_view(self, backend: str | None, step: int | None) -> tuple[DivergenceReport, str, str]:
        """(the logits report, backend, output) the explorer opens on: ``step`` (default: the backend's first
        SUSPECT step, else its first flip, else its worst) of ``backend`` (default: the worst)."""
        backend = backend or self.worst_backend()
        if backend not in self.backend_names:
            raise InputError(f"unknown backend {backend!r}; this report has {self.backend_names}")
        step = self.focus_step(backend) if step is None else self.check_step(step)
        return self.logits, backend, step_name(step)

    def worst_backend(self) -> str:
        """SUSPECT backends first, then the one with the largest step line."""
        if not self.backend_names:
            raise InputError("this report has no backend but the oracle")
        table = self.steps
        verdicts = self.verdicts()

        def rank(name: str) -> tuple:
            line = table[table.backend == name].line.max()
            return (verdicts[name] != SUSPECT, -(line if line == line else -1.0))

        return sorted(self.backend_names, key=rank)[0]

    def focus_step(self, backend: str) -> int:
        """The step to look at for ``backend``: its first SUSPECT step, else its first flip, else its worst step."""
        mine = self.steps[self.steps.backend == backend]
        for rows in (mine[mine.verdict == SUSPECT], mine[mine.flip]):
            if not rows.empty:
                return int(rows.iloc[0].step)
        return int(mine.loc[mine.line.fillna(-1).idxmax()].step) if not mine.empty else 0

    def check_step(self, step: Any) -> int:
        if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < self.n_steps:
            raise InputError(f"step must be an integer from 0 to {self.n_steps - 1}, got {step!r}")
        return step

    def localize(self, backend: str | None = None, step: int | None = None, **kwargs: Any) -> Any:
        """:func:`rlx_nb.localize` one step: the model fed that step's token with the oracle's cache of the steps
        before, on ``backend`` (default: the worst) against the oracle and fp64; returns a Localization."""
        from rlx_nb.localization.locate import localize

        if self.source is None:
            raise InputError("this report does not hold its model (it was loaded): run generation_divergence again")
        backend = backend or self.worst_backend()
        step = self.focus_step(backend) if step is None else self.check_step(step)
        model, ids, step_fn, masked = self.source
        at, token = at_step(model, ids, self.tokens, step, step_fn=step_fn, masked=masked)
        given = self.backend_objects.get(backend)
        if given is None:
            return localize(at, (token,), backend=backend, **kwargs)
        with lent(given):  # (a Backend object passed in backends=[...], not registered)
            return localize(at, (token,), backend=backend, **kwargs)


def _record(report: DivergenceReport, backend: str, output: str | None) -> Any:
    for r in report.records:
        if r.backend == backend and r.output == output:
            return r
    return None


def progress_line(early: DivergenceReport, tokens: Any) -> str:
    """The line a long generation call shows for a backend as soon as it has been judged (``early`` holds that
    backend alone), in the words the finished report uses: where the tokens part and whether that is a near-tie,
    not a forward pass's largest difference.  ``tokens`` are the oracle's (``batch x steps``)."""
    meta = {"mode": "teacher", "tokens": np.asarray(tokens).tolist()}
    results = dataclasses.replace(early.results, environment={**early.results.environment, GENERATION_KEY: meta})
    return GenerationReport(type(early)(results, early.records, rule=early.rule, tol_rel=early.tol_rel)).lines()[0]


def _status(report: DivergenceReport, backend: str) -> str:
    # "error"/"skipped" for a backend that did not run (its records have no output), else "".
    recs = [r for r in report.records if r.backend == backend]
    if recs and all(r.output is None for r in recs):
        return recs[0].verdict
    return ""


def load_generation(report: DivergenceReport, where: Any = "report") -> GenerationReport | DivergenceReport:
    """A loaded report as a GenerationReport when it holds a generation's tokens, else as it is; metadata
    that is not a generation's (tokens a rectangle of integers matching the steps) raises ReportFormatError."""
    from rlx_nb.errors import ReportFormatError

    meta = report.results.environment.get(GENERATION_KEY)
    if meta is None:
        return report
    if not isinstance(meta, dict) or not _token_rows(meta.get("tokens")):
        raise ReportFormatError(
            f"{where}: environment.generation must hold 'tokens', a non-empty rectangle of integers"
        )
    free = meta.get("free")
    if free is not None and not (isinstance(free, dict) and all(r == [] or _token_rows(r) for r in free.values())):
        raise ReportFormatError(f"{where}: environment.generation.free must map backends to rectangles of integers")
    texts = meta.get("texts")
    if texts is not None and not (isinstance(texts, dict) and all(
            isinstance(v, list) and all(isinstance(x, str) for x in v) for v in texts.values())):  # fmt: skip
        raise ReportFormatError(f"{where}: environment.generation.texts must map names to lists of strings")
    kept = meta.get("token_texts")
    if kept is not None and not (isinstance(kept, dict) and all(
            isinstance(k, str) and k.isdigit() and isinstance(v, str) for k, v in kept.items())):  # fmt: skip
        raise ReportFormatError(f"{where}: environment.generation.token_texts must map token ids to strings")
    for key in ("mode", "step_function", "oracle_note", "tokenizer_note"):
        if meta.get(key) is not None and not isinstance(meta[key], str):
            raise ReportFormatError(f"{where}: environment.generation.{key} must be a string, got {meta[key]!r:.80}")
    if meta.get("prompt") is not None and not _token_rows(meta["prompt"]):
        raise ReportFormatError(f"{where}: environment.generation.prompt must be a rectangle of integers")
    rows, steps = len(meta["tokens"]), len(meta["tokens"][0])
    if free is not None and any(r and (len(r) != rows or len(r[0]) != steps) for r in free.values()):
        raise ReportFormatError(f"{where}: environment.generation.free holds rows unlike the {rows} x {steps} tokens")
    runs = [report.results.oracle, report.results.reference, *report.results.candidates.values()]
    vocab = None
    for run in runs:
        for name, leaf in (run.outputs or {}).items():
            if not name.startswith("step "):
                continue
            if not (name[5:].isdigit() and int(name[5:]) < steps):
                raise ReportFormatError(f"{where}: its step outputs do not match its {steps} generated tokens")
            shape = leaf.shape if leaf.is_array else None
            if shape is None or len(shape) != 2 or shape[0] != rows or shape[1] < 1:
                raise ReportFormatError(
                    f"{where}: {run.backend}'s {name} is not one row of logits per sequence ({rows} x vocabulary), "
                    f"got shape {shape}"
                )
            vocab = shape[1] if vocab is None else vocab
    if vocab is not None and max(max(r) for r in meta["tokens"]) >= vocab:
        raise ReportFormatError(f"{where}: environment.generation.tokens name ids past the logits' {vocab} entries")
    return GenerationReport(report)


def _token_rows(rows: Any) -> bool:
    # A non-empty list of equally long non-empty lists of non-negative integers.
    if not isinstance(rows, list) or not rows or not all(isinstance(r, list) and r for r in rows):
        return False
    width = len(rows[0])
    return all(len(r) == width and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in r)
               for r in rows)  # fmt: skip


__all__ = ["GenerationReport", "load_generation"]
