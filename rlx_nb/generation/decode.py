"""A causal language model's decode, as one module every backend can run: the steps' logits as outputs.

:class:`Decode` wraps a Hugging Face causal LM (with its own cache, as it is) or a user's
``step(model, input_ids, cache) -> (logits, cache)``.  Called with the prompt followed by the tokens to
feed, it runs the prompt (the prefill) and then one decode step per token, each with the cache the
previous step returned, and returns ``{"step 0": logits, "step 1": logits, ...}``: the last position's
logits after each step (``batch x vocab``).

*Teacher forcing*: every step is fed the oracle's token, whatever the backend's own logits preferred, so
each backend's step ``k`` sees the same tokens as the oracle's and the fp64 reference's step ``k``: the
steps stay aligned and one step's error is compared with the same step's round-off.  A backend still
keeps its own cache (its own keys and values, with its own errors), which is how error grows through the
cache.  ``free=True`` instead feeds each step its own greedy token (the text the backend would generate).

Because a decode is one module with tensor outputs, every backend runs it as it runs any model: the
eager ones (oneDNN off, reduced precision, faults, a user's) as they are; the fp64 reference casts it
whole.  Compiled backends compile the step, not the loop (:mod:`rlx_nb.generation.backends`).

rlx_nb's helper runs (the fp64 reference, the sequential-sums run, the precision anchors:
:func:`rlx_nb._support.meter.in_helper_run`) need the steps' *values*, not the decode's own computation: there a
Hugging Face model teacher-forced runs every step at once, one forward over the prompt and the fed tokens
without a cache (``whole_helpers``).  A causal model's logits at position ``prompt_len - 1 + k`` are step
``k``'s: the same dot products over the same keys, without 64 calls' overhead.  In float64 the two
computations agree to ~1e-15, far below any float32 budget; a sequential-sums or anchor run so computed is a
legitimate float32 (or emulated) computation of the same logits, which is what those runs measure.
:func:`rlx_nb.generation_divergence` checks that the oracle's decode agrees with the whole-sequence
reference (a model whose cached path computes something else would not) and otherwise runs the helpers
step by step.
"""

from __future__ import annotations

import copy
import functools
import types
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from rlx_nb._support import meter as phases
from rlx_nb._support.hugepages import weights_bytes
from rlx_nb.errors import still_interrupted

Step = Callable[[Any, torch.Tensor, Any], tuple[torch.Tensor, Any]]

STREAM_FROM_BYTES = 64 << 20
"""Weights (parameters and buffers) from which a decode's fp64 reference is streamed (:attr:`Decode.streams_reference`).  At GPT-2
small's 500 MB the two take the same time (the cast back against ~500 ops' Python calls) and streaming never
holds every weight in float64; on a zoo decoder's 1 MB lending saves a third of the reference's ~18 ms."""


def hf_step(model: Any, input_ids: torch.Tensor, cache: Any, attention_mask: torch.Tensor | None = None) -> tuple:
    """One step of a Hugging Face causal LM with its own cache: ``(logits, cache)``."""
    kwargs: dict[str, Any] = {"input_ids": input_ids, "use_cache": True}
    if cache is not None:
        kwargs[cache_argument(model)] = cache
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    out = model(**kwargs)
    logits = getattr(out, "logits", None)
    if logits is None:
        raise TypeError(
            f"{type(model).__name__} returns no logits ({type(out).__name__}): generation needs a causal LM "
            "(e.g. ...ForCausalLM), or a step(model, input_ids, cache) -> (logits, cache)"
        )
    cache = getattr(out, "cache", None)
    if cache is None:
        cache = getattr(out, "past_key_values", None)
    return logits, cache


def cache_argument(model: Any) -> str:
    """The keyword a Hugging Face model takes its cache by: ``cache`` (transformers 5.2x) or ``past_key_values``."""
    model = getattr(model, "_orig_mod", model)  # (a torch.compile'd model: the module it wraps)
    fn = getattr(model, "forward", model)
    try:
        return _cache_keyword(getattr(fn, "__func__", fn))  # (once per forward function, not once per step)
    except TypeError:  # (unhashable)
        return _cache_keyword.__wrapped__(fn)


@functools.lru_cache(maxsize=64)
def _cache_keyword(fn: Any) -> str:
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def last_logits(logits: Any) -> torch.Tensor:
    """A step's logits at its last position (``batch x vocab``) from ``batch x [positions x] vocab``."""
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"a step must return (logits, cache) with logits a tensor, got {type(logits).__name__}")
    if logits.dim() == 3:
        return logits[:, -1]
    if logits.dim() == 2:
        return logits
    raise TypeError(
        f"a step's logits must be batch x vocab or batch x positions x vocab, got shape {tuple(logits.shape)}"
    )


class Tokens:
    """The oracle's greedy tokens (``batch x steps``), kept for every run after it: one holder shared by every
    copy of its :class:`Decode` (a private copy, a backend's own, a cast one)."""

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None

    def __deepcopy__(self, memo: dict) -> Tokens:
        return self


