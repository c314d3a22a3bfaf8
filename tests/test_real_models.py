"""The verdict on real architectures nobody on the project wrote: a fast subset of bench/real_models.py.

Hugging Face models from small configs (random weights, nothing downloaded), passed as they are with
their own keyword inputs and outputs, at batch sizes 1 and 2: every legitimate backend is round-off,
forward and backward, and catalogue faults that change the outputs are SUSPECT.  The full corpus
(13 architectures, batch 1-8, 3 seeds, Inductor and OpenVINO too) is ``python bench/real_models.py``.
"""

from __future__ import annotations

import pytest
import torch

import rlx_nb
from rlx_nb.backends.faults import HITS
from rlx_nb.models import zoo
from rlx_nb.verdict.types import ROUNDOFF, SUSPECT
from tests.conftest import require_live

pytest.importorskip("transformers")

FORWARD_FAULTS = ["fault:softmax-row", "fault:linear-bias-channel"]
BACKWARD_FAULTS = ["fault:layernorm-backward", "fault:rmsnorm-backward"]


def _legit(backward: bool) -> list[str]:
    live = rlx_nb.available_backends()
    return [b for b in ("cpu-nomkldnn", "onnxruntime") if b in live and not (backward and b == "onnxruntime")]


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("name", ["bert", "gpt2", "llama", "vit-pooler", "resnet"])
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_real_architectures_as_they_are(name, batch, backward):
    model, inputs = zoo.build(name, batch=batch)
    assert type(model).__module__.startswith("transformers.")  # the model itself, no wrapper
    legit = _legit(backward)
    faults = BACKWARD_FAULTS if backward else FORWARD_FAULTS
    HITS.clear()
    report = rlx_nb.backend_divergence(model, inputs, backends=legit + faults, backward=backward, progress=False)
    for b in legit:
        rec = report.record(b)
        assert rec.verdict == ROUNDOFF, (b, rec.output, rec.reason)
    fired = [f for f in faults if HITS[f] and any(r.pair.max_abs > 0 for r in report.records if r.backend == f)]
    for f in fired:
        assert report.record(f).verdict == SUSPECT, (f, report.record(f).reason)
    if not (name == "resnet" and backward):  # (no LayerNorm or RMSNorm for the backward faults to break)
        assert fired, f"no fault reached {name}"
    names = list(report.results.oracle.outputs)
    if name in ("gpt2", "llama"):  # a decoder's DynamicCache, flattened to its tensors
        assert "cache.layers[0].keys" in names and "cache.layers[1].values" in names
    if name in ("bert", "vit-pooler"):
        assert "pooler_output" in names  # (batch, 64): 64 slices of `batch` elements each


@pytest.mark.slow
def test_faults_reach_attention_and_norms_that_models_write_themselves():
    # Llama attends through F.scaled_dot_product_attention and writes its RMSNorm out by hand: the
    # softmax and RMSNorm faults reach both, so they are tested on real architectures, not inert.
    model, inputs = zoo.build("llama", batch=2)
    HITS.clear()
    report = rlx_nb.backend_divergence(
        model, inputs, backends=["fault:softmax-row", "fault:rmsnorm-backward"], backward=True, progress=False
    )
    assert HITS["fault:softmax-row"] > 0 and HITS["fault:rmsnorm-backward"] > 0
    assert report.suspects == ["fault:softmax-row", "fault:rmsnorm-backward"]


@pytest.mark.slow
def test_a_real_inductor_bug_on_efficientnet_is_caught():
    # Hugging Face's EfficientNet pools with AvgPool2d(kernel 1280-ish, ceil_mode=True) on a 2x2 map; Inductor's
    # avg_pool2d backward divides such overhanging windows by the whole kernel area (pytorch/pytorch#198119),
    # so every gradient upstream of the pool comes out ~1e-5 of its size while the forward is exact.
    require_live("cpu-inductor")
    pool = torch.nn.AvgPool2d(8, ceil_mode=True)
    x = torch.randn(1, 3, 2, 2, requires_grad=True)
    report = rlx_nb.backend_divergence(pool, x, backends=["cpu-inductor", "cpu-nomkldnn"], backward=True)
    assert report.record("cpu-inductor", "out").verdict == ROUNDOFF  # the forward is right
    grad = report.record("cpu-inductor", "grad:input[0]")
    assert grad.verdict == SUSPECT and grad.judgement.excess > 1e3
    assert report.record("cpu-nomkldnn").verdict == ROUNDOFF


def test_zoo_names_and_bad_input():
    assert set(zoo.MODELS) >= {"bert", "distilbert", "gpt2", "llama", "qwen2", "t5", "whisper", "vit", "convnext"}
    assert set(zoo.MODELS) >= {"resnet", "mobilenet", "efficientnet", "swin"}
    with pytest.raises(rlx_nb.InputError, match="unknown zoo model 'nope'; the zoo has: bert"):
        zoo.build("nope")
    with pytest.raises(rlx_nb.InputError, match="batch must be a positive integer, got 0"):
        zoo.build("bert", batch=0)
