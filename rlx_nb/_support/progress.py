"""Progress bars for the steps that can take more than a couple of seconds.

One helper so every bar behaves the same: ``tqdm.auto`` (a widget in Jupyter, text on a
terminal), shown only once the step has run for :data:`DELAY_S` seconds, and cleared when done.
``RLX_NB_PROGRESS=0`` in the environment turns every bar off (CI logs, notebooks saved with
their outputs); ``progress=False`` does the same for one call.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

DELAY_S = 2.0
"""Seconds before a bar appears; quick steps never show one."""
TICK_S = 1.0
"""How often a bar's elapsed time is redrawn while nothing advances it."""


class _Silent:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> _Silent:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def bar(desc: str, *, total: int | None = None, unit: str = "it", enabled: bool = True, file: Any = None) -> Any:
    """A delayed, notebook-aware bar (a no-op object when tqdm is missing or ``enabled`` is false).

    Examples
    --------
    >>> with bar("rlx_nb demo", total=3, unit="step") as b:
    ...     for _ in range(3):
    ...         b.update()
    """
    if not enabled or os.environ.get("RLX_NB_PROGRESS", "1") == "0":
        return _Silent()
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return _Silent()
    shown = tqdm(desc=desc, total=total, unit=unit, delay=DELAY_S, leave=False, file=file)
    # A ticker keeps the bar's clock running while one long step (a 20 s compile) holds it still.
    threading.Thread(target=_tick, args=(shown,), daemon=True, name="rlx_nb:progress").start()
    return shown


def _tick(shown: Any) -> None:
    while not getattr(shown, "disable", True):
        time.sleep(TICK_S)
        try:
            shown.update(0)
        except Exception:  # the bar was closed in between
            return


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover - IPython comes with the notebook extra
        return False
    shell = get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


class Board:
    """Lines that land one by one during a long call (each backend's verdict as it is judged).

    In a notebook they are one output that grows in place, removed when the call returns (the report
    then shows everything), like the bars; elsewhere each line goes to stderr as it lands.  Nothing
    shows before the call has run :data:`DELAY_S` seconds, and nothing with ``enabled=False`` or
    ``RLX_NB_PROGRESS=0``.
    """

    def __init__(self, *, enabled: bool = True) -> None:
        self.enabled = enabled and os.environ.get("RLX_NB_PROGRESS", "1") != "0"
        self.start = time.monotonic()
        self.lines: list[str | Callable[[], str]] = []
        self._handle: Any = None

    def add(self, line: str | Callable[[], str]) -> None:
        """Add a line, or a function that makes it: called only once the line is to be shown (a call that
        ends within :data:`DELAY_S`, or with the board disabled, never makes its lines)."""
        self.lines.append(line)
        if not self.enabled or time.monotonic() - self.start <= DELAY_S:
            return
        if _in_notebook():  # (the whole board shows: every line made)
            self.lines = [text if isinstance(text, str) else text() for text in self.lines]
            from IPython.display import display

            from rlx_nb._support.safe import html_text

            text = "\n".join(self.lines)
            bundle = {"text/plain": text, "text/html": f"<pre>{html_text(text)}</pre>"}
            if self._handle is None:
                self._handle = display(bundle, raw=True, display_id=True)
            else:
                self._handle.update(bundle, raw=True)
            return
        import sys

        from rlx_nb._support.safe import term_text

        if not isinstance(line, str):
            line = self.lines[-1] = line()
        try:
            from tqdm import tqdm

            tqdm.write(term_text(line), file=sys.stderr)  # (moves a bar on the same stream out of the way)
        except ImportError:  # pragma: no cover - tqdm is a dependency
            print(term_text(line), file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.update({"text/plain": ""}, raw=True)
            self._handle = None
