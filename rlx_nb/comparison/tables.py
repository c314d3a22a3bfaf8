"""Flat rows of the package's structured results, and the DataFrames made of them.  Column names are
defined once, here.

A record (:class:`~rlx_nb.verdict.records.OutputRecord`: identity, :class:`~rlx_nb.verdict.records.PairFields`,
:class:`~rlx_nb.verdict.rule.Judgement`) is flattened only here (:func:`record_row`; :func:`record_from_row` reads
one back, for a saved report), so a table, a file and a benchmark's CSV all name a figure the same way.
"""

from __future__ import annotations

import dataclasses
import functools
import html
import typing
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from rlx_nb.numerics.device import worst_columns as device_worst_columns
from rlx_nb.numerics.elements import worst_columns
from rlx_nb.verdict.records import VERDICT_ORDER, OutputRecord, PairFields, worst_record
from rlx_nb.verdict.types import GROUPS, SUSPECT, VERDICT_ERROR, Judgement

BACKEND = "backend"
OUTPUT = "output"
VERDICT = "verdict"
EXCESS = "excess"

_IDENTITY = [f for f in dataclasses.fields(OutputRecord) if f.name not in ("judgement", "pair")]
_PAIR = list(dataclasses.fields(PairFields))
_JUDGEMENT = [  # (class, field) of every column of a judgement: its own, then its figures (the notes are the record's)
    *((Judgement, f) for f in dataclasses.fields(Judgement) if f.name not in ("notes", *GROUPS)),
    *((cls, f) for cls in GROUPS.values() for f in dataclasses.fields(cls)),
]
SUMMARY_COLUMNS = [
    *(BACKEND, OUTPUT, "output_index", "kind", VERDICT, "verdict_fixed", "verdict_budget", "reason"),
    *("compute_dtype", "shape", "dtype", "numel"),
    *(f.name for f in _PAIR),
    *("oracle_rmse", "backend_rmse", "oracle_max_err", "backend_max_err", "sequential_rmse", "sequential_max_err"),
    *("ratio_rmse", "ratio_max", "budget_rmse", "budget_max", EXCESS, "concentration", "concentrated"),
    *("slice_ratio", "slice_at", "tol_rel", "reduction_length", "effective_bits", "closest_format"),
    *("anchor_likeness", "zero_mismatch", "zero_mismatch_max", "excess_elsewhere", "error_bias", "error_value_corr"),
    *("less_accurate", "discrete_events", "note", "cause", "line", "nonfinite_unexplained", "oracle_outliers"),
]
"""One row per (backend, output): every figure of a record (``report.summary_detail``)."""
SUMMARY_SHORT_COLUMNS = [BACKEND, OUTPUT, "kind", VERDICT, "line", "why", "max_abs", "worst_index", "effective_bits"]
"""... the columns a person reads first (``report.summary``): the verdict, its place on the SUSPECT line
(``line``: 1.0 is the line) and a few words why; the whole reason and every other figure one attribute away."""
RECORD_COLUMNS = [*SUMMARY_COLUMNS, "detail", "nondeterminism"]
"""... and what a saved report keeps besides."""


def record_row(r: OutputRecord) -> dict[str, Any]:
    """One record as a flat row (:data:`RECORD_COLUMNS`)."""
    row = {f.name: getattr(r, f.name) for f in _IDENTITY}
    row.update({f.name: getattr(r.pair, f.name) for f in _PAIR})
    row.update({f.name: getattr(r.judgement, f.name) for _, f in _JUDGEMENT})
    return row


def record_from_row(row: dict[str, Any]) -> OutputRecord:
    """A record from a flat row (a saved report's; a field it lacks takes its default)."""
    pair = PairFields(**{f.name: row[f.name] for f in _PAIR if f.name in row})
    judged = {f.name: row[f.name] for _, f in _JUDGEMENT if f.name in row}
    judged.setdefault("cause", "")
    judgement = Judgement.of(**judged)
    ident = {f.name: row[f.name] for f in _IDENTITY if f.name in row}
    return OutputRecord(**ident, judgement=judgement, pair=pair)


REQUIRED_COLUMNS = (BACKEND, OUTPUT, "output_index", "kind", "compute_dtype", VERDICT, "verdict_fixed",
                    "verdict_budget", "reason")  # fmt: skip
