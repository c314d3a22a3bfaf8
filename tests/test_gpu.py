"""CUDA backends for real; skipped cleanly where no GPU is present (CI never has one)."""

from __future__ import annotations

import pytest
import torch

import rlx_nb
from rlx_nb import demo

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["mlp", "transformer", "conv"])
def test_cuda_fp32_is_roundoff_and_bf16_within_its_budget(family):
    model, inputs = demo.MODELS[family]()
    report = rlx_nb.backend_divergence(model, inputs, backends=["cuda", "cuda-bf16"], backward=True)
    rows = report.backends.set_index("backend")
    assert rows.loc["cuda", "verdict"] == "round-off", rows.loc["cuda", "reason"]
    assert rows.loc["cuda-bf16", "verdict"] == "round-off", rows.loc["cuda-bf16", "reason"]


@pytest.mark.gpu
def test_cuda_tf32_judged_against_tf32_budget():
    model, inputs = demo.mlp()
    report = rlx_nb.backend_divergence(model, inputs, backends=["cuda-tf32"])
    rec = report.record("cuda-tf32")
    assert rec.compute_dtype == "tf32" and rec.verdict == "round-off", rec.reason
