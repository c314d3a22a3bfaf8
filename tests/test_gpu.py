"""CUDA backends for real; skipped cleanly where no GPU is present (CI never has one)."""

from __future__ import annotations

import pytest
import torch

import rlx_nb
from rlx_nb.models import demo

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["mlp", "transformer", "conv"])
def test_cuda_fp32_is_roundoff_and_bf16_within_its_budget(family):
    model, inputs = demo.MODELS[family]()
    report = rlx_nb.backend_divergence(model, inputs, backends=["cuda", "cuda-bf16"], backward=True)
    rows = report.backends_detail.set_index("backend")
    assert rows.loc["cuda", "verdict"] == "round-off", rows.loc["cuda", "reason"]
    assert rows.loc["cuda-bf16", "verdict"] == "round-off", rows.loc["cuda-bf16", "reason"]


@pytest.mark.gpu
def test_cuda_tf32_judged_against_tf32_budget():
    model, inputs = demo.mlp()
    report = rlx_nb.backend_divergence(model, inputs, backends=["cuda-tf32"])
    rec = report.record("cuda-tf32")
    assert rec.compute_dtype == "tf32" and rec.verdict == "round-off", rec.reason


@pytest.mark.gpu
def test_cuda_outputs_are_compared_on_the_gpu():
    # The candidate's outputs stay on the GPU; the statistics match the host path on the same arrays.
    model, inputs = demo.transformer()
    report = rlx_nb.backend_divergence(model, inputs, backends=["cuda"], backward=True)
    leaves = report.results.candidates["cuda"].outputs
    assert all(leaf.on_device and leaf.tensor.is_cuda for leaf in leaves.values() if leaf.is_array)
    top = report.elements("cuda", top=5)
    assert all(leaf.on_device for leaf in leaves.values() if leaf.is_array)  # top-k moved only 5 values
    from rlx_nb.comparison.comparators import Candidate, compare_output
    from rlx_nb.comparison.context import contexts
    from rlx_nb.execution.results import Leaf

    outputs = {ctx.name: ctx for ctx in contexts(report.results)}
    for rec in report.records:
        host = leaves[rec.output].value  # the host copy, made here
        again = compare_output(
            outputs[rec.output], Candidate("cuda", rec.compute_dtype, Leaf(host, rec.dtype, host.shape))
        )
        assert (again.pair.max_abs, again.pair.worst_index, again.pair.max_ulp, again.pair.mismatched) == (
            rec.pair.max_abs,
            rec.pair.worst_index,
            rec.pair.max_ulp,
            rec.pair.mismatched,
        )
        assert again.pair.p99_abs == pytest.approx(rec.pair.p99_abs) and again.verdict == rec.verdict
    assert top["abs_err"].iloc[0] == pytest.approx(report.record("cuda").pair.max_abs)
