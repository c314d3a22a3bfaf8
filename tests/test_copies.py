"""rlx_nb._support.copies.module_copy makes the copy copy.deepcopy makes; judgement.replaced the object dataclasses.replace makes."""

from __future__ import annotations

import copy
import dataclasses
import functools
import types
import weakref

import pytest
import torch

from rlx_nb._support.copies import copies_plainly, module_copy, shared_copy
from rlx_nb.generation.decode import Decode
from rlx_nb.models import demo, zoo
from rlx_nb.verdict.records import OutputRecord
from rlx_nb.verdict.types import Judgement, replaced
from rlx_nb.verdict.words import Cause

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

_ATOMIC = (type(None), bool, int, float, complex, str, bytes, type)


def _same_copy(a, b, original, *, seen_a=None, seen_b=None, path="model"):
    """``a`` and ``b``, two copies of ``original``, have the same types, values and sharing at every node."""
    seen_a = {} if seen_a is None else seen_a
    seen_b = {} if seen_b is None else seen_b
    assert type(a) is type(b), path
    if isinstance(a, _ATOMIC):
        assert a == b, path
        return
    if isinstance(a, types.MethodType):  # (deepcopy binds the function to the copy of its object)
        assert a.__func__ is b.__func__, path
        _same_copy(a.__self__, b.__self__, original.__self__, seen_a=seen_a, seen_b=seen_b, path=f"{path}.__self__")
        return
    if isinstance(a, weakref.ref):  # (a module's __setstate__ may make new ones, to its copied tensors)
        _same_copy(a(), b(), original(), seen_a=seen_a, seen_b=seen_b, path=f"{path}()")
        return
    if isinstance(a, (types.FunctionType, types.BuiltinFunctionType, types.MethodWrapperType)):
        assert a is b, path  # (functions: deepcopy keeps them as they are)
        return
    # The same sharing: a node met before in one copy was met at the same place in the other.
    assert seen_a.get(id(a)) == seen_b.get(id(b)), path
    if id(a) in seen_a:
        return
    seen_a[id(a)] = seen_b[id(b)] = path
    assert (a is original) == (b is original), path  # (copied where deepcopy copies)
    if isinstance(a, functools.partial):  # (a new partial in both: the same function, its arguments copied)
        assert a.func is b.func, path
        _same_copy(a.args, b.args, original.args, seen_a=seen_a, seen_b=seen_b, path=f"{path}.args")
        _same_copy(a.keywords, b.keywords, original.keywords, seen_a=seen_a, seen_b=seen_b, path=f"{path}.keywords")
        return
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.requires_grad == b.requires_grad, path
        assert torch.equal(a, b), path
        return
    if isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            _same_copy(a[k], b[k], original.get(k), seen_a=seen_a, seen_b=seen_b, path=f"{path}[{k!r}]")
        return
    if isinstance(a, (list, tuple, set, frozenset)):
        assert len(a) == len(b), path
        if isinstance(a, (set, frozenset)):
            assert a == b, path
            return
        for i, (x, y, o) in enumerate(zip(a, b, original, strict=True)):
            _same_copy(x, y, o, seen_a=seen_a, seen_b=seen_b, path=f"{path}[{i}]")
        return
    if hasattr(a, "__dict__"):
        _same_copy(vars(a), vars(b), vars(original), seen_a=seen_a, seen_b=seen_b, path=f"{path}.__dict__")


