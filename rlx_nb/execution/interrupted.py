"""What an interrupted call had finished: kept, not lost, while the interrupt propagates.

Ctrl-C in a notebook (a kernel interrupt) or ``SystemExit`` during :func:`rlx_nb.run` never becomes a row
and is never swallowed: it propagates, after every switch is restored (:mod:`rlx_nb._support.switches`).  The
backends that had finished are kept here, as results marked incomplete
(``environment["incomplete"]`` says what did not run), and the exception gets a note saying how to get
them back: :func:`rlx_nb.interrupted_report`.
"""

from __future__ import annotations

import threading
from typing import Any

from rlx_nb.execution.results import RunResults

_KEPT: dict[str, Any] = {"results": None, "by": None}
_LOCK = threading.Lock()


def keep(results: RunResults, exc: BaseException) -> None:
    """Keep ``results`` (those of a call ``exc`` interrupted) and say so on ``exc``."""
    with _LOCK:
        _KEPT["results"], _KEPT["by"] = results, exc
    done = len(results.candidates)
    exc.add_note(
        f"rlx_nb: {done} backend(s) had finished before the interrupt ({', '.join(results.candidates) or 'none'}); "
        "rlx_nb.interrupted_report() returns their report, marked incomplete"
    )


def nothing_finished(exc: BaseException | None, running: str) -> bool:
    """An interrupt (``exc``) of a call before any of its backends had finished, while ``running`` ran: what an
    earlier call kept is dropped (:func:`rlx_nb.interrupted_report` must not hand out another call's report) and
    ``exc`` says so.  Any other exception, or an interrupt whose results were kept, passes as it is.  Returns
    False (the exception propagates)."""
    if not isinstance(exc, (KeyboardInterrupt, SystemExit)):
        return False
    with _LOCK:
        if _KEPT["by"] is exc:
            return False
        _KEPT["results"], _KEPT["by"] = None, exc
    exc.add_note(f"rlx_nb: interrupted while {running} ran, before any backend had finished: nothing was kept")
    return False


def latest() -> RunResults | None:
    """The results the last interrupted call kept, or ``None`` (kept until the next interrupt or :func:`clear`)."""
    with _LOCK:
        return _KEPT["results"]


def clear() -> None:
    """Drop the kept results (their outputs can be large)."""
    with _LOCK:
        _KEPT["results"] = _KEPT["by"] = None
