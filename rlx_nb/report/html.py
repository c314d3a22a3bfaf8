"""One self-contained HTML file for a report: to attach to an issue or send to a vendor.

Images are inline PNGs, styles inline; no script and no network is needed to read it.  It holds the
verdict lines, the backends and summary tables, for each SUSPECT output its heatmap, histogram and worst elements,
the environment (versions, CPU flags, backend settings), and a localization when one is given.  It
holds no model weights: only outputs' statistics, a few elements' values and pictures of the errors.
"""

from __future__ import annotations

import base64
import datetime
import html
import io
from pathlib import Path
from typing import Any

from rlx_nb._support.safe import html_text
from rlx_nb.errors import writing

MAX_SECTIONS = 12
"""At most this many SUSPECT (backend, output) pairs get figures; the rest are listed."""

MAX_SUMMARY_ROWS = 300
"""Rows of the summary table, SUSPECT first, then by their place on the SUSPECT line; the rest are counted."""

SUMMARY_COLUMNS = (
    "backend", "output", "verdict", "line", "cause", "shape", "max_abs", "max_rel", "ratio_rmse", "ratio_max",
    "mismatched", "max_ulp", "cosine", "pcc", "sqnr_db", "nmse", "effective_bits",
)  # fmt: skip
"""The summary's columns in the file (the whole row of every output: the ``.rlxnb`` file)."""

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 1200px; }
pre { background: #f6f6f6; padding: 0.8em; white-space: pre-wrap; font-size: 12px; }
.wide { max-width: 100%; overflow-x: auto; }
table { border-collapse: collapse; font-size: 12px; margin: 0.5em 0; }
td, th { border: 1px solid #ddd; padding: 3px 6px; text-align: right; white-space: nowrap; }
th { background: #f0f0f0; }
td:first-child, th:first-child { text-align: left; }
table.environment th, table.inner th { text-align: left; vertical-align: top; font-weight: normal; }
td.value { text-align: left; white-space: normal; }
table.inner { margin: 0; font-size: 11px; }
td.value ul { margin: 0; padding-left: 1.2em; }
.suspect { color: #b00020; font-weight: bold; }
.figs img { max-width: 100%; margin-right: 1em; vertical-align: top; }
section { border-top: 1px solid #ccc; margin-top: 1.5em; }
"""


def png_uri(fig: Any) -> str:
    """A figure as an inline PNG (``data:`` URI) for a page that needs no file beside it."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80, bbox_inches="tight")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def page_figure(width: float, height: float) -> Any:
    """A figure for a page, outside pyplot (nothing is left open)."""
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def table_html(frame: Any) -> str:
    """A frame as a page's table: as the notebook shows it (:func:`rlx_nb.comparison.tables.table_html`: each number
    in its column's format, verdicts in their colours), in a box that scrolls sideways where it is wider than the
    page (the page itself never is)."""
    from rlx_nb.comparison.tables import table_html as html_of

    return f"<div class='wide'>{html_of(frame, index=False)}</div>"


def environment_html(env: dict[str, Any]) -> str:
    """An environment as the page shows it: a table of keys and values, a mapping as its own small table."""
    rows = "".join(
        f"<tr><th>{html.escape(str(key))}</th><td class='value'>{_value(value)}</td></tr>" for key, value in env.items()
    )
    return f"<div class='wide'><table class='environment'>{rows}</table></div>"


def _value(value: Any, depth: int = 0) -> str:
    # A value of the environment as a reader takes it in: a mapping as its own small table of keys and values, a list
    # of words as one line, a number as it is; never raw JSON.
    if isinstance(value, dict):
        if not value:
            return "<i>none</i>"
        rows = list(value.values())
        if all(isinstance(v, dict) and v and v.keys() == rows[0].keys() for v in rows):  # (records: one table)
            head = "".join(f"<th>{html.escape(str(k))}</th>" for k in rows[0])
            body = "".join(f"<tr><th>{html.escape(str(name))}</th>" + "".join(f"<td>{_value(v, 2)}</td>" for v in
                           record.values()) + "</tr>" for name, record in value.items())  # fmt: skip
            return f"<table class='inner'><tr><th></th>{head}</tr>{body}</table>"
        if depth >= 2:
            return html.escape(", ".join(f"{k}: {v}" for k, v in value.items()))
        rows = "".join(f"<tr><th>{html.escape(str(k))}</th><td class='value'>{_value(v, depth + 1)}</td></tr>"
                       for k, v in value.items())  # fmt: skip
        return f"<table class='inner'>{rows}</table>"
    if isinstance(value, (list, tuple)):
        if not value:
            return "<i>none</i>"
        if all(isinstance(v, (str, int, float)) for v in value) and sum(len(str(v)) for v in value) <= 400:
            joined = ", ".join(str(v) for v in value) if all(len(str(v)) <= 40 for v in value) else None
            if joined is not None:
                return html.escape(joined)
        return "<ul>" + "".join(f"<li>{_value(v, depth + 1)}</li>" for v in value) + "</ul>"
    if value is None:
        return "<i>none</i>"
    if isinstance(value, float):
        return html.escape(f"{value:.4g}")
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    text = str(value)
    return html.escape(text if len(text) <= 600 else text[:600] + " …")


def _summary(report: Any) -> str:
    from rlx_nb.verdict.types import SUSPECT

    frame = report.summary_detail
    frame = frame.assign(_first=frame.verdict != SUSPECT).sort_values(["_first", "line"], ascending=[True, False])
    cols = [c for c in SUMMARY_COLUMNS if c in frame]
    rest = len(frame) - MAX_SUMMARY_ROWS
    more = (
        f"<p>{rest} more rows, after these in the same order (SUSPECT first, then by their place on the SUSPECT "
        "line): <code>report.save(path)</code> keeps every row.</p>"
        if rest > 0
        else ""
    )
    return "<h2>Summary: one row per backend and output</h2>" + table_html(frame[cols].head(MAX_SUMMARY_ROWS)) + more


def _suspect_section(report: Any, rec: Any) -> str:
    metric = "line" if rec.judgement.budget.budget_max == rec.judgement.budget.budget_max else "abs"
    heat = page_figure(6.0, 4.5)
    report.plot.heatmap(rec.backend, rec.output, metric=metric, ax=heat.add_subplot(), max_pixels=400)
    hist = page_figure(6.5, 4.0)
    report.plot.histogram(rec.output, metric=metric, ax=hist.add_subplot(), highlight=rec.backend)
    worst = report.elements(rec.backend, rec.output, top=10)
    return (
        f"<section><h3><span class='suspect'>SUSPECT</span> {html.escape(rec.backend)} · "
        f"<code>{html.escape(rec.output)}</code></h3><p>{html.escape(rec.reason)}</p>"
        f"<div class='figs'><img alt='heatmap of {html.escape(rec.backend)} {html.escape(rec.output)}' "
        f"src='{png_uri(heat)}'><img alt='histogram of {html.escape(rec.output)}' src='{png_uri(hist)}'></div>"
        f"<h4>Worst elements</h4>{table_html(worst)}</section>"
    )


def _localization(loc: Any) -> str:
    fig = page_figure(9.0, 4.0)
    loc.plot(ax=fig.add_subplot())
    culprit = html.escape(loc.culprit or "none — every module within round-off")
    repro = (
        "<p>Standalone repro: <code>loc.repro('repro/')</code> writes one script that needs only torch, numpy and "
        "the runtime, shrunk, with where the error is born; <code>report.issue(backend, 'repro/')</code> writes an "
        "issue ready to file around it.</p>"
        if loc.culprit
        else ""
    )
    cols = [c for c in ("name", "kind", "verdict", "local_line", "propagated_line", "notes") if c in loc.frame]
    return (
        f"<section><h2>Localization: {html.escape(loc.backend)}</h2><p>Culprit: <b>{culprit}</b>; suspects: "
        f"{html.escape(', '.join(loc.suspects) or 'none')}</p><img src='{png_uri(fig)}' alt='localization'>"
        f"{repro}{table_html(loc.frame[cols])}</section>"
    )


def _repros(report: Any) -> str:
    # Each standalone repro written for this report (report.repro / report.issue): where the error is born, what
    # was shrunk, the script and what it printed when run without rlx_nb.
    parts = ["<h2>Standalone repros</h2>"]
    for backend, repro in report.repros.items():
        state = {True: "reproduces the divergence", False: "did NOT cross the line", None: "not run"}[repro.reproduces]
        parts.append(
            f"<section><h3>{html.escape(backend)} · <code>{html.escape(repro.label)}</code></h3>"
            f"<p><b>{html.escape(repro.attribution or 'Where in the backend: not attributed.')}</b></p>"
            f"<p>{html.escape(str(repro.shrunk) if repro.shrunk is not None else '')}</p>"
            f"<p><code>{html.escape(repro.path.name)}</code>, {repro.lines} lines; run without rlx_nb it {state}:</p>"
            f"<pre>{html.escape(repro.ran.rstrip())}</pre><details><summary>The script</summary>"
            f"<pre>{html.escape(repro.text)}</pre></details></section>"
        )
    return "".join(parts)


def report_html(report: Any, *, localization: Any = None, title: str | None = None, prelude: str = "") -> str:
    """The whole HTML document for ``report`` (and ``localization``, a :class:`rlx_nb.Localization`);
    ``prelude`` (HTML rlx_nb built, its texts escaped) goes before the verdicts."""
    from rlx_nb._version import __version__
    from rlx_nb.verdict.types import SUSPECT

    title = title or f"rlx_nb: {report.label}"
    suspects = [r for r in report.records if r.verdict == SUSPECT and r.output is not None]
    shown = suspects[:MAX_SECTIONS]
    rest = suspects[MAX_SECTIONS:]
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>{html_text(title)}</title><style>{STYLE}</style></head><body>",
        f"<h1>{html_text(title)}</h1>",
        f"<p>{len(report.results.candidates)} backend(s) against the CPU oracle, judged by the "
        f"<i>{html.escape(report.rule)}</i> rule; suspects: <span class='suspect'>"
        f"{html.escape(', '.join(report.suspects) or 'none')}</span>. Written by rlx_nb {__version__} on "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC.</p>",
        prelude,
        "<h2>Verdicts</h2><pre>" + html.escape("\n".join(report.lines())) + "</pre>",
        "<h2>Backends</h2>" + table_html(report.backends),
        _summary(report),
    ]
    if shown:
        parts.append("<h2>SUSPECT outputs</h2>")
        parts += [_suspect_section(report, rec) for rec in shown]
    if rest:
        listed = ", ".join(f"{r.backend} · {r.output}" for r in rest)
        parts.append(f"<p>{len(rest)} more SUSPECT outputs, without figures: {html.escape(listed)}</p>")
    if localization is not None:
        parts.append(_localization(localization))
    if getattr(report, "repros", None):
        parts.append(_repros(report))
    parts += [
        "<h2>Environment</h2>",
        environment_html(dict(report.results.environment)),
        "<p>No model weights are in this file: outputs' statistics, a few elements' values and pictures of the "
        "errors only. Every output's arrays are in the report itself: <code>report.save('name.rlxnb')</code> "
        "writes them, <code>rlx_nb.load_report</code> reads them back.</p></body></html>",
    ]
    return "".join(parts)


def write_html(
    report: Any, path: str | Path, *, localization: Any = None, title: str | None = None, prelude: str = ""
) -> Path:
    """Write :func:`report_html` to ``path`` (``.html`` appended when it has no suffix); returns the path."""
    path = Path(path)
    if path.suffix.lower() not in (".html", ".htm"):
        path = path.with_name(path.name + ".html")
    page = report_html(report, localization=localization, title=title, prelude=prelude)
    with writing(path, "the HTML report"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(page, encoding="utf-8", errors="replace")  # (a lone surrogate anywhere: "?", never a crash)
    return path


__all__ = ["MAX_SECTIONS", "MAX_SUMMARY_ROWS", "STYLE", "environment_html", "report_html", "write_html"]
