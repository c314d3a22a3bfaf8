"""The fault catalogue: at least ten kinds, each registered, documented, firing and called SUSPECT."""

from __future__ import annotations

from pathlib import Path

import pytest

import rlx_nb
from rlx_nb.backends.faults import CATALOGUE, HITS, fault_backend
from rlx_nb.backends.registry import _REGISTRY, get_backend
from rlx_nb.models import demo

WHERE = {
    "fault:softmax-row": ("transformer", False),
    "fault:attention-scale": ("transformer", False),
    "fault:layernorm-eps": ("transformer", False),
    "fault:layernorm-unbiased": ("transformer", False),
    "fault:linear-bias-channel": ("mlp", False),
    "fault:gelu-approx": ("mlp", False),
    "fault:linear-lowp-accum": ("mlp", False),
    "fault:mean-off-by-one": ("conv", False),
    "fault:layernorm-backward": ("transformer", True),
    "fault:rmsnorm-backward": ("rmsnorm_classifier", True),
    "fault:xent-backward": ("rmsnorm_classifier", True),
}


def test_catalogue_has_ten_kinds_each_documented():
    assert len(CATALOGUE) >= 10
    assert set(WHERE) == set(CATALOGUE)
    # The catalogue is documented once, in docs/hardening.md (the module docstring links there).
    doc = (Path(__file__).resolve().parents[1] / "docs" / "hardening.md").read_text()
    for name, fault in CATALOGUE.items():
        assert f"| `{name}` |" in doc
        assert len(fault.severities) >= 2
        backend = get_backend(name)
        assert backend.description and not backend.default


@pytest.mark.parametrize("name", sorted(WHERE))
def test_each_fault_fires_and_is_suspect_at_default_severity(name):
    family, backward = WHERE[name]
    model, inputs = demo.MODELS[family]()
    HITS.clear()
    report = rlx_nb.backend_divergence(model, inputs, backends=[name], backward=backward)
    assert HITS[name] > 0, "the faulty function never ran"
    assert report.suspects == [name]
    if CATALOGUE[name].backward_only:
        assert report.record(name).kind == "grad"


def test_severity_backends_are_named_and_milder_is_smaller():
    mild = fault_backend("fault:softmax-row", 1e-5)
    assert mild.name == "fault:softmax-row@1e-05"
    _REGISTRY[mild.name] = mild
    model, inputs = demo.transformer()
    report = rlx_nb.backend_divergence(model, inputs, backends=[mild.name, "fault:softmax-row"])
    assert report.record(mild.name).pair.max_abs < report.record("fault:softmax-row").pair.max_abs
    del _REGISTRY[mild.name]
    with pytest.raises(ValueError, match="unknown fault"):
        fault_backend("fault:nope")
