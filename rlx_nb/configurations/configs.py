"""The configurations one row is computed in: alone (the reference), inside batches of other sizes and at other
positions, padded, and -- for a decoder with a cache -- prefilled in chunks or decoded token by token.

A model's inputs are its batch-first tensors (one tensor, a tuple, or a dict of keyword arguments such as a Hugging
Face model's ``input_ids`` and ``attention_mask``); row ``i`` is slice ``i`` of every one of them.  Each
:class:`Config` builds the inputs of its run from the rows and says where row ``i`` is in the run's outputs; its
outputs are then cut back to what the row computed alone (:func:`aligned`), so the two can be compared bit for bit.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
from collections.abc import Callable, Mapping
from typing import Any

import torch

from rlx_nb._support.tree import flatten
from rlx_nb.errors import InputError

BATCH_SIZES = (2, 3, 4, 8, 16)
"""The batch sizes a row is computed inside by default: odd ones and powers of two (a kernel may choose another
path by size: on this machine ``F.linear`` gives other bits at 1, 2 and 3 rows than at 4, 8 and 16)."""
PAD = 3
"""Padding tokens added, left and right, by default."""


@dataclasses.dataclass
class Inputs:
    """A model's inputs by name, each batch-first, and how the model takes them."""

    tensors: dict[str, torch.Tensor]
    keywords: bool

    @classmethod
    def of(cls, inputs: Any) -> Inputs:
        if isinstance(inputs, torch.Tensor):
            named, keywords = {"input": inputs}, False
        elif isinstance(inputs, Mapping):
            named, keywords = dict(inputs), True
        elif isinstance(inputs, (tuple, list)):
            named, keywords = {f"input[{k}]": v for k, v in enumerate(inputs)}, False
        else:
            raise InputError(f"inputs must be a batch-first tensor, a tuple of them, or a dict of keyword arguments; "
                             f"got {type(inputs).__name__}")  # fmt: skip
        bad = [k for k, v in named.items() if not isinstance(v, torch.Tensor) or v.dim() == 0]
        if bad:
            raise InputError(f"every input must be a batch-first tensor (row i is slice i); not {bad}")
        sizes = {k: v.shape[0] for k, v in named.items()}
        if len(set(sizes.values())) != 1:
            raise InputError(f"the inputs' first dimensions differ ({sizes}): each must hold the same rows")
        return cls(named, keywords)

    @property
    def rows(self) -> int:
        return next(iter(self.tensors.values())).shape[0]

    def row(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i : i + 1] for k, v in self.tensors.items()}

    def call(self, model: Any, named: dict[str, torch.Tensor]) -> Any:
        return model(**named) if self.keywords else model(*named.values())

    @property
    def tokens(self) -> bool:
        """Whether the inputs are a sequence of token ids (a dict with ``input_ids``): padding applies."""
        return self.keywords and "input_ids" in self.tensors and self.tensors["input_ids"].dim() == 2


@dataclasses.dataclass
class Config:
    """One way of computing row ``row``: ``kind`` (batch, position, padding, cache), its name as the tables show it,
    and ``run(model) -> outputs`` with the row's outputs already cut to what it computes alone."""

    kind: str
    name: str
    row: int
    run: Callable[[Any], dict[str, torch.Tensor]]
    where: dict[str, Any] = dataclasses.field(default_factory=dict)
    """What the op alignment needs: the row's place in the batch (``at``, ``size``) and its padding (``pad``,
    ``side``)."""
    last: Callable[[Any], Callable[[Any], Any]] | None = None
    """For a run of several calls (a cache): ``last(model)`` runs all but its last call and returns that call, whose
    ops are the ones compared (a decode step's, against the same positions of the row computed whole)."""
    window: tuple[int, int] | None = None
    """With ``last``: the positions that call computes (from, of the row's length)."""


