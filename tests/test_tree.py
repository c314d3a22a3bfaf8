"""Outputs of any structure: the tensors objects hold are found and named; nothing is compared by identity."""

from __future__ import annotations

import collections
import dataclasses

import torch

import rlx_nb
from rlx_nb._support.tree import Opaque, flatten, map_tensors
from rlx_nb.verdict.types import SUSPECT, VERDICT_SKIPPED


class Layer:
    def __init__(self, keys, values):
        self.keys, self.values = keys, values
        self.is_initialized, self.device = True, keys.device


class Cache:
    """Shaped like a Hugging Face DynamicCache: a list of layer objects with tensors, plus state."""

    def __init__(self, *layers):
        self.layers = list(layers)
        self.offloading = False
        self.owner = self  # a back-reference: walked once, never in a loop

    def __repr__(self):
        return f"Cache at {id(self):#x}"  # a repr that differs between any two runs


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    cache: Cache | None = None


Pair = collections.namedtuple("Pair", ["values", "indices"])


def test_objects_are_walked_for_their_tensors_with_readable_names():
    k, v = torch.zeros(2, 3), torch.ones(2, 3)
    out = {"logits": torch.zeros(2), "past": Cache(Layer(k, v))}
    named = flatten(out)
    assert [n for n, _ in named] == ["logits", "past.layers[0].keys", "past.layers[0].values"]
    assert named[1][1] is k and named[2][1] is v  # the tensors themselves, no copies
    assert [n for n, _ in flatten(Output(torch.zeros(1)))] == ["logits", "cache"]
    assert [n for n, _ in flatten(Pair(torch.zeros(1), torch.zeros(1)))] == ["values", "indices"]


def test_an_object_without_tensors_is_an_opaque_leaf():
    named = flatten({"logits": torch.zeros(1), "meta": object(), "n": 3, "shape": torch.Size([2])})
    assert [(n, type(v)) for n, v in named] == [
        ("logits", torch.Tensor),
        ("meta", Opaque),
        ("n", int),
        ("shape", torch.Size),
    ]
    assert named[1][1] == Opaque("object")


def test_map_tensors_copies_objects_around_the_new_tensors():
    cache = Cache(Layer(torch.ones(2), torch.ones(2)))
    doubled = map_tensors(lambda t: t * 2, {"past": cache})["past"]
    assert doubled is not cache and doubled.layers[0] is not cache.layers[0]
    assert doubled.layers[0].keys.tolist() == [2.0, 2.0] and cache.layers[0].keys.tolist() == [1.0, 1.0]
    assert doubled.owner is doubled  # the structure, back-references included, is the object's own


class CachingModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        return Output(logits=h.tanh(), cache=Cache(Layer(h, h.relu())))


def test_a_model_returning_cache_objects_is_judged_on_their_tensors():
    report = rlx_nb.backend_divergence(CachingModel(), torch.randn(4, 8), backends=["cpu-nomkldnn"], backward=True)
    names = [r.output for r in report.records]
    assert names[:3] == ["logits", "cache.layers[0].keys", "cache.layers[0].values"]
    assert not report.any_suspect  # a repr with an address, flags and devices are not compared


class OpaqueModel(torch.nn.Module):
    def forward(self, x):
        return {"y": x * 2, "handle": object()}  # a new object, with a new identity, on every run


def test_an_opaque_output_is_skipped_with_a_reason_never_suspect():
    report = rlx_nb.backend_divergence(OpaqueModel(), torch.randn(3), backends=["cpu-nomkldnn"])
    rec = report.record("cpu-nomkldnn", "handle")
    assert rec.verdict == VERDICT_SKIPPED and rec.verdict != SUSPECT
    assert "not compared" in rec.reason and "object" in rec.reason


class CacheInput(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, past):
        past.layers.append(Layer(x, x))  # grows the cache the caller passed, as decoders do
        return self.lin(x) + sum(layer.keys.sum() for layer in past.layers)


def test_an_input_object_is_private_to_each_run():
    past = Cache(Layer(torch.ones(2, 4), torch.ones(2, 4)))
    report = rlx_nb.backend_divergence(CacheInput(), (torch.randn(2, 4), past), backends=["cpu-nomkldnn"])
    assert not report.any_suspect  # every run saw one layer plus its own, never the others'
    assert len(past.layers) == 1  # the user's cache is untouched