class Decode(torch.nn.Module):
    """Prefill ``prompt_len`` tokens, then ``steps - 1`` decode steps; returns each step's last logits.

    ``forward(ids)``: ``ids`` is ``batch x (prompt_len + steps - 1)`` (teacher forcing: the prompt, then the
    tokens to feed), or ``batch x prompt_len`` when ``free`` (each step fed its own argmax).  ``step`` is
    ``None`` for a Hugging Face model's own call, else the user's function.  ``run_step`` may be replaced by a
    backend (a compiled step: :mod:`rlx_nb.generation.backends`).

    ``oracle_first``: ``forward`` gets the prompt only; its first call (the oracle's run, the first a
    :func:`rlx_nb.run` makes) decodes greedily and keeps its tokens (``tokens.value``); every later call is
    teacher-forced on them (:meth:`fed`).  The oracle's greedy decode is then the oracle's run itself, and a
    determinism rerun (or ``cpu-nomkldnn``'s run, where it is the second run: :func:`rlx_nb.execution.run.run`) is the
    teacher-forced decode of the same tokens: bit for bit the same computation.
    """

    def __init__(self, model: Any, *, prompt_len: int, steps: int, step: Step | None = None, free: bool = False,
                 masked: bool = False, oracle_first: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.model = model
        self.prompt_len, self.steps, self.free, self.masked = prompt_len, steps, free, masked
        self.step = step
        self.run_step: Callable[..., tuple] | None = None
        self.whole_helpers = step is None and not free
        self.tokens = Tokens() if oracle_first else None

    @property
    def streams_reference(self) -> bool:
        """Whether the fp64 reference should cast each weight where its op uses it (:func:`rlx_nb.execution.run.run`) rather
        than the whole model at once: its helper runs are one forward over the whole sequence, which uses each
        weight once (a tied one twice), so that is one cast per weight, none back, and never every weight in
        float64 together.  Below :data:`STREAM_FROM_BYTES` of weights the whole model is lent instead: casting
        it back costs less than the streaming mode's Python call on every op (the same float64 values)."""
        if not (self.whole_helpers and self.run_step is None):
            return False
        if not isinstance(self.model, torch.nn.Module):
            return True
        return weights_bytes(self.model) >= STREAM_FROM_BYTES

    def fed(self, ids: torch.Tensor) -> torch.Tensor:
        """The ids a teacher-forced run is fed: the prompt and the oracle's tokens before the last (``ids``
        itself where no oracle tokens are held)."""
        if self.tokens is None or self.tokens.value is None:
            return ids
        return teacher_ids(ids[:, : self.prompt_len], self.tokens.value)

    def call(self, input_ids: torch.Tensor, cache: Any, mask: torch.Tensor | None) -> tuple:
        if self.run_step is not None:
            return self.run_step(input_ids, cache, mask)
        return self.call_model(self.model, input_ids, cache, mask)

    def call_model(self, model: Any, input_ids: torch.Tensor, cache: Any, mask: torch.Tensor | None) -> tuple:
        """One step of ``model`` (the wrapped one, or a compiled form of it): ``(logits, cache)``."""
        if self.step is None:
            return hf_step(model, input_ids, cache, mask)
        return self.step(model, input_ids, cache)

    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.tokens is not None and self.tokens.value is None:  # the oracle's run: greedy, its tokens kept
            out = self.loop(ids[:, : self.prompt_len], free=True)
            self.tokens.value = torch.stack([out[step_name(k)].argmax(-1) for k in range(self.steps)], dim=1)
            return out
        ids = self.fed(ids)
        if self.whole_helpers and self.run_step is None and phases.in_helper_run():
            return self.whole(ids)
        return self.loop(ids, free=self.free)

    def loop(self, ids: torch.Tensor, *, free: bool) -> dict[str, torch.Tensor]:
        """The prefill and every step, each with the cache the step before returned."""
        p = self.prompt_len
        batch = ids.shape[0]
        mask = torch.ones(batch, p, dtype=torch.long, device=ids.device) if self.masked else None
        current, cache = ids[:, :p], None
        out: dict[str, torch.Tensor] = {}
        for k in range(self.steps):
            try:
                logits, cache = self.call(current, cache, mask)
            except Exception as exc:  # (which step, and what it was fed: a runtime written for whole sequences)
                still_interrupted(exc)
                fed = f"the prompt's {current.shape[1]} tokens" if k == 0 else "one new token and the cache"
                exc.add_note(f"rlx_nb: raised in decode step {k} ({fed})")
                raise
            last = last_logits(logits)
            out[step_name(k)] = last
            if k + 1 == self.steps:
                break
            if free:
                current = last.argmax(-1, keepdim=True).to(ids.dtype)
            else:
                current = ids[:, p + k : p + k + 1]
            if mask is not None:
                mask = torch.cat([mask, mask.new_ones(batch, 1)], dim=1)
        return out

    def whole(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every teacher-forced step's logits from one forward over ``ids`` without a cache (a helper run)."""
        kwargs: dict[str, Any] = {"input_ids": ids, "use_cache": False}
        if self.masked:
            kwargs["attention_mask"] = torch.ones(ids.shape, dtype=torch.long, device=ids.device)
        logits = self.model(**kwargs).logits
        p = self.prompt_len
        return {step_name(k): logits[:, p - 1 + k].contiguous() for k in range(self.steps)}


def teacher_ids(prompt: torch.Tensor, tokens: Any) -> torch.Tensor:
    """What a teacher-forced decode is fed: the prompt, then the oracle's ``tokens`` but the last."""
    return torch.cat([prompt, torch.as_tensor(tokens)[:, :-1].to(prompt)], dim=1)


def step_name(k: int) -> str:
    """The output name of step ``k``'s logits."""
    return f"step {k}"


def step_of(output: str) -> int:
    """The step number of an output named by :func:`step_name`."""
    return int(output.split()[-1])


# -- one step alone, for localize ------------------------------------------------------------------------


class AtStep(torch.nn.Module):
    """One step of a user's step function on its own: ``forward(token)`` with the oracle's cache of the steps
    before (copied per call, cast to the model's float format), for :func:`rlx_nb.localize`."""

    def __init__(self, model: Any, cache: Any, step: Step) -> None:
        super().__init__()
        self.model = model
        self._cache = [cache]  # (not a submodule or buffer: the backends never see it but through forward)
        self.step = step

    def forward(self, token: torch.Tensor) -> torch.Tensor:
        dtype = next((p.dtype for p in self.model.parameters() if p.is_floating_point()), torch.float32)
        logits, _ = self.step(self.model, token, _cast_cache(copy.deepcopy(self._cache[0]), dtype, token.device))
        return last_logits(logits)


def _one_step(base: torch.nn.Module, cache: Any, mask_len: int | None) -> torch.nn.Module:
    # The Hugging Face model itself (a private copy), its forward made one step: ``forward(token)`` with the
    # oracle's cache of the steps before.  Its modules keep the names the user's model gives them.
    base._rlx_nb_step = (cache, mask_len)
    base.forward = types.MethodType(_step_forward, base)
    return base


def _step_forward(self: torch.nn.Module, token: torch.Tensor) -> torch.Tensor:
    cache, mask_len = self._rlx_nb_step
    dtype = next((p.dtype for p in self.parameters() if p.is_floating_point()), torch.float32)
    kwargs: dict[str, Any] = {"input_ids": token, "use_cache": True}
    if cache is not None:
        kwargs[cache_argument(type(self))] = _cast_cache(copy.deepcopy(cache), dtype, token.device)
    if mask_len is not None:
        kwargs["attention_mask"] = torch.ones(token.shape[0], mask_len, dtype=torch.long, device=token.device)
    return last_logits(type(self).forward(self, **kwargs).logits)


def map_cache(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor], depth: int = 0) -> Any:
    """``fn`` applied to every tensor inside a cache object (lists, tuples, dicts, attributes; objects changed in
    place), returning the cache."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if depth > 6:
        return obj
    if isinstance(obj, (list, tuple)):
        cast = [map_cache(x, fn, depth + 1) for x in obj]
        return type(obj)(cast) if not hasattr(obj, "_fields") else type(obj)(*cast)
    if isinstance(obj, dict):
        return {k: map_cache(v, fn, depth + 1) for k, v in obj.items()}
    if hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.nn.Module)):
        for k, v in list(vars(obj).items()):
            setattr(obj, k, map_cache(v, fn, depth + 1))
    return obj


def _cast_cache(obj: Any, dtype: torch.dtype, device: Any) -> Any:
    # Every floating tensor inside a cache object to ``dtype``, every tensor to ``device``.
    return map_cache(obj, lambda t: t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device))


@torch.no_grad()
def at_step(model: Any, ids: torch.Tensor, tokens: np.ndarray, k: int, *, step_fn: Step | None,
            masked: bool) -> tuple[torch.nn.Module, torch.Tensor]:  # fmt: skip
    """(module, token): step ``k`` alone, the oracle's cache of steps ``0..k-1`` built here in float32."""
    from rlx_nb.execution.prepare import prepare_model

    base = prepare_model(model, None, None)
    fed = teacher_ids(ids, tokens)
    p = ids.shape[1]
    if k == 0:  # the prefill itself
        return _alone(base, None, step_fn, p if masked else None), ids.clone()
    decode = Decode(base, prompt_len=p, steps=k, step=step_fn, masked=masked)
    cache: list[Any] = []

    def keep(input_ids: torch.Tensor, c: Any, mask: Any) -> tuple:
        logits, new = decode.call_model(base, input_ids, c, mask)
        cache[:] = [new]
        return logits, new

    decode.run_step = keep
    decode(fed[:, : p + k])
    return _alone(base, cache[0], step_fn, (p + k) if masked else None), fed[:, p + k - 1 : p + k].clone()


def _alone(base: torch.nn.Module, cache: Any, step_fn: Step | None, mask_len: int | None) -> torch.nn.Module:
    # A Hugging Face model runs its one step itself (its module names as the user knows them); a user's step
    # function is wrapped (its modules under ``model.``).
    return AtStep(base, cache, step_fn) if step_fn is not None else _one_step(base, cache, mask_len)
