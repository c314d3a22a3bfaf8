"""The exported backends (ONNX Runtime, OpenVINO) return the model's own outputs, named as its eager run names them.

Tracing for export is not the eager run: a number a model keeps in an object can become a tensor, an
output can stop being one, and a failed conversion can leave state on the model the next route traces.
"""

from __future__ import annotations

import pytest
import torch

import rlx_nb
from rlx_nb.models import zoo
from rlx_nb.verdict.types import ROUNDOFF, VERDICT_SKIPPED
from tests.conftest import require_live

EXPORTED = ["onnxruntime", "openvino"]


def _tracing() -> bool:
    return torch.jit.is_tracing() or torch.compiler.is_compiling()


class Window:
    """A cache that keeps its length as a number, as a sliding-window cache layer does."""

    def __init__(self, keys: torch.Tensor) -> None:
        self.keys = keys
        # Under export tracing the length comes from a traced shape: a tensor.
        self.length = torch.tensor(keys.shape[1]) if _tracing() else keys.shape[1]


class WithCache(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.proj(x)
        return {"out": torch.tanh(h), "cache": Window(h * 0.5)}


class EagerOnlyOutput(torch.nn.Module):
    """Returns its second output only when not traced (as a model that builds a cache only eagerly)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.proj(x)
        return h.relu(), (None if _tracing() else h.sin())


@pytest.mark.slow
@pytest.mark.parametrize("backend", EXPORTED)
def test_a_number_that_tracing_makes_a_tensor_is_not_an_extra_output(backend):
    require_live(backend)
    torch.manual_seed(0)
    report = rlx_nb.backend_divergence(WithCache(), torch.randn(4, 8), backends=[backend], progress=False)
    assert sorted(r.output for r in report.records) == ["cache.keys", "out"]
    assert all(r.verdict == ROUNDOFF for r in report.records), [r.reason for r in report.records]


@pytest.mark.slow
@pytest.mark.parametrize("backend", EXPORTED)
def test_an_output_the_export_leaves_out_is_skipped_and_said_not_blamed(backend):
    require_live(backend)
    torch.manual_seed(0)
    report = rlx_nb.backend_divergence(EagerOnlyOutput(), torch.randn(4, 8), backends=[backend], progress=False)
    by_output = {r.output: r for r in report.records}
    assert by_output["out[0]"].verdict == ROUNDOFF
    assert by_output["out[1]"].verdict == VERDICT_SKIPPED
    assert "not exported" in by_output["out[1]"].reason
    notes = " ".join(report.results.candidates[backend].notes)
    assert "leaves out 1 output(s)" in notes and "out[1]" in notes


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mistral", "mamba"])
def test_real_caches_come_back_whole_from_the_exported_backends(name):
    # Mistral's sliding-window cache keeps its length as a number; Mamba writes its cache states in place,
    # and after the TorchScript exporter fails on it, the dynamo exporter used to drop them from the graph.
    pytest.importorskip("transformers")
    live = [b for b in EXPORTED if b in rlx_nb.available_backends()]
    if not live:
        pytest.skip("neither ONNX Runtime nor OpenVINO is live here")
    model, inputs = zoo.build(name, batch=2)
    report = rlx_nb.backend_divergence(model, inputs, backends=live, progress=False)
    outputs = {r.output for r in report.records}
    assert any(o.startswith("cache.") for o in outputs), outputs
    for r in report.records:
        assert r.verdict == ROUNDOFF, (r.backend, r.output, r.reason)


def test_an_exporter_error_is_said_by_its_root_cause_without_terminal_colours():
    from rlx_nb.errors import with_root_cause

    try:
        try:
            raise ValueError("the model's own message\nmore lines")
        except ValueError as inner:
            raise RuntimeError(
                "\x1b[96mFailed to export the model\x1b[0m with torch.export. Next steps: ..."
            ) from inner
    except RuntimeError as outer:
        text = with_root_cause(outer)
    assert text == (
        "RuntimeError: Failed to export the model with torch.export. Next steps: ... "
        "(caused by ValueError: the model's own message)"
    )
