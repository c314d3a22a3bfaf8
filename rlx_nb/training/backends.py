"""How a training backend runs a step: its forward and backward (through a backend of the registry, compiled or not),
its optimizer (another implementation, compiled, or one of its own), and the switches around them.

A training backend changes one part of the step the oracle runs (float32 eager, the optimizer as the call's factory
makes it): ``cpu-nomkldnn`` the kernels, ``cpu-inductor`` the model compiled by ``torch.compile`` (forward and
backward), ``cpu-inductor-optimizer`` the optimizer's step compiled, ``optimizer:foreach`` / ``optimizer:for-loop`` /
``optimizer:fused`` the optimizer's implementation, ``threads`` torch's thread count, ``cpu-bf16`` autocast to
bfloat16 (judged on its own budget); any backend of the registry that runs eagerly and differentiably (a fault of
the catalogue, a user's runtime) runs the forward and backward; :func:`register_training_backend` adds a user's own
(an optimizer of its own, a forward through a registered backend).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from rlx_nb._support import switches
from rlx_nb.backends.registry import get_backend
from rlx_nb.errors import BackendError, InputError, did_you_mean


class LossModule(torch.nn.Module):
    """``loss(model, batch)`` as a module whose inputs are the batch's tensors: what a backend of the registry runs
    (``fn(module, inputs)``) and what a localization takes apart."""

    def __init__(self, model: torch.nn.Module, loss: Callable[[torch.nn.Module, Any], torch.Tensor], batch: Any):
        super().__init__()
        self.model, self._loss = model, loss
        self._keys = list(batch) if isinstance(batch, Mapping) else None
        self._kind = type(batch)

    @staticmethod
    def inputs(batch: Any) -> tuple:
        if isinstance(batch, Mapping):
            return tuple(batch.values())
        return tuple(batch) if isinstance(batch, (list, tuple)) else (batch,)

    def forward(self, *tensors: Any) -> torch.Tensor:
        if self._keys is not None:
            batch: Any = dict(zip(self._keys, tensors, strict=True))
        elif self._kind in (list, tuple):
            batch = self._kind(tensors)
        else:
            batch = tensors[0]
        return self._loss(self.model, batch)


@dataclasses.dataclass(frozen=True)
class TrainBackend:
    """One way of running a training step (module docstring)."""

    name: str
    description: str
    forward: str | None = None
    """A backend of the registry the forward and backward run through (``None``: eager, as the oracle)."""
    compile_model: bool = False
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None
    """An optimizer factory of the backend's own (``None``: the call's)."""
    optimizer_options: tuple[tuple[str, Any], ...] = ()
    """The call's optimizer made again with these options changed (``foreach``, ``fused``)."""
    compile_optimizer: bool = False
    switches: tuple[tuple[str, Any], ...] = ()
    threads: int | None = None
    autocast: torch.dtype | None = None
    compute_dtype: str = "float32"
    ranks: int = 0
    """Local ranks the step runs on under DistributedDataParallel (:mod:`rlx_nb.training.ddp`; 0: this process)."""

    def make_optimizer(self, factory: Callable[[Any], torch.optim.Optimizer], params: Any) -> torch.optim.Optimizer:
        if self.optimizer is not None:
            return self.optimizer(params)
        opt = factory(params)
        if not self.optimizer_options:
            return opt
        import inspect

        accepted = inspect.signature(type(opt).__init__).parameters  # (defaults hold keys no constructor takes)
        options = {k: v for k, v in {**opt.defaults, **dict(self.optimizer_options)}.items() if k in accepted}
        try:
            return type(opt)(params, **options)
        except (TypeError, RuntimeError) as exc:
            raise BackendError(f"{self.name}: {type(opt).__name__} cannot be made with {dict(self.optimizer_options)}: "
                               f"{exc}") from None  # fmt: skip

    def prepared(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model as this backend runs it (compiled once per run of it)."""
        return torch.compile(model) if self.compile_model else model

    @contextlib.contextmanager
    def around(self) -> Iterator[None]:
        """The switches this backend runs a step under, put back after (whatever ends the step)."""
        with contextlib.ExitStack() as stack:
            if self.switches:
                stack.enter_context(switches.flipped(**dict(self.switches)))
            if self.threads is not None:
                stack.enter_context(switches.flipped(threads=self.threads))
            if self.autocast is not None:
                stack.enter_context(torch.autocast("cpu", dtype=self.autocast))
            if self.compile_model or self.compile_optimizer:
                import torch._inductor.config as inductor_config

                # (compiled code draws its random numbers as eager does: dropout's masks are the oracle's, so a
                # step judges the compiler's arithmetic, not another random stream)
                stack.enter_context(inductor_config.patch(fallback_random=True))
            yield

    def loss(self, model: torch.nn.Module, spec: Any, batch: Any) -> torch.Tensor:
        """The step's forward and loss on this backend (differentiable)."""
        if self.forward is None:
            return spec.loss(model, batch)
        backend = get_backend(self.forward)
        return backend.fn(LossModule(model, spec.loss, batch), LossModule.inputs(batch))

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.compile_optimizer:
            step = getattr(optimizer, "_rlx_nb_compiled_step", None)
            if step is None:
                step = torch.compile(optimizer.step)
                optimizer._rlx_nb_compiled_step = step
            step()
        else:
            optimizer.step()


def _threads() -> int:
    # Another thread count than this process runs with, at the least cost: one fewer (the work split another way,
    # n / (n - 1) of the time: 16 threads' run on 15 costs 7% more, where one thread cost 16x), two where it runs one.
    # Never more threads than it runs (more than the cores: OpenMP's spinning waits made one run 3.5x as slow).
    n = torch.get_num_threads()
    return 2 if n == 1 else n - 1


def builtin(name: str) -> TrainBackend | None:
    """The built-in training backend ``name``, or None."""
    if name == "cpu-nomkldnn":
        return TrainBackend(name, "eager with oneDNN and NNPACK off (ATen's own kernels)",
                            switches=(("mkldnn_enabled", False), ("nnpack_enabled", False)))  # fmt: skip
    if name == "cpu-inductor":
        return TrainBackend(name, "the model compiled by torch.compile (Inductor, forward and backward)",
                            compile_model=True)  # fmt: skip
    if name == "cpu-inductor-optimizer":
        return TrainBackend(name, "the optimizer's step compiled by torch.compile", compile_optimizer=True)
    if name == "threads":
        return TrainBackend(name, f"eager on {_threads()} thread(s) (how reductions split)", threads=_threads())
    if name == "optimizer:foreach":
        return TrainBackend(name, "the optimizer's foreach implementation", optimizer_options=(("foreach", True),))
    if name == "optimizer:for-loop":
        return TrainBackend(name, "the optimizer's for-loop implementation",
                            optimizer_options=(("foreach", False), ("fused", None)))  # fmt: skip
    if name == "optimizer:fused":
        return TrainBackend(name, "the optimizer's fused implementation",
                            optimizer_options=(("fused", True), ("foreach", None)))  # fmt: skip
    if name == "ddp":
        from rlx_nb.training.ddp import WORLD

        return TrainBackend(name, f"DistributedDataParallel over {WORLD} local ranks (gloo), each batch split between "
                            "them, against one process", ranks=WORLD)  # fmt: skip
    if name == "cpu-bf16":
        return TrainBackend(name, "autocast to bfloat16 (judged on bfloat16's budget)", autocast=torch.bfloat16,
                            compute_dtype="bfloat16")  # fmt: skip
    return None


BUILTIN = ("cpu-nomkldnn", "cpu-inductor", "cpu-inductor-optimizer", "threads", "optimizer:foreach",
           "optimizer:for-loop", "optimizer:fused", "ddp", "cpu-bf16")  # fmt: skip
"""The built-in training backends; the default set leaves out ``ddp`` (processes of its own, and a step another than
one process's for models with dropout or BatchNorm) and ``cpu-bf16`` (its own budget): each asked for by name."""
DEFAULT = tuple(b for b in BUILTIN if b not in ("ddp", "cpu-bf16"))

_REGISTERED: dict[str, TrainBackend] = {}


def register_training_backend(
    name: str,
    *,
    forward: str | None = None,
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
    description: str = "",
    replace: bool = False,
) -> TrainBackend:
    """Register a training backend: its forward and backward through ``forward`` (a backend of the registry that runs
    eagerly and differentiably: a user's runtime, ``rlx_nb.register_backend``), its optimizer from ``optimizer``
    (``optimizer(params) -> torch.optim.Optimizer``: a user's own implementation), or both.

    Examples
    --------
    >>> import torch, rlx_nb
    >>> b = rlx_nb.register_training_backend("my-sgd", optimizer=lambda p: torch.optim.SGD(p, lr=0.1), replace=True)
    >>> b.name
    'my-sgd'
    """
    if not isinstance(name, str) or not name or builtin(name) is not None:
        raise InputError(f"a training backend needs a new name (not one of {', '.join(BUILTIN)}); got {name!r}")
    if name in _REGISTERED and not replace:
        raise BackendError(f"training backend {name!r} is registered already (replace=True replaces it)")
    if forward is None and optimizer is None:
        raise InputError("register_training_backend needs forward= (a registered backend's name), optimizer= (a "
                         "factory), or both: with neither it would be the oracle")  # fmt: skip
    if forward is not None:
        backend = get_backend(forward)
        if not backend.differentiable:
            raise InputError(f"backend {forward!r} runs no backward, so a step cannot train through it")
    if optimizer is not None and not callable(optimizer):
        raise InputError(f"optimizer must be a factory optimizer(params) -> torch.optim.Optimizer; got {optimizer!r}")
    made = TrainBackend(name, description or f"a registered training step ({forward or 'eager'} forward, "
                        f"{'its own' if optimizer else 'the call’s'} optimizer)", forward=forward, optimizer=optimizer)  # fmt: skip
    _REGISTERED[name] = made
    return made


def resolve(names: Any) -> list[TrainBackend]:
    """The training backends asked for: names (built-in, registered here, or a differentiable backend of the
    registry, run as the forward), :class:`TrainBackend` objects, or None for :data:`DEFAULT`."""
    if names is None:
        names = DEFAULT
    if isinstance(names, (str, TrainBackend)):
        names = [names]
    out: list[TrainBackend] = []
    for n in names:
        if isinstance(n, TrainBackend):
            out.append(n)
            continue
        found = builtin(n) if isinstance(n, str) else None
        found = found or _REGISTERED.get(n)
        if found is None and isinstance(n, str):
            try:
                backend = get_backend(n)
            except BackendError:
                known = [*BUILTIN, *_REGISTERED]
                raise InputError(f"unknown training backend {n!r}{did_you_mean(n, known)}; built in: "
                                 f"{', '.join(BUILTIN)}; or a registered backend that runs a backward") from None  # fmt: skip
            if not backend.differentiable or backend.device != "cpu":
                raise InputError(f"backend {n!r} cannot run a training step here (it needs a backward on the CPU)")
            found = TrainBackend(n, f"forward and backward through {n}", forward=n, compute_dtype=backend.compute_dtype)
        if found is None:
            raise InputError(f"a training backend is a name or a TrainBackend; got {type(n).__name__}")
        out.append(found)
    names_seen = [b.name for b in out]
    if len(set(names_seen)) != len(names_seen):
        raise InputError(f"a training backend is named twice: {names_seen}")
    return out


__all__ = ["BUILTIN", "DEFAULT", "LossModule", "TrainBackend", "builtin", "register_training_backend", "resolve"]
