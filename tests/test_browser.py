"""End to end in a real JupyterLab, driven by headless Chromium (Debian's; playwright's own download fails here).

Every walkthrough notebook, as executed by the suite (the ``executed_notebook`` fixture, shared with
``test_notebooks``), is opened in Lab; every figure it shows is screenshotted and must not be blank (pixel
variance) nor cut off (its box inside the output area).  A notebook of a report and its explorer is run with
"Run All" in Lab and the explorer driven like a person would — backend, metric, element — each interaction's time
kept beside the screenshots (``bench/explorer_speed.py`` measures the 1 s target; a timed test fails on a loaded machine); a notebook under ``%matplotlib widget`` checks the live canvas fits its box.  Skips when
chromium, playwright or jupyterlab is missing (``.ci/run`` installs them).  ``RLX_NB_SCREENSHOT_DIR``
keeps the screenshots.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import nbformat
import numpy as np
import pytest

from rlx_nb.distributed import free_local_port
from tests.conftest import NO_IRI_CHECKER, per_notebook
from tests.pixels import near

playwright_api = pytest.importorskip("playwright.sync_api")
pytest.importorskip("jupyterlab")
PIL = pytest.importorskip("PIL.Image")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed")]

NOTEBOOKS = sorted(
    (Path(__file__).parent.parent / "notebooks").glob("[0-9][0-9]_*.ipynb")
)  # (every walkthrough, 10 and on too)
TIMEOUT_MS = 120_000
INTERACTIVE = "interactive_explorer.ipynb"


def _wait_http(url: str, deadline: float) -> None:
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except Exception:
            time.sleep(0.5)
    raise TimeoutError(f"JupyterLab did not answer at {url}")


def _write_notebook(path: Path, cells: list[str]) -> None:
    # A notebook of these code cells, for the Python 3 kernel Lab starts for it.
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    nbformat.write(nb, path)


def _interactive_notebook(path: Path) -> None:
    _write_notebook(path, [
        "%matplotlib widget",
        "import rlx_nb\nfrom rlx_nb.models import demo\nmodel, inputs = demo.mlp()\n"
        'report = rlx_nb.backend_divergence(model, inputs, backends=["cpu-nomkldnn", "fault:gelu-approx"])\n'
        "rlx_nb.explore(report)",
    ])  # fmt: skip


STEPS = "explorer_steps.ipynb"
"""Notebook 01's report (the demo transformer, a legitimate backend and the softmax fault) and its explorer, alone:
run with "Run All" in Lab and driven a step at a time.  (It was notebook 01 itself, whose other cells added half a
minute to the suite and nothing to the steps; the walkthrough's executed copy is opened in Lab below.)"""


def _steps_notebook(path: Path) -> None:
    _write_notebook(path, [
        "import rlx_nb\nfrom rlx_nb.models import demo\nmodel, inputs = demo.transformer()\n"
        'report = rlx_nb.backend_divergence(model, inputs, backends=["cpu-nomkldnn", "fault:softmax-row"])\n'
        "report",
        "rlx_nb.explore(report)",
    ])  # fmt: skip


CALM = "no_suspect.ipynb"
"""A report where every backend is legitimate: red must appear nowhere, and the explorer opens on the worst."""


def _calm_notebook(path: Path) -> None:
    code = [
        "import pathlib, tempfile\nimport rlx_nb\nfrom rlx_nb.models import demo\nfrom rlx_nb.plot.charts import plot_effective_bits\n"
        "model, inputs = demo.mlp()\n"
        'backends = [b for b in ["cpu-nomkldnn", "onnxruntime", "openvino", "cpu-tf32-emulated", "cpu-bf16"]\n'
        "            if b in rlx_nb.available_backends(include_optin=True)]\n"
        'report = rlx_nb.backend_divergence(model, inputs, backends=backends, label="calm")\n'
        "worst = max(report.records, key=lambda r: (r.verdict == 'SUSPECT', r.judgement.line))\n"
        'print("SUSPECTS", len(report.suspects))\n'
        'print("WORST", worst.backend, "|", worst.output, "|", worst.pair.worst_index)',
        '<!-- tolerance -->\nreport.plot.tolerance_curve("out");',
        # (against its own saved copy: a run again on this machine gives the same bits, and took 10 s)
        "<!-- baseline -->\nout = pathlib.Path(tempfile.mkdtemp())\n"
        'moved = rlx_nb.compare_reports(report.save(out / "before.rlxnb"), report)\n'
        "moved.plot();",
        "<!-- sweep -->\nsweep = rlx_nb.precision_sweep(model, inputs)\n"
        "legit = sweep[sweep.verdict != 'SUSPECT']  # (a setting that claims fp32 and is not may be red)\n"
        "plot_effective_bits(dict(zip(legit.setting, legit.effective_bits)), "
        "verdicts=dict(zip(legit.setting, legit.verdict)));",
        "rlx_nb.explore(report)",
    ]
    _write_notebook(path, [c.replace("<!-- ", "# ").replace(" -->", "") for c in code])


@pytest.fixture(scope="session")
def lab(tmp_path_factory):
    # One Lab and one browser per worker: module-scoped, they were started again each time a worker came back to
    # this module from another test group (4 s a time, 8 times a suite).
    tmp_path = tmp_path_factory.mktemp("lab")
    root = tmp_path / "root"
    (root / "notebooks").mkdir(parents=True)
    (root / "executed").mkdir()
    for nb in NOTEBOOKS:
        shutil.copy(nb, root / "notebooks" / nb.name)
    bench = Path(__file__).parent.parent / "bench" / "results"
    shutil.copytree(bench, root / "bench" / "results")  # notebook 03 reads the detection benchmark's results
    _interactive_notebook(root / "notebooks" / INTERACTIVE)
    _steps_notebook(root / "notebooks" / STEPS)
    _calm_notebook(root / "notebooks" / CALM)
    settings = tmp_path / "settings"
    (settings / "@jupyterlab" / "apputils-extension").mkdir(parents=True)
    (settings / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false"})
    )
    # Render every cell (Lab 4 virtualises off-screen cells, leaving their prompts empty).
    (settings / "@jupyterlab" / "notebook-extension").mkdir(parents=True)
    (settings / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings").write_text(
        json.dumps({"windowingMode": "none"})
    )
    port, token = free_local_port(), secrets.token_hex(16)
    env = dict(
        os.environ,
        JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
        JUPYTERLAB_SETTINGS_DIR=str(settings),
        JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "workspaces"),
        JUPYTER_CONFIG_DIR=str(tmp_path / "config"),
        RLX_NB_PROGRESS="0",
    )
    server = subprocess.Popen(
        [
            sys.executable,
            "-c",  # (`python -m jupyterlab`, without the iri checker's 3 s import: tests/conftest.py NO_IRI_CHECKER)
            f"import sys; sys.modules[{NO_IRI_CHECKER!r}] = None; from jupyterlab.labapp import main; sys.exit(main())",
            "--no-browser",
            "--ip=127.0.0.1",
            f"--port={port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={token}",
            "--allow-root",
            f"--ServerApp.root_dir={root}",
            "--LabApp.news_url=None",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "lab.log", "w"),
    )
    base = f"http://127.0.0.1:{port}"
    args = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
    ]
    try:
        _wait_http(f"{base}/api/status?token={token}", time.time() + 120)
        with playwright_api.sync_playwright() as p:
            browser = p.chromium.launch_persistent_context(
                str(tmp_path / "chrome-profile"),
                executable_path=CHROMIUM,
                args=args,
                headless=True,
                viewport={"width": 1400, "height": 1000},
            )
            try:
                yield browser, base, token, root
            finally:
                browser.close()
    finally:
        try:
            req = urllib.request.Request(f"{base}/api/shutdown?token={token}", method="POST")
            urllib.request.urlopen(req, timeout=10)
        except Exception:
            pass
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


