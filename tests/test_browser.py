"""End to end in a real JupyterLab, driven by headless Chromium (Debian's; playwright's own download fails here).

Open the walkthrough notebook, run all cells, change the explorer's backend
picker, see the heatmap image change, take a screenshot.  Skips when
chromium, playwright or jupyterlab is missing (``.ci/run`` installs them).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from rlx_nb.distributed import free_local_port

playwright_api = pytest.importorskip("playwright.sync_api")
pytest.importorskip("jupyterlab")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed")]

NOTEBOOK = Path(__file__).parent.parent / "notebooks" / "01_find_the_suspect.ipynb"
TIMEOUT_MS = 120_000


def _wait_http(url: str, deadline: float) -> None:
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except Exception:
            time.sleep(0.5)
    raise TimeoutError(f"JupyterLab did not answer at {url}")


@pytest.fixture
def lab(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    shutil.copy(NOTEBOOK, root / NOTEBOOK.name)
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
    )
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyterlab",
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
    try:
        _wait_http(f"{base}/api/status?token={token}", time.time() + 120)
        yield base, token, tmp_path
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


def test_run_all_change_backend_and_see_the_heatmap_change(lab):
    base, token, tmp_path = lab
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
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch_persistent_context(
            str(tmp_path / "chrome-profile"),
            executable_path=CHROMIUM,
            args=args,
            headless=True,
            viewport={"width": 1600, "height": 1200},
        )
        try:
            page = browser.new_page()
            page.set_default_timeout(TIMEOUT_MS)
            expect = playwright_api.expect
            expect.set_options(timeout=TIMEOUT_MS)
            page.goto(f"{base}/lab/tree/{NOTEBOOK.name}?token={token}")
            # Kernel readiness: idle indicator AND a real kernel name (not "No Kernel").
            expect(page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").first).to_be_visible()
            expect(page.locator(".jp-Toolbar-kernelName").first).to_contain_text("Python")
            page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
            page.locator(".lm-Menu-item:visible", has_text="Run All Cells").first.click()
            accept = page.locator(".jp-Dialog .jp-mod-accept")
            if accept.count():
                accept.first.click()
            # Every code cell finished: no prompt reads [*] or [ ].
            cells = page.locator(".jp-NotebookPanel .jp-CodeCell .jp-InputArea-prompt")
            deadline = time.time() + 300
            while time.time() < deadline:
                prompts = [t.strip() for t in cells.all_inner_texts()]
                if prompts and all(re.fullmatch(r"\[\d+\]:?", t) for t in prompts):
                    break
                time.sleep(1)
            else:
                pytest.fail(f"cells did not all run: {prompts}")
            assert not page.locator(
                ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr'] :text('Traceback')"
            ).count()
            picker = page.locator(".widget-dropdown select").first
            picker.scroll_into_view_if_needed()
            image = page.locator(".widget-output .jp-RenderedImage img").first
            expect(image).to_be_visible()
            before = image.get_attribute("src")
            assert picker.input_value() == "⚠ fault:softmax-row (SUSPECT)"  # suspects first, marked
            picker.select_option(label="cpu-nomkldnn")
            deadline = time.time() + 60
            while time.time() < deadline and image.get_attribute("src") == before:
                time.sleep(0.5)
            assert image.get_attribute("src") != before, "the heatmap did not change with the backend"
            # The inspector follows: it lands on the new backend's worst element.
            expect(page.locator(".widget-html", has_text="backend (cpu-nomkldnn)").first).to_be_visible()
            explorer = page.locator(".widget-vbox").first
            explorer.scroll_into_view_if_needed()
            shot = tmp_path / "explorer.png"
            explorer.screenshot(path=str(shot))
            assert shot.stat().st_size > 10_000
            out_dir = os.environ.get("RLX_NB_SCREENSHOT_DIR")
            if out_dir:
                shutil.copy(shot, Path(out_dir) / "explorer.png")
        finally:
            browser.close()
