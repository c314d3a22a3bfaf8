"""The documentation stays true: links resolve, every fault and every public name is documented."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

import rlx_nb
from rlx_nb.backends.faults import CATALOGUE

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_relative_link_resolves():
    broken = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", doc.read_text()):
            if not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def test_every_catalogue_fault_is_documented():
    text = (ROOT / "docs" / "hardening.md").read_text()
    assert [f for f in CATALOGUE if f"`{f}`" not in text] == []


def test_the_readme_shows_the_two_commands_and_an_install_line():
    text = (ROOT / "README.md").read_text()
    assert "make demo" in text and "make test" in text and "pip install 'rlx_nb[" in text
    for name in ("backend_divergence", "localize", "explore", "merge_reports", "precision_sweep", "register_backend"):
        assert name in text and name in rlx_nb.__all__


def _quickstart_cells() -> list[str]:
    # The README's quickstart code blocks, each one notebook cell as a reader types it.
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Quickstart") : text.index("## What you get")]
    return re.findall(r"```python\n(.*?)```", section, re.S)


@pytest.mark.slow
def test_the_readme_quickstart_runs_cell_by_cell_and_each_cell_shows_what_the_prose_says(tmp_path):
    # As a reader pastes it into a notebook, one block a cell.  It was one block whose mid-cell expressions
    # (``loc.culprit``) never showed; each cell's last line now is what it shows, and the comment there says what.
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    cells = _quickstart_cells()
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nbclient.NotebookClient(nb, timeout=900, kernel_name="python3", store_widget_state=True,
                            resources={"metadata": {"path": str(tmp_path)}}).execute()  # fmt: skip

    def shown(cell) -> dict[str, str]:
        # What the cell shows: its printed text, its displays by type, and its result (the last line's value).
        out: dict[str, str] = {}
        for o in cell.outputs:
            if o.output_type == "stream":
                out["stream"] = out.get("stream", "") + o.text
            for mime, value in o.get("data", {}).items():
                text = value if isinstance(value, str) else json.dumps(value)
                key = "result" if o.output_type == "execute_result" and mime == "text/plain" else mime
                out[key] = out.get(key, "") + text
        return out

    expected = {  # the cell's last line -> what it shows
        "report": lambda o: "<table" in o["text/html"] and "round-off" in o["text/html"],
        "print(report)": lambda o: o["stream"].startswith("[GPT2LMHeadModel]"),
        "report.summary": lambda o: "<table" in o["text/html"] and "cache.layers[0].keys" in o["text/html"],
        "report.plot.heatmap()": lambda o: "image/png" in o,
        "rlx_nb.explore(report)": lambda o: "application/vnd.jupyter.widget-view+json" in o,
        "loc.culprit": lambda o: o["result"] == "'transformer.h.0.ln_1 :: F.layer_norm'",
        "loc.plot()": lambda o: "image/png" in o,
        'report.issue("my-runtime", "repro/")': lambda o: (
            o["text/markdown"].startswith("# my-runtime: `F.layer_norm` in `transformer.h.0.ln_1` diverges")
            and "reproduces" in o["stream"]
        ),
    }
    seen = []
    for code, cell in zip(cells, nb.cells, strict=True):
        last = code.strip().splitlines()[-1]
        statement, _, comment = last.partition("#")
        statement = statement.strip()
        out = shown(cell)
        assert "error" not in {o.output_type for o in cell.outputs}, code
        # (#62: building the GPT-2 imported torchao, whose "Failed to load <.so>" and torch's warnings showed here)
        assert not re.search(r"Failed to load|register_constant", out.get("stream", "")), out.get("stream", "")[:300]
        assert not out.get("result", "").startswith("<Axes"), (statement, out)  # (a raw line above the figure)
        assert statement in expected, f"a README cell ends in {statement!r}: say in this test what it shows"
        assert expected[statement](out), (statement, {k: v[:300] for k, v in out.items()})
        if comment.strip().startswith("'"):  # the comment quotes what the cell shows: it is that
            assert out["result"] == comment.strip()
        seen.append(statement)
    assert seen.count("report") == 2  # (the default backends, then the faulty runtime's)
    html = [shown(c)["text/html"] for c, code in zip(nb.cells, cells, strict=True) if code.strip().endswith("position")]
    assert "SUSPECT" in html[0] and re.search(r"\d+% of its error sits on \[:, :, 3\]", html[0])
    # A figure a comment gives is the one the cell shows (#46: the README said 100% where the table said 92%; the
    # share depends on the random weights, so the comment gives none).
    for code in cells:
        for figure in re.findall(r"\d+(?:\.\d+)?%", code.strip().splitlines()[-1].partition("#")[2]):
            assert all(
                figure in shown(c).get("text/html", "") for c, k in zip(nb.cells, cells, strict=True) if k == code
            )


def _readme_block_run(marker: str, shows: str, tmp_path, timeout: int = 900) -> str:
    # The README's one python block holding ``marker``, run as written in a fresh interpreter, then ``shows``
    # (a line printing what the test checks); returns its printed text.
    import subprocess
    import sys

    blocks = [b for b in re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S) if marker in b]
    assert len(blocks) == 1
    done = subprocess.run([sys.executable, "-c", blocks[0] + shows], cwd=tmp_path, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, MPLBACKEND="Agg", RLX_NB_PROGRESS="0"))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_readme_training_block_runs_as_written(tmp_path):
    out = _readme_block_run("training_divergence", "\nprint('VERDICTS', sorted(set(report.local.verdict)), "
                            "report.failed)\n", tmp_path)  # fmt: skip
    assert "[Sequential] cpu-inductor vs cpu over 50 step(s): round-off" in out, out
    assert "VERDICTS ['round-off'] {}" in out  # (every default training backend, every local step)


def test_the_readme_invariance_block_runs_as_written(tmp_path):
    out = _readme_block_run("rlx_nb.invariance(", "\nprint('FIRST', sorted(set(inv.summary.first_op)), "
                            "inv.verdict())\n", tmp_path, timeout=600)  # fmt: skip
    assert "FIRST ['0 :: F.linear'] round-off" in out, out


def test_the_readme_generation_block_runs_as_written(tmp_path):
    out = _readme_block_run("generation_divergence", "\nprint('VERDICTS', sorted(set(gen.verdicts().values())))\n",
                            tmp_path)  # fmt: skip
    assert "GPT2LMHeadModel] cpu-inductor vs cpu:" in out
    assert "VERDICTS ['round-off']" in out  # (ONNX Runtime and OpenVINO decode their exported step)
