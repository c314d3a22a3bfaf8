"""Text from a model, a backend, an exception or a received file never runs as script and never crashes a view.

Markup, script, matplotlib math text and control characters go in as output names, module names, backend
names, labels and error messages; every HTML view rlx_nb produces (notebook reprs, the frames' Styler
views, the explorer's HTML, the HTML report, a localization) is parsed and must hold no tag or attribute
that came from them, before and after a save/load round trip; every figure must draw.
"""

from __future__ import annotations

import html.parser
import json
import zipfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rlx_nb
from rlx_nb._support.safe import html_text, plot_text

HOSTILE = [
    "<img src=x onerror=alert(1)>",
    "<script>alert(2)</script>",
    "</style><script>alert(3)</script>",
    "$\\x$",
    "cost $5 and $\\frac{1}{0}$",
    "bell\x07 nul\x00 esc\x1b[31m tab\t",
    "\"' onmouseover=alert(4) x='",
    "rtl \u202e gnp.exe",
]
ALLOWED_TAGS = {
    "html", "head", "body", "meta", "title", "style", "table", "thead", "tbody", "tr", "th", "td", "p", "b", "i",
    "code", "span", "div", "h1", "h2", "h3", "h4", "pre", "section", "img", "br", "ul", "li", "small", "em",
}  # fmt: skip


class _Tags(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.found: list[tuple[str, list[tuple[str, str | None]]]] = []

    def handle_starttag(self, tag, attrs):
        self.found.append((tag, attrs))


def assert_safe_html(text: str) -> None:
    """No tag outside the short list rlx_nb writes, no event handler, images only inline PNGs."""
    parser = _Tags()
    parser.feed(text)
    for tag, attrs in parser.found:
        assert tag in ALLOWED_TAGS, f"<{tag}> in the HTML"
        for name, value in attrs:
            assert not name.startswith("on"), f"an event handler {name}= on <{tag}>"
            if name in ("src", "href"):
                assert tag == "img" and (value or "").startswith("data:image/png;base64,"), f"{name}={value!r}"
    for bad in ("<img src=x", "<script"):  # (escaped, the same words are harmless text)
        assert bad not in text


class Hostile(torch.nn.Module):
    """A model whose output names and module names are ``name``."""

    def __init__(self, name: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.key = name
        self.add_module(name.replace(".", "_") or "m", torch.nn.Linear(6, 6))

    def forward(self, x):
        y = next(iter(self.children()))(x)
        return {self.key: y, "plain": y.tanh()}


def _faulty(name: str):
    def fn(model, inputs):
        out = model(*inputs)
        return {k: v * 1.01 if k != "plain" else v for k, v in out.items()}

    return fn


def _raises(message: str):
    def fn(model, inputs):
        raise ValueError(message)

    return fn


def _rename_backends(path: Path, old: str, new: str) -> None:
    # A received file may name backends anything (the registry's rules do not bind a file).
    with zipfile.ZipFile(path) as zf:
        items = {n: zf.read(n) for n in zf.namelist()}
    meta = json.loads(items["meta.json"])
    runs = meta["runs"]["candidates"]
    runs[new] = runs.pop(old)
    runs[new]["backend"] = new
    for r in meta["records"]:
        if r["backend"] == old:
            r["backend"] = new
    items["meta.json"] = json.dumps(meta).encode()
    with zipfile.ZipFile(path, "w") as zf:
        for n, d in items.items():
            zf.writestr(n, d)


def _every_view(report: rlx_nb.DivergenceReport, tmp_path: Path, *, figures: bool = True) -> None:
    assert_safe_html(report._repr_html_())
    for frame in (report.backends, report.backends_detail, report.summary, report.summary_detail):
        assert_safe_html(frame._repr_html_())
    for backend in report.results.candidates:
        if backend in report.errors:
            continue
        rec = report.record(backend)
        assert_safe_html(report.elements(backend, rec.output, top=3)._repr_html_())
    assert "\n".join(report.lines())  # the text lines are text: nothing to escape, nothing to crash
    if figures:
        assert_safe_html(report.to_html(tmp_path / "r.html").read_text(encoding="utf-8"))
        ex = rlx_nb.explore(report)
        for widget in (ex.status, ex.table, ex.inspector):
            assert_safe_html(widget.value)
        for label, _ in (*ex.backend_picker.options, *ex.output_picker.options):
            assert isinstance(label, str)  # (dropdown labels are text nodes in the page, never markup)


@pytest.mark.parametrize("name", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_names_and_messages_never_become_markup(name, tmp_path, capsys):
    rlx_nb.register_backend("test-hostile-fault", _faulty(name), replace=True)
    rlx_nb.register_backend("test-hostile-error", _raises(name), replace=True)
    try:
        report = rlx_nb.backend_divergence(
            Hostile(name),
            torch.randn(4, 6),
            backends=["test-hostile-fault", "test-hostile-error", "cpu-nomkldnn"],
            label=name,
            progress=False,
        )
    finally:
        rlx_nb.unregister_backend("test-hostile-fault")
        rlx_nb.unregister_backend("test-hostile-error")
    assert report.suspects == ["test-hostile-fault"]
    assert name.split("\x00")[0][:8] in report.record("test-hostile-error").reason  # the message is kept
    _every_view(report, tmp_path)
    saved = report.save(tmp_path / "hostile.rlxnb")
    _rename_backends(saved, "test-hostile-fault", name)
    loaded = rlx_nb.load_report(saved)
    assert loaded.suspects == [name]
    _every_view(loaded, tmp_path)
    from rlx_nb.cli import main

    assert main(["show", str(saved)]) == 1
    printed = capsys.readouterr().out
    assert "SUSPECT" in printed and not any(c in printed for c in "\x00\x07\x1b")  # no terminal escapes in a CI log
    loc = rlx_nb.localize(Hostile(name), torch.randn(4, 6), backend="cpu-nomkldnn")
    assert_safe_html(loc._repr_html_())
    loc.plot().figure.savefig(tmp_path / "loc.png")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(alphabet=st.sampled_from([*"<>&\"'$\\/=x ()", "\x00", "\x07", "\ud800", "\u202e"]), max_size=24))
def test_any_text_escapes_for_html_and_draws_literally(text):
    escaped = html_text(text)
    assert "<" not in escaped and ">" not in escaped and '"' not in escaped
    assert_safe_html(f"<p>{escaped}</p>")
    literal = plot_text(text)
    from matplotlib.figure import Figure
    from matplotlib.text import Text

    assert not Text(text=literal)._preprocess_math(literal)[1]  # never math text
    fig = Figure(figsize=(2, 1))
    fig.add_subplot().set_title(literal)
    fig.canvas.draw()  # no crash (a lone surrogate crashed matplotlib's text engine)
