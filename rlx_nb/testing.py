"""Backend agreement as a test assertion, in the ``torch.testing`` style.

:func:`assert_backends_agree` runs :func:`rlx_nb.backend_divergence` and raises ``AssertionError``
when a backend is SUSPECT (or, unless ``allow_errors``, when a backend you named could not run).
The message is the seed's report lines and where the failing report was saved, so a CI log says
what diverged and the report can be opened later (``rlx_nb.load_report``, ``rlx-nb show``-style
notebooks, the explorer).

Under pytest, the ``rlx_nb`` plugin (installed with the package) adds ``--rlx-nb-report-dir DIR``:
every failing check saves its report there, named after the test.  Without the option and without
``report_dir``, nothing is written.

Examples
--------
>>> import torch
>>> from rlx_nb.testing import assert_backends_agree
>>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
>>> report = assert_backends_agree(model, torch.randn(4, 8), backends=["cpu-nomkldnn"])
>>> report.suspects
[]
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from rlx_nb._support.safe import file_stem, inside, term_text
from rlx_nb.api import backend_divergence
from rlx_nb.errors import InputError, RlxError
from rlx_nb.report.report import DivergenceReport

REPORT_DIR: Path | None = None
"""Where failing checks save their reports when ``report_dir`` is not given; else the pytest plugin's
``--rlx-nb-report-dir``."""


def _plugin_state(key: str) -> Any:
    plugin = sys.modules.get("rlx_nb_pytest")  # (the plugin, a module beside the package)
    return plugin.STATE.get(key) if plugin is not None else None


def _file_name(label: str) -> str:
    test = _plugin_state("test")
    stem = f"{test}--{label}" if test else label
    return file_stem(stem) + ".rlxnb"


def _save(report: DivergenceReport, target: Path) -> str:
    # Save under a name no earlier check took (a test may fail several checks with one label); the line to
    # add to the failure message.  A failed save never hides the assertion: the line says why instead.
    name = _file_name(report.label)
    try:
        target.mkdir(parents=True, exist_ok=True)
        path, n = inside(target, name, "the report"), 1
        while path.exists():
            n += 1
            path = inside(target, f"{name.removesuffix('.rlxnb')}-{n}.rlxnb", "the report")
        path = report.save(path)
    except (OSError, RlxError) as exc:
        return f"report NOT saved: {target / name} could not be written ({type(exc).__name__}: {exc})"
    return f"report saved to {path} (rlx_nb.load_report({str(path)!r}), then rlx_nb.explore(report))"


def assert_backends_agree(
    model: Any,
    inputs: Any,
    *,
    backends: Any = None,
    backward: bool = False,
    int8: bool = False,
    allow_errors: bool = False,
    report_dir: str | Path | None = None,
    msg: str | None = None,
    **kwargs: Any,
) -> DivergenceReport:
    """Assert every backend's divergence from the CPU oracle is round-off; return the report.

    Parameters
    ----------
    model, inputs, backends, backward
        As for :func:`rlx_nb.backend_divergence`; other keyword arguments go there too.
    int8 : bool
        Judge int8 runtimes of the model against its Q/DQ simulation instead (:func:`rlx_nb.quantized_divergence`,
        which the other keyword arguments then go to; ``backward`` does not apply).
    allow_errors : bool
        Pass even when a backend could not run (an ``error`` or ``skipped`` row).  By default a backend named in
        ``backends`` that did not run is a failure; with ``backends=None`` (every live default backend)
        such rows never fail the check, as a backend that is absent is not a divergence.  A check that judged
        nothing (every backend skipped or failed, or the call interrupted) fails whatever this says.
    report_dir : str or Path, optional
        Save the report of a failing check there (default: :data:`REPORT_DIR`, which the pytest
        plugin's ``--rlx-nb-report-dir`` sets).
    msg : str, optional
        A first line for the failure message.

    Raises
    ------
    AssertionError
        With the seed's report lines, the failing backends and where the report was saved.
    """
    if not isinstance(allow_errors, bool):
        raise InputError(f"allow_errors must be True or False, got {allow_errors!r}")
    if not isinstance(int8, bool):
        raise InputError(f"int8 must be True or False, got {int8!r}")
    kwargs.setdefault("progress", False)
    if int8:
        if backward:
            raise InputError("backward=True does not apply to int8=True: int8 runtimes are judged on the forward")
        from rlx_nb.int8.divergence import quantized_divergence

        report = quantized_divergence(model, inputs, backends=backends, **kwargs)
    else:
        report = backend_divergence(model, inputs, backends=backends, backward=backward, **kwargs)
    suspects = report.suspects
    errors = [] if (allow_errors or backends is None) else report.not_run
    nothing = report.judged_nothing()
    if not suspects and not errors and not nothing:
        return report
    lines = [msg] if msg else []
    what = []
    if suspects:
        what.append(f"SUSPECT: {', '.join(suspects)}")
    if errors:
        what.append(f"did not run: {', '.join(errors)}")
    if suspects or errors:
        lines.append(f"backends disagree with the CPU oracle beyond round-off ({'; '.join(what)})")
    if nothing:
        lines.append(f"the check judged nothing, so it cannot pass: {nothing}")
    lines += report.lines()
    target = report_dir if report_dir is not None else REPORT_DIR or _plugin_state("report_dir")
    if target is not None:
        lines.append(_save(report, Path(target)))
    else:
        lines.append("report not saved: pass report_dir=, or run pytest with --rlx-nb-report-dir DIR")
    raise AssertionError(term_text("\n".join(lines)))  # (a CI log: no terminal escapes from a name or message)


def assert_training_agrees(
    model: Any,
    batches: Any,
    loss_fn: Any = None,
    *,
    optimizer: Any,
    steps: int,
    backends: Any = None,
    trajectory: bool = False,
    allow_errors: bool = False,
    msg: str | None = None,
    **kwargs: Any,
) -> Any:
    """Assert no training backend has a local step past the line (:func:`rlx_nb.training_divergence`); return the
    report.  ``trajectory=True`` also fails on a trajectory that leaves its envelope (drift, which chaos alone can
    make); a backend that could not train fails unless ``allow_errors``.

    Raises
    ------
    AssertionError
        With the report's lines and, for each backend past the line, where its error is born.
    """
    from rlx_nb.training.divergence import training_divergence

    for name, flag in (("trajectory", trajectory), ("allow_errors", allow_errors)):
        if not isinstance(flag, bool):
            raise InputError(f"{name} must be True or False, got {flag!r}")
    kwargs.setdefault("progress", False)
    report = training_divergence(model, batches, loss_fn, optimizer=optimizer, steps=steps, backends=backends,
                                 **kwargs)  # fmt: skip
    drifted = sorted(report.leaving) if trajectory else []
    failed = [] if allow_errors else sorted(report.failed)
    if not report.suspects and not drifted and not failed:
        return report
    lines = [msg] if msg else []
    if report.suspects:
        lines.append(f"training backends past the line at a local step: {', '.join(report.suspects)}")
    if drifted:
        lines.append("trajectories that leave their envelope: "
                     + ", ".join(f"{b} at step {report.leaving[b]}" for b in drifted))  # fmt: skip
    if failed:
        lines.append(f"did not train: {', '.join(f'{b} ({report.failed[b]})' for b in failed)}")
    lines += report.lines()
    raise AssertionError(term_text("\n".join(lines)))


def assert_invariant(model: Any, inputs: Any, *, past_line_only: bool = False, msg: str | None = None,
                     **kwargs: Any) -> Any:  # fmt: skip
    """Assert every row's outputs are bit for bit the row alone's in every configuration (:func:`rlx_nb.invariance`;
    ``past_line_only=True``: only that no difference is past the line); return the report.

    Raises
    ------
    AssertionError
        With the report's lines: the configurations that part and the first op that does.
    """
    from rlx_nb.configurations.run import invariance

    if not isinstance(past_line_only, bool):
        raise InputError(f"past_line_only must be True or False, got {past_line_only!r}")
    kwargs.setdefault("progress", False)
    report = invariance(model, inputs, **kwargs)
    verdict = report.verdict()
    if not report.failed and (verdict == "bit for bit" or (past_line_only and verdict != "SUSPECT")):
        return report
    lines = [msg] if msg else []
    lines.append("not bit for bit invariant" if verdict != "SUSPECT" else "a configuration parts past the line")
    lines += report.lines()
    raise AssertionError(term_text("\n".join(lines)))


__all__ = ["REPORT_DIR", "assert_backends_agree", "assert_invariant", "assert_training_agrees"]