class Shares(torch.nn.Module):
    """Tied weights, a submodule held twice, an empty list two modules share, a hook and a plain attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(3, 3)
        self.b = torch.nn.Linear(3, 3)
        self.b.weight = self.a.weight
        self.again = self.a
        self.losses: list = []
        self.a.losses = self.losses  # (an empty container two modules share: one copy of it, shared)
        self.register_buffer("scale", torch.tensor(2.0))
        self.note = {"kind": "test", "sizes": [3, 3]}
        self.a.register_forward_hook(_hook)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x)) * self.scale


def _hook(module, args, out):
    return out + 0


class OwnCopy(torch.nn.Linear):
    """A module with a __deepcopy__ of its own: module_copy leaves it to copy.deepcopy."""

    copies = 0

    def __deepcopy__(self, memo):
        OwnCopy.copies += 1
        new = torch.nn.Linear(self.in_features, self.out_features)
        new.load_state_dict(self.state_dict())
        return new


def _decoder(name: str) -> torch.nn.Module:
    model, ids = zoo.decoder(name, batch=1, seed=0)
    return Decode(model, prompt_len=ids.shape[1], steps=4, oracle_first=True)


def _zoo(name: str) -> torch.nn.Module:
    return zoo.build(name, batch=1)[0]


MODELS = {  # (built by the test that takes them: at collection, every worker built all of them, 6 s)
    "shares": Shares,
    "compiled-flag": lambda: torch.nn.Linear(2, 2),
    "lstm": lambda: torch.nn.LSTM(4, 5, num_layers=2),
    "encoder": lambda: torch.nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True),
    "demo": lambda: demo.transformer()[0],
    "conv": lambda: demo.conv()[0],
    "hf-gpt2": lambda: demo.gpt2()[0],
    **{f"decode-{name}": functools.partial(_decoder, name) for name in ("gpt2", "llama")},
    # (Mamba: a load hook bound to its module; others: partial activations, configs)
    **{f"zoo-{name}": functools.partial(_zoo, name) for name in zoo.MODELS},
}


@pytest.mark.parametrize("name", list(MODELS))
def test_module_copy_is_the_copy_deepcopy_makes(name):
    model = MODELS[name]()
    if name == "compiled-flag":
        model.compile()  # (Module.compile(): nn.Module.__getstate__ leaves its compiled call out of a copy)
    ours, theirs = module_copy(model, {}), copy.deepcopy(model)
    _same_copy(ours, theirs, model)
    assert "_compiled_call_impl" not in vars(ours)


def test_a_module_copy_shares_what_the_original_shares_and_nothing_with_it():
    model = Shares()
    c = module_copy(model, {})
    assert c.b.weight is c.a.weight and c.again is c.a and c.a.losses is c.losses
    assert c.a.weight is not model.a.weight and c.losses is not model.losses and c.note is not model.note
    c.note["kind"] = "changed"
    c.losses.append(1)
    assert model.note["kind"] == "test" and model.losses == []
    x = torch.randn(2, 3)
    torch.testing.assert_close(c(x), model(x), rtol=0, atol=0)  # (the hook copied with its module)


def test_a_module_with_its_own_copy_is_left_to_deepcopy():
    model = torch.nn.Sequential(OwnCopy(2, 2), torch.nn.ReLU())
    assert not copies_plainly(OwnCopy) and copies_plainly(torch.nn.ReLU)
    before = OwnCopy.copies
    c = module_copy(model, {})
    assert OwnCopy.copies == before + 1 and type(c[0]) is torch.nn.Linear
    one = torch.nn.ReLU()
    one.__deepcopy__ = lambda memo: "its own"  # (on the instance: deepcopy finds it there too)
    assert module_copy(torch.nn.Sequential(one), {})[0] == copy.deepcopy(one) == "its own"


def test_shared_copy_shares_storage_and_nothing_else():
    model, ids = zoo.decoder("qwen2", batch=1, seed=0)
    c = shared_copy(model)
    for (n, p), (_, q) in zip(model.named_parameters(), c.named_parameters(), strict=True):
        assert q is not p and q.data_ptr() == p.data_ptr(), n
    with torch.no_grad():
        torch.testing.assert_close(c(ids).logits, model(ids).logits, rtol=0, atol=0)
    c.to(torch.float64)  # (a backend casting its copy: new tensors in the copy, the original untouched)
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_replaced_is_dataclasses_replace():
    j = Judgement("round-off", Cause.WITHIN, line=0.5, detail="x")
    for changes in ({"line": 2.0}, {"verdict": "SUSPECT", "cause": Cause.WHOLE}, {}):
        ours, theirs = replaced(j, **changes), dataclasses.replace(j, **changes)
        assert ours == theirs and ours is not j and type(ours) is Judgement
        assert vars(ours) == vars(theirs)
    with pytest.raises(dataclasses.FrozenInstanceError):
        replaced(j, line=3.0).line = 4.0  # (still frozen)
    rec = OutputRecord("b", "out", 0, "forward", "float32", j)
    assert replaced(rec, note="n") == dataclasses.replace(rec, note="n")
    with pytest.raises(TypeError, match="no field 'nope'"):
        replaced(j, nope=1)


@dataclasses.dataclass(frozen=True)
class _Derived:
    a: int
    b: int = dataclasses.field(init=False, default=0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "b", 2 * self.a)


def test_replaced_leaves_a_dataclass_with_its_own_init_work_to_dataclasses_replace():
    x = _Derived(1)
    assert replaced(x, a=5) == dataclasses.replace(x, a=5) == _Derived(5)  # (b from __post_init__, not copied)
