"""Progress bars for the steps that can take more than a couple of seconds.

One helper so every bar behaves the same: ``tqdm.auto`` (a widget in Jupyter, text on a
terminal), shown only once the step has run for :data:`DELAY_S` seconds, and cleared when done.
``RLX_NB_PROGRESS=0`` in the environment turns every bar off (CI logs, notebooks saved with
their outputs); ``progress=False`` does the same for one call.
"""

from __future__ import annotations

import os
from typing import Any

DELAY_S = 2.0
"""Seconds before a bar appears; quick steps never show one."""


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


def bar(desc: str, *, total: int | None = None, unit: str = "it", enabled: bool = True) -> Any:
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
    return tqdm(desc=desc, total=total, unit=unit, delay=DELAY_S, leave=False)
