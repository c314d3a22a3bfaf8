"""What a backend is: a name, how it runs a model, where, in which format, and whether it is live here.

Every backend family (eager, compiled, ONNX Runtime, OpenVINO, precision, faults) builds these;
the registry (:mod:`rlx_nb.backends.registry`) keeps them by name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

ORACLE = "cpu"

REFERENCE = "cpu-f64"

BackendFn = Callable[[Any, tuple], Any]


@dataclasses.dataclass(frozen=True)
class Backend:
    """One way of executing a model.

    Attributes
    ----------
    name : str
        Registry key, e.g. ``"cpu-inductor"``.
    fn : callable
        ``fn(model, inputs) -> outputs``.
    device : str
        Device family the backend runs on (``"cpu"``, ``"cuda"``, ``"mps"``, ...).
    compute_dtype : str
        The format whose round-off the backend is judged against
        (``"float32"``, ``"bfloat16"``, ``"float16"``, ``"tf32"``).
    default : bool
        Whether ``backends=None`` includes it.  Reduced-precision and
        fault-injection backends are opt-in.
    differentiable : bool
        Whether gradients can flow through ``fn``'s outputs.
    probe : callable, optional
        ``probe() -> None`` when live, else a short reason it is not.
    description : str
        One line for tables.
    hookable : bool
        Whether module forward hooks observe the backend's own computation
        (true for eager backends; false for compiled or exported ones, whose
        hooks fire, if at all, while tracing).  Localization reports the
        propagated error only for hookable backends.
    compare_on_device : bool, optional
        Keep the outputs where the backend left them and compute the metrics there
        (:mod:`rlx_nb.numerics.device`), moving only summaries and requested slices to the host.
        ``None`` (default): yes for ``cuda`` and ``xpu`` backends (devices with float64).
    prepare : callable, optional
        ``prepare(model, inputs) -> runner``, ``runner(inputs) -> outputs``: the backend's costly step
        (a compile, an export) apart from running, so :mod:`rlx_nb.execution.cache` can keep it across
        calls.  ``fn`` must do the same as ``prepare(model, inputs)(inputs)``.
    on_caller : bool
        Run on the calling thread, as the oracle (and a user's own run) does, instead of a worker thread a
        timeout can abandon; past ``timeout_s`` it is stopped at its next Python step.  rlx_nb's own CPU
        backends whose code is PyTorch's (eager kernels with a switch, a format or a fault changed; the
        helper runs; Inductor's compiled CPU code): in a worker thread they ran 25-40% slower, because a
        second OpenMP team makes libgomp count more threads than cores and wake them from sleep at every
        parallel region.  Exported runtimes, devices and registered backends keep the worker thread.
    carries : Backend, optional
        A catalogue fault carried into a runtime (:func:`rlx_nb.backends.exported_faults.fault_through`): the fault's
        backend, whose computation the runtime is given (a repro traces it; a runtime's other path is given it too).
    """

    name: str
    fn: BackendFn
    device: str = "cpu"
    compute_dtype: str = "float32"
    default: bool = True
    differentiable: bool = True
    probe: Callable[[], str | None] | None = None
    description: str = ""
    builtin: bool = False
    hookable: bool = False
    compare_on_device: bool | None = None
    prepare: Callable[[Any, tuple], Callable[[tuple], Any]] | None = None
    on_caller: bool = False
    carries: Backend | None = None

    def __repr__(self) -> str:
        # Short: a notebook shows it when register_backend ends a cell.
        default = "default" if self.default else "opt-in"
        return f"<Backend {self.name!r}: {self.device}, {self.compute_dtype}, {default}>"

    @property
    def keeps_outputs_on_device(self) -> bool:
        return self.compare_on_device if self.compare_on_device is not None else self.device in ("cuda", "xpu")

    def unavailable_reason(self) -> str | None:
        """``None`` when the backend is live on this node, else why it is not."""
        if self.probe is None:
            return None
        try:
            return self.probe()
        except Exception as exc:  # a probe must never crash the caller
            return f"probe failed: {type(exc).__name__}: {exc}"

    @property
    def live(self) -> bool:
        return self.unavailable_reason() is None
