"""The two entry points the RLX runtime's diagnostic had, in Python form."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from rlx_nb.execution import interrupted
from rlx_nb.execution.results import GENERATION_KEY
from rlx_nb.generation.report import GenerationReport, load_generation
from rlx_nb.report.judged import CallOptions, judged_report
from rlx_nb.report.report import DivergenceReport, read_report
from rlx_nb.verdict.rule import check_rule


def backend_divergence(
    model: Any,
    inputs: Any,
    *,
    params: Mapping[str, torch.Tensor] | None = None,
    backends: str | Iterable[str] | None = None,
    tol_rel: float | None = None,
    backward: bool = False,
    loss: Callable[[Any], torch.Tensor] | None = None,
    label: str | None = None,
    rule: str = "budget",
    progress: bool | Callable[[str], None] | None = None,
    timeout_s: float | None = 600.0,
    check_determinism: bool = True,
    memory_budget: float | None = None,
) -> DivergenceReport:
    """Run ``model`` on the CPU oracle and on every other backend, and judge each one's gap.

    Parameters
    ----------
    model : torch.nn.Module or callable
        Run on a private copy (eval mode, float32, CPU); the original is untouched.
    inputs : Tensor, tuple or dict
        Positional arguments (a tensor or a tuple) or keyword arguments (a dict).
    params : mapping, optional
        ``name -> tensor`` loaded into the copy before running (the seed's ``set_param``).
    backends : None, str or list of str
        ``None`` runs every live default backend; a comma-separated string or a
        list picks some (opt-in ones such as ``cpu-bf16`` and ``fault:*`` too).
    tol_rel : float, optional
        The fixed rule's threshold on ``max_rel``; defaults to 2e-3 for
        forward outputs and 1e-2 for gradients.
    backward : bool
        Also compare gradients w.r.t. parameters and to inputs that require
        grad, as outputs named ``grad:<name>``.
    loss : callable, optional
        ``loss(outputs) -> scalar`` for the backward; defaults to
        ``sum(out * w)`` over floating outputs with fixed random ``w``.
    label : str, optional
        Name in the report lines; defaults to the model's class name.
    rule : {"budget", "fixed"}
        The verdict in charge; both are always computed and shown.
    progress : None, bool or callable
        ``None`` (default): progress bars (tqdm; a widget in Jupyter) appear on
        steps that take more than two seconds.  ``True`` also prints each
        backend's name to stderr as it starts; a callable receives the name
        instead.  ``False``: no bars and no messages (quiet CI logs).
    timeout_s : float or None
        Per-backend limit (default 600 s); a backend still running then is an
        ``error`` row and the others keep going.  ``None``: no limit.  Exported,
        device and registered backends run in a worker thread, abandoned at the
        limit; rlx_nb's own CPU backends (eager, autocast, faults, Inductor) run on
        the calling thread, as the oracle does, and stop at their next Python step.
    check_determinism : bool
        Check that the oracle's outputs repeat on a second run; outputs that
        differ are the model's own nondeterminism and get the verdict
        ``nondeterministic``, not SUSPECT.  The second run is ``cpu-nomkldnn``'s
        (or ``cpu-nnpack``'s) when it is a candidate and repeats every output bit
        for bit (the same eager float32 code, no kernel the switch changes), else
        the oracle once more.  ``False`` saves that model run; the model's
        nondeterminism is then not measured, and any would count against the
        backends.
    memory_budget : float, optional
        Bytes the call may use beyond what the process holds when it starts (``float("inf")``: no limit, no phase
        skipped).  By default, what the kernel says is available.  Before each phase that needs much memory (the fp64 reference, a
        conversion) its need is estimated against this; one that would not fit becomes a ``skipped``
        row saying so (kept preparations of earlier calls are dropped first), never a killed kernel.

    Returns
    -------
    DivergenceReport

    Examples
    --------
    >>> import torch, rlx_nb
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    >>> report = rlx_nb.backend_divergence(model, torch.randn(4, 8), backends=["cpu-nomkldnn"])
    >>> report.suspects
    []
    """
    options = CallOptions(params=params, backends=backends, tol_rel=tol_rel, backward=backward, loss=loss,
                          label=label, rule=rule, progress=progress, timeout_s=timeout_s,
                          check_determinism=check_determinism, memory_budget=memory_budget)  # fmt: skip
    return judged_report(model, inputs, options, entry="backend_divergence")


def interrupted_report(*, rule: str = "budget") -> DivergenceReport | GenerationReport | None:
    """The report of the backends that had finished when the last call was interrupted (Ctrl-C), or ``None``.

    A :class:`~rlx_nb.GenerationReport` where the call was :func:`rlx_nb.generation_divergence` and the oracle had
    decoded; ``None`` also where the interrupt came before any backend had finished.

    An interrupt is never swallowed: it propagates (every switch restored), with a note saying this
    function has what finished.  The report is marked incomplete: ``report.incomplete`` and its last text
    line say which backends did not run.  It is kept until the next interrupt
    (``rlx_nb.execution.interrupted.clear()`` drops it).

    Examples
    --------
    >>> import rlx_nb
    >>> rlx_nb.execution.interrupted.clear(); rlx_nb.interrupted_report() is None
    True
    """
    check_rule(rule)
    results = interrupted.latest()
    if results is None:
        return None
    report = DivergenceReport.from_results(results, rule=rule, progress=False)
    return GenerationReport(report) if GENERATION_KEY in results.environment else report


def load_report(path: str | Path) -> DivergenceReport | GenerationReport:
    """Read a report saved by ``report.save`` (or ``rlx-nb check --save``): a :class:`~rlx_nb.GenerationReport` where
    the file holds a generation's tokens, else a :class:`~rlx_nb.DivergenceReport`; arrays are read lazily.

    Every field is checked on load: anything that is not a readable report of this version raises
    :class:`~rlx_nb.ReportFormatError`; nothing is unpickled or executed.

    Examples
    --------
    >>> import tempfile, torch, rlx_nb
    >>> r = rlx_nb.backend_divergence(torch.nn.Linear(2, 2), torch.ones(1, 2), backends=["cpu-nomkldnn"])
    >>> rlx_nb.load_report(r.save(tempfile.mkdtemp() + "/r")).lines() == r.lines()
    True
    """
    return load_generation(read_report(path), path)


def report_backend_divergence(label: str, model: Any, inputs: Any, **kwargs: Any) -> bool:
    """Print one line per backend to stderr; return True if any backend is SUSPECT.

    A CPU-only node (nothing to compare) prints that and returns False, as
    the RLX runtime's ``report_backend_divergence`` does.  Keyword arguments
    go to :func:`backend_divergence`.

    Examples
    --------
    >>> import torch, rlx_nb
    >>> rlx_nb.report_backend_divergence("lin", torch.nn.Linear(2, 2), torch.ones(1, 2), backends=["cpu"])
    False
    """
    report = backend_divergence(model, inputs, label=label, **kwargs)
    for line in report.lines():
        print(line, file=sys.stderr)
    return report.any_suspect