def _url(base: str, token: str, path: str) -> str:
    # A workspace of its own per page: Lab would otherwise reopen every notebook an earlier page opened.
    return f"{base}/lab/workspaces/w{secrets.token_hex(4)}/tree/{path}?token={token}&reset"


def _close(page, base: str, token: str) -> None:
    # Close the page and shut its kernel down, so the next notebook has both cores.
    page.close()
    _shut_kernels(base, token)


def _shut_kernels(base: str, token: str) -> None:
    with urllib.request.urlopen(f"{base}/api/kernels?token={token}", timeout=10) as answer:
        kernels = json.load(answer)
    for kernel in kernels:
        req = urllib.request.Request(f"{base}/api/kernels/{kernel['id']}?token={token}", method="DELETE")
        urllib.request.urlopen(req, timeout=30)


def _menu(page, menu: str, item: str) -> None:
    page.locator(".lm-MenuBar-itemLabel", has_text=menu).first.click()
    page.locator(".lm-Menu-item:visible", has_text=item).first.click()


_KEPT: dict[str, object] = {}
"""The worker's Lab page that opened the last notebook, kept open for the next (:func:`_notebook_page`)."""


@contextlib.contextmanager
def _notebook_page(lab, path: str):
    """A Lab page showing the notebook at ``path`` (under Lab's root), nothing else open.

    Lab's shell is loaded once and kept: each later notebook opens in it from the File menu ("Open from Path"), as a
    reader opens a second notebook, after the one before was closed and its kernel shut down (a fresh page loaded
    the shell again: 6-8 s a page, 3 s in the kept one).  A page whose test failed is closed, not kept, so a later
    test starts from a fresh one."""
    browser, base, token, _ = lab
    page = _KEPT.pop("page", None)
    if page is not None:
        try:
            _menu(page, "File", "Open from Path")
            box = page.locator(".jp-Dialog input").first
            box.fill(path)
            box.press("Enter")
        except Exception:
            page.close()
            page = None
    if page is None:
        page = browser.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        page.goto(_url(base, token, path))
    try:
        playwright_api.expect(page.locator(".lm-TabBar-tab.jp-mod-current").first).to_contain_text(Path(path).name)
        yield page
    except BaseException:
        _close(page, base, token)
        raise
    try:  # (every tab closed: the checks read the whole page, which must hold the next notebook alone)
        _menu(page, "File", "Close All Tabs")
        playwright_api.expect(page.locator(".jp-NotebookPanel")).to_have_count(0, timeout=30_000)
    except Exception:
        _close(page, base, token)
        return
    _shut_kernels(base, token)
    _KEPT["page"] = page


