"""One (backend, output) comparison: who and what it is, the pair's statistics, and the judgement.

:class:`OutputRecord` is built once, whole, by :mod:`rlx_nb.comparison.compare` from a comparator's :class:`Finding`;
nothing patches it after.  Its
parts are typed: :class:`PairFields` (the backend against the oracle, element by element) and
:class:`~rlx_nb.verdict.rule.Judgement` (the verdict, its cause and the figures behind it).  The flat row a table
or a saved file holds is :mod:`rlx_nb.comparison.tables`' business (``frames.record_row``, ``frames.record_from_row``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from rlx_nb.verdict.types import SUSPECT, VERDICT_ERROR, Judgement


@dataclasses.dataclass(frozen=True)
class PairFields:
    """The backend's output against the oracle's: the statistics any comparison tool reports.

    ``worst_index`` is the element of largest absolute difference, with the oracle's, the backend's and the
    fp64 reference's values there.  ``nonfinite_mismatch`` counts NaN/Inf pattern differences from the oracle
    (the verdict holds them against fp64 as well: ``Judgement.nonfinite_mismatch``).
    """

    max_abs: float = math.nan
    max_rel: float = math.nan
    worst_index: tuple[int, ...] | None = None
    oracle_value: float = math.nan
    backend_value: float = math.nan
    reference_value: float = math.nan
    mismatched: int = 0
    mismatched_frac: float = math.nan
    mean_abs: float = math.nan
    p99_abs: float = math.nan
    cosine: float = math.nan
    pcc: float = math.nan
    sqnr_db: float = math.nan
    nmse: float = math.nan
    max_ulp: int = 0
    nonfinite_mismatch: int = 0


NO_PAIR = PairFields()


@dataclasses.dataclass(frozen=True)
class _Compared:
    # What a finding and its record share: the (backend, output) pair's identity, its statistics, its judgement.
    backend: str
    output: str | None
    output_index: int
    kind: str
    compute_dtype: str
    judgement: Judgement
    pair: PairFields = NO_PAIR
    shape: tuple[int, ...] | None = None
    dtype: str = ""
    numel: int = 0
    reduction_length: int = 1


@dataclasses.dataclass(frozen=True)
class OutputRecord(_Compared):
    """How one backend's output compares with the oracle's and the fp64 reference (see :mod:`rlx_nb.verdict.rule`).

    Identity (``backend``, ``output`` -- None for a backend that did not run --, its index among the oracle's
    outputs, ``kind`` ``"forward"`` or ``"grad"``, the backend's ``compute_dtype``, the oracle output's
    ``shape``, ``dtype``, ``numel`` and ``reduction_length``), the ``pair`` statistics, the ``judgement``, and
    its words: ``reason`` (:func:`rlx_nb.verdict.words.reason` of the judgement) and ``note``.
    """

    reason: str = ""
    note: str = ""

    @property
    def verdict(self) -> str:
        return self.judgement.verdict

    @property
    def suspect(self) -> bool:
        return self.judgement.verdict == SUSPECT

    @property
    def cause(self) -> str:
        return self.judgement.cause


@dataclasses.dataclass(frozen=True)
class Finding(_Compared):
    """One (backend, output) as its comparator judged it, before what only all of a backend's outputs (a less
    accurate arithmetic), the model's own nondeterminism and the call add: the parts of an :class:`OutputRecord`
    but its words.  :func:`rlx_nb.comparison.compare.compare` makes each record from one, once."""

    notes: tuple[str, ...] = ()

    def record(self, judgement: Judgement, reason: str, notes: Sequence[str] = ()) -> OutputRecord:
        """The record: this finding with its final ``judgement``, its ``reason`` and every note."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(_Compared)}
        note = "; ".join(n for n in (*self.notes, *notes) if n)
        return OutputRecord(**{**fields, "judgement": judgement}, reason=reason, note=note)


VERDICT_ORDER = {SUSPECT: 0, VERDICT_ERROR: 1}
"""How verdicts rank when one record must speak for a backend (others after these)."""


def worst_first(records: Sequence[OutputRecord]) -> list[OutputRecord]:
    """Records in the order that decides a backend's verdict: SUSPECT first, then errors, then the largest
    excess over the round-off budget, then the largest seed ``max_rel``."""

    def key(r: OutputRecord) -> tuple:
        excess = r.judgement.budget.excess if r.judgement.budget.excess == r.judgement.budget.excess else -1.0
        rel = r.pair.max_rel if r.pair.max_rel == r.pair.max_rel else -1.0
        return (VERDICT_ORDER.get(r.verdict, 2), -excess, -rel)

    return sorted(records, key=key)


def worst_record(records: Sequence[OutputRecord]) -> OutputRecord:
    """The record that decides a backend's verdict (the first of :func:`worst_first`)."""
    return worst_first(records)[0]
