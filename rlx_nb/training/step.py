"""What one training step is: the model, its batches, its loss, its optimizer, and the state a step starts from.

A step is ``loss_fn(model, batch)`` (forward and loss: the caller's own, so any model and batch work; by default a
batch of keyword arguments whose model returns a Hugging Face ``ModelOutput`` with ``loss``), ``loss.backward()``, then
``optimizer.step()``.  Every run of a step sets torch's random number generator from the step's number first, so the
runs of one step draw the same random numbers (dropout under a fixed seed) whatever ran before.  A :class:`State` is
all a step starts from -- the parameters, the buffers, the optimizer's state -- and can start any number of runs.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from rlx_nb.errors import InputError


def _loss_of(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    # The default loss: a batch of keyword arguments, a model that returns its own loss (Hugging Face's ModelOutput).
    if not isinstance(batch, Mapping):
        raise InputError(
            f"a batch of {type(batch).__name__} needs loss_fn(model, batch) -> loss; only a dict batch whose model "
            "returns its own loss (a Hugging Face ModelOutput with labels in the batch) has a default"
        )
    out = model(**batch)
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise InputError(
            f"the model returned {type(out).__name__} without a loss: put the labels in the batch, or pass "
            "loss_fn(model, batch) -> loss"
        )
    return loss


ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
               torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.ASGD,
               torch.optim.Rprop)  # fmt: skip
"""torch's optimizers whose for-loop update is elementwise: each element of a parameter is updated from that
element's gradient and state and the parameter's step count alone (exactly these types, not a subclass, which may
step otherwise; not Adafactor, Muon or L-BFGS, whose update reads a whole parameter or all of them)."""


@dataclasses.dataclass
class Spec:
    """The training a call judges: ``loss(model, batch)``, the optimizer factory and the batch of each step."""

    loss: Callable[[torch.nn.Module, Any], torch.Tensor]
    optimizer: Callable[[Any], torch.optim.Optimizer]
    batches: Callable[[int], Any]
    steps: int
    seed: int = 0
    elementwise: bool = False
    """The optimizer is one of :data:`ELEMENTWISE`: the float64 reference's update runs a piece at a time
    (:mod:`rlx_nb.training.reference`), and a local step runs the reference after the float32 runs."""

    def batch(self, step: int) -> Any:
        return self.batches(step)

    def seeded(self, step: int) -> None:
        """torch's random numbers for ``step``: the same in every run of it (dropout, a sampled mask)."""
        torch.manual_seed(self.seed * 1_000_003 + step)


def batch_source(batches: Any, steps: int) -> Callable[[int], Any]:
    """``batches`` as ``step -> batch``: a list or tuple is cycled, a callable is called with the step, any other
    iterable is read as the steps ask (each batch once, kept: every run of a step gets the same one)."""
    if callable(batches) and not isinstance(batches, torch.nn.Module):
        return batches
    if isinstance(batches, (list, tuple)):
        if not batches:
            raise InputError("batches is empty: give at least one batch (a list is cycled over the steps)")
        return lambda step: batches[step % len(batches)]
    if isinstance(batches, (torch.Tensor, Mapping)):
        raise InputError(
            f"batches must be a list of batches (cycled), a callable step -> batch or an iterable of them; got one "
            f"{type(batches).__name__} (wrap it in a list to train on it every step)"
        )
    if not isinstance(batches, Iterable):
        raise InputError(
            f"batches must be a list, a callable step -> batch or an iterable; got {type(batches).__name__}"
        )
    it: Iterator[Any] = iter(batches)
    seen: list[Any] = []

    def read(step: int) -> Any:
        while len(seen) <= step:
            try:
                seen.append(next(it))
            except StopIteration:
                raise InputError(
                    f"batches ran out after {len(seen)} of the {steps} steps asked: give a list (cycled), a callable "
                    "step -> batch, or steps= at most the batches there are"
                ) from None
        return seen[step]

    return read


