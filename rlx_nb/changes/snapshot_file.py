"""A snapshot read back: its modules, each one's call, inputs, outputs and float64 value, its environment."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlx_nb.changes import files
from rlx_nb.changes.record import template
from rlx_nb.execution.results import Leaf
from rlx_nb.localization.capture import fill


class Snapshot:
    """One environment's run of a model, module by module (:func:`rlx_nb.snapshot` writes it; read lazily).

    Attributes
    ----------
    label, backend : str
        The environment's name and what the model ran on there.
    environment : dict
        Versions, CPU features, BLAS and oneDNN, threads, dispatch variables, rlx_nb's switches.
    fingerprints : dict
        The model's and inputs' fingerprints and structures.
    modules : list of str
        The modules recorded, in the order they were first called.
    """

    def __init__(self, meta: dict, stored: files.Stored, path: Path | None = None) -> None:
        self.meta, self._stored, self.path = meta, stored, path
        self.label: str = meta["label"]
        self.backend: str = meta["backend"]
        self.environment: dict = meta["environment"]
        self.fingerprints: dict = meta["fingerprints"]
        self._modules = {m["name"]: m for m in meta["modules"]}

    @classmethod
    def load(cls, path: str | Path) -> Snapshot:
        meta, stored = files.read(path)
        return cls(meta, stored, Path(path))

    @property
    def modules(self) -> list[str]:
        return list(self._modules)

    @property
    def has_ops(self) -> bool:
        """Whether it recorded its modules' own torch function calls (``ops=True``)."""
        return any(m.get("op") for m in self._modules.values())

    @property
    def has_reference(self) -> bool:
        return any(m["reference"] for m in self._modules.values())

    @property
    def nbytes(self) -> int:
        """The bytes of arrays it holds."""
        return int(self.meta["bytes"])

    def entry(self, name: str) -> dict:
        return self._modules[name]

    def _leaf(self, entry: str) -> Leaf:
        spec = self._stored.declared[entry]
        return Leaf(None, spec["dtype"], tuple(spec["shape"]), loader=lambda: self._stored.array(entry))

    def outputs(self, name: str) -> dict[str, Leaf]:
        """``{output leaf: Leaf}`` of one module as recorded (leaves past the byte budget left out)."""
        return {k: self._leaf(e) for k, e in self._modules[name]["outputs"].items() if e is not None}

    def reference(self, name: str) -> dict[str, Leaf]:
        """``{output leaf: Leaf}``: the float64 model's value of each output of one module (where recorded)."""
        out = {}
        m = self._modules[name]
        for k, e in m["reference"].items():
            o = m["outputs"].get(k)
            if e is None or o is None:
                continue
            value = self._stored.array(o).astype(np.float64) + self._stored.array(e).astype(np.float64)
            out[k] = Leaf(value, "float64", tuple(value.shape))
        return out

    def call(self, name: str) -> tuple[tuple, dict] | None:
        """``(args, kwargs)`` of the module's first call as recorded (fresh tensors each time), or None where it
        cannot run alone (:meth:`why`)."""
        m = self._modules[name]
        if m["call"] is None:
            return None
        return fill(template(m["call"]), tuple(self.tensors(name)))

    def tensors(self, name: str) -> list[torch.Tensor]:
        """The tensors of the module's first call as recorded (fresh ones each time), in its call's slot order."""
        return [self._tensor(e) for e in self._modules[name]["inputs"] if e is not None]

    def why(self, name: str) -> str:
        return self._modules[name]["why"]

    def _tensor(self, entry: str) -> torch.Tensor:
        spec = self._stored.declared[entry]
        t = torch.from_numpy(np.array(self._stored.array(entry)))
        return t.to(getattr(torch, spec["dtype"])) if spec["dtype"] == "bfloat16" else t

    def __repr__(self) -> str:
        ref = ", with its float64 reference" if self.has_reference else ""
        ref = (" (each alone)" if self.meta.get("alone") else "") + ref
        return (f"<Snapshot {self.label!r}: {len(self._modules)} modules on {self.backend}{ref}, "
                f"{self.nbytes / 1e6:.1f} MB>")  # fmt: skip


def load_snapshot(path: str | Path) -> Snapshot:
    """Read a snapshot written by :func:`rlx_nb.snapshot` (every field and array header checked; arrays read on
    first use).  A file that is not one raises :class:`~rlx_nb.errors.ReportFormatError`."""
    return Snapshot.load(path)


def as_snapshot(x: Any, what: str) -> Snapshot:
    from rlx_nb.errors import InputError

    if isinstance(x, Snapshot):
        return x
    if isinstance(x, (str, Path)):
        return Snapshot.load(x)
    raise InputError(f"{what} must be a snapshot (rlx_nb.snapshot's file, or rlx_nb.load_snapshot's), "
                     f"got {type(x).__name__}")  # fmt: skip


__all__ = ["Snapshot", "as_snapshot", "load_snapshot"]