"""What every saved record has held since the format began (a later column may be missing: its default)."""


@functools.cache
def record_fields() -> tuple[tuple[str, Any, bool], ...]:
    """``(column, type, required)`` of every column a saved record may hold (:mod:`rlx_nb.report.schema` checks them).

    Worked out once: the type hints of the record's classes (strings, under ``from __future__ import annotations``,
    each evaluated anew by ``typing.get_type_hints``) were 40% of loading a report, once per column per file."""
    columns = [*((OutputRecord, f) for f in _IDENTITY), *((PairFields, f) for f in _PAIR), *_JUDGEMENT]
    hints = {cls: typing.get_type_hints(cls) for cls in {cls for cls, _ in columns}}
    return tuple((f.name, hints[cls][f.name], f.name in REQUIRED_COLUMNS) for cls, f in columns)


BACKEND_COLUMNS = [
    BACKEND,
    VERDICT,
    "verdict_fixed",
    "verdict_budget",
    "worst_output",
    "worst_output_index",
    "reason",
    "max_abs",
    "max_rel",
    "max_rel_output",
    "line",
    "ratio_rmse",
    "ratio_max",
    EXCESS,
    "outputs",
    "suspect_outputs",
    "compute_dtype",
    "seconds",
    "note",
]
ELEMENT_COLUMNS = [
    "rank",
    "index",
    "flat_index",
    "oracle",
    "backend",
    "reference",
    "abs_err",
    "rel_err",
    "ulp_err",
    "oracle_err_fp64",
    "backend_err_fp64",
]
LOCALIZE_COLUMNS = [
    "order",
    "name",
    "kind",
    "depth",
    "verdict",
    "output",
    "local_ratio_rmse",
    "local_ratio_max",
    "local_line",
    "propagated_ratio_rmse",
    "propagated_ratio_max",
    "propagated_line",
    "amplification",
    "reason",
    "notes",
]


FORMATS: dict[str, str] = {
    **dict.fromkeys(("max_abs", "mean_abs", "p99_abs", "abs_err", "budget_rmse", "budget_max"), "{:.3e}"),
    **dict.fromkeys(("oracle_rmse", "backend_rmse", "oracle_max_err", "backend_max_err"), "{:.3e}"),
    **dict.fromkeys(("sequential_rmse", "sequential_max_err", "oracle_err_fp64", "backend_err_fp64"), "{:.3e}"),
    **dict.fromkeys(("max_rel", "rel_err", "tol_rel", "nmse"), "{:.3e}"),
    **dict.fromkeys(("cosine", "pcc"), "{:.9f}"),
    "sqnr_db": "{:.1f}",
    **dict.fromkeys(("ratio_rmse", "ratio_max", "excess", "slice_ratio", "concentration", "mismatched_frac"), "{:.3g}"),
    **dict.fromkeys(("line", "old_line", "new_line"), "{:.3g}"),
    **dict.fromkeys(("local_ratio_rmse", "local_ratio_max", "local_line", "amplification"), "{:.3g}"),
    **dict.fromkeys(("propagated_ratio_rmse", "propagated_ratio_max", "propagated_line"), "{:.3g}"),
    **dict.fromkeys(("oracle_value", "backend_value", "oracle", "backend", "reference"), "{:.9g}"),
    **dict.fromkeys(("reference_value",), "{:.12g}"),
    **dict.fromkeys(("effective_bits", "anchor_likeness", "excess_elsewhere", "zero_mismatch_max"), "{:.3g}"),
    **dict.fromkeys(("max_quanta", "budget_max_quanta", "quantum"), "{:.3g}"),  # (int8: in quanta)
    **dict.fromkeys(("accumulator_quantum", "fp32_error", "width"), "{:.3g}"),  # (int8: a requantization's width)
    **dict.fromkeys(("seconds",), "{:.2f}"),
    **dict.fromkeys(("peak_bytes", "rss_after_bytes"), "{:,.0f}"),
}
"""How a notebook shows each numeric column: enough digits to tell the oracle from the reference, and
scientific numbers that never wrap inside a cell."""
PROSE = ("reason", "note", "notes")
DEFAULT_FORMAT = "{:.4g}"
"""A float column :data:`FORMATS` does not name (a generation's ``gap_fp64``, a user's own)."""


