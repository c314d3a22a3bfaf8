"""report.to_html: one self-contained file, under 2 MB for the demo, every SUSPECT output's heatmap in it,
readable in a real Chromium with the network cut off."""

from __future__ import annotations

import re
import shutil

import pytest
import torch

import rlx_nb
from rlx_nb.cli import main
from rlx_nb.models import demo

# (one xdist worker for this file: its module-scoped fixtures are built once, not once per worker)
pytestmark = pytest.mark.xdist_group("html-report")


@pytest.fixture(scope="module")
def report():
    model, inputs = demo.transformer()
    return rlx_nb.backend_divergence(
        model, inputs, backends=["cpu-nomkldnn", "fault:softmax-row", "fault:layernorm-eps"], progress=False
    )


def _suspect_outputs(report):
    return [(r.backend, r.output) for r in report.records if r.verdict == "SUSPECT" and r.output is not None]


def test_the_html_holds_every_suspect_heatmap_and_nothing_external(report, tmp_path):
    path = report.to_html(tmp_path / "transformer")
    assert path.name == "transformer.html"
    text = path.read_text()
    assert path.stat().st_size < 2_000_000
    for backend, output in _suspect_outputs(report):
        assert f"alt='heatmap of {backend} {output}'" in text
    assert text.count("src='data:image/png;base64,") >= 2 * len(_suspect_outputs(report))
    assert not re.search(r"<script|src=['\"]https?:|href=['\"]https?:", text)  # no script, no network
    for line in report.lines():
        assert line.split(" — ")[0].replace(">", "&gt;") in text
    assert "torch" in text  # the environment's versions
    environment = text.split("<h2>Environment</h2>")[1]
    for key in ("cpu_simd", "aten_cpu_capability", "settings", "backends"):
        assert f"<th>{key}</th>" in environment  # CPU flags, the global settings, each backend's settings
    assert "float32_matmul_precision" in text and "torch eager with oneDNN and NNPACK disabled" in text
    # Read as a reader takes it in, not raw JSON (#46): a mapping as a small table, a list of flags as one line.
    assert '{"' not in environment and "[&quot;" not in environment and '["' not in environment
    assert "<th>float32_matmul_precision</th><td class='value'>highest</td>" in environment
    summary = text.split("<h2>Summary: one row per backend and output</h2>")[1].split("</table>")[0]
    assert summary.startswith("<div class='wide'>")  # (wider than the page: it scrolls in its box)
    for column in ("line", "ratio_rmse", "cosine", "pcc", "sqnr_db", "nmse"):
        assert re.search(rf"<th[^>]*>{column}</th>", summary)
    cell = r"<td[^>]*>([^<]*)</td>"
    rows = re.findall(rf"<tr>{cell}{cell}{cell}", summary)
    assert len(rows) == len(report.summary)  # under the row cap: every (backend, output)
    assert {(b, o) for b, o, v in rows if v == "SUSPECT"} == set(_suspect_outputs(report))
    assert [v for _, _, v in rows][: len(_suspect_outputs(report))] == ["SUSPECT"] * len(_suspect_outputs(report))
    # Each verdict in its colour, in every table, as the notebook shows it (#46: the page's were uncoloured).
    red, green = "color:#b00020", "color:#1b5e20"
    for verdict, colour in (("SUSPECT", red), ("round-off", green)):
        shown = re.findall(rf'<td style="([^"]*)">{verdict}</td>', text)
        assert shown and all(colour in style for style in shown), (verdict, shown[:3])


def test_cli_check_and_show_write_the_html(report, tmp_path):
    saved = report.save(tmp_path / "r.rlxnb")
    assert main(["show", str(saved), "--html", str(tmp_path / "shown.html")]) == 1  # a SUSPECT: exit 1
    assert "SUSPECT" in (tmp_path / "shown.html").read_text()


def test_a_localization_goes_in_too(tmp_path):
    model, inputs = demo.layered(n_layers=2, fault_layer=1)
    report = rlx_nb.backend_divergence(model, inputs, backends=["fault:softmax-row"], progress=False)
    loc = report.localize()
    text = report.to_html(tmp_path / "loc.html", localization=loc).read_text()
    assert "Localization: fault:softmax-row" in text and "blocks.1.attn" in text and "loc.repro('repro/')" in text


@pytest.mark.slow
def test_it_opens_in_chromium_with_no_network(report, tmp_path):
    playwright_api = pytest.importorskip("playwright.sync_api")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium not installed")
    path = report.to_html(tmp_path / "offline.html")
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"], headless=True)
        try:
            context = browser.new_context(offline=True, java_script_enabled=False)
            page = context.new_page()
            asked = []
            page.on("request", lambda r: asked.append(r.url))
            page.goto(path.as_uri())
            images = page.locator("img")
            assert images.count() >= 2 * len(_suspect_outputs(report))
            for i in range(images.count()):
                width = images.nth(i).evaluate("e => e.naturalWidth")
                assert width > 100, f"image {i} did not load"
            assert page.locator(".suspect").first.is_visible()
            assert all(u.startswith(("file:", "data:")) for u in asked), asked
            # No table makes the page wider than the window (#46: the summary was): a wide one scrolls in its box.
            page.set_viewport_size({"width": 1000, "height": 800})
            assert page.evaluate("document.documentElement.scrollWidth") <= 1000
            if shots := __import__("os").environ.get("RLX_NB_SCREENSHOT_DIR"):
                page.screenshot(path=f"{shots}/html-report.png", full_page=True)
        finally:
            browser.close()


def test_a_suspect_complex_output_gets_its_figures(tmp_path):
    # to_html raised InputError and wrote nothing: the histogram had no real pair to draw.
    class Complex(torch.nn.Module):
        def forward(self, x):
            return torch.complex(x, -x)

    rlx_nb.register_backend("test-complex-fault", lambda m, xs: m(*xs) * (1 + 1e-2j), replace=True)
    try:
        report = rlx_nb.backend_divergence(Complex(), torch.randn(6, 4), backends=["test-complex-fault"])
    finally:
        rlx_nb.unregister_backend("test-complex-fault")
    assert report.suspects == ["test-complex-fault"]
    text = report.to_html(tmp_path / "complex").read_text()
    assert "alt='heatmap of test-complex-fault out'" in text and "alt='histogram of out'" in text
    ax = report.plot.heatmap(metric="abs")
    assert "(real, imag)" in " ".join(a.get_title() for a in ax.figure.axes)  # drawn as its parts, side by side
