"""The verdict's data: the verdict names, what decided one (:class:`rlx_nb.verdict.words.Cause`), what the rule reads
(:class:`Evidence`) and what it returns (:class:`Judgement`).  Types only; the rule is :mod:`rlx_nb.verdict.rule`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, TypeVar

from rlx_nb.numerics.reference import ReferenceStats, SliceStats

ROUNDOFF = "round-off"
SUSPECT = "SUSPECT"
VERDICT_ERROR = "error"
VERDICT_SKIPPED = "skipped"
NEAR_TIE = "near-tie"
"""A generated token that differs from the oracle's where fp64 puts the two within the step's round-off."""
DISAGREEMENT = "real disagreement"
"""A generated token that differs from the oracle's further than the step's round-off allows (SUSPECT)."""
NONDETERMINISTIC = "nondeterministic"

_Frozen = TypeVar("_Frozen")


def replaced(obj: _Frozen, **changes: Any) -> _Frozen:
    """``dataclasses.replace(obj, **changes)`` for the verdict's frozen dataclasses (a :class:`Judgement`, an
    output record), without its per-field walk: the record of every (backend, output) is replaced four times
    on its way to the table, and ``dataclasses.replace`` took 12% of a small decoder's comparison.  The same new
    object: every field ``obj``'s but ``changes``, none of which may be a name that is not a field.

    Examples
    --------
    >>> j = Judgement("round-off", "within budget", line=0.5)
    >>> replaced(j, line=2.0) == dataclasses.replace(j, line=2.0)
    True
    """
    if isinstance(obj, Judgement):
        return obj.but(**changes)  # type: ignore[return-value]
    return _replaced(obj, **changes)


def _replaced(obj: _Frozen, **changes: Any) -> _Frozen:
    names = _init_fields(type(obj))
    if names is None:  # (a field __init__ does not set, or a __post_init__: only dataclasses.replace knows)
        return dataclasses.replace(obj, **changes)  # type: ignore[type-var]
    unknown = [k for k in changes if k not in names]
    if unknown:
        raise TypeError(f"{type(obj).__name__} has no field {unknown[0]!r}")
    new = object.__new__(type(obj))
    state = obj.__dict__
    new.__dict__.update({k: state[k] for k in names})  # (what __init__ would set: the fields, nothing else)
    new.__dict__.update(changes)
    return new


@functools.cache
def _init_fields(cls: type) -> tuple[str, ...] | None:
    # The fields __init__ sets from its arguments, when that is all it does; else None.
    fields = dataclasses.fields(cls)
    if hasattr(cls, "__post_init__") or hasattr(cls, "__slots__") or not all(f.init for f in fields):
        return None
    return tuple(f.name for f in fields)


RMSE_LIMIT = 4.0
"""The SUSPECT line for an error's RMS over its budget (docs/verdict.md: "The rule in full")."""
MAX_LIMIT = 8.0
"""... and for its largest element over its budget: 1.0 on the one scale (:attr:`Judgement.line`) is either."""


def whole_excess(ratio_rmse: float, ratio_max: float) -> float:
    """How far an error's RMSE and max ratios to their budgets go past the limits (> 1: SUSPECT).

    Examples
    --------
    >>> whole_excess(2.0, 16.0)
    2.0
    """
    return max(ratio_rmse / RMSE_LIMIT, ratio_max / MAX_LIMIT)


@dataclasses.dataclass(frozen=True)
class SliceEvidence:
    """Per-slice error sums (:class:`~rlx_nb.numerics.reference.SliceStats`) of the backend and of the legitimate runs.

    ``legit``: the fp32 oracle and sequential run; ``at_precision``: the anchor at a reduced-precision
    backend's own width; ``profiles``: ``(whole-output RMSE, slice sums)`` of every precision anchor,
    whose error shows which slices amplify round-off.  All have the backend's axes.
    """

    backend: SliceStats
    legit: tuple[SliceStats, ...]
    at_precision: tuple[SliceStats, ...] = ()
    profiles: tuple[tuple[float, SliceStats], ...] = ()


