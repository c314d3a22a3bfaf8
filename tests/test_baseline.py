"""Baselines: compare_reports and rlx-nb check --baseline, on an upgrade simulated by re-registering a backend."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest
import torch

import rlx_nb
from rlx_nb.cli import main


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.LayerNorm(64), torch.nn.GELU()), torch.randn(32, 16)


def _stack_v1(model, inputs):
    return model(*inputs)


def _stack_v2(model, inputs):  # "the upgrade": its GELU became the tanh approximation
    for m in model.modules():
        if isinstance(m, torch.nn.GELU):
            m.approximate = "tanh"
    return model(*inputs)


def test_the_same_stack_is_the_same_and_an_upgrade_that_breaks_is_worse(tmp_path):
    model, x = _model()
    rlx_nb.register_backend("test:stack", _stack_v1, default=False, replace=True)
    old = rlx_nb.backend_divergence(model, x, backends=["cpu-nomkldnn", "test:stack"], progress=False)
    again = rlx_nb.backend_divergence(model, x, backends=["cpu-nomkldnn", "test:stack"], progress=False)
    same = rlx_nb.compare_reports(old, again)
    assert set(same.frame.status) == {"same"} and not same.any_worse
    rlx_nb.register_backend("test:stack", _stack_v2, default=False, replace=True)
    new = rlx_nb.backend_divergence(model, x, backends=["cpu-nomkldnn", "test:stack"], progress=False)
    moved = rlx_nb.compare_reports(old.save(tmp_path / "old.rlxnb"), new)  # a saved baseline reads the same
    assert moved.worse[["backend", "output", "old_verdict", "new_verdict"]].values.tolist() == [
        ["test:stack", "out", "round-off", "SUSPECT"]
    ]
    assert moved.frame.set_index("backend").loc["cpu-nomkldnn", "status"] == "same"
    assert any(line.startswith("[Sequential] test:stack: WORSE") for line in moved.lines())
    assert moved.plot().collections  # old vs new excess
    back = rlx_nb.compare_reports(new, old)
    assert back.frame.set_index("backend").loc["test:stack", "status"] == "better"


def main_report(target):
    from rlx_nb.cli import load_target

    model, inputs = load_target(f"{target}:build")
    return rlx_nb.backend_divergence(model, inputs, backends=["cpu-nomkldnn", "fault:gelu-approx"], progress=False)


def test_cli_check_baseline_exits_1_only_when_worse(tmp_path):
    target = tmp_path / "build.py"
    target.write_text(
        "import torch\n"
        "def build():\n"
        "    torch.manual_seed(0)\n"
        "    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU()), torch.randn(32, 16)\n"
    )
    assert (
        main(["check", f"{target}:build", "--backends", "cpu-nomkldnn", "--save", str(tmp_path), "--node", "v1"]) == 0
    )
    base = str(tmp_path / "v1.rlxnb")
    assert main(["check", f"{target}:build", "--backends", "cpu-nomkldnn", "--baseline", base]) == 0
    worse = ["check", f"{target}:build", "--backends", "cpu-nomkldnn,fault:gelu-approx", "--baseline", base]
    assert main(worse) == 0  # a backend the baseline did not have is new, not worse
    added = rlx_nb.compare_reports(base, rlx_nb.load_report(base))
    assert all(" same — worst move x1 " in line for line in added.lines())
    lines = rlx_nb.compare_reports(base, main_report(target)).lines()
    # (main_report's model is gone: its weights cannot be hashed any more, and the first line says so)
    assert lines[0].startswith("[Sequential] baseline: the weights not checked: the new report has no fingerprint")
    lines = lines[1:]
    assert [line.split(" — ")[0] for line in lines] == [
        "[Sequential] cpu-nomkldnn: same",
        "[Sequential] fault:gelu-approx: new",
    ]
    assert "not in both reports" in lines[1] and "- -> SUSPECT" in lines[1]
    assert (
        main(["check", f"{target}:build", "--backends", "fault:gelu-approx", "--save", str(tmp_path), "--node", "v2"])
        == 1
    )
    assert (
        main(["check", f"{target}:build", "--backends", "fault:gelu-approx", "--baseline", str(tmp_path / "v2.rlxnb")])
        == 0
    )


def test_a_baseline_of_another_model_or_inputs_is_refused_unless_allowed(tmp_path, capsys):
    # compare_reports / --baseline compared reports of different models silently, exit 0.
    model, x = _model()
    old = rlx_nb.backend_divergence(model, x, backends=["cpu-nomkldnn"], progress=False)
    other_weights = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.LayerNorm(64), torch.nn.GELU())
    cases = {
        "weights": (other_weights, x, "the weights differ"),
        "inputs": (model, x + 1, "the inputs' values differ"),
        "shapes": (
            model,
            x[:8],
            r"the inputs' structure \(names, dtypes, shapes\) differs: .*\(32, 16\).* vs .*\(8, 16\)",
        ),
        "structure": (torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU()), x, "the model's structure"),
    }
    for name, (m, inputs, says) in cases.items():
        new = rlx_nb.backend_divergence(m, inputs, backends=["cpu-nomkldnn"], progress=False)
        with pytest.raises(rlx_nb.InputError, match=says):
            rlx_nb.compare_reports(old, new)
        allowed = rlx_nb.compare_reports(old, new, allow_different_model=True)
        assert any("compared although" in line for line in allowed.lines()), name
    same = rlx_nb.compare_reports(old, rlx_nb.backend_divergence(model, x, backends=["cpu-nomkldnn"], progress=False))
    assert same.notes == []
    saved = old.save(tmp_path / "old.rlxnb")
    target = tmp_path / "target.py"
    target.write_text(
        "import torch\n"
        "def build():\n"
        "    torch.manual_seed(1)\n"
        "    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU()), torch.randn(32, 16)\n"
    )
    code = main(["check", f"{target}:build", "--backends", "cpu-nomkldnn", "--baseline", str(saved)])
    err = capsys.readouterr().err
    assert code == 2 and "not made from the same model and inputs" in err and err.count("\n") == 1
    code = main(
        ["check", f"{target}:build", "--backends", "cpu-nomkldnn", "--baseline", str(saved), "--allow-different-model"]
    )
    assert code == 0 and "compared although the model's structure" in capsys.readouterr().out
