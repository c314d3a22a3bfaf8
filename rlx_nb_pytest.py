"""rlx_nb's pytest plugin: ``--rlx-nb-report-dir DIR`` keeps the report of every failing backend check.

Installed with rlx_nb (the ``pytest11`` entry point ``rlx_nb``); it does nothing unless the option
is given, and imports neither rlx_nb nor torch: a module of its own beside the package, so that loading it
imports nothing of rlx_nb's (a project's other tests do not pay for torch, and a torch older than rlx_nb's range
stops only the tests that use rlx_nb, not the whole run).  Each
test's failing :func:`rlx_nb.testing.assert_backends_agree` saves its report as
``DIR/<test id>--<label>.rlxnb`` (``-2``, ``-3``, ... for further failing checks of the same test and
label: a report is never overwritten).  A ``DIR`` that cannot be made or written is a usage error at
start-up.  ``-p no:rlx_nb`` turns the plugin off.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

STATE: dict[str, object] = {"report_dir": None, "test": None}
"""What :mod:`rlx_nb.testing` reads: the report directory and the running test's id."""


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("rlx_nb", "rlx_nb backend-divergence checks")
    group.addoption(
        "--rlx-nb-report-dir",
        metavar="DIR",
        default=None,
        help="save the report of every failing rlx_nb.testing.assert_backends_agree in DIR",
    )


def pytest_configure(config: pytest.Config) -> None:
    where = config.getoption("--rlx-nb-report-dir", default=None)
    if where:
        STATE["report_dir"] = usable_dir(where)


def usable_dir(where: str) -> Path:
    """``where`` as a directory reports can be written to (made if missing), or a usage error saying why not."""
    path = Path(where)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise pytest.UsageError(
            f"--rlx-nb-report-dir {where}: cannot be made a directory ({exc.strerror or exc}); "
            "give a directory, or a path where one can be created"
        ) from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise pytest.UsageError(f"--rlx-nb-report-dir {where}: the directory cannot be written to")
    return path.resolve()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    STATE["test"] = item.nodeid
    try:
        yield
    finally:
        STATE["test"] = None