@dataclasses.dataclass(frozen=True)
class Evidence:
    """Everything the budget verdict reads about one (backend, output): errors against the fp64 reference."""

    backend: str
    kind: str
    compute_dtype: str
    numel: int
    errors: ReferenceStats
    """The backend's output against fp64."""
    oracle: ReferenceStats
    sequential: ReferenceStats | None = None
    anchor: tuple[int, ReferenceStats] | None = None
    """``(bits, errors)`` of the anchor at the backend's own precision (reduced-precision backends only)."""
    slices: SliceEvidence | None = None
    nonfinite_mismatch: int = 0
    """Elements whose NaN/Inf pattern differs from both the oracle's and fp64's (or from the oracle's, without
    a reference)."""
    reduction_length: int = 1
    anchors_rmse: dict[int, float] = dataclasses.field(default_factory=dict)
    """Every precision anchor's RMSE against fp64 on this output: the effective-precision scale."""
    oracle_outliers: int = 0
    """Elements where the backend's NaN/Inf pattern is fp64's and the oracle's is not."""
    max_abs: float = math.nan
    """The backend's largest difference from the oracle (0: bit for bit the oracle's)."""
    discrete_events: int = 0
    """Flipped ReLU inputs taken out of the backend's error before it was measured (:mod:`rlx_nb.execution.discrete`)."""
    legit: tuple[ReferenceStats, ...] = ()
    """Further legitimate runs' errors against the reference, beside the oracle's and the sequential run's: an int8
    model's requantization trials (:mod:`rlx_nb.int8`)."""
    quantum: float = math.nan
    """An int8 output's quantum: no correct int8 kernel's error is held to less than one element one quantum off."""


@dataclasses.dataclass(frozen=True)
class Rules:
    """What each rule decided: the budget's verdict (None without an fp64 reference), the seed's and its threshold."""

    verdict_budget: str | None = None
    verdict_fixed: str = ""
    tol_rel: float = math.nan


@dataclasses.dataclass(frozen=True)
class Budget:
    """The round-off budget (RMSE and largest error) and the backend's error over it: ``ratio_*``, and ``excess``,
    how far past the limits (> 1: SUSPECT)."""

    budget_rmse: float = math.nan
    budget_max: float = math.nan
    ratio_rmse: float = math.nan
    ratio_max: float = math.nan
    excess: float = math.nan


@dataclasses.dataclass(frozen=True)
class Errors:
    """Each run's error against the fp64 reference: RMSE and largest, the oracle's, the backend's, the sequential
    run's."""

    oracle_rmse: float = math.nan
    backend_rmse: float = math.nan
    oracle_max_err: float = math.nan
    backend_max_err: float = math.nan
    sequential_rmse: float = math.nan
    sequential_max_err: float = math.nan


@dataclasses.dataclass(frozen=True)
class Where:
    """Where the error sits: the slice whose mean stands out most, the worst element's isolation, the slice that
    holds most of its square."""

    slice_ratio: float = math.nan
    slice_at: str = ""
    concentration: float = math.nan
    concentrated: bool = False
    slice_share: float = math.nan
    """The share of the error's square on the slice that holds most over its round-off share
    (:func:`rlx_nb.verdict.chance.slice_share`) ..."""
    slice_share_over: float = math.nan
    """... how many times its round-off share that is ..."""
    slice_share_at: str = ""
    """... and which slice (``[:, :, 3]``).  Past :data:`rlx_nb.verdict.readings.LOCALIZED_OVER` with at least
    :data:`rlx_nb.verdict.readings.LOCALIZED_SHARE` of the error, the error is localized: a bug on one row, position or
    channel, never read as a precision mode or a less accurate arithmetic."""
    bias_ratio: float = math.nan
    """An int8 output's mean error over what unbiased rounding leaves (the legitimate runs' largest mean, or
    :data:`rlx_nb.verdict.rule.BIAS_SHARE` of the RMS budget); NaN for a float output."""


@dataclasses.dataclass(frozen=True)
class Reading:
    """What an error reads as: its effective precision, a precision likeness, zeroed positions, its shape."""

    effective_bits: float = math.nan
    closest_format: str = ""
    anchor_likeness: float = math.nan
    """For a SUSPECT reading near a narrower format: correlation of |error| with that format's anchor."""
    zero_mismatch: int = 0
    """For a SUSPECT output: elements where the oracle and fp64 are exactly 0 and the backend is not."""
    zero_mismatch_max: float = math.nan
    excess_elsewhere: float = math.nan
    """... and the budget excess (as ``excess``) over every other element."""
    error_bias: float = math.nan
    """For a SUSPECT output: the mean of its error against fp64 over the error's RMS (noise: ~0)."""
    error_value_corr: float = math.nan
    """... and the error's correlation with the fp64 values (noise: ~0; a scale bug: ~1)."""
    less_accurate: bool = False
    """Every SUSPECT output of this backend reads as a uniformly less accurate arithmetic."""


