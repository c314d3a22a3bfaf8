from __future__ import annotations

import re

import numpy as np
import torch

import rlx_nb
from rlx_nb.comparison.tables import (
    BACKEND_COLUMNS,
    COMPACT_COLUMNS,
    ELEMENT_COLUMNS,
    SUMMARY_COLUMNS,
    SUMMARY_SHORT_COLUMNS,
)

LINE = re.compile(
    r"^\[(?P<label>[^\]]+)\] +(?P<backend>\S+) vs cpu: max_abs=\d\.\d{3}e[+-]\d\d max_rel=\d\.\d{3}e[+-]\d\d "
    r"\(output #\d+ \S+\) — (round-off \(explainable\)|SUSPECT \(.+\))"
)


def _report():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Softmax(-1))
    return rlx_nb.backend_divergence(
        model, torch.randn(8, 16), backends=["cpu-nomkldnn", "fault:softmax-row"], label="tiny"
    )


def test_frames_have_their_columns():
    r = _report()
    assert list(r.summary.columns) == SUMMARY_SHORT_COLUMNS  # what a person reads first
    assert list(r.summary_detail.columns) == SUMMARY_COLUMNS  # every figure, one attribute away
    assert len(r.summary.columns) <= 10
    assert r.summary.line.tolist() == r.summary_detail.line.tolist()  # the one number, the same in both
    detail = r.backends_detail.set_index("backend")
    for backend in detail.index:  # each ratio keeps the name of what it measures: excess is the budget's part
        j = r.record(backend).judgement
        assert detail.loc[backend, "line"] == j.line and detail.loc[backend, "excess"] == j.excess
    assert list(r.backends_detail.columns) == BACKEND_COLUMNS
    assert list(r.backends.columns) == COMPACT_COLUMNS  # the glance: verdict, how far over, a few words why
    assert (
        r.backends.why.tolist()[1].startswith(f"{r.backends.line.iloc[1]:.3g}x the line")
        and len(r.backends.why.iloc[1]) < 60
    )
    assert r.backends["backend"].tolist() == ["cpu-nomkldnn", "fault:softmax-row"]
    assert r.suspects == ["fault:softmax-row"] and r.any_suspect


def test_text_lines_follow_the_seed_format():
    lines = str(_report()).splitlines()
    assert len(lines) == 2
    for line in lines:
        assert LINE.match(line), line
    # (a backend bit for bit the oracle's says so, not "0.23 of the line": #62)
    assert re.search(r"round-off \(explainable\), (0\.\d+ of the SUSPECT line|bit for bit identical)$", lines[0]), (
        lines[0]
    )
    rec = _report().record("cpu-nomkldnn")
    assert (rec.judgement.line == 0.0) == (rec.judgement.cause == "identical")
    assert "SUSPECT" in lines[1] and "likely a kernel bug" in lines[1]


def test_elements_are_the_worst_with_values():
    r = _report()
    frame = r.elements("fault:softmax-row", top=5)
    assert list(frame.columns) == ELEMENT_COLUMNS
    o, b, _ref = r.arrays("fault:softmax-row")
    err = np.abs(b.astype(np.float64) - o)
    assert frame["abs_err"].iloc[0] == err.max()
    assert frame["index"].iloc[0] == np.unravel_index(err.argmax(), o.shape)
    assert frame["index"].iloc[0][0] == 0  # the faulty row
    assert frame["reference"].notna().all()


def test_html_repr_marks_suspects():
    html = _report()._repr_html_()
    assert "<table" in html and "fault:softmax-row" in html and "SUSPECT" in html


def test_cpu_only_node_prints_and_returns_false(capsys):
    assert rlx_nb.report_backend_divergence("node", torch.nn.Linear(2, 2), torch.ones(1, 2), backends="cpu") is False
    assert "CPU-only node — nothing to compare" in capsys.readouterr().err


def test_report_backend_divergence_returns_true_on_suspect(capsys):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Softmax(-1))
    assert rlx_nb.report_backend_divergence("s", model, torch.randn(3, 4), backends=["fault:softmax-row"])
    assert "SUSPECT" in capsys.readouterr().err