def checked_spec(model: Any, batches: Any, loss_fn: Any, optimizer: Any, steps: Any, *, seed: int = 0) -> Spec:
    """The call's training, every part checked with a clear error (what is wrong and what is allowed)."""
    if not isinstance(model, torch.nn.Module):
        raise InputError(
            f"model must be a torch.nn.Module (its parameters are what trains); got {type(model).__name__}"
        )
    if not any(p.requires_grad for p in model.parameters()):
        raise InputError("the model has no parameter that requires a gradient: nothing would train")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0:
        raise InputError(f"steps must be a whole number of steps >= 1; got {steps!r}")
    if loss_fn is not None and not callable(loss_fn):
        raise InputError(f"loss_fn must be a callable loss_fn(model, batch) -> loss tensor; got {loss_fn!r}")
    if not callable(optimizer) or isinstance(optimizer, torch.optim.Optimizer):
        raise InputError(
            "optimizer must be a factory, optimizer(params) -> torch.optim.Optimizer (e.g. "
            "lambda params: torch.optim.AdamW(params, lr=1e-3)), called once per run; got "
            f"{type(optimizer).__name__}"
        )
    probe = optimizer(copy.deepcopy(list(model.parameters())))
    if not isinstance(probe, torch.optim.Optimizer):
        raise InputError(f"optimizer(params) must return a torch.optim.Optimizer; it returned {type(probe).__name__}")
    elementwise = type(probe) in ELEMENTWISE
    return Spec(loss_fn or _loss_of, optimizer, batch_source(batches, steps), steps, seed, elementwise)


IMPLEMENTATION = ("foreach", "fused", "capturable", "differentiable")
"""An optimizer's options that choose its implementation, not its arithmetic's values: a run started from a saved
state keeps its own."""


@dataclasses.dataclass
class State:
    """All a step starts from: the model (its parameters and buffers) and the optimizer's state, kept as copies."""

    model: torch.nn.Module
    optimizer: dict

    def resolved(self) -> State:
        """This state (a :class:`~rlx_nb.training.divergence.Replayed` one is trained again when first asked)."""
        return self

    def copy(self) -> State:
        """A state of its own (this one may be a live model's: :func:`~rlx_nb.training.divergence.training_divergence`
        judges a step from the oracle's model as it stands)."""
        return State(copy.deepcopy(self.model), copy.deepcopy(self.optimizer))

    def start(self, spec: Spec, *, dtype: torch.dtype | None = None,
              make: Callable[[Any], torch.optim.Optimizer] | None = None,
              load: bool = True) -> tuple[torch.nn.Module, Any]:  # fmt: skip
        """A fresh model and optimizer at this state (in ``dtype`` where given: the float64 reference's).
        ``load=False``: the optimizer's options as they were saved but none of its state (the float64 reference's
        update converts each parameter's own as it comes to it: :mod:`rlx_nb.training.reference`)."""
        model = copy.deepcopy(self.model)
        if dtype is not None:
            model = model.to(dtype)
        opt = (make or spec.optimizer)(list(model.parameters()))
        saved = self.optimizer if load else {**self.optimizer, "state": {}}
        if dtype is None:
            state = copy.deepcopy(saved)  # (loading shares tensors of the right dtype: the run's own copies)
        else:  # (converted straight from the kept state, not from a copy of it: the conversion is the copy)
            state = {"state": {k: converted(s, dtype) for k, s in saved["state"].items()},
                     **{k: copy.deepcopy(v) for k, v in saved.items() if k != "state"}}  # fmt: skip
        return model, restored(opt, state)


