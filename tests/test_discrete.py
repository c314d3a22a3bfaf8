"""Discrete events (rlx_nb.discrete) and uniformly less accurate backends: named for what they are."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import rlx_nb
from rlx_nb import discrete
from rlx_nb.backends.emulated import emulate
from rlx_nb.verdict import ROUNDOFF, SUSPECT


class PlainCNN(torch.nn.Module):
    """Conv-BN-ReLU twice, a mean, a Linear; eval: the shape of the issue's case."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.c1, self.b1 = torch.nn.Conv2d(3, width, 3, padding=1), torch.nn.BatchNorm2d(width)
        self.c2, self.b2 = torch.nn.Conv2d(width, width, 3, padding=1), torch.nn.BatchNorm2d(width)
        self.fc = torch.nn.Linear(width, 10)
        with torch.no_grad():
            for bn in (self.b1, self.b2):
                bn.running_mean.normal_(0, 0.1)
                bn.running_var.uniform_(0.5, 1.5)
        self.eval()

    def forward(self, x):
        x = torch.relu(self.b1(self.c1(x)))
        x = torch.relu(self.b2(self.c2(x)))
        return self.fc(x.mean((2, 3)))


def _nudged(scale: float):
    # A legitimate backend a little less accurate than the oracle in the first layer's output (what NNPACK's
    # fast convolutions do at batch 16 and up): noise of a few units of round-off of the output's scale, so
    # ReLU inputs within round-off of 0 cross it.
    def noisy(module, args, out):
        gen = torch.Generator().manual_seed(7)
        return out + scale * float(out.detach().abs().max()) * torch.randn(out.shape, generator=gen)

    def fn(model, inputs):
        handle = model.c1.register_forward_hook(noisy)
        try:
            return model(*inputs)
        finally:
            handle.remove()

    return fn


def test_relu_inputs_within_round_off_that_flip_are_accounted_for_not_called_a_bug():
    # SUSPECT at batch 16 before: "error 2.02e+03x the fp32 round-off budget — likely a kernel bug", while the
    # forward output was within 1x: the slightly larger forward error flipped ReLU inputs within round-off of 0.
    rlx_nb.register_backend("test-nudged", _nudged(3e-7), replace=True, hookable=True)
    try:
        x = torch.randn(16, 3, 32, 32, generator=torch.Generator().manual_seed(3))
        report = rlx_nb.backend_divergence(PlainCNN(), x, backends=["test-nudged"], backward=True, progress=False)
    finally:
        rlx_nb.unregister_backend("test-nudged")
    flipped = [r for r in report.records if r.judgement.discrete_events]
    assert flipped, "the nudge flips ReLU inputs here (the test's premise)"
    assert report.record("test-nudged").verdict == ROUNDOFF, report.record("test-nudged").reason
    rec = flipped[0]
    assert "discrete event(s) are accounted for" in rec.reason
    assert "relu input(s) in the model's forward, after `b" in rec.note and "within round-off of 0 flipped" in rec.note
    assert "test-nudged" in report.results.discrete
    saved = rlx_nb.load_report(report.save(__import__("tempfile").mkdtemp() + "/flips"))
    assert saved.record("test-nudged").verdict == ROUNDOFF  # the account travels with the file
    judged = rlx_nb.DivergenceReport.from_results(saved.results)
    assert judged.summary_detail.equals(report.summary_detail)  # and judging the file again gives the same


def test_a_real_fault_is_not_explained_away_by_flips():
    x = torch.randn(16, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    report = rlx_nb.backend_divergence(
        PlainCNN(), x, backends=["fault:linear-bias-channel", "fault:mean-off-by-one"], backward=True, progress=False
    )
    assert set(report.suspects) == {"fault:linear-bias-channel", "fault:mean-off-by-one"}


def test_the_fit_takes_flips_only_where_they_explain_the_difference():
    rng = np.random.default_rng(0)
    d = [{"g": rng.standard_normal(50)} for _ in range(4)]
    truth = d[1]["g"] + d[3]["g"]
    chosen = discrete.fit({"g": truth + 1e-6 * rng.standard_normal(50)}, d, {"g": 1.0})
    assert chosen.tolist() == [0.0, 1.0, 0.0, 1.0]
    assert discrete.fit({"g": 3 * rng.standard_normal(50)}, d, {"g": 1.0}).sum() <= 2  # noise: little to take


def test_a_uniformly_less_accurate_backend_is_named_so_not_a_kernel_bug():
    # NNPACK's fast convolutions carry several times the oracle's round-off, uniformly: "likely a kernel bug"
    # before.  Here: convolution operands at 19 bits, a legitimate but less accurate arithmetic.
    rlx_nb.register_backend("test-19-bits", emulate(19), replace=True, hookable=True)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.GELU(), torch.nn.Conv2d(32, 32, 3, padding=1),
            torch.nn.GELU(), torch.nn.Conv2d(32, 8, 3, padding=1),
        )  # fmt: skip
        x = torch.randn(4, 3, 32, 32)
        report = rlx_nb.backend_divergence(model, x, backends=["test-19-bits", "fault:gelu-approx"], progress=False)
    finally:
        rlx_nb.unregister_backend("test-19-bits")
    less = report.record("test-19-bits")
    assert less.verdict == SUSPECT  # the documented policy: it claims fp32 and is beyond its budget
    assert "uniformly less accurate" in less.reason and "likely a kernel bug" not in less.reason
    assert "convolution call(s)" in less.reason and 19 < less.judgement.effective_bits < 23
    assert "x the line: less accurate, ~" in report.backends.set_index("backend").loc["test-19-bits", "why"]
    bug = report.record("fault:gelu-approx")
    assert bug.verdict == SUSPECT and "likely a kernel bug" in bug.reason  # systematic: follows the values


@pytest.mark.parametrize("catalogue", ["fault:layernorm-eps", "fault:linear-bias-channel", "fault:attention-scale"])
def test_systematic_faults_keep_their_name(catalogue):
    from rlx_nb import demo

    model, inputs = demo.transformer()
    rec = rlx_nb.backend_divergence(model, inputs, backends=[catalogue], progress=False).record(catalogue)
    assert rec.verdict == SUSPECT and "uniformly less accurate" not in rec.reason
