"""Preparations (compiles, exports, conversions) are made once and reused only when nothing they depend on changed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import rlx_nb
from rlx_nb.execution import cache as preparations
from tests.conftest import require_live


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.head(torch.nn.functional.gelu(self.norm(self.fc(x))))


@pytest.fixture
def net():
    rlx_nb.clear_preparations()
    torch.manual_seed(0)
    yield _Net(), torch.randn(8, 16)
    rlx_nb.clear_preparations()


def _notes(report, backend: str) -> str:
    return " ".join(report.backends_detail.set_index("backend").loc[backend, ["note"]].astype(str))


def _verdict(report, backend: str) -> str:
    return report.backends.set_index("backend").loc[backend, "verdict"]


def _out(report, backend: str) -> np.ndarray:
    return report.arrays(backend, "out")[1]


@pytest.mark.parametrize("backend", ["cpu-inductor", "onnxruntime", "openvino"])
def test_a_repeated_call_reuses_the_preparation_and_gives_the_same_numbers(net, backend):
    require_live(backend)
    model, x = net
    first = rlx_nb.backend_divergence(model, x, backends=[backend], progress=False)
    again = rlx_nb.backend_divergence(model, x, backends=[backend], progress=False)
    (kept,) = rlx_nb.kept_preparations()
    assert kept["backend"] == backend and kept["reuses"] == 1
    assert "reused the preparation" in _notes(again, backend) and "reused" not in _notes(first, backend)
    np.testing.assert_array_equal(_out(first, backend), _out(again, backend))
    # New input values, same shapes: the same preparation runs them, and its numbers are the new ones.
    moved = rlx_nb.backend_divergence(model, x + 1, backends=[backend], progress=False)
    assert rlx_nb.kept_preparations()[0]["reuses"] == 2
    assert _verdict(moved, backend) == "round-off"
    assert not np.allclose(_out(moved, backend), _out(first, backend))


def test_a_reused_compile_is_still_checked_to_have_compiled(net):
    require_live("cpu-inductor")
    model, x = net
    rlx_nb.backend_divergence(model, x, backends=["cpu-inductor"], progress=False)
    for _ in range(3):
        again = rlx_nb.backend_divergence(model, x, backends=["cpu-inductor"], progress=False)
        assert "torch.compile: reused 1 compiled graph(s), 1 compiled call(s) ran" in _notes(again, "cpu-inductor")


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda m: m.fc.weight.data.mul_(1.5), id="a weight, in place"),
        pytest.param(lambda m: setattr(m.norm, "eps", 1e-2), id="a plain attribute"),
        pytest.param(lambda m: setattr(m, "head", torch.nn.Linear(32, 4)), id="a submodule"),
    ],
)
def test_any_change_to_the_model_makes_a_new_preparation(net, change):
    require_live("onnxruntime")  # its weights are baked into the export: a stale one would be wrong
    model, x = net
    rlx_nb.backend_divergence(model, x, backends=["onnxruntime"], progress=False)
    change(model)
    after = rlx_nb.backend_divergence(model, x, backends=["onnxruntime"], progress=False)
    assert [p["reuses"] for p in rlx_nb.kept_preparations()] == [0, 0]
    assert _verdict(after, "onnxruntime") == "round-off"  # the new model's numbers, not the old export's
    assert "reused" not in _notes(after, "onnxruntime")


def test_backward_through_a_reused_compile_does_not_accumulate_gradients(net):
    require_live("cpu-inductor")
    model, x = net
    runs = [rlx_nb.backend_divergence(model, x, backends=["cpu-inductor"], backward=True, progress=False) for _ in "ab"]
    assert rlx_nb.kept_preparations()[0]["reuses"] == 1
    for name in ("grad:fc.weight", "grad:head.bias"):
        first, second = (r.arrays("cpu-inductor", name)[1] for r in runs)
        np.testing.assert_array_equal(first, second)
    assert _verdict(runs[1], "cpu-inductor") == "round-off"


def test_at_most_max_entries_are_kept_and_clearing_drops_them(net, monkeypatch):
    require_live("onnxruntime")
    monkeypatch.setattr(preparations, "MAX_ENTRIES", 2)
    model, _ = net
    for batch in (1, 2, 3):
        rlx_nb.backend_divergence(model, torch.randn(batch, 16), backends=["onnxruntime"], progress=False)
    assert len(rlx_nb.kept_preparations()) == 2
    assert rlx_nb.clear_preparations() == 2 and rlx_nb.kept_preparations() == []


def test_keys_see_values_not_identities():
    torch.manual_seed(0)
    model = _Net()
    import copy

    assert preparations.model_key(copy.deepcopy(model)) == preparations.model_key(copy.deepcopy(model))
    other = copy.deepcopy(model)
    other.norm.weight.data[0] += 1e-7
    assert preparations.model_key(other) != preparations.model_key(model)
    x = torch.randn(4, 16)
    assert preparations.inputs_key((x,)) == preparations.inputs_key((x + 1,))
    assert preparations.inputs_key((x,)) != preparations.inputs_key((x.double(),))


def test_kept_preparations_are_held_to_a_byte_budget_least_recently_used_out(net):
    # Not only a count: what the kept preparations hold together stays within the run's byte budget (a share
    # of the memory free when it began), the least recently used dropped first.
    require_live("onnxruntime")
    rlx_nb.clear_preparations()
    model, _ = net
    for batch in (1, 2, 3):
        rlx_nb.backend_divergence(model, torch.randn(batch, 16), backends=["onnxruntime"], progress=False)
    kept = list(preparations._CACHE.values())
    assert len(kept) == 3
    for i, prep in enumerate(kept):  # (what each held, set here: a session's own growth is noise-sized)
        prep.held_bytes = (i + 1) * 1000
    newest = list(preparations._CACHE)[-1]
    preparations.fit(5000)  # 1000 + 2000 + 3000 held: the oldest goes
    assert [p.held_bytes for p in preparations._CACHE.values()] == [2000, 3000]
    preparations.fit(3000)
    assert list(preparations._CACHE) == [newest]
    preparations.fit(None)  # (no budget known: nothing dropped)
    assert len(preparations._CACHE) == 1
    rlx_nb.clear_preparations()


def _public_callables():
    # Every public function of torch, torch.nn.functional and torch.Tensor (dunders included), once each.
    seen, out = set(), []
    for space in (torch, torch.nn.functional, torch.special, torch.linalg, torch.Tensor):
        for name in dir(space):
            f = getattr(space, name, None)
            if callable(f) and not isinstance(f, type) and id(f) not in seen:
                seen.add(id(f))
                out.append((f"{getattr(space, '__name__', space)}.{name}", f))
    return out


def test_no_two_distinct_callables_share_a_preparation_key():
    # #62: Tensor methods were keyed by their type alone (Tensor.abs == Tensor.neg, __mul__ == __add__), so a
    # localization reused one op's compiled or exported preparation for another and named the wrong culprit.
    from rlx_nb.execution.cache import model_key
    from rlx_nb.localization.capture import OpModule, Slot

    template = ((Slot(0),), {})
    keys: dict = {}
    for name, f in _public_callables():
        key = model_key(OpModule(f, template))
        assert key not in keys, f"{name} and {keys[key]} share a key"
        keys[key] = name
    assert len(keys) > 1500
    abs_, neg = (model_key(OpModule(f, template)) for f in (torch.Tensor.abs, torch.Tensor.neg))
    assert abs_ != neg and model_key(OpModule(torch.Tensor.abs, template)) == abs_  # (the same op: the same key)
    import copy

    module = OpModule(torch.Tensor.__mul__, template)
    assert model_key(copy.deepcopy(module)) == model_key(module)  # (a deep copy reuses it)
    assert model_key(OpModule(torch.Tensor.__add__, template)) != model_key(module)


def test_a_phase_short_of_memory_drops_kept_preparations_oldest_first_in_doubling_batches(monkeypatch):
    # Each dropped preparation cost a full garbage collection, one after another (48 s over five tests of a long
    # session): they are dropped 1, 2, 4, ... at a time, oldest first, one collection a batch, until the phase fits.
    import gc

    from rlx_nb.backends.registry import get_backend
    from rlx_nb.execution.memory import Memory

    saved = preparations._CACHE.copy()
    collections = []
    monkeypatch.setattr(gc, "collect", lambda *a, **k: collections.append(len(preparations._CACHE)) or 0)
    try:
        preparations._CACHE.clear()
        for i in range(10):
            preparations._CACHE[("kept", i)] = object()
        memory = Memory(torch.nn.Linear(4, 4), None)
        memory.activations = 1000  # (what the phase needs)
        fits_after = iter([100, 100, 100, 10**12])  # (free bytes after each batch: the third batch makes room)
        monkeypatch.setattr(memory, "free", lambda: next(fits_after))
        assert memory.shortfall(get_backend("cpu-nomkldnn"), "cpu-nomkldnn") == ""
        assert collections == [9, 7, 3]  # (1, then 2, then 4 dropped: one collection each)
        assert list(preparations._CACHE) == [("kept", i) for i in range(7, 10)]  # (the three most recent kept)
    finally:
        preparations._CACHE.clear()
        preparations._CACHE.update(saved)
