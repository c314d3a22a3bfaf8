"""Standalone repros (#47): each one runs in a fresh interpreter where ``import rlx_nb`` fails, crosses the line
rlx_nb measured, is short and shrunk; the compiler bisection and the runtime's layer name where the error is born."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import rlx_nb
from rlx_nb.backends.exported_faults import fault_through
from rlx_nb.backends.registry import get_backend
from rlx_nb.errors import FileWriteError
from rlx_nb.models import demo
from tests.conftest import require_live

pytestmark = pytest.mark.xdist_group("repro")


BLOCKED = "import runpy, sys; sys.modules['rlx_nb'] = None; runpy.run_path(sys.argv[1], run_name='__main__')"
"""Run a script (``sys.argv[1]``) in an interpreter where ``import rlx_nb`` fails: what a maintainer has.  (An
editable install's finder comes before PYTHONPATH, so a shadow package would not hide it; a None in sys.modules
makes every import of rlx_nb and its modules raise ImportError.)"""


@pytest.fixture
def without_rlx_nb(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import rlx_nb\n")
    done = subprocess.run([sys.executable, "-c", BLOCKED, str(probe)], capture_output=True, text=True)
    assert done.returncode != 0 and "ModuleNotFoundError" in done.stderr  # (the block holds)

    def run(script):
        return subprocess.run([sys.executable, "-c", BLOCKED, str(script)], capture_output=True, text=True,
                              timeout=600, cwd=script.parent)  # fmt: skip

    return run


def _check(repro, run, *, shrunk_at_least: float = 10.0):
    # The file: one script (an .npz beside it at most), no import of rlx_nb, at most 80 lines; run without rlx_nb it
    # crosses the line (exit 1) and says so; its inputs were shrunk.
    files = {p.name for p in repro.path.parent.iterdir() if p.stem == repro.path.stem}
    assert files <= {repro.path.name, repro.path.with_suffix(".npz").name}
    text = repro.text
    assert "rlx_nb" not in "\n".join(line for line in text.splitlines() if line.startswith(("import", "from")))
    assert repro.lines <= 80, repro.lines
    done = run(repro.path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "PAST the line" in done.stdout and "float32 eager" in done.stdout
    assert repro.reproduces is True
    n0, n1 = repro.shrunk.elements
    assert n0 / n1 >= shrunk_at_least, str(repro.shrunk)
    return done


def test_a_catalogue_fault_reproduces_without_rlx_nb_shrunk(tmp_path, without_rlx_nb):
    model, inputs = demo.layered(fault_layer=1)
    loc = rlx_nb.localize(model, inputs, backend="fault:softmax-row")
    repro = loc.repro(tmp_path / "r", progress=False)
    assert repro.path == tmp_path / "r" / "repro_fault_softmax-row.py"
    done = _check(repro, without_rlx_nb)
    assert "fault:softmax-row" in done.stdout
    assert "Shrunk from 8x4x32x32 (32768 elements)" in repro.text  # (what was shrunk, in the file)
    # The line in the file is the one rlx_nb measured: 8x / 4x the budget of the judged record.
    assert f"LINE_MAX, LINE_RMS = {repro.line[0]:.6g}" in repro.text


def test_a_fault_through_onnx_runtime_reproduces_and_is_born_in_what_is_exported(tmp_path, without_rlx_nb):
    require_live("onnxruntime")
    model, inputs = demo.layered(fault_layer=1)
    backend = fault_through("fault:softmax-row", get_backend("onnxruntime"))
    report = rlx_nb.backend_divergence(model, inputs, backends=[backend], progress=False)
    repro = report.repro(backend.name, tmp_path, progress=False)
    done = _check(repro, without_rlx_nb)
    assert "import onnxruntime" in repro.text and "torch.onnx.export" in repro.text
    assert "onnxruntime+softmax-row" in done.stdout
    assert "Born in the export" in repro.attribution  # (the fault is in the graph the runtime is given)


@pytest.mark.slow
def test_the_real_inductor_avg_pool_backward_bug_is_bisected_to_its_lowering(tmp_path, without_rlx_nb):
    # pytorch/pytorch#198119: Inductor's avg_pool2d backward divides an overhanging ceil_mode window by the whole
    # kernel area.  The bisection names Inductor's lowerings and the op, and a fallback to eager as the workaround.
    require_live("cpu-inductor")
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 3, 1), torch.nn.AvgPool2d(8, ceil_mode=True))
    report = rlx_nb.backend_divergence(model, torch.randn(4, 3, 2, 2), backends=["cpu-inductor"], backward=True,
                                       progress=False)  # fmt: skip
    repro = report.repro("cpu-inductor", tmp_path, progress=False)
    _check(repro, without_rlx_nb, shrunk_at_least=4)
    assert "avg_pool2d" in repro.label
    assert "Inductor (inductor), in its lowerings, at avg_pool2d_backward" in repro.attribution
    assert "Workaround, checked: torch._inductor.lowering.make_fallback(torch.ops.aten.avg_pool2d_backward)" in (
        repro.attribution
    )
    assert "lowerings" in repro.text  # (the attribution is in the file too)


@pytest.mark.slow
def test_the_real_xnnpack_tanh_gelu_bug_is_born_in_the_delegate(tmp_path, without_rlx_nb):
    # ExecuTorch 1.5.1's XNNPACK computes gelu(approximate="tanh") as the exact gelu; portable is right.
    require_live("executorch-xnnpack")
    require_live("executorch-portable")
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(32, 8))
    report = rlx_nb.backend_divergence(model, torch.randn(4, 16), backends=["executorch-xnnpack"], progress=False)
    repro = report.repro("executorch-xnnpack", tmp_path, progress=False)
    _check(repro, without_rlx_nb)
    assert "XnnpackPartitioner" in repro.text
    assert repro.attribution.startswith("Born in the delegate (XNNPACK)")


def test_no_repro_for_a_backend_within_round_off_and_a_path_that_cannot_be_written(tmp_path):
    model, inputs = demo.layered()
    loc = rlx_nb.localize(model, inputs, backend="cpu-nomkldnn", propagated=False)
    with pytest.raises(rlx_nb.RlxError, match="nothing is beyond round-off"):
        loc.repro(tmp_path)
    report = rlx_nb.backend_divergence(model, inputs, backends=["cpu-nomkldnn"], progress=False)
    with pytest.raises(rlx_nb.RlxError, match="cpu-nomkldnn is within round-off: no repro written"):
        report.repro("cpu-nomkldnn", tmp_path)
    faulty, inputs = demo.layered(fault_layer=1)
    loc = rlx_nb.localize(faulty, inputs, backend="fault:softmax-row")
    (tmp_path / "a_file").write_text("")
    with pytest.raises(FileWriteError, match=r"cannot write the repro to '.*a_file/r': '.*a_file' is not a directory"):
        loc.repro(tmp_path / "a_file" / "r")
    assert not list(tmp_path.glob("*.py"))