def outputs(out: Any) -> dict[str, torch.Tensor]:
    """A model's floating tensor outputs by name (a ``ModelOutput``'s and its cache's too); differentiable where
    gradients are on (a row's per-sample gradients are taken from them)."""
    keep = torch.is_grad_enabled()
    return {
        k: v if keep else v.detach() for k, v in flatten(out) if isinstance(v, torch.Tensor) and v.is_floating_point()
    }


def aligned(t: torch.Tensor, like: torch.Size, *, at: int = 0, size: int = 1, pad: int = 0, side: str = "") -> Any:
    """``t`` (a run's tensor) cut to the row's part shaped ``like`` (the row alone), or None where they do not align:
    the batch dimension (``size`` rows, the row at ``at``; or rows flattened with another dimension), and the
    sequence dimensions padded by ``pad`` tokens on ``side``."""
    if tuple(t.shape) == tuple(like):
        return t
    if t.dim() != len(like) or t.dim() == 0:
        return None
    if t.shape[0] != like[0]:
        if t.shape[0] == size * like[0]:
            k = like[0]
            t = t[at * k : (at + 1) * k]
        elif pad and t.shape[0] == like[0] + pad:  # (one row's tokens flattened: a linear's rows)
            t = t.narrow(0, pad if side == "left" else 0, like[0])
        else:
            return None
    for d in range(1, t.dim()):
        if t.shape[d] != like[d]:
            if pad and t.shape[d] == like[d] + pad:
                t = t.narrow(d, pad if side == "left" else 0, like[d])
            else:
                return None
    return t


def windowed(t: torch.Tensor, like: torch.Size, lo: int, n: int) -> Any:
    """``t`` (the row computed whole, ``n`` positions) cut to positions ``lo`` to ``n`` where a run's last call
    (shaped ``like``) computed only those: every dimension of ``n`` against ``n - lo`` narrowed, the others (the
    keys a cached call reads: all ``n``) as they are; None where they do not align."""
    if tuple(t.shape) == tuple(like):
        return t
    if t.dim() != len(like):
        return None
    for d in range(t.dim()):
        if t.shape[d] != like[d]:
            if t.shape[d] == n and like[d] == n - lo:
                t = t.narrow(d, lo, n - lo)
            else:
                return None
    return t


def _with_others(inputs: Inputs, i: int, size: int, at: int) -> dict[str, torch.Tensor]:
    # A batch of ``size`` rows with row ``i`` at ``at``; the others are the other rows, cycled (row i itself where it
    # is the only one).
    others = [r for r in range(inputs.rows) if r != i] or [i]
    order = [others[k % len(others)] for k in range(size - 1)]
    order.insert(at, i)
    return {k: v[order] for k, v in inputs.tensors.items()}


def batch_configs(inputs: Inputs, i: int, sizes: tuple[int, ...]) -> list[Config]:
    """Row ``i`` first and last inside batches of each size."""
    out = []
    for size in sizes:
        for at in sorted({0, size - 1}):
            named = _with_others(inputs, i, size, at)
            kind = "batch" if at == 0 else "position"

            def run(model: Any, named=named, at=at, size=size) -> dict[str, torch.Tensor]:
                return {k: v[at : at + 1] for k, v in outputs(inputs.call(model, named)).items() if v.shape[0] == size}

            out.append(Config(kind, f"batch of {size}, at {at}", i, run, {"at": at, "size": size}))
    return out