class Table(pd.DataFrame):
    """A DataFrame that shows itself readably in a notebook (:data:`FORMATS`; numbers never wrap, prose
    wraps at a readable width); as data it is an ordinary DataFrame."""

    @property
    def _constructor(self) -> type:
        return Table

    def _repr_html_(self) -> str:
        return table_html(self)


def table_html(frame: pd.DataFrame, *, index: bool = True) -> str:
    """A frame as an HTML table, the same in a notebook and on a page (:func:`rlx_nb.report.html.write_html`): each
    float column in its format (:data:`FORMATS`, else :data:`DEFAULT_FORMAT`), verdicts in their colours, prose
    wrapped, numbers never.  Styles inline on each cell, never in a ``<style>`` block: JupyterLab strips those from
    an untrusted notebook (every notebook a user did not run), and the verdicts' colours went with them."""
    frame = _escaped(pd.DataFrame(frame))
    if len(frame) > 200 or frame.columns.duplicated().any():
        return frame.to_html(escape=False, max_rows=60, index=index)  # (escaped above, once)
    # (a float column no format names: 4 significant digits, never a float's 17 -- 0.18157668617571687)
    formats = {c: FORMATS.get(c, DEFAULT_FORMAT) for c in frame.columns if frame[c].dtype.kind == "f"}
    plain, prose = "white-space:nowrap;text-align:right", "white-space:normal;min-width:24em;text-align:left"
    head = ("<th></th>" if index else "") + "".join(f'<th style="{plain}">{c}</th>' for c in frame.columns)
    body = []
    for key, row in frame.iterrows():
        cells = [f'<th style="{plain}">{key}</th>'] if index else []
        for column, value in row.items():
            style = prose if column in PROSE else plain
            colour = verdict_css(str(value)) if VERDICT in str(column) else ""  # (verdict_fixed, old_verdict ...)
            if colour:
                style += ";" + colour.replace(": ", ":").replace("; ", ";")
            cells.append(f'<td style="{style}">{_cell_text(value, formats.get(column))}</td>')
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f'<table class="dataframe" border="1"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def _cell_text(value: Any, fmt: str | None) -> str:
    # One cell as a notebook shows it: a float in its column's format, a missing value as "—".
    if value is None or (isinstance(value, (float, np.floating)) and value != value):
        return "—"
    if fmt is not None and isinstance(value, (int, float, np.number)) and not isinstance(value, (bool, np.bool_)):
        return fmt.format(value)
    return str(value)


def _escaped(frame: pd.DataFrame) -> pd.DataFrame:
    # Every text a model, a backend, an exception or a received file put in a frame (names, reasons,
    # notes; column and index labels), HTML-escaped: a notebook renders Styler's HTML as it is.  Numbers
    # and missing values stay themselves so their formats apply.
    def cell(v: Any) -> Any:
        if v is None or isinstance(v, (bool, int, float, np.number, np.bool_)):
            return v
        return html.escape(str(v))

    out = frame.copy()
    for c in out.columns:
        if out[c].dtype.kind not in "biufc":
            out[c] = out[c].map(cell).astype(object)
    out.columns = pd.Index([cell(c) for c in out.columns])
    out.index = pd.Index([cell(i) for i in out.index])
    return out


ELEMENT_DIGITS = {"oracle": 9, "backend": 9, "reference": 12}
"""Significant digits of the element table's values: float32's 9 tell the oracle and the backend apart where
they differ in the last bit; the fp64 reference shows the digits that the float32 values round away."""


def element_html(frame: Any) -> str:
    """The worst elements as an HTML table whose numbers show the digits that differ (never wrapped)."""
    shown = frame.copy()
    for column in shown.columns:
        digits = ELEMENT_DIGITS.get(column)
        if digits is not None:
            shown[column] = [f"{float(v):.{digits}g}" for v in shown[column]]
        elif shown[column].dtype.kind == "f":
            shown[column] = [f"{float(v):.3e}" for v in shown[column]]
    shown["index"] = [str(tuple(v)) for v in shown["index"]]
    body = shown.to_html(index=False, escape=True, classes="rlx-elements")
    # (never wrapped, an index or a number on two lines; wider than its box, it scrolls there, no column cut)
    body = body.replace("<td>", "<td style='white-space:nowrap'>").replace("<th>", "<th style='white-space:nowrap'>")
    return f"<div style='white-space:nowrap;overflow-x:auto;max-width:100%'>{body}</div>"


