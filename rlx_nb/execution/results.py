"""The data a run produces: named outputs of every run, saveable before any comparison.

:class:`RunResults` holds the oracle's, the fp64 reference's and each candidate's outputs as
:class:`Leaf` objects -- numpy arrays (read lazily from a saved report), plain values, or, for a
backend that compares on its device, the device tensor with a host copy made on first use -- and
the environment.  Nothing here runs a model: :mod:`rlx_nb.run` produces these, :mod:`rlx_nb.report.files`
saves and loads them, :mod:`rlx_nb.compare` judges them.
"""

from __future__ import annotations

import collections.abc
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from rlx_nb._support.tree import Opaque
from rlx_nb.numerics.pairs import same_bits

OK, ERROR, SKIPPED = "ok", "error", "skipped"

GRAD_PREFIX = "grad:"


GENERATION_KEY = "generation"
"""Where a generation's report keeps its tokens in a run's environment: ``environment["generation"]``."""


class Leaf:
    """One named output of one run: a numpy array (or a plain value) and the torch dtype it came as.

    ``value`` may be loaded lazily (a report read from disk reads an array on first access).  A
    backend that compares on its device (:attr:`Backend.keeps_outputs_on_device`) leaves the
    output there as ``tensor``; the host copy behind ``value`` is then made on first access only,
    and the metrics run on the device.
    """

    __slots__ = ("_loader", "_value", "dtype", "shape", "tensor")

    def __init__(
        self,
        value: Any = None,
        dtype: str = "",
        shape: tuple[int, ...] | None = None,
        loader: Callable[[], Any] | None = None,
        tensor: torch.Tensor | None = None,
    ) -> None:
        self._value, self._loader, self.dtype, self.shape, self.tensor = value, loader, dtype, shape, tensor

    @property
    def value(self) -> Any:
        if self._loader is not None:
            self._value, self._loader = self._loader(), None
        if self._value is None and self.tensor is not None:
            self._value = self.tensor.cpu().numpy()  # the host copy, on first use (the tensor is contiguous)
        return self._value

    @property
    def loaded(self) -> bool:
        return self._loader is None

    @property
    def on_device(self) -> bool:
        """True while the output exists only on its device (no host copy made yet)."""
        return self.tensor is not None and self._value is None

    @property
    def is_array(self) -> bool:
        return self.shape is not None

    @property
    def nbytes(self) -> int:
        """Bytes this output holds now (device tensor plus host copy), without making a host copy.

        0 for plain values and for arrays not read from disk yet.
        """
        size = self.tensor.numel() * self.tensor.element_size() if self.tensor is not None else 0
        if self._loader is None and self._value is not None and self.is_array:
            size += self._value.nbytes
        return size

    def __repr__(self) -> str:
        where = f", on {self.tensor.device}" if self.tensor is not None else ""
        return f"Leaf(dtype={self.dtype!r}, shape={self.shape!r}, loaded={self.loaded}{where})"


@dataclasses.dataclass
class BackendRun:
    """Everything one backend produced: named outputs (and ``grad:`` outputs), status, timing."""

    backend: str
    status: str
    outputs: dict[str, Leaf]
    message: str = ""
    seconds: float = 0.0
    grad_status: str | None = None
    grad_message: str = ""
    compute_dtype: str = "float32"
    reduction_lengths: dict[str, int] = dataclasses.field(default_factory=dict)
    """For ``grad:<param>`` outputs: about how many terms the backward sums into each element."""
    notes: list[str] = dataclasses.field(default_factory=list)
    """What the backend said about how it ran (:func:`rlx_nb.backends.notes.add_note`): a route, graph breaks."""
    detail: str = ""
    """A failed run's whole error (every line, chained causes, where it was raised); ``message`` is its gist."""
    abandoned: bool = dataclasses.field(default=False, repr=False, compare=False)
    """Its thread was left running after its timeout (not saved: a run's own business)."""


class Fingerprints(collections.abc.Mapping):
    """``inputs`` and ``model`` fingerprints, computed the first time something reads them.

    Nothing in a single-node report reads them; saving, merging and gathering do.  ``compute()``
    returns the dict (a value is ``None`` when it can no longer be computed, e.g. the inputs were
    changed in place after the run); it runs once and is then dropped.
    """

    def __init__(self, compute: Callable[[], dict]) -> None:
        self._values: dict | None = None
        self._compute: Callable[[], dict] | None = compute

    def _get(self) -> dict:
        if self._values is None:
            self._values = self._compute()
            self._compute = None
        return self._values

    def __getitem__(self, key: str) -> str | None:
        return self._get()[key]

    def __iter__(self):
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())

    def __repr__(self) -> str:
        return repr(self._get()) if self._values is not None else "Fingerprints(<computed when read>)"