@dataclasses.dataclass(frozen=True)
class Events:
    """What was counted outside the budget: discrete events taken out, NaN/Inf patterns, the model's own noise."""

    discrete_events: int = 0
    """ReLU inputs within round-off of a threshold that flipped in this backend's run, taken out before judging."""
    nonfinite_unexplained: int = 0
    """Elements whose NaN/Inf pattern the backend has and neither the oracle nor fp64 does (or the reverse)."""
    oracle_outliers: int = 0
    """Elements where the backend's NaN/Inf pattern is fp64's and the oracle's is not."""
    nondeterminism: float = math.nan
    """For a nondeterministic output: how far the model's own two oracle runs differ."""


GROUPS: dict[str, type] = {"rules": Rules, "budget": Budget, "errors": Errors, "where": Where, "reading": Reading,
                           "events": Events}  # fmt: skip
"""A judgement's figures, grouped; every figure's name is unique across the groups (a saved row's column)."""
FIGURES: dict[str, str] = {f.name: g for g, cls in GROUPS.items() for f in dataclasses.fields(cls)}
"""Which group holds each figure."""


@dataclasses.dataclass(frozen=True)
class Judgement:
    """The verdict on one (backend, output), the clause that decided it and the figures behind it, grouped.

    ``verdict`` is what the rule in charge decided; ``cause`` (a :class:`~rlx_nb.verdict.words.Cause`) why; ``line``
    the one number on the SUSPECT line's scale (past 1.0 is SUSPECT: the budget clauses' excess, ``max_rel / tol_rel``
    under the fixed rule, infinite for a NaN/Inf or structural mismatch); ``detail`` what happened, for a verdict
    without statistics.  The figures: ``rules``, ``budget``, ``errors``, ``where``, ``reading``, ``events``
    (:data:`GROUPS`).  Each figure also reads by its own name (``j.effective_bits``), as a saved row's column does.
    Every text of a verdict formats a Judgement (:mod:`rlx_nb.verdict.words`).

    Examples
    --------
    >>> j = Judgement.of("SUSPECT", "whole output", 2.0, ratio_rmse=8.0, effective_bits=12.0)
    >>> j.budget.ratio_rmse, j.reading.effective_bits, j.effective_bits
    (8.0, 12.0, 12.0)
    """

    verdict: str
    cause: str
    line: float = math.nan
    detail: str = ""
    notes: tuple[str, ...] = ()
    rules: Rules = Rules()
    budget: Budget = Budget()
    errors: Errors = Errors()
    where: Where = Where()
    reading: Reading = Reading()
    events: Events = Events()

    @classmethod
    def of(cls, verdict: str, cause: str, line: float = math.nan, **figures: Any) -> Judgement:
        """A judgement from its figures by name (``ratio_rmse=...``), each put in its group."""
        top, grouped = split_figures(figures)
        return cls(verdict, cause, line, **top, **{g: GROUPS[g](**v) for g, v in grouped.items()})

    def but(self, **changes: Any) -> Judgement:
        """This judgement with ``changes`` (top-level fields or figures by name)."""
        top, grouped = split_figures(changes)
        for g, values in grouped.items():
            top[g] = _replaced(getattr(self, g), **values)
        return _replaced(self, **top)

    def figures(self) -> dict[str, Any]:
        """Every figure by name, flat (a saved row's columns)."""
        return {name: getattr(getattr(self, g), name) for name, g in FIGURES.items()}

    def __getattr__(self, name: str) -> Any:
        group = FIGURES.get(name)
        if group is None:
            raise AttributeError(f"Judgement has no field {name!r}")
        return getattr(object.__getattribute__(self, group), name)

    @property
    def suspect(self) -> bool:
        return self.verdict == SUSPECT


def split_figures(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """``(top-level fields, {group: its figures})`` of a judgement's fields and figures by name."""
    top, grouped = {}, {}
    for name, value in values.items():
        group = FIGURES.get(name)
        if group is None:
            top[name] = value
        else:
            grouped.setdefault(group, {})[name] = value
    return top, grouped


def without_statistics(verdict: str, cause: str, detail: str) -> Judgement:
    """A verdict decided without statistics: an error, a skip, a structural mismatch (SUSPECT), an exact match."""
    line = math.inf if verdict == SUSPECT else 0.0 if verdict == ROUNDOFF else math.nan
    budget = SUSPECT if verdict == SUSPECT else None
    return Judgement(verdict, cause, line, detail=detail, rules=Rules(verdict_budget=budget, verdict_fixed=verdict))