def verdict_css(v: str) -> str:
    """The colour of a verdict in tables: red for SUSPECT only."""
    if v == SUSPECT:
        return "color: #b00020; font-weight: bold"
    if v in (VERDICT_ERROR, "skipped"):
        return "color: #8a6d00"
    return "color: #1b5e20" if v in ("round-off", "nondeterministic") else ""


def summary_frame(records: Sequence[OutputRecord], *, short: bool = False) -> pd.DataFrame:
    """One row per (backend, output), in run order: every column, or (``short``) :data:`SUMMARY_SHORT_COLUMNS`."""
    if not short:
        return Table([record_row(r) for r in records], columns=SUMMARY_COLUMNS)
    from rlx_nb.verdict.words import short_reason

    rows = [{**record_row(r), "why": short_reason(r)} for r in records]
    return Table(rows, columns=SUMMARY_SHORT_COLUMNS)


def backends_frame(
    records: Sequence[OutputRecord], seconds: dict[str, float], notes: dict[str, list[str]] | None = None
) -> pd.DataFrame:
    """One row per backend: its verdict and worst output, plus the seed's per-backend maxima.

    ``note`` holds what the backend said about its run (``notes``: a conversion route, graph breaks)
    and then the records' notes.
    """
    notes = notes or {}
    by_backend: dict[str, list[OutputRecord]] = {}
    for r in records:
        by_backend.setdefault(r.backend, []).append(r)
    rows = []
    for name, recs in by_backend.items():
        worst = worst_record(recs)
        rels = [r for r in recs if r.pair.max_rel == r.pair.max_rel]
        rel_worst = max(rels, key=lambda r: r.pair.max_rel) if rels else None
        rows.append(
            {
                BACKEND: name,
                VERDICT: worst.verdict,
                "verdict_fixed": _worst_of(r.judgement.rules.verdict_fixed for r in recs),
                "verdict_budget": _worst_of(
                    r.judgement.rules.verdict_budget for r in recs if r.judgement.rules.verdict_budget
                ),
                "worst_output": worst.output,
                "worst_output_index": worst.output_index,
                "reason": worst.reason,
                "max_abs": np.nanmax([r.pair.max_abs for r in recs]) if rels else np.nan,
                "max_rel": rel_worst.pair.max_rel if rel_worst else np.nan,
                "max_rel_output": rel_worst.output if rel_worst else None,
                "line": worst.judgement.line,
                "ratio_rmse": worst.judgement.budget.ratio_rmse,
                "ratio_max": worst.judgement.budget.ratio_max,
                EXCESS: worst.judgement.budget.excess,
                "outputs": len([r for r in recs if r.output is not None]),
                "suspect_outputs": sum(r.verdict == SUSPECT for r in recs),
                "compute_dtype": worst.compute_dtype,
                "seconds": seconds.get(name, np.nan),
                "note": "; ".join([*notes.get(name, []), *sorted({r.note for r in recs if r.note})])[:600],
            }
        )
    return Table(rows, columns=BACKEND_COLUMNS)


COMPACT_COLUMNS = [BACKEND, VERDICT, "line", "worst_output", "why", "max_abs", "effective_bits"]
"""The backends at a glance (``report.backends``): the verdict and its place on the SUSPECT line (``line``: 1.0
is the line, the one number of every verdict), the worst output and a few words why."""


def compact_backends_frame(detail: pd.DataFrame, records: Sequence[OutputRecord]) -> pd.DataFrame:
    """The backends at a glance: verdict, worst output, how far over the limits, and a few words why
    (``why``; the whole reason and every other column are in the detailed frame)."""
    from rlx_nb.verdict.words import short_reason

    worst = {}
    for r in records:
        worst.setdefault(r.backend, []).append(r)
    why = {name: short_reason(worst_record(recs)) for name, recs in worst.items()}
    bits = {
        name: min((b for r in recs if (b := r.judgement.reading.effective_bits) == b), default=np.nan)
        for name, recs in worst.items()
    }
    frame = detail.assign(why=detail[BACKEND].map(why), effective_bits=detail[BACKEND].map(bits))
    return Table(frame[COMPACT_COLUMNS])