def converted(state: Mapping[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """One parameter's optimizer state with its floating tensors in ``dtype`` (its step count as it was), as copies
    (a copy where the state is in ``dtype`` already: a float64 model's state is the live optimizer's own, which the
    float64 reference's update would otherwise step in place)."""
    return {n: v.to(dtype, copy=True) if torch.is_tensor(v) and v.is_floating_point() and n != "step"
            else copy.deepcopy(v) for n, v in state.items()}  # fmt: skip


def restored(opt: torch.optim.Optimizer, state: dict) -> torch.optim.Optimizer:
    """``opt`` (just made) at the saved ``state``: its values as they were saved, its implementation as it was made."""
    made = [{k: g[k] for k in IMPLEMENTATION if k in g} for g in opt.param_groups]
    opt.load_state_dict(state)  # (which sets every group's options as they were saved ...)
    for group, own in zip(opt.param_groups, made, strict=True):
        group.update(own)  # (... but the implementation is the one this run asked for)
    return opt


def to_dtype(batch: Any, dtype: torch.dtype) -> Any:
    """A batch with its floating tensors in ``dtype`` (integers, token ids and masks as they are)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(dtype) if batch.is_floating_point() else batch
    if isinstance(batch, Mapping):
        return {k: to_dtype(v, dtype) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_dtype(v, dtype) for v in batch)
    return batch


def perturbed(model: torch.nn.Module, seed: int, relative: float = 2.0**-24) -> torch.nn.Module:
    """A copy of ``model`` with every floating parameter moved by ``relative`` of itself, each element up or down at
    random (``seed``): about one ulp of float32 with the default, round-off by construction."""
    out = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            if p.is_floating_point():
                sign = torch.randint(0, 2, p.shape, generator=gen, dtype=torch.int8).to(p.dtype) * 2 - 1
                p.mul_(1 + relative * sign)
    return out


def grad_norm(model: torch.nn.Module) -> float:
    """The L2 norm of every parameter's gradient (0 where none has one)."""
    return l2_norm([p.grad.detach() for p in model.parameters() if p.grad is not None])


ROW = 1024
"""A norm's rows: each row's norm is taken in float32 (a vectorised pass, within a few float32 ulps over so few
terms), the rows' combined in float64."""
_BLOCK = 1 << 18


def _squares(flat: torch.Tensor) -> torch.Tensor:
    # The sum of squares of a flat tensor in float64, from its rows' norms (in float32 for a half-precision tensor,
    # in its own precision otherwise: the float64 reference's in float64).
    rows = flat.numel() // ROW
    dtype = torch.float32 if flat.dtype in (torch.float16, torch.bfloat16) else None
    parts = [torch.linalg.vector_norm(flat[: rows * ROW].view(rows, ROW), dim=1, dtype=dtype)] if rows else []
    if flat.numel() > rows * ROW:
        parts.append(torch.linalg.vector_norm(flat[rows * ROW :], dtype=dtype).reshape(1))
    return torch.cat(parts).double().square().sum() if parts else torch.zeros((), dtype=torch.float64)


def l2_norm(tensors: list[torch.Tensor]) -> float:
    """The L2 norm of all ``tensors`` together, within a few float32 ulps of exact: float32 norms of rows of
    :data:`ROW` elements (a vectorised pass each), combined in float64.

    One float32 norm of a whole tensor was not: torch's CPU norm of 8.4M float32 elements was 0.5% off (its
    accumulation is float32's over millions of terms), enough to swamp the difference of two runs' gradient norms;
    accumulated in float64 (``dtype=torch.float64``) it took 10x as long, and the eleven norms of a step cost more than
    the step's backward on an 11.5M-parameter MLP."""
    total = sum((_squares(t.detach().reshape(-1)) for t in tensors), torch.zeros((), dtype=torch.float64))
    return math.sqrt(float(total))


def l2_distance(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """``l2_norm`` of ``a - b`` (tensor by tensor), the difference taken in blocks of one buffer: no copy of the
    tensors (a 46 MB difference made for every distance was page faults, 60% of its time)."""
    buf = torch.empty(_BLOCK, dtype=torch.float32)
    total = torch.zeros((), dtype=torch.float64)
    for x, y in zip(a, b, strict=True):
        xf, yf = x.detach().reshape(-1), y.detach().reshape(-1)
        if xf.dtype != torch.float32 or yf.dtype != torch.float32:
            total += _squares(xf.float() - yf.float())
            continue
        for at in range(0, xf.numel(), _BLOCK):
            n = min(_BLOCK, xf.numel() - at)
            total += _squares(torch.sub(xf[at : at + n], yf[at : at + n], out=buf[:n]))
    return math.sqrt(float(total))


def log_spaced(steps: int, extra: Iterable[int] = ()) -> list[int]:
    """The steps a call judges locally by default: the first, then 1, 2, 4, 8 ... and the last, with ``extra``."""
    picked = {0, steps - 1, *itertools.takewhile(lambda s: s < steps, (2**k for k in range(64)))}
    return sorted(s for s in picked | set(extra) if 0 <= s < steps)


__all__ = [
    "ELEMENTWISE",
    "IMPLEMENTATION",
    "Spec",
    "State",
    "batch_source",
    "checked_spec",
    "converted",
    "grad_norm",
    "l2_distance",
    "l2_norm",
    "log_spaced",
    "perturbed",
    "restored",
    "to_dtype",
]
