"""What an interrupted call had finished: kept, not lost, while the interrupt propagates.

Ctrl-C in a notebook (a kernel interrupt) or ``SystemExit`` during :func:`rlx_nb.run` never becomes a row
and is never swallowed: it propagates, after every switch is restored (:mod:`rlx_nb.switches`).  The
backends that had finished are kept here, as results marked incomplete
(``environment["incomplete"]`` says what did not run), and the exception gets a note saying how to get
them back: :func:`rlx_nb.interrupted_report`.
"""

from __future__ import annotations

import threading

from rlx_nb.results import RunResults

_KEPT: dict[str, RunResults | None] = {"results": None}
_LOCK = threading.Lock()


def keep(results: RunResults, exc: BaseException) -> None:
    """Keep ``results`` (those of a call ``exc`` interrupted) and say so on ``exc``."""
    with _LOCK:
        _KEPT["results"] = results
    done = len(results.candidates)
    exc.add_note(
        f"rlx_nb: {done} backend(s) had finished before the interrupt ({', '.join(results.candidates) or 'none'}); "
        "rlx_nb.interrupted_report() returns their report, marked incomplete"
    )


def latest() -> RunResults | None:
    """The results the last interrupted call kept, or ``None`` (kept until the next interrupt or :func:`clear`)."""
    with _LOCK:
        return _KEPT["results"]


def clear() -> None:
    """Drop the kept results (their outputs can be large)."""
    with _LOCK:
        _KEPT["results"] = None