def test_unknown_backend_or_output_in_report():
    r = _report()
    import pytest

    with pytest.raises(rlx_nb.RlxError, match="no backend 'x'"):
        r.elements("x")
    with pytest.raises(rlx_nb.RlxError, match="no output 'y'"):
        r.elements("cpu-nomkldnn", "y")
    with pytest.raises(rlx_nb.RlxError, match="top must be"):
        r.elements("cpu-nomkldnn", top=0)


def test_element_frame_is_compact_and_refuses_huge_requests():
    r = _report()
    frame = r.element_frame("fault:softmax-row")
    o, b, _ = r.arrays("fault:softmax-row")
    assert len(frame) == o.size
    assert (
        frame["i0"].dtype == np.uint8 and frame["abs_err"].dtype == np.float32 and frame["ulp_err"].dtype == np.uint32
    )
    assert frame["abs_err"].max() == np.float32(np.abs(b.astype(np.float64) - o).max())
    import pytest

    with pytest.raises(rlx_nb.RlxError, match=r"would take about .* GB \(max_bytes=100\)"):
        r.element_frame("fault:softmax-row", max_bytes=100)


def test_a_progress_bar_keeps_its_clock_running_during_one_long_step(monkeypatch):
    # During a 20 s compile the bar stood at "00:00": nothing updated it until the backend finished.
    import io
    import time

    from rlx_nb._support import progress

    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    monkeypatch.setattr(progress, "TICK_S", 0.2)
    monkeypatch.delenv("RLX_NB_PROGRESS", raising=False)
    out = io.StringIO()
    shown = progress.bar("compile", total=1, file=out)
    time.sleep(1.3)
    shown.close()
    frames = out.getvalue().split("\r")
    assert any("00:01" in f for f in frames), frames[-3:]


def test_a_board_makes_a_line_only_when_it_shows_it(monkeypatch, capsys):
    # A generation's early line builds its step table: a call too short to show its lines never makes them.
    from rlx_nb._support import progress

    made: list[str] = []

    def maker(text: str):
        return lambda: made.append(text) or text

    monkeypatch.delenv("RLX_NB_PROGRESS", raising=False)
    progress.Board(enabled=False).add(maker("disabled"))
    monkeypatch.setattr(progress, "DELAY_S", 60.0)
    board = progress.Board()
    board.add(maker("too early"))
    assert made == []
    monkeypatch.setattr(progress, "DELAY_S", -1.0)
    board.add(maker("shown"))
    assert made == ["shown"] and "shown" in capsys.readouterr().err


def test_a_tables_colours_are_inline_so_an_untrusted_notebook_keeps_them():
    # JupyterLab strips <style> blocks from notebooks the user did not run themselves; the verdicts' colours were
    # in one (pandas' Styler).
    import torch

    import rlx_nb

    report = rlx_nb.backend_divergence(torch.nn.Linear(4, 4), torch.randn(3, 4), progress=False,
                                       backends=["cpu-nomkldnn", "fault:linear-bias-channel"])  # fmt: skip
    for html in (report._repr_html_(), report.summary._repr_html_(), report.backends._repr_html_()):
        assert "<style" not in html and "<table" in html
    assert 'style="white-space:nowrap;text-align:right;color:#b00020;font-weight:bold">SUSPECT</td>' in (
        report.backends._repr_html_()
    )


def test_every_short_why_is_a_whole_sentence():
    # A SUSPECT row's few words were cut mid-phrase ("15.3x the line: its largest error").
    import rlx_nb
    from rlx_nb.models import demo

    model, inputs = demo.transformer()
    faults = ["fault:softmax-row", "fault:layernorm-eps", "fault:gelu-approx", "fault:linear-bias-channel"]
    report = rlx_nb.backend_divergence(model, inputs, backends=["cpu-nomkldnn", *faults], progress=False)
    for why in (*report.backends.why, *report.summary.why):
        assert why.endswith((".", "identical")) or why.startswith(("round-off", "error:", "skipped:")), why


def test_a_float_column_no_format_names_shows_four_significant_digits_not_seventeen():
    # #46: notebook 07's first_divergence showed 0.18157668617571687 and 1.0535135361978731e-05.
    from rlx_nb.comparison.tables import Table

    html = Table(
        {"gap_fp64": [0.18157668617571687], "allowance": [1.0535135361978731e-05], "line": [2.5]}
    )._repr_html_()
    assert ">0.1816<" in html and ">1.054e-05<" in html and ">2.5<" in html
    assert "0.18157668617571687" not in html