def _worst_of(verdicts: Any) -> str | None:
    vs = [v for v in verdicts if v]
    if not vs:
        return None
    return min(vs, key=lambda v: VERDICT_ORDER.get(v, 2))


def elements_frame(rows: dict[str, Any]) -> pd.DataFrame:
    """The worst elements of one output, worst first (columns: :data:`ELEMENT_COLUMNS`)."""
    return Table(rows, columns=ELEMENT_COLUMNS)


def worst_elements_frame(oracle: np.ndarray, backend: Any, reference: np.ndarray | None, top: int) -> pd.DataFrame:
    """:func:`elements_frame` of the ``top`` worst elements (``backend`` a host array, or a tensor on its device)."""
    if isinstance(backend, np.ndarray):
        return elements_frame(worst_columns(oracle, backend, reference, top))
    return elements_frame(device_worst_columns(oracle, backend, reference, top))


def element_table(oracle: np.ndarray, backend: np.ndarray, reference: np.ndarray | None) -> pd.DataFrame:
    """Every element of one output, compact dtypes (see ``DivergenceReport.element_frame``)."""
    from rlx_nb.numerics.elements import rel_error, ulp_distance

    o, b = oracle.reshape(-1), backend.reshape(-1)
    columns: dict[str, np.ndarray] = {}
    # (a 0-d output is one row with no index column)
    for axis, idx in enumerate(np.unravel_index(np.arange(o.size), oracle.shape) if oracle.ndim else ()):
        columns[f"i{axis}"] = idx.astype(np.min_scalar_type(max(oracle.shape[axis] - 1, 0)))
    columns["oracle"], columns["backend"] = o, b
    columns["reference"] = (
        reference.reshape(-1).astype(np.float64) if reference is not None else np.full(o.size, np.nan)
    )
    d = np.abs(b.astype(np.float64) - o)
    columns["abs_err"] = d.astype(np.float32)
    columns["rel_err"] = rel_error(o, b).astype(np.float32)
    columns["ulp_err"] = np.minimum(ulp_distance(o, b.astype(o.dtype)), np.iinfo(np.uint32).max).astype(np.uint32)
    return pd.DataFrame(columns)


def backend_table_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """The registry as a table: every backend, whether it is live here, and why not."""
    return pd.DataFrame(rows)


def localization_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """The checks of a localization, modules first then ops, each in execution order (:data:`LOCALIZE_COLUMNS`)."""
    order = {"module": 0, "op": 1}
    frame = Table(rows, columns=LOCALIZE_COLUMNS)
    return frame.sort_values(["kind", "order"], key=lambda c: c.map(order) if c.name == "kind" else c).reset_index(
        drop=True
    )


PRECISION_COLUMNS = ["setting", "switch", "effective_bits", "closest_format", "verdict", "reason"]


def precision_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """A precision sweep: one row per setting (:data:`PRECISION_COLUMNS`)."""
    return Table(rows, columns=PRECISION_COLUMNS)


BASELINE_COLUMNS = [BACKEND, OUTPUT, "status", "old_verdict", "new_verdict", "old_line", "new_line", "moved"]


def baseline_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """How each (backend, output) moved against a baseline report (:data:`BASELINE_COLUMNS`)."""
    return Table(rows, columns=BASELINE_COLUMNS)


TIMING_COLUMNS = ["phase", "seconds", "peak_bytes", "rss_after_bytes"]


def timings_frame(phases: dict[str, Any]) -> pd.DataFrame:
    """A call's phases in the order they ran (:data:`TIMING_COLUMNS`); values a file got wrong are NaN."""

    def number(v: Any) -> float:
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else float("nan")

    rows = [
        {
            "phase": str(name),
            **{c: number(v.get(c)) if isinstance(v, dict) else float("nan") for c in TIMING_COLUMNS[1:]},
        }
        for name, v in phases.items()
    ]
    return Table(rows, columns=TIMING_COLUMNS)