def _takes(model: Any, name: str) -> bool:
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def padding_configs(model: Any, inputs: Inputs, i: int, pad: int, pad_id: int) -> list[Config]:
    """Row ``i`` padded by ``pad`` masked tokens on the left and on the right, and beside a row of padding only."""
    row = inputs.row(i)
    ids = row["input_ids"]
    mask = row.get("attention_mask", torch.ones_like(ids))
    positions = _takes(model, "position_ids")
    out = []
    for side in ("left", "right"):
        pads = torch.full((1, pad), pad_id, dtype=ids.dtype)
        zeros = torch.zeros((1, pad), dtype=mask.dtype)
        named = {**row, "input_ids": torch.cat([pads, ids] if side == "left" else [ids, pads], 1),
                 "attention_mask": torch.cat([zeros, mask] if side == "left" else [mask, zeros], 1)}  # fmt: skip
        if positions:
            named["position_ids"] = _positions(named["attention_mask"])

        def run(model: Any, named=named) -> dict[str, torch.Tensor]:
            return outputs(inputs.call(model, named))  # (cut to the row's tokens by the comparison: aligned)

        out.append(Config("padding", f"{side}-padded by {pad}", i, run, {"pad": pad, "side": side}))
    extra = {k: torch.cat([v, v], 0) for k, v in row.items()}
    extra["input_ids"][1:] = pad_id
    extra["attention_mask"] = torch.cat([mask, torch.zeros_like(mask)], 0)
    if positions:
        extra["position_ids"] = _positions(extra["attention_mask"])

    def beside(model: Any) -> dict[str, torch.Tensor]:
        return {k: v[:1] for k, v in outputs(inputs.call(model, extra)).items() if v.shape[0] == 2}

    out.append(Config("padding", "beside a padded row", i, beside, {"at": 0, "size": 2}))
    return out


def _cache_name(model: Any) -> str | None:
    # The keyword a decoder takes its cache by (Hugging Face: past_key_values; GPT-2 of transformers 5: cache).
    for name in ("past_key_values", "cache"):
        if _takes(model, name):
            return name
    return None


def has_cache(model: Any) -> bool:
    """Whether ``model`` decodes with a cache (a Hugging Face decoder: ``past_key_values`` or ``cache``, and
    ``use_cache``)."""
    return _cache_name(model) is not None and _takes(model, "use_cache")


def cache_configs(model: Any, inputs: Inputs, i: int) -> list[Config]:
    """Row ``i`` prefilled in two chunks (the second reading the first's cache: a prefix-cache hit) and decoded token
    by token after its first half, against the whole prefill: the logits of every position."""
    row = inputs.row(i)
    ids = row["input_ids"]
    n = ids.shape[1]
    if n < 2:
        raise InputError(f"cache configurations need rows of at least 2 tokens; got {n}")
    mask = row.get("attention_mask", torch.ones_like(ids))
    positions, keyword = _takes(model, "position_ids"), _cache_name(model)

    def part(lo: int, hi: int, past: Any) -> dict[str, Any]:
        named = {**{k: v for k, v in row.items() if k not in ("input_ids", "attention_mask")},
                 "input_ids": ids[:, lo:hi], "attention_mask": mask[:, :hi], "use_cache": True}  # fmt: skip
        if past is not None:
            named[keyword] = past
        if positions:
            named["position_ids"] = _positions(mask[:, :hi])[:, lo:hi]
        return named

    def chunks(model: Any, bounds: list[int]) -> tuple[list[torch.Tensor], Any]:
        past, logits = None, []
        for lo, hi in itertools.pairwise(bounds):
            out = model(**part(lo, hi, past))
            logits.append(out.logits.detach())
            past = getattr(out, keyword, None)
            if past is None:
                past = getattr(out, "past_key_values", None)
        return logits, past

    def config(name: str, bounds: list[int]) -> Config:
        def last(model: Any) -> Callable[[Any], Any]:
            past = chunks(model, bounds[:-1])[1]
            return lambda m: m(**part(bounds[-2], bounds[-1], past))

        return Config("cache", name, i, lambda m: {"logits": torch.cat(chunks(m, bounds)[0], 1)},
                      last=last, window=(bounds[-2], n))  # fmt: skip

    half = max(1, n // 2)
    return [config("prefilled in two chunks", [0, half, n]),
            config("decoded token by token", [0, half, *range(half + 1, n + 1)])]  # fmt: skip


__all__ = ["BATCH_SIZES", "PAD", "Config", "Inputs", "aligned", "batch_configs", "cache_configs", "has_cache",
           "outputs", "padding_configs", "windowed"]  # fmt: skip
