"""The ``rlx-nb`` command, run as a subprocess exactly as CI gates would."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

TARGET = textwrap.dedent(
    """
    import torch
    import rlx_nb

    def good():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Softmax(-1)), torch.randn(4, 8)

    def broken_backend(model, inputs):
        raise RuntimeError("unsupported op")

    rlx_nb.register_backend("target-broken", broken_backend)
    """
)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlx_nb.cli", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture
def target(tmp_path):
    path = tmp_path / "my_models.py"
    path.write_text(TARGET)
    return f"{path}:good"


def test_check_roundoff_exits_0(target):
    p = _cli("check", target, "--backends", "cpu-nomkldnn", "--label", "L")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("[L] cpu-nomkldnn vs cpu: max_abs=")
    assert "round-off (explainable)" in p.stdout


def test_check_suspect_exits_1(target):
    p = _cli("check", target, "--backends", "cpu-nomkldnn,fault:softmax-row")
    assert p.returncode == 1, p.stderr
    assert "fault:softmax-row vs cpu" in p.stdout and "SUSPECT" in p.stdout


def test_backend_registered_by_target_failing_exits_3(target):
    p = _cli("check", target, "--backends", "cpu-nomkldnn,target-broken")
    assert p.returncode == 3, p.stderr
    assert "target-broken vs cpu: ERROR — RuntimeError: unsupported op" in p.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["check", "no_such_file.py:build"], "does not exist"),
        (["check", "json:loads_nothing"], "has no callable 'loads_nothing'"),
        (["check", "missing_colon"], "must be 'path/to/file.py:factory'"),
    ],
)
def test_bad_targets_exit_2_with_one_line(args, message):
    p = _cli(*args)
    assert p.returncode == 2
    assert message in p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_unknown_backend_exits_2(target):
    p = _cli("check", target, "--backends", "warp-drive")
    assert p.returncode == 2
    assert "unknown backend 'warp-drive'; live here: cpu" in p.stderr


def test_backends_lists_live_and_absent():
    p = _cli("backends")
    assert p.returncode == 0
    lines = {line.split()[0]: line for line in p.stdout.splitlines()}
    assert "live" in lines["cpu"]
    assert "fault:softmax-row" in lines and "opt-in" in lines["fault:softmax-row"]


@pytest.mark.slow
def test_demo_catches_every_fault_and_nothing_else():
    p = _cli(
        "demo",
        "--backends",
        "cpu-nomkldnn,fault:softmax-row,fault:layernorm-eps,fault:rmsnorm-backward,fault:xent-backward",
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "missed: none; legitimate backends called SUSPECT: none" in p.stdout
    assert "[transformer] fault:softmax-row vs cpu" in p.stdout


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--html", "{file}/page.html"], "--html '{file}/page.html' cannot be written: '{file}' is not a directory"),
        (["--save", "{file}"], "--save '{file}' is a file; it must be a directory"),
        (["--save", "{dir}", "--node", "../../escaped"], "--node must be a plain name for a file in --save"),
        (["--html", "{dir}"], "--html '{dir}' is a directory; it must name a file"),
    ],
)
def test_file_problems_exit_2_with_one_line_before_the_model_runs(target, tmp_path, capsys, extra, message):
    # They printed a traceback and exited 1 (the SUSPECT code) after the whole check had run; --node '../../x'
    # wrote outside --save.
    from rlx_nb import cli

    a_file = tmp_path / "a_file"
    a_file.write_text("")
    fill = {"file": str(a_file), "dir": str(tmp_path)}
    args = ["check", f"{target.rsplit(':', 1)[0]}:missing_factory", *[x.format(**fill) for x in extra]]
    assert cli.main(args) == 2  # (said before the target is even loaded)
    err = capsys.readouterr().err
    assert err.startswith(f"rlx-nb: error: {message.format(**fill)}") and len(err.strip().splitlines()) == 1
    assert not (tmp_path.parent / "escaped.rlxnb").exists()


def test_a_file_that_cannot_be_written_after_the_check_is_one_line_and_exit_2(target, capsys, monkeypatch):
    from rlx_nb import cli

    monkeypatch.setenv("RLX_NB_PROGRESS", "0")

    assert cli.main(["check", target, "--backends", "cpu-nomkldnn", "--html", "/proc/rlx_nb-page.html"]) == 2
    out, err = capsys.readouterr()
    assert "round-off (explainable)" in out  # the verdict was printed before
    assert err.startswith("rlx-nb: error: cannot write the HTML report to '/proc/rlx_nb-page.html': ")
    assert len(err.strip().splitlines()) == 1


def test_a_gate_that_judged_nothing_exits_3(tmp_path, capsys):
    # An interrupted report, or one whose every backend was skipped for memory, exited 0.
    import torch

    import rlx_nb
    from rlx_nb import cli

    model, x = torch.nn.Linear(8, 8), torch.randn(2, 8)
    # (a converting backend needs twice the weights: skipped for memory whatever the process holds already)
    skipped = rlx_nb.backend_divergence(model, x, backends=["onnxruntime"], memory_budget=1, progress=False)
    ran = rlx_nb.backend_divergence(model, x, backends=["cpu-nomkldnn"], progress=False)
    ran.results.environment["incomplete"] = "interrupted (KeyboardInterrupt) while cpu-inductor ran"
    for name, report, why in (
        ("skipped", skipped, "no backend's output was judged (onnxruntime: skipped)"),
        ("interrupted", ran, "the call was interrupted, so not every backend was judged"),
    ):
        assert cli.main(["show", str(report.save(tmp_path / name))]) == 3
        assert f"rlx-nb: judged nothing, so this cannot pass: {why}" in capsys.readouterr().err


@pytest.fixture
def old_torch(tmp_path):
    # A process in which torch reports a release older than rlx_nb's range (a sitecustomize runs first).
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import torch\ntorch.__version__ = '2.5.1'\n")
    import os

    return dict(os.environ, PYTHONPATH=str(site))


def test_under_a_torch_older_than_the_range_the_command_is_a_usage_error_with_the_message(old_torch):
    # #46: `rlx-nb backends` / `check` printed a traceback and exited 1, which a gate reads as "SUSPECT".
    import shutil
    from pathlib import Path

    command = shutil.which("rlx-nb", path=str(Path(sys.executable).parent)) or "rlx-nb"
    for args in (["backends"], ["check", "x.py:f"]):
        p = subprocess.run([command, *args], capture_output=True, text=True, timeout=300, env=old_torch)
        assert p.returncode == 2, (p.returncode, p.stderr)
        assert "Traceback" not in p.stderr
        assert p.stderr.startswith("rlx-nb: error: rlx_nb cannot start: rlx_nb needs torch>=2.13"), p.stderr
        assert "torch 2.5.1 is installed" in p.stderr


def test_under_a_torch_older_than_the_range_the_pytest_plugin_stops_no_unrelated_test(tmp_path, old_torch):
    # The plugin loads with every pytest run in an environment that has rlx_nb: it imported the package (and so
    # torch's range check), which stopped every test of the project, rlx_nb's or not.
    (tmp_path / "test_unrelated.py").write_text(
        "import sys\n\ndef test_unrelated():\n    assert 'rlx_nb' not in sys.modules\n"
    )
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_unrelated.py"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path, env=old_torch)  # fmt: skip
    assert p.returncode == 0 and "1 passed" in p.stdout, (p.stdout[-2000:], p.stderr[-2000:])
