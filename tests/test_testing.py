"""rlx_nb.testing.assert_backends_agree and the pytest plugin that keeps failing reports."""

from __future__ import annotations

import textwrap

import pytest
import torch

import rlx_nb
from rlx_nb.testing import assert_backends_agree

pytest_plugins = ["pytester"]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU()), torch.randn(8, 16)


def test_round_off_passes_and_returns_the_report():
    model, x = _model()
    report = assert_backends_agree(model, x, backends=["cpu-nomkldnn"])
    assert report.suspects == [] and report.record("cpu-nomkldnn").verdict == "round-off"


def test_a_suspect_fails_with_the_seed_lines_and_the_saved_report(tmp_path):
    model, x = _model()
    with pytest.raises(AssertionError) as caught:
        assert_backends_agree(model, x, backends=["cpu-nomkldnn", "fault:gelu-approx"], report_dir=tmp_path, msg="mlp")
    text = str(caught.value)
    lines = text.splitlines()
    assert lines[0] == "mlp" and "SUSPECT: fault:gelu-approx" in lines[1]
    assert any(line.startswith("[Sequential] fault:gelu-approx vs cpu:") and "SUSPECT" in line for line in lines)
    (saved,) = tmp_path.glob("*.rlxnb")
    assert str(saved) in text
    assert rlx_nb.load_report(saved).suspects == ["fault:gelu-approx"]


def test_a_named_backend_that_fails_to_run_fails_unless_allowed():
    def broken(model, inputs):
        raise RuntimeError("no kernel for this op")

    rlx_nb.register_backend("test:broken", broken, default=False)
    model, x = _model()
    with pytest.raises(AssertionError, match=r"did not run: test:broken[\s\S]*report not saved"):
        assert_backends_agree(model, x, backends=["cpu-nomkldnn", "test:broken"])
    allowed = assert_backends_agree(model, x, backends=["cpu-nomkldnn", "test:broken"], allow_errors=True)
    assert allowed.errors == ["test:broken"]
    # ... but a check where it was the only backend judged nothing: it never passes (it passed)
    with pytest.raises(AssertionError, match=r"judged nothing, so it cannot pass: no backend's output was judged"):
        assert_backends_agree(model, x, backends=["test:broken"], allow_errors=True)
    with pytest.raises(rlx_nb.InputError, match="allow_errors must be True or False"):
        assert_backends_agree(model, x, backends=["cpu-nomkldnn"], allow_errors="yes")


def test_a_check_that_judged_nothing_fails():
    # Every backend skipped for memory, the rows allowed: it passed, having compared nothing.  (Converting and
    # compiling backends need the weights again: skipped at a 1-byte budget whatever the process holds.)
    model, x = _model()
    with pytest.raises(AssertionError, match=r"^the check judged nothing, so it cannot pass: no backend's output was "
                                             r"judged \(cpu-inductor: skipped; onnxruntime: skipped\)"):  # fmt: skip
        assert_backends_agree(model, x, backends=["cpu-inductor", "onnxruntime"], allow_errors=True, memory_budget=1)


def test_the_pytest_plugin_keeps_each_failing_report(pytester):
    pytester.makepyfile(
        test_user=textwrap.dedent(
            """
            import torch
            from rlx_nb.testing import assert_backends_agree

            def _model():
                torch.manual_seed(0)
                return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU()), torch.randn(8, 16)

            def test_clean():
                assert_backends_agree(*_model(), backends=["cpu-nomkldnn"])

            def test_faulty():
                assert_backends_agree(*_model(), backends=["fault:gelu-approx"])
            """
        )
    )
    result = pytester.runpytest_subprocess("--rlx-nb-report-dir", "kept", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*SUSPECT: fault:gelu-approx*", "*report saved to *kept*test_faulty*"])
    kept = sorted(p.name for p in (pytester.path / "kept").iterdir())
    assert kept == ["test_user.py_test_faulty--Sequential.rlxnb"]


def test_the_plugin_keeps_one_file_per_failing_check_and_refuses_a_bad_directory(pytester):
    pytester.makepyfile(
        test_twice=textwrap.dedent(
            """
            import pytest, torch
            from rlx_nb.testing import assert_backends_agree

            def test_two_checks_one_label():
                torch.manual_seed(0)
                model, x = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU()), torch.randn(8, 16)
                for _ in range(2):
                    with pytest.raises(AssertionError):
                        assert_backends_agree(model, x, backends=["fault:gelu-approx"], label="same")
            """
        )
    )
    result = pytester.runpytest_subprocess("--rlx-nb-report-dir", "kept", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    kept = sorted(p.name for p in (pytester.path / "kept").iterdir())
    assert kept == [
        "test_twice.py_test_two_checks_one_label--same-2.rlxnb",
        "test_twice.py_test_two_checks_one_label--same.rlxnb",
    ]
    (pytester.path / "a_file").write_text("not a directory")
    result = pytester.runpytest_subprocess("--rlx-nb-report-dir", "a_file/reports", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR  # not INTERNALERROR, and no test ran
    result.stderr.fnmatch_lines(["*--rlx-nb-report-dir a_file/reports: cannot be made a directory*"])


def test_a_report_that_cannot_be_saved_never_hides_the_assertion(tmp_path):
    (tmp_path / "a_file").write_text("not a directory")
    model, x = _model()
    with pytest.raises(AssertionError) as caught:
        assert_backends_agree(model, x, backends=["fault:gelu-approx"], report_dir=tmp_path / "a_file" / "reports")
    text = str(caught.value)
    assert "SUSPECT: fault:gelu-approx" in text and "fault:gelu-approx vs cpu" in text  # the lines are all there
    assert "report NOT saved" in text and "could not be written" in text
