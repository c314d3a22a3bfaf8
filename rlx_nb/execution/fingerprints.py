"""Fingerprints of a run's inputs and model: what saving, merging, gathering and baselines check.

Two kinds, both in a report's ``fingerprints``:

- ``inputs`` and ``model``: sha256 over every tensor's name, dtype, shape and bytes (:func:`fingerprint`).
  Nodes of a cluster must agree on ``inputs``; a baseline compares both.  They cost a pass over every byte
  (0.13 s per 200 MB here), so a run computes them only when something reads them (:func:`later`).
- ``input_structure`` and ``model_structure``: names, dtypes and shapes, no values (:func:`structure`):
  what a baseline names when two reports were made from different models or inputs.
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch

from rlx_nb._support.hugepages import raw_bytes
from rlx_nb._support.tree import flatten


def fingerprint(obj: Any) -> str:
    """sha256 over every tensor leaf's name, dtype, shape and bytes (and plain leaves' reprs)."""
    return _fingerprint(obj, lambda data: data)  # (sha256 over the bytes themselves: no copy of them)


def quick_fingerprint(obj: Any) -> str:
    """:func:`fingerprint` with each tensor's bytes summed by CRC-32 instead of sha256 (3.5 GB/s against 1.5 here):
    what a snapshot and a diff compare, which pass over every weight each time.  It tells accidental differences
    (another checkpoint, one weight edited) apart, not a crafted collision."""
    import zlib

    return _fingerprint(obj, lambda data: zlib.crc32(data).to_bytes(4, "little"))


def _fingerprint(obj: Any, summed: Callable[[memoryview], Any]) -> str:
    # sha256 over every leaf's name, dtype and shape, and ``summed(its bytes)`` (a plain leaf: its repr).
    h = hashlib.sha256()
    for name, leaf in flatten(obj):
        h.update(name.encode())
        if isinstance(leaf, torch.Tensor):
            t = leaf.detach().to("cpu").contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            if t.numel():
                h.update(summed(raw_bytes(t)))
        else:
            h.update(repr(leaf).encode())
    return h.hexdigest()[:32]


STRUCTURE_CHARS = 400
"""How much of a structure's listing :func:`structure` keeps (its hash covers all of it)."""


def structure(obj: Any) -> str:
    """Names, dtypes and shapes of every tensor leaf (no values): a short listing and a hash of all of it.

    Examples
    --------
    >>> structure((torch.zeros(2, 3),))
    '1 tensor(s), 6 element(s): out[0] float32 (2, 3) #1c98c1375054'
    """
    items, elements = [], 0
    for name, leaf in flatten(obj):
        if isinstance(leaf, torch.Tensor):
            items.append(f"{name} {str(leaf.dtype).removeprefix('torch.')} {tuple(leaf.shape)}")
            elements += leaf.numel()
    listing = ", ".join(items)
    digest = hashlib.sha256(listing.encode()).hexdigest()[:12]
    if len(listing) > STRUCTURE_CHARS:
        listing = listing[:STRUCTURE_CHARS] + " ..."
    return f"{len(items)} tensor(s), {elements} element(s): {listing} #{digest}"


def later(args: tuple, model: Any, params: Mapping[str, torch.Tensor] | None) -> Callable[[], dict]:
    # The fingerprints hash every input and parameter byte (0.13 s per 200 MB here), and only saving,
    # merging, gathering and baselines read them: hash when read, from the user's own tensors, which is
    # what the run ran on as long as none was changed in place since (their version counters tell).  The
    # model's tensors are watched through weak references, so a report does not keep a model's weights
    # alive; a parameter replaced since the run (not the same tensor any more) counts as a change.
    # Tensors made under torch.inference_mode keep no version counter: with any of those, hash now.
    # The structures (names, dtypes, shapes: what a baseline names when they differ) cost nothing: now.
    module = model if isinstance(model, torch.nn.Module) else None
    shapes = {"input_structure": structure(args)}
    if module is not None:
        shapes["model_structure"] = structure({**dict(module.state_dict()), **dict(params or {})})
    given = [t for _, t in flatten((args, dict(params or {}))) if isinstance(t, torch.Tensor)]
    if any(t.is_inference() for t in given + (_model_tensors(module) if module is not None else [])):
        now = {**shapes, "inputs": fingerprint(args), "model": _weights(module, params)}
        return lambda: now
    given_versions = [t._version for t in given]
    model_ref = weakref.ref(module) if module is not None else None
    own = [(weakref.ref(t), t._version) for t in _model_tensors(module)] if module is not None else []

    def model_unchanged(user_model: torch.nn.Module) -> bool:
        now = _model_tensors(user_model)
        return len(now) == len(own) and all(
            ref() is t and t._version == v for (ref, v), t in zip(own, now, strict=True)
        )

    def compute() -> dict:
        user_model = model_ref() if model_ref is not None else None
        changed = [t._version for t in given] != given_versions
        inputs = None if changed else fingerprint(args)
        if changed or (model_ref is not None and (user_model is None or not model_unchanged(user_model))):
            state = None  # changed since the run, or the model is gone: the run's bytes are not at hand
        else:
            state = _weights(user_model, params)
        return {"inputs": inputs, "model": state, **shapes}

    return compute


def _weights(model: torch.nn.Module | None, params: Mapping[str, torch.Tensor] | None) -> str:
    return fingerprint({**(dict(model.state_dict()) if model is not None else {}), **dict(params or {})})


def _model_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]
