"""Attributes of another library replaced while rlx_nb's own calls run, and put back as they were after.

Used where a library does needless work inside rlx_nb's calls (OpenVINO's telemetry, ExecuTorch's quantizer
re-tracing its patterns, torch.export's op table and torch's annotation subscripts): the replacement is in place only while at least one such call
is inside; calls may overlap (threads, nesting), the first one in replaces, the last one out restores.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any


class Held:
    """One set of replacements, shared by every caller of :meth:`replaced`.

    Examples
    --------
    >>> import types
    >>> lib = types.SimpleNamespace(work=lambda: "slow")
    >>> held = Held()
    >>> with held.replaced(lambda: [(lib, "work", lambda: "fast")]):
    ...     with held.replaced(lambda: [(lib, "work", lambda: "never made")]):
    ...         inside = lib.work()
    >>> inside, lib.work()
    ('fast', 'slow')
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inside = 0
        self._saved: list[tuple[Any, str, Any]] = []

    @contextlib.contextmanager
    def replaced(self, replacements: Callable[[], list[tuple[Any, str, Any]]]) -> Iterator[None]:
        """Inside, each ``(owner, name, value)`` that ``replacements()`` gives is set; it is called by the first
        caller in only (the others find them set), and each attribute is put back after the last caller leaves."""
        with self._lock:
            if not self._inside:
                for owner, name, value in replacements():
                    self._saved.append((owner, name, getattr(owner, name)))
                    setattr(owner, name, value)
            self._inside += 1
        try:
            yield
        finally:
            with self._lock:
                self._inside -= 1
                if not self._inside:
                    for owner, name, value in reversed(self._saved):
                        setattr(owner, name, value)
                    self._saved.clear()
