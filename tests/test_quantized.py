"""int8: runtimes judged against the PT2E Q/DQ simulation, on a budget that requantization rounding measures."""

from __future__ import annotations

import pytest
import torch

import rlx_nb
from rlx_nb import quantized
from rlx_nb.backends.executorch_runtime import executorch_reason
from rlx_nb.errors import InputError
from rlx_nb.models import demo
from rlx_nb.verdict.types import ROUNDOFF, SUSPECT

pytestmark = [
    pytest.mark.filterwarnings("ignore"),
    pytest.mark.skipif(executorch_reason() is not None, reason="no ExecuTorch"),
]

FAULT = dict(layer=-1, channel=1, factor=1.5)  # the output layer's channel 1 weight scale 1.5x


@pytest.fixture(scope="module", params=["mlp", "conv"])
def case(request):
    model, inputs = getattr(demo, request.param)()
    converted = quantized.quantize_pt2e(model, inputs)
    fault = quantized.channel_scale_fault(**FAULT)
    report = quantized.quantized_divergence(
        converted, inputs, backends=["executorch-xnnpack", "executorch-portable", fault], progress=False
    )
    return converted, inputs, fault, report


def test_legitimate_int8_runtimes_are_quantization_noise(case):
    _, _, _, report = case
    for backend in ("executorch-xnnpack", "executorch-portable"):
        row = report.record(backend)
        assert row["verdict"] == ROUNDOFF and row["reading"] == quantized.NOISE, row["why"]
        assert row["why"].startswith("quantization noise")
    # XNNPACK's int8 kernels land whole quanta off the simulation in places (never more than the trials allow)
    assert report.record("executorch-xnnpack")["max_quanta"] >= 1.0


def test_the_fp32_budget_called_the_same_int8_run_a_kernel_bug(case):
    # What the quantized verdict replaces: judged as an fp32 backend, correct int8 reads SUSPECT.
    converted, inputs, _, _ = case
    report = rlx_nb.backend_divergence(converted, inputs, backends=["executorch-xnnpack"], progress=False)
    assert report.suspects == ["executorch-xnnpack"]


def test_one_channel_scale_off_is_a_kernel_bug_in_that_channel(case):
    _, _, fault, report = case
    row = report.record(fault.name)
    assert row["verdict"] == SUSPECT and row["reading"] == quantized.BUG, row["why"]
    assert (row["slice_axis"], row["slice_index"]) == (1, FAULT["channel"]), row
    assert report.suspects == [fault.name]


def test_the_error_heatmap_is_drawn_on_the_budget_scale(case):
    import matplotlib

    matplotlib.use("Agg")
    _, _, fault, report = case
    ax = report.plot_heatmap(fault.name)
    assert any(a.get_title().endswith("x int8 budget") for a in ax.figure.axes)
    oracle, got = report.arrays(fault.name)
    assert oracle.shape == got.shape and (oracle != got).any()


def test_bad_settings_are_named():
    model, inputs = demo.mlp()
    with pytest.raises(InputError, match="trials must be an int of at least 2"):
        quantized.quantized_divergence(model, inputs, trials=1, progress=False)
    with pytest.raises(InputError, match=r"width must be a number of quanta in \(0, 0.5\]"):
        quantized.quantized_divergence(model, inputs, width=0.0, progress=False)
    with pytest.raises(InputError, match="past the model's 2 per-channel weights"):
        converted = quantized.quantize_pt2e(model, inputs)
        quantized.channel_scale_fault(layer=5).fn(converted, (torch.randn(64, 512),))


def test_localize_finds_the_layer_whose_scale_is_off():
    # The MLP's first Linear (fc1) with channel 1's weight scale 4x: the bisection over the graph's requantization
    # points stops at fc1's output, and names it; a legitimate runtime is never past the budget at any point.
    model, inputs = demo.mlp()
    fault = quantized.channel_scale_fault(layer=0, channel=1, factor=4.0)
    report = quantized.quantized_divergence(model, inputs, backends=["executorch-xnnpack", fault], progress=False)
    assert report.suspects == [fault.name]
    found = report.localize()
    assert found["module"] == "fc1 (Linear)" and found["point"] == 1
    assert found["checked"] <= 3  # bisection over the 4 points
    with pytest.raises(InputError, match="did not run here"):
        report.localize("litert")


def test_a_model_with_keyword_inputs_is_quantized_and_judged_as_it_is_called():
    # Keyword inputs (a Hugging Face model's) reach the model by name, not in the dict's order.
    class Keyword(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(16, 8)

        def forward(self, x, scale):
            return self.fc(x) * scale

    gen = torch.Generator().manual_seed(0)
    inputs = {"scale": torch.full((1,), 2.0), "x": torch.randn(32, 16, generator=gen)}  # not in forward's order
    report = quantized.quantized_divergence(Keyword(), inputs, backends=["executorch-portable"], progress=False)
    assert report.record("executorch-portable")["verdict"] == ROUNDOFF
    oracle, _ = report.arrays("executorch-portable")
    assert oracle.shape == (32, 8)


def test_a_language_model_shape_quantizes_keeps_its_output_names_and_is_judged():
    # What a Hugging Face language model does that PT2E's XNNPACK path tripped on: position ids from integer
    # arithmetic with a Python scalar (ExecuTorch's scalar pass made them float32, and the embedding lookup
    # failed), and outputs returned by name in a dict.
    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tokens, self.positions = torch.nn.Embedding(50, 16), torch.nn.Embedding(40, 16)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))

        def forward(self, input_ids):
            past = 3  # (a cache's length: a plain int)
            positions = torch.arange(input_ids.shape[1]) + past
            hidden = self.tokens(input_ids) + self.positions(positions)
            return {"logits": self.mlp(hidden), "hidden": hidden}

    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))
    converted = quantized.quantize_pt2e(Tiny().eval(), {"input_ids": ids})
    assert set(converted(ids)) == {"logits", "hidden"}  # by name, as the float model returns them
    model, inputs = demo.mlp()
    assert isinstance(quantized.quantize_pt2e(model, inputs)(*inputs), torch.Tensor)  # a tensor stays a tensor
    fault = quantized.channel_scale_fault(**FAULT)
    report = quantized.quantized_divergence(converted, (ids,), backends=["executorch-xnnpack", fault], progress=False)
    assert report.record("executorch-xnnpack", "logits")["verdict"] == ROUNDOFF
    assert report.suspects == [fault.name]
