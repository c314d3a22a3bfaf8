"""One output's comparison context: everything a backend is judged against, built once per output.

The oracle's output, the fp64 reference in the oracle's layout, the legitimate runs' errors against it
(the oracle's, the sequential run's, each precision anchor's, with their per-slice sums), whether the
anchors can be read on this output, and the uploads of the oracle and reference to a device.  None of it
depends on the candidate, so each is computed at most once (on first use: an output no backend reaches
costs nothing) and shared by every comparator (:mod:`rlx_nb.comparison.comparators`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from rlx_nb.backends.base import ORACLE
from rlx_nb.comparison.flips import Flips, flips_of, less
from rlx_nb.execution.results import GRAD_PREFIX, OK, Leaf, RunResults
from rlx_nb.numerics import device as device_metrics
from rlx_nb.numerics import formats
from rlx_nb.numerics.reference import ReferenceStats, SliceStats, error_stats, reference_stats
from rlx_nb.verdict import rule as verdict


@dataclasses.dataclass(frozen=True)
class Errors:
    """One run's errors against the fp64 reference: the whole output's, and per slice (None: not sliced)."""

    stats: ReferenceStats
    slices: SliceStats | None


def errors_of(x: np.ndarray, r: np.ndarray) -> Errors:
    """A legitimate run's errors against fp64, with slice sums in the same pass for outputs of two or more
    dimensions (a complex output's interleaved view is not sliced)."""
    sliced = x.ndim >= 2 and x.dtype.kind == "f" and x.shape == r.shape
    return Errors(*error_stats(x, r)) if sliced else Errors(reference_stats(x, r), None)


@dataclasses.dataclass(frozen=True, eq=False)
class OutputContext:
    """What every backend's output called ``name`` is judged against (see the module docstring).

    ``reference`` is None when the fp64 reference did not run (or has no such output); ``anchors`` are the
    precision anchors' outputs by width; ``flips`` the discrete events the oracle's and the sequential run's
    gradients are corrected for (:mod:`rlx_nb.execution.discrete`), None where none were recorded.
    """

    name: str
    index: int
    oracle: Leaf
    reference: Leaf | None
    sequential: Leaf | None
    anchors: dict[int, Leaf]
    reduction_length: int = 1
    flips: Flips | None = None
    trials: tuple[Leaf, ...] = ()
    """int8: the requantization trials' outputs (:attr:`~rlx_nb.execution.results.RunResults.trials`), legitimate
    runs beside the oracle; empty for a float model."""
    quantum: float = float("nan")
    """int8: the output's quantum (the scale of the dequantize that gives it; NaN for an output computed in float,
    and for a float model)."""
    _uploads: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def kind(self) -> str:
        return "grad" if self.name.startswith(GRAD_PREFIX) else "forward"

    @functools.cached_property
    def r(self) -> np.ndarray | None:
        """The fp64 reference as the float comparators read it (a complex output as interleaved floats), or None."""
        ref, o = self.reference, self.oracle.value
        if ref is None or not ref.is_array or not _is_float(ref.value) or ref.value.shape != o.shape:
            return None
        if np.iscomplexobj(ref.value):
            shape = (*o.shape, 2)
            return ref.value.view(np.float64).reshape(shape)
        return ref.value

    # -- the oracle's errors ---------------------------------------------------------------------------

    @functools.cached_property
    def oracle_errors(self) -> Errors:
        """The oracle's errors against fp64, as it ran."""
        return errors_of(self.flat_oracle, self.r)

    @functools.cached_property
    def flat_oracle(self) -> np.ndarray:
        """The oracle's output in the reference's layout (a complex one as interleaved floats)."""
        o = self.oracle.value
        return np.ascontiguousarray(o).view(o.real.dtype).reshape(self.r.shape) if np.iscomplexobj(o) else o

    @functools.cached_property
    def budget_oracle(self) -> Errors:
        """The oracle's errors the budget reads: without its own discrete events where they were accounted for.

        (Where the anchors are checked on this output, the oracle's errors as it ran: what this comparison has
        always read there; :meth:`_anchors_checked`.)
        """
        if self.flips is None or self.flips.oracle is None or self._anchors_checked:
            return self.oracle_errors
        return errors_of(less(self.flat_oracle, self.flips.oracle), self.r)

    @functools.cached_property
    def trial_errors(self) -> tuple[Errors, ...]:
        """Each int8 trial's errors against the reference (the exact simulation), as the oracle's are measured."""
        return tuple(errors_of(t, self.r) for t in map(self.comparable, self.trials) if t is not None)

    # -- the sequential run and the anchors ------------------------------------------------------------

    def comparable(self, leaf: Leaf | None, *, complex_ok: bool = False) -> np.ndarray | None:
        """A helper run's output where it can be compared like the oracle's, else None (a complex output as
        interleaved floats where ``complex_ok``)."""
        o, r = self.oracle.value, self.r
        if leaf is None or r is None or not leaf.is_array or leaf.value.shape != o.shape or leaf.value.dtype != o.dtype:
            return None
        v = leaf.value
        if np.iscomplexobj(v):
            return np.ascontiguousarray(v).view(v.real.dtype).reshape(r.shape) if complex_ok else None
        return v if v.dtype.kind == "f" and r.shape == o.shape else None

    @functools.cached_property
    def sequential_errors(self) -> Errors | None:
        """The sequential-sums run's errors against fp64 (None: no such run, or its gradients were corrected
        for discrete events, which leaves a float64 array this comparison does not read)."""
        leaf = self.sequential
        if self.flips is not None and leaf is not None:
            leaf = self.flips.sequential_leaf(leaf)
        seq = self.comparable(leaf)
        return errors_of(seq, self.r) if seq is not None else None

    @functools.cached_property
    def anchors_left_out(self) -> str:
        """Why the precision anchors cannot be read on this output ("" when they can).

        An anchor is the model with its matmuls rounded to fewer bits: its error is rounding only if it shrinks
        as the bits grow.  Two anchors closer to each other than the wider one is to fp64 (while the oracle is
        close to fp64) share a difference that is not rounding: their run took another code path than the
        oracle's (the torch-function mode that rounds turns PyTorch's fused inference fast paths off).
        """
        if not self._anchors_checked:
            return ""
        narrow, wide = min(self.anchors), max(self.anchors)
        a, b = self.comparable(self.anchors[narrow]), self.comparable(self.anchors[wide])
        oracle = self.oracle_errors.stats
        wide_err = self.anchor_errors(wide).stats
        apart = reference_stats(a, b).rmse
        floor = verdict.FLOOR_UNITS * formats.unit_roundoff("float32") * oracle.ref_rms
        if not verdict.anchors_took_another_path(oracle.rmse, floor, wide_err.rmse, apart):
            return ""
        return (
            f"precision anchors left out on this output: the {narrow}- and {wide}-bit runs differ from each other by "
            f"{apart:.3g} (RMS) but from fp64 by {wide_err.rmse:.3g}, so what they share is not rounding — they took "
            "another code path than the oracle (rounding runs under a torch-function mode, which turns PyTorch's "
            "fused inference fast paths off)"
        )

    @functools.cached_property
    def _anchors_checked(self) -> bool:
        # Whether the two anchors can be held against each other on this output (a real float output).
        if len(self.anchors) < 2 or self.r is None or self.oracle.value.dtype.kind != "f":
            return False
        return all(self.comparable(self.anchors[b]) is not None for b in (min(self.anchors), max(self.anchors)))

    @property
    def read_anchors(self) -> dict[int, Leaf]:
        """The anchors this output's verdicts read: none where they took another path (:attr:`anchors_left_out`)."""
        return {} if self.anchors_left_out else self.anchors

    def anchor_errors(self, bits: int) -> Errors | None:
        """The ``bits``-bit anchor's errors against fp64 (None: not comparable here)."""
        return self._anchor_errors.get(bits)

    @functools.cached_property
    def _anchor_errors(self) -> dict[int, Errors]:
        out = {}
        for bits, leaf in self.anchors.items():
            a = self.comparable(leaf)
            if a is not None:
                out[bits] = errors_of(a, self.r)
        return out

    @functools.cached_property
    def anchors_rmse(self) -> dict[int, float]:
        """Each read anchor's RMSE against fp64 on this output: the effective-precision scale."""
        out = {}
        for bits, leaf in self.read_anchors.items():
            a = self.comparable(leaf, complex_ok=True)
            if a is None:
                continue
            errors = self.anchor_errors(bits) if not np.iscomplexobj(leaf.value) else errors_of(a, self.r)
            out[bits] = errors.stats.rmse
        return out

    # -- devices ---------------------------------------------------------------------------------------

    def on(self, device: Any, what: str) -> Any:
        """The oracle's (``what="oracle"``) or the reference's output on ``device``, uploaded once."""
        key = (str(device), what)
        if key not in self._uploads:
            x = self.oracle.value if what == "oracle" else self.r
            self._uploads[key] = device_metrics.as_device(x, device)
        return self._uploads[key]


def contexts(results: RunResults) -> Iterator[OutputContext]:
    """One :class:`OutputContext` per output of the oracle, in the oracle's order."""
    reference = results.reference.outputs if results.reference.status == OK else {}
    sequential = results.sequential.outputs if results.sequential is not None else {}
    quanta = (results.environment.get("int8") or {}).get("quanta") or {}
    for index, (name, leaf) in enumerate(results.oracle.outputs.items()):
        anchors = {b: a.outputs[name] for b, a in results.anchors.items() if name in a.outputs}
        yield OutputContext(
            name,
            index,
            leaf,
            reference.get(name),
            sequential.get(name),
            anchors,
            results.oracle.reduction_lengths.get(name, 1),
            flips=flips_of(results, ORACLE, name) if results.discrete else None,
            trials=tuple(t.outputs[name] for t in results.trials.values() if name in t.outputs),
            quantum=_quantum(quanta.get(name)),
        )


def _quantum(value: Any) -> float:
    # An output's quantum as saved (a number, or None for an output computed in float).
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else math.nan


def _is_float(x: np.ndarray) -> bool:
    return np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.complexfloating)
