"""rlx_nb: is this backend's divergence round-off, or a kernel bug — and where?

Run one PyTorch model on the CPU oracle and on every other backend live on
this machine, and judge each backend's gap against a float64 reference.
"""

from __future__ import annotations

from rlx_nb._support.loud_imports import quiet_noisy_imports as _quiet_noisy_imports
from rlx_nb._version import __version__  # (first: it stops a torch older than the tested range, clearly)
from rlx_nb.api import backend_divergence, interrupted_report, load_report, report_backend_divergence
from rlx_nb.backends.registry import available_backends, register_backend, unregister_backend
from rlx_nb.changes.diff import diff
from rlx_nb.changes.record import snapshot
from rlx_nb.changes.result import Diff
from rlx_nb.changes.snapshot_file import Snapshot, load_snapshot
from rlx_nb.comparison.compare import compare
from rlx_nb.configurations.report import InvarianceReport
from rlx_nb.configurations.run import interrupted_invariance, invariance
from rlx_nb.errors import BackendError, InputError, ReportFormatError, RlxError
from rlx_nb.errors import short_tracebacks_in_ipython as _short_tracebacks
from rlx_nb.execution.cache import clear_preparations, kept_preparations
from rlx_nb.execution.results import RunResults
from rlx_nb.execution.run import run
from rlx_nb.generation.divergence import generation_divergence
from rlx_nb.generation.report import GenerationReport
from rlx_nb.int8.divergence import quantized_divergence
from rlx_nb.localization.locate import localize
from rlx_nb.localization.result import Localization
from rlx_nb.numerics import warmup as _warmup
from rlx_nb.precision import precision_sweep
from rlx_nb.report.baseline import compare_reports
from rlx_nb.report.merge import merge_reports
from rlx_nb.report.report import DivergenceReport
from rlx_nb.training.backends import register_training_backend
from rlx_nb.training.divergence import interrupted_training, training_divergence
from rlx_nb.training.report import TrainingReport
from rlx_nb.verdict.records import OutputRecord

_warmup.start()  # the numba kernels load in the background (rlx_nb/numerics/warmup.py)
_short_tracebacks()  # in a notebook, an RlxError shows as the user's line and its message (rlx_nb/errors.py)
_quiet_noisy_imports()  # torchao's "Failed to load" lines kept out, whoever imports it (rlx_nb/_support/loud_imports.py)


def explore(report, **kwargs):
    """The widget explorer for ``report`` (needs ipywidgets): a forward or a generation report
    (:func:`rlx_nb.explorer.explore`); a diff, a training report or an invariance report -- a picker of their parts
    above the explorer of the part picked (:mod:`rlx_nb.diff_explorer`)."""
    from rlx_nb import diff_explorer

    for kind, opener in ((Diff, diff_explorer.explore_diff), (TrainingReport, diff_explorer.explore_training),
                         (InvarianceReport, diff_explorer.explore_invariance)):  # fmt: skip
        if isinstance(report, kind):
            return opener(report, **kwargs)
    if {"module", "side"} & set(kwargs):
        raise InputError("module= and side= pick a diff's module; this is a report (rlx_nb.diff(...) makes a diff)")
    from rlx_nb.explorer import explore as _explore

    return _explore(report, **kwargs)


__all__ = [
    "BackendError",
    "Diff",
    "DivergenceReport",
    "GenerationReport",
    "InputError",
    "InvarianceReport",
    "Localization",
    "OutputRecord",
    "ReportFormatError",
    "RlxError",
    "RunResults",
    "Snapshot",
    "TrainingReport",
    "__version__",
    "available_backends",
    "backend_divergence",
    "clear_preparations",
    "compare",
    "compare_reports",
    "diff",
    "explore",
    "generation_divergence",
    "interrupted_invariance",
    "interrupted_report",
    "interrupted_training",
    "invariance",
    "kept_preparations",
    "load_report",
    "load_snapshot",
    "localize",
    "merge_reports",
    "precision_sweep",
    "quantized_divergence",
    "register_backend",
    "register_training_backend",
    "report_backend_divergence",
    "run",
    "snapshot",
    "training_divergence",
    "unregister_backend",
]