@dataclasses.dataclass
class RunResults:
    """The oracle, the fp64 reference and each candidate's outputs, plus the environment."""

    label: str
    oracle: BackendRun
    reference: BackendRun
    candidates: dict[str, BackendRun]
    backward: bool
    environment: dict[str, Any]
    fingerprints: Mapping[str, str | None] = dataclasses.field(default_factory=dict)
    """``inputs`` and ``model``: sha256 of the tensors' dtypes, shapes and bytes (nodes must agree on inputs);
    a :class:`Fingerprints` computed only when read (saving, merging, gathering)."""
    anchors: dict[int, BackendRun] = dataclasses.field(default_factory=dict)
    """Runs with matmul/conv operands rounded to 8 and 11 bits: the effective-precision scale."""
    sequential: BackendRun | None = None
    """The model in float32 with plain sequential reductions (:mod:`rlx_nb.backends.sequential`): a second
    legitimate error next to the oracle's.  ``None`` when the model has no reduction it changes
    (it would repeat the oracle) or the run failed; when only its backward failed, it holds the
    forward outputs.  A failure's reason is in ``environment["sequential_failed"]``."""
    discrete: dict[str, BackendRun] = dataclasses.field(default_factory=dict)
    """Per run (a candidate, ``cpu`` for the oracle, ``sequential``): the part of its gradients that ReLU inputs
    within round-off of their thresholds, flipped in that run, explain (:mod:`rlx_nb.execution.discrete`), taken out
    before the budget judges them; the run's notes say which units."""
    trials: dict[str, BackendRun] = dataclasses.field(default_factory=dict)
    """int8 (:mod:`rlx_nb.int8`): the Q/DQ simulation run again with its requantizations rounded as a correct int8
    kernel may round them, by name (``trial0`` ...): legitimate runs the budget is measured from, beside the oracle.
    Empty for a float model."""
    worlds: Any = dataclasses.field(default=None, repr=False, compare=False)
    """int8: the decisive elements' worlds (:class:`rlx_nb.int8.worlds.Worlds`) that ``discrete`` was accounted from,
    for a localization that judges other runs as these were judged.  Not saved; None for a float model."""

    @property
    def output_names(self) -> list[str]:
        return list(self.oracle.outputs)


OPAQUE = "opaque"
"""The dtype of a leaf that is neither a tensor nor a plain value: it is named, never compared."""


def to_leaf(value: Any, keep_on_device: bool = False, *, copy: bool = False) -> Leaf:
    """One output as a :class:`Leaf`: a host array sharing the tensor's memory (``copy``: its own), or the
    device tensor itself (``keep_on_device``)."""
    if isinstance(value, Opaque):
        return Leaf(value.type_name, OPAQUE, None)
    if not isinstance(value, torch.Tensor):
        return Leaf(value, type(value).__name__, None)
    t = value.detach()
    dtype = str(t.dtype).removeprefix("torch.")
    if t.dtype == torch.bfloat16:
        t = t.float()  # numpy has no bfloat16 (nor do the device metrics); the dtype name keeps the truth
    if keep_on_device and t.dtype in (torch.float32, torch.float16):
        return Leaf(None, dtype, tuple(t.shape), tensor=t.contiguous())
    arr = t.to("cpu").resolve_conj().resolve_neg().numpy()
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)  # (not on 0-d outputs: it would make them 1-d)
    elif copy:
        arr = arr.copy()
    return Leaf(arr, dtype, tuple(arr.shape))


def nondeterministic(first: BackendRun, second: BackendRun, *, any_only: bool = False) -> dict[str, float]:
    """Outputs whose two runs differ (NaN in both counts as equal), with the largest difference; with
    ``any_only``, at most the first such output, found without reading further than its first difference
    (whether two runs are the same, not by how much)."""
    unstable = {}
    for name, leaf in first.outputs.items():
        other = second.outputs.get(name)
        if other is None or not leaf.is_array:
            continue
        a, b = leaf.value, other.value
        if a.shape != b.shape:
            unstable[name] = float("inf")
        elif (largest := _largest_difference(a, b, first_only=any_only)) is not None:
            unstable[name] = largest
        if unstable and any_only:
            break
    return unstable


_CHUNK = 1 << 20  # elements compared at a time: the temporaries stay a few MB whatever the output's size


def _largest_difference(a: np.ndarray, b: np.ndarray, *, first_only: bool) -> float | None:
    # The largest |a - b| over the elements where two arrays of one shape differ (NaN equal to NaN; NaN against a
    # number is inf), None where none does; chunk by chunk, each first compared byte for byte (the common case:
    # the same bits, one pass).
    bitwise = a.dtype == b.dtype and a.dtype.kind in "biufc"
    x, y = np.ascontiguousarray(a).reshape(-1), np.ascontiguousarray(b).reshape(-1)
    largest = None
    for s in range(0, x.size, _CHUNK):
        xc, yc = x[s : s + _CHUNK], y[s : s + _CHUNK]
        if bitwise and same_bits(xc, yc):
            continue
        same = (xc == yc) | ((xc != xc) & (yc != yc)) if xc.dtype.kind in "fc" or yc.dtype.kind in "fc" else xc == yc
        if np.all(same):
            continue
        off = ~same
        if xc.dtype.kind == "b":
            here = 1.0
        else:
            wide = np.complex128 if "c" in (xc.dtype.kind, yc.dtype.kind) else np.float64
            with np.errstate(invalid="ignore", over="ignore"):
                diff = np.abs(xc[off].astype(wide) - yc[off].astype(wide))
            here = float(np.where(np.isnan(diff), np.inf, diff).max())
        largest = here if largest is None else max(largest, here)
        if first_only:
            break
    return largest
