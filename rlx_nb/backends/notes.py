"""What a backend says about how it ran: notes collected while its ``fn`` runs, kept with its run.

A backend function returns outputs only; :func:`add_note` lets it also say how it got them (the
route a converter took, graph breaks, a retry), and the run's record keeps the notes
(``BackendRun.notes``), so a report never shows a result without the way it was produced.
Registered backends may call it too.

Examples
--------
>>> with collecting() as notes:
...     add_note("converted through ONNX")
>>> notes
['converted through ONNX']
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

_NOTES: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("rlx_nb_backend_notes", default=None)


def add_note(text: str) -> None:
    """Record one line about the running backend's run (ignored outside a run)."""
    notes = _NOTES.get()
    if notes is not None and text not in notes:
        notes.append(text)


@contextlib.contextmanager
def collecting() -> Iterator[list[str]]:
    """Collect the notes :func:`add_note` records inside the block (this thread and context)."""
    notes: list[str] = []
    token = _NOTES.set(notes)
    try:
        yield notes
    finally:
        _NOTES.reset(token)