def _open_and_run_all(browser, base: str, token: str, name: str):
    page = browser.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    playwright_api.expect.set_options(timeout=TIMEOUT_MS)
    expect = playwright_api.expect
    page.goto(_url(base, token, f"notebooks/{name}"))
    # Kernel readiness: idle indicator AND a real kernel name (not "No Kernel").
    expect(page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").first).to_be_visible()
    expect(page.locator(".jp-Toolbar-kernelName").first).to_contain_text("Python")
    cells = page.locator(".jp-NotebookPanel .jp-CodeCell .jp-InputArea-prompt")
    for _attempt in range(3):  # a click that lands while Lab still settles does nothing: click again
        page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
        page.locator(".lm-Menu-item:visible", has_text="Run All Cells").first.click()
        accept = page.locator(".jp-Dialog .jp-mod-accept")
        if accept.count():
            accept.first.click()
        started = time.time() + 20
        while time.time() < started and all(t.strip() in ("[ ]:", "[ ]", "") for t in cells.all_inner_texts()):
            time.sleep(0.5)
        if not all(t.strip() in ("[ ]:", "[ ]", "") for t in cells.all_inner_texts()):
            break
    deadline = time.time() + 400
    prompts: list[str] = []
    errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']", has_text="Error")
    while time.time() < deadline:
        prompts = [t.strip() for t in cells.all_inner_texts()]
        if prompts and all(re.fullmatch(r"\[\d+\]:?", t) for t in prompts):
            break
        assert not errors.count(), f"{name}: {errors.first.inner_text()[:800]}"  # Run All stops at an error
        time.sleep(1)
    else:
        pytest.fail(f"{name}: cells did not all run: {prompts}")
    assert not errors.count(), f"{name}: {errors.first.inner_text()[:800]}"
    return page


def _pixels(png: bytes) -> np.ndarray:
    return np.asarray(PIL.open(io.BytesIO(png)).convert("L"), dtype=np.float64)


def _keep(shot: bytes | Callable[[], bytes], name: str) -> None:
    # ``shot``: the bytes, or what takes them (a screenshot only kept is taken only when it is kept: a full-page one
    # of a long notebook costs Chromium a second or more).
    out_dir = os.environ.get("RLX_NB_SCREENSHOT_DIR")
    if out_dir:
        Path(out_dir, name).write_bytes(shot() if callable(shot) else shot)


def _settle(images) -> None:
    # Lab re-renders outputs while it restores widget state: wait until the figures stop changing.
    # (Polled every 0.25 s, settled once unchanged for a second: a one-second poll made every page wait 3 s.)
    last, stable, deadline = -1, 0, time.time() + 60
    while stable < 4 and time.time() < deadline:
        time.sleep(0.25)
        n = images.count()
        stable, last = (stable + 1, n) if n == last else (0, n)


FIGURES = """images => images.map(e => {
    const area = e.closest('.jp-OutputArea-output, .widget-output');
    const b = e.getBoundingClientRect(), o = area.getBoundingClientRect(), style = getComputedStyle(e);
    const shown = b.width > 0 && b.height > 0 && style.visibility !== 'hidden' && e.offsetParent !== null;
    return {x: b.x, width: b.width, ox: o.x, owidth: o.width, natural: e.naturalWidth, complete: e.complete,
            shown: shown, src: e.src.startsWith('data:') ? e.src : ''};
})"""


def _check_figures(page, notebook: str) -> int:
    # Every figure on screen: loaded, drawn (not blank: the very PNG Lab shows, decoded), whole (inside its output
    # area).  One pass over the page's images (a screenshot of each cost a second a figure); the figures are kept
    # with RLX_NB_SCREENSHOT_DIR.
    images = page.locator(".jp-OutputArea-output img, .widget-output img")
    _settle(images)
    count = 0
    for i, g in enumerate(images.evaluate_all(FIGURES)):
        if not g["shown"]:  # a widget view the notebook keeps folded (an unopened tab), not on screen
            continue
        count += 1
        assert g["complete"] and g["natural"] > 0, f"{notebook} figure {i} did not load"
        assert g["x"] >= g["ox"] - 1 and g["x"] + g["width"] <= g["ox"] + g["owidth"] + 1, (
            f"{notebook} figure {i} is cut off at the side: { {k: v for k, v in g.items() if k != 'src'} }"
        )
        # (drawn at its own size, or as wide as its cell: a figure shrunk to half the cell drew 6-pixel legends)
        assert g["width"] >= 0.95 * min(g["natural"], g["owidth"]), (
            f"{notebook} figure {i} is shrunk: { {k: v for k, v in g.items() if k != 'src'} }"
        )
        png = base64.b64decode(g["src"].partition(",")[2]) if g["src"] else images.nth(i).screenshot()
        pixels = _pixels(png)
        assert pixels.std() > 8, f"{notebook} figure {i} is blank (pixel spread {pixels.std():.1f})"
        _keep(png, f"{notebook.removesuffix('.ipynb')}-figure{i}.png")
    return count


OVERFLOWING = """() => {
    // Tables wider than their cell and not in a box that scrolls; toggle buttons whose words are cut.
    const out = [];
    for (const t of document.querySelectorAll('.jp-OutputArea-output table')) {
        if (!t.offsetParent) continue;
        const area = t.closest('.jp-OutputArea-output').getBoundingClientRect();
        let box = t.parentElement, scrolls = false;
        while (box) {
            const o = getComputedStyle(box).overflowX;
            if ((o === 'auto' || o === 'scroll') && box.getBoundingClientRect().right <= area.right + 1) {
                scrolls = true; break;
            }
            if (box.classList.contains('jp-OutputArea-output')) break;
            box = box.parentElement;
        }
        if (!scrolls && t.getBoundingClientRect().right > area.right + 1) out.push('table: ' + t.innerText.slice(0, 60));
    }
    for (const b of document.querySelectorAll('.widget-toggle-button')) {
        if (b.offsetParent && b.scrollWidth > b.clientWidth + 1) out.push('toggle: ' + b.innerText);
    }
    return out;
}"""


def _check_layout(page, notebook: str) -> None:
    # What a reader would see cut: a table running past its cell, a toggle's words cut (#62: the worst-elements
    # table was wider than the cell, the diff explorer's toggle truncated).
    cut = page.evaluate(OVERFLOWING)
    assert cut == [], f"{notebook}: {cut}"


def _shows_widgets(path: Path) -> bool:
    # A notebook whose outputs Lab lays out itself (an explorer: widgets, a snapshot's HTML), beyond plain figures.
    cells = nbformat.read(path, as_version=4).cells
    return any(c.cell_type == "code" and re.search(r"\bexplore\(", c.source) for c in cells)


@pytest.mark.parametrize("notebook", per_notebook([nb for nb in NOTEBOOKS if _shows_widgets(nb)], ids=False))
def test_every_notebook_shows_every_figure_whole(lab, executed_notebook, notebook):
    # The notebooks with an explorer, as this tree executes them (those with plain figures only: their PNGs are
    # checked in tests/test_notebooks.py, and their committed copies below, in Lab).
    root = lab[3]
    shutil.copy(executed_notebook(Path(__file__).parent.parent / "notebooks" / notebook), root / "executed" / notebook)
    with _notebook_page(lab, f"executed/{notebook}") as page:
        playwright_api.expect(page.locator(".jp-OutputArea-output img").first).to_be_visible(timeout=TIMEOUT_MS)
        assert _check_figures(page, notebook) >= 1
        _check_layout(page, notebook)
        assert not page.locator(".jp-OutputArea-output", has_text=re.compile(r"^<Axes: ")).count()  # no stray reprs
        # Every explorer picker shows its choice whole (#46: the module picker cut long module names).
        for select in page.locator(".rlx-explorer .widget-dropdown select").all():
            if select.is_visible():
                shown = select.evaluate(WHOLE_OPTION)
                assert shown["needed"] + 16 <= shown["width"], f"{notebook}: a picker cuts its choice: {shown}"


def _until_changed(get, before: str, what: str) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < 120:  # (how long it took is kept, never asserted: a loaded machine)
        if get() != before:
            return time.perf_counter() - start
        time.sleep(0.02)
    pytest.fail(f"{what}: the picture did not change")


def test_the_explorer_follows_every_interaction(lab):
    # What each interaction took is kept beside the screenshots, never asserted: a timed test fails on a loaded
    # machine, not on slow code; bench/explorer_speed.py measures the target (1 s).
    browser, base, token, _ = lab
    page = _open_and_run_all(browser, base, token, STEPS)  # a real "Run All" in Lab
    try:
        assert _check_figures(page, "explorer_steps_run_all_in_lab.ipynb") >= 2  # the live explorer's figures
        explorer = page.locator(".rlx-explorer").last
        explorer.scroll_into_view_if_needed()
        heatmap = explorer.locator(".widget-output .jp-RenderedImage img").first
        histogram = explorer.locator(".widget-output .jp-RenderedImage img").nth(1)
        picker = explorer.locator(".widget-dropdown select").first
        assert picker.input_value() == "⚠ fault:softmax-row (SUSPECT)"  # suspects first, marked
        assert _pixels(heatmap.screenshot()).std() > 8  # opens on a view that shows the error
        steps = [
            ("backend", lambda: picker.select_option(label="cpu-nomkldnn")),
            ("metric", lambda: explorer.locator(".widget-toggle-button", has_text="abs").first.click()),
            ("element", lambda: explorer.locator(".widget-select select").first.select_option(index=3)),
            (
                "index",
                lambda: (explorer.locator(".widget-text input").first.fill("1, 2, 3"), page.keyboard.press("Enter")),
            ),
        ]
        times: dict[str, float] = {}
        for step, act in steps:
            before, hist_before = heatmap.get_attribute("src"), histogram.get_attribute("src")
            start = time.perf_counter()
            act()
            _until_changed(lambda h=heatmap: h.get_attribute("src"), before, step)
            if step in ("backend", "metric"):  # the histogram follows the backend and the metric
                _until_changed(lambda h=histogram: h.get_attribute("src"), hist_before, f"{step}: the histogram")
            took = time.perf_counter() - start
            times[step] = round(took, 3)
            _keep(explorer.screenshot, f"explorer-after-{step}.png")
            assert _pixels(heatmap.screenshot()).std() > 8, f"after {step}: the heatmap is blank"
        _keep(json.dumps(times).encode(), "explorer-times.json")
        print(f"explorer update times (s): {times}")
        expect = playwright_api.expect
        expect(page.locator(".widget-html", has_text="(1, 2, 3)").first).to_be_visible()
        # With the file browser open the notebook is narrower: the worst-elements table scrolls in its box, no
        # column cut off at the explorer's edge (#46).
        page.locator(".jp-SideBar .lm-TabBar-tab[data-id='filebrowser']").first.click()
        time.sleep(1)
        table = explorer.locator("table.rlx-elements").last
        table.scroll_into_view_if_needed()
        holder = table.evaluate(SCROLLS)
        _keep(explorer.screenshot, "explorer-with-the-file-browser.png")
        assert holder["right"] <= holder["outer_right"] + 1, f"the worst-elements table is cut off: {holder}"
        assert holder["width"] >= holder["needed"] or holder["overflow"] in ("auto", "scroll"), holder
    finally:
        _close(page, base, token)


SCROLLS = """e => {
    const box = e.closest('.widget-html'), outer = e.closest('.rlx-explorer');
    const b = box.getBoundingClientRect(), o = outer.getBoundingClientRect();
    return {right: b.right, outer_right: o.right, width: box.clientWidth, needed: box.scrollWidth,
            overflow: getComputedStyle(box).overflowX};
}"""

WHOLE_OPTION = """e => {
    const c = document.createElement('canvas').getContext('2d');
    c.font = getComputedStyle(e).font;
    return {text: e.options[e.selectedIndex].text, needed: c.measureText(e.options[e.selectedIndex].text).width,
            width: e.clientWidth};
}"""


def test_the_live_canvas_fits_its_box(lab):
    browser, base, token, _ = lab
    page = _open_and_run_all(browser, base, token, INTERACTIVE)
    try:
        canvas = page.locator(".jupyter-matplotlib-canvas-div canvas").first
        canvas.scroll_into_view_if_needed()
        box = canvas.bounding_box()
        for holder in (".rlx-heatmap", ".rlx-explorer", ".jp-OutputArea-output"):
            outer = page.locator(holder).last.bounding_box()
            assert outer["x"] - 1 <= box["x"] and box["x"] + box["width"] <= outer["x"] + outer["width"] + 1, (
                f"the live heatmap is cut off by {holder}: {box} in {outer}"
            )
        # ipympl draws the canvas after the cell has run (a message round trip more): under load the first frame
        # can still be blank, so wait for it (a minute at most) rather than read one frame.
        deadline, spread = time.time() + 60, 0.0
        while time.time() < deadline and (spread := _pixels(canvas.screenshot()).std()) <= 8:
            time.sleep(0.5)
        assert spread > 8, f"the live heatmap stayed blank (pixel spread {spread:.1f})"
        _keep(page.locator(".rlx-explorer").last.screenshot, "explorer-live.png")
    finally:
        _close(page, base, token)


RAW_WIDGET = re.compile(r"(Explorer|HBox|VBox|Tab|Output)\(children=|layout=Layout\(")


def _red_pixels(png: bytes) -> int:
    # Strong reds only (SUSPECT's #b00020, matplotlib's tab:red, crimson); a line's anti-aliased edge is pink.
    rgb = np.asarray(PIL.open(io.BytesIO(png)).convert("RGB")).astype(int)
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    return int(((r > 150) & (g < 70) & (b < 80) & (r - g > 100)).sum())


def _top_of_scale(pixels: np.ndarray) -> np.ndarray:
    # Pixels in the top quarter of a heatmap's colour scale (past 10x the line on the SUSPECT-line scale's
    # coolwarm; magma's brightest for plain errors), whichever map draws it: within 30 of one of its colours.
    import matplotlib

    tops = [
        np.array(matplotlib.colormaps[c](t)[:3]) * 255 for c in ("coolwarm", "magma") for t in np.linspace(0.75, 1, 11)
    ]
    return np.any([near(pixels, t, tol=30) for t in tops], axis=0)


HEADLINE = "01_find_the_suspect.ipynb"


@pytest.mark.parametrize("notebook", [nb.name for nb in NOTEBOOKS])
def test_committed_notebooks_show_pictures_without_running(lab, notebook):
    # Opened as committed, nothing run: every explorer shows its static snapshot, never a raw widget repr,
    # and every figure is drawn.  (GitHub and nbviewer readers see the same outputs.)  Notebook 01's headline
    # heatmap shows its bad row as a band (:func:`_headline_band`).
    with _notebook_page(lab, f"notebooks/{notebook}") as page:
        playwright_api.expect(page.locator(".jp-OutputArea-output img").first).to_be_visible(timeout=TIMEOUT_MS)
        assert _check_figures(page, f"committed-{notebook}") >= 1
        _check_layout(page, f"committed-{notebook}")
        # (what Lab shows for a widget whose kernel is gone takes a moment to replace the bundle: read once the
        # figures have settled, seconds after the page opened)
        texts = page.locator(".jp-OutputArea-output").all_inner_texts()
        raw = [t[:120] for t in texts if RAW_WIDGET.search(t)]
        assert not raw, f"{notebook}: raw widget reprs where a picture belongs: {raw}"
        cells = nbformat.read(Path(__file__).parent.parent / "notebooks" / notebook, as_version=4).cells
        if any(c.cell_type == "code" and re.search(r"\bexplore\(", c.source) for c in cells):
            snapshots = page.locator(".rlx-snapshot img")
            assert snapshots.count() >= 1, f"{notebook}: an explorer without its static snapshot"
            shot = snapshots.first.screenshot()
            assert _pixels(shot).std() > 8
            _keep(shot, f"committed-{notebook.removesuffix('.ipynb')}-snapshot.png")
            # Its worst-elements table whole: no index or number wrapped onto two lines (#46).
            for table in page.locator(".rlx-snapshot table.rlx-elements").all():
                rows = table.evaluate("t => [...t.rows].map(r => r.getBoundingClientRect().height)")
                assert max(rows) <= 1.6 * min(rows), f"{notebook}: a snapshot row wraps: {rows}"
        if any(c.cell_type == "code" and "localization=" in c.source and "explore(" in c.source for c in cells):
            shown = page.locator(".rlx-snapshot", has_text="Localization on").first  # (#46: 02's had none)
            assert shown.count() and shown.locator("img").count() >= 3, f"{notebook}: no localization view"
            _keep(shown.screenshot, f"committed-{notebook.removesuffix('.ipynb')}-localization-snapshot.png")
        # Opened as committed, nothing changed: not marked modified (#46: the kernelspec's name made it so, once the
        # kernel Lab starts for it had connected).
        playwright_api.expect(page.locator(".jp-Toolbar-kernelName").first).to_contain_text("Python")
        playwright_api.expect(page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").first).to_be_visible()
        tab = page.locator(".lm-TabBar-tab.jp-mod-current").first
        assert "jp-mod-dirty" not in (tab.get_attribute("class") or ""), f"{notebook} opens marked modified"
        _keep(lambda: page.screenshot(full_page=True), f"committed-{notebook.removesuffix('.ipynb')}.png")
        if notebook == HEADLINE:  # (on this page: another page of it took 10 s of the suite)
            _headline_band(page)


def _headline_band(page) -> None:
    # Notebook 01's first heatmap of the suspect (its softmax is off on one row): the row is a band of the
    # colour scale's top, several pixels tall, not a one-pixel line under the map's edge.
    cell = page.locator(".jp-CodeCell", has_text="ax = report.plot.heatmap(suspect, rec.output").first
    img = cell.locator(".jp-OutputArea-output img").first
    playwright_api.expect(img).to_be_visible(timeout=TIMEOUT_MS)
    img.scroll_into_view_if_needed()
    shot = img.screenshot()
    _keep(shot, "headline-heatmap.png")
    pixels = np.asarray(PIL.open(io.BytesIO(shot)).convert("RGB")).astype(float)
    hot = _top_of_scale(pixels)
    rows = np.flatnonzero(hot.mean(axis=1) >= 0.3)  # pixel rows mostly at the top of the scale
    assert rows.size >= 3, f"the bad row is {rows.size} pixel row(s) tall"
    assert rows.size < 0.25 * pixels.shape[0]  # a band, distinct from the rest, not the whole map


def test_a_report_without_suspects_shows_no_red_and_opens_on_its_worst(lab):
    browser, base, token, _ = lab
    page = _open_and_run_all(browser, base, token, CALM)
    try:
        first = page.locator(".jp-CodeCell").first.locator(".jp-OutputArea-output").all_inner_texts()
        text = "\n".join(first)
        assert "SUSPECTS 0" in text, text[-600:]
        backend, output, index = next(ln for ln in text.splitlines() if ln.startswith("WORST"))[6:].split(" | ")
        wrong = []  # every way the picture contradicts the report, collected, then asserted together
        for tag in ("# tolerance", "# baseline", "# sweep"):
            img = page.locator(".jp-CodeCell", has_text=tag).first.locator(".jp-OutputArea-output img").first
            img.scroll_into_view_if_needed()
            shot = img.screenshot()
            _keep(shot, f"calm-{tag[2:]}.png")
            assert _pixels(shot).std() > 8, tag
            if _red_pixels(shot) >= 20:
                wrong.append(f"{tag}: red on a figure without a SUSPECT ({_red_pixels(shot)} pixels)")
        explorer = page.locator(".rlx-explorer").last
        explorer.scroll_into_view_if_needed()
        _keep(explorer.screenshot, "calm-explorer.png")
        # A live explorer is shown once: its static snapshot (for readers without a kernel) hides beside it.
        snapshot = page.locator(".rlx-snapshot")
        assert snapshot.count() == 1 and not snapshot.first.is_visible() and explorer.is_visible()
        picker = explorer.locator(".widget-dropdown select")
        if backend not in picker.first.input_value():
            wrong.append(f"the explorer opens on {picker.first.input_value()!r}, not the worst backend {backend!r}")
        elif output not in picker.nth(1).input_value():
            wrong.append(f"the explorer opens on output {picker.nth(1).input_value()!r}, not the worst {output!r}")
        worst_list = explorer.locator(".widget-select select").first.locator("option").all_inner_texts()
        zeros = [o for o in worst_list if "abs=0.00e+00" in o]
        if zeros and len(zeros) < len(worst_list):
            wrong.append(f"zero-error elements in the worst list beside non-zero ones: {zeros[:3]}")
        inspector = explorer.locator(".widget-html", has_text="fp64").last.inner_text()
        if index not in inspector:
            wrong.append(f"the inspector does not show the worst element {index}: {inspector[:200]!r}")
        assert not wrong, "\n".join(wrong)
    finally:
        _close(page, base, token)
