"""Every run of a call trained side by side, one step at a time: the oracle, the envelope's runs and each backend.

The *envelope* is the drift round-off alone makes: the oracle's training again from initial weights moved by about
one float32 ulp (each element up or down at random, :func:`~rlx_nb.training.step.perturbed`), a few seeds, and on
another thread count.  Chaos amplifies those differences step after step; a backend whose drift stays within what they
drift is within chaos.  Per step, each run's loss, gradient norm and parameters are set against the oracle's: the
loss's and the gradient norm's differences, and the parameters' relative distance (their difference's norm over the
oracle's parameters' norm).  A backend's place on the line at a step is its largest difference over
:data:`LIMIT` times the envelope's (its largest so far: chaos does not shrink), so 1.0 is the line, as everywhere.

The runs share each step's batch and random numbers; nothing of a step is kept past it but these numbers (the states
the local steps start from are the call's: :mod:`rlx_nb.training.divergence`).  The envelope's runs train first, side
by side, and keep their figures only (:func:`envelope_pass`): each step's losses and gradient norms, and how far apart
their parameters are (the largest distance between two of them: two runs each one round-off from the oracle are
about as far from each other as from it).  Then the oracle and the backends train side by side and are set against
those figures, so at most the envelope's runs, or the oracle and the backends, hold a model and an optimizer at once.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from rlx_nb.training.backends import TrainBackend
from rlx_nb.training.local import one_step
from rlx_nb.training.step import Spec, l2_distance, l2_norm, perturbed

LIMIT = 4.0
"""A backend leaves the envelope where its difference from the oracle passes this many times the envelope's."""
FLOOR_ULPS = 4.0
"""No envelope is narrower than this many float32 ulps of the oracle's own figure (at step 0 it has barely begun)."""
U32 = 2.0**-23
ENVELOPE_SEEDS = 2
"""The envelope's one-ulp perturbations of the initial weights, by default (plus the run on another thread count)."""
METRICS = ("loss", "grad_norm", "param_distance")


@dataclasses.dataclass
class Run:
    """One training run of the call: its model and optimizer, and the backend (None: the oracle's step)."""

    name: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    backend: TrainBackend | None = None
    relative: float = 2.0**-24
    error: str = ""
    copy_grads: bool = False
    """Its optimizer writes into its gradients: a step that keeps them copies them (the oracle's judged steps)."""

    def step(self, spec: Spec, step: int, batch: Any) -> tuple[float, float]:
        loss, norm, _ = one_step(self.model, self.optimizer, spec, step, batch, backend=self.backend, keep=False)
        for p in self.model.parameters():  # (nothing of a step kept past it: a run between steps holds its state only)
            p.grad = None
        return loss, norm


def _params(run: Run) -> list[torch.Tensor]:
    return [p.detach() for p in run.model.parameters()]


def distance(run: Run, oracle: Run, scale: float | None = None) -> float:
    """``run``'s parameters' relative distance from the oracle's: the norm of their difference over the oracle's
    (``scale``: that norm, where known).  The difference of two nearby float32 values is exact (Sterbenz), so it is
    taken in float32 and only its norm accumulated in float64."""
    a, b = _params(run), _params(oracle)
    diff = l2_distance(a, b)
    scale = l2_norm(b) if scale is None else scale
    return diff / scale if scale > 0 else diff


def envelope_runs(model: torch.nn.Module, spec: Spec, seeds: int, threads: bool) -> list[Run]:
    """The envelope's runs: the oracle's training from ``seeds`` one-ulp perturbations of the initial weights, and
    (``threads``) on another thread count (:class:`~rlx_nb.training.backends.TrainBackend` ``threads``)."""
    from rlx_nb.training.backends import builtin

    runs = []
    for k in range(seeds):
        m = perturbed(model, 1 + k)
        runs.append(Run(f"one ulp, seed {1 + k}", m, spec.optimizer(list(m.parameters()))))
    if threads:
        m = perturbed(model, 0, 0.0)
        runs.append(Run("another thread count", m, spec.optimizer(list(m.parameters())), builtin("threads")))
    return runs


def bf16_envelope(model: torch.nn.Module, spec: Spec, seeds: int) -> list[Run]:
    """The envelope a bfloat16 run is judged against: the oracle's training from the initial weights moved by one
    bfloat16 ulp (its own budget's scale)."""
    runs = []
    for k in range(seeds):
        m = perturbed(model, 101 + k, 2.0**-8)
        runs.append(Run(f"one bfloat16 ulp, seed {101 + k}", m, spec.optimizer(list(m.parameters())),
                        relative=2.0**-8))  # fmt: skip
    return runs


@dataclasses.dataclass
class Drift:
    """An envelope's runs at one step: their losses, gradient norms, and the largest distance between two of them."""

    losses: list[float]
    norms: list[float]
    spread: float

    def against(self, oracle: tuple[float, float]) -> dict[str, float]:
        """The envelope's figures at this step once the oracle's loss and gradient norm are known."""
        return {"loss": max((abs(v - oracle[0]) for v in self.losses if v == v), default=math.nan),
                "grad_norm": max((abs(v - oracle[1]) for v in self.norms if v == v), default=math.nan),
                "param_distance": self.spread}  # fmt: skip


def drift(runs: list[Run], got: list[tuple[float, float]], anchor: Run | None = None) -> Drift:
    """One step's :class:`Drift` of ``runs`` (``anchor``: a run each is also set against, where they are one)."""
    pool = [*runs, anchor] if anchor is not None and len(runs) < 2 else runs
    # (one scale for every pair: the runs' norms are one round-off apart)
    scale = l2_norm(_params(pool[0])) if pool else 0.0
    spread = max((distance(a, b, scale) for i, a in enumerate(pool) for b in pool[i + 1:]), default=math.nan)  # fmt: skip
    return Drift([g[0] for g in got], [g[1] for g in got], spread)


@dataclasses.dataclass
class Envelope:
    """The largest difference from the oracle so far, per figure, over an envelope's runs."""

    loss: float = 0.0
    grad_norm: float = 0.0
    param_distance: float = 0.0

    def grow(self, figures: dict[str, float]) -> None:
        for k in METRICS:
            v = figures.get(k, math.nan)
            if v == v:
                setattr(self, k, max(getattr(self, k), v))


def figures(loss: float, norm: float, dist: float, oracle: tuple[float, float]) -> dict[str, float]:
    """A run's differences from the oracle at one step."""
    return {"loss": abs(loss - oracle[0]), "grad_norm": abs(norm - oracle[1]), "param_distance": dist}


def line(diffs: dict[str, float], env: Envelope, oracle: tuple[float, float]) -> tuple[float, str]:
    """``(place on the line, the figure that sets it)``: the largest difference over :data:`LIMIT` envelopes."""
    floors = {"loss": FLOOR_ULPS * U32 * abs(oracle[0]), "grad_norm": FLOOR_ULPS * U32 * abs(oracle[1]),
              "param_distance": FLOOR_ULPS * U32}  # fmt: skip
    best, which = 0.0, "loss"
    for k in METRICS:
        d = diffs.get(k, math.nan)
        width = LIMIT * max(getattr(env, k), floors[k])
        v = d / width if width > 0 else (math.inf if d > 0 else 0.0)
        if v == v and v > best:
            best, which = v, k
    if any(v != v or math.isinf(v) for v in diffs.values()):
        return math.inf, "non-finite"
    return best, which


__all__ = ["ENVELOPE_SEEDS", "LIMIT", "METRICS", "Drift", "Envelope", "Run", "bf16_envelope", "distance", "drift",
           "envelope_runs", "figures", "line"]  # fmt: skip
