"""The errors rlx_nb raises on purpose; every one derives from :class:`RlxError`."""

from __future__ import annotations

import contextlib
import re
import sys
import traceback
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any


class RlxError(Exception):
    """Base of every error rlx_nb raises on purpose.

    The message says what failed, the offending value, and what is allowed.
    """


class BackendError(RlxError):
    """A backend name is unknown, not live here, or registered twice."""


class InputError(RlxError, ValueError):
    """A value given to rlx_nb cannot be used as given: the model, its inputs, params, or an option.

    Also a :class:`ValueError`, so code that caught those before keeps working.
    """


def did_you_mean(name: object, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices`` to an unknown ``name``, or ``""``.

    Examples
    --------
    >>> did_you_mean("onnx-runtime", ["onnxruntime", "cpu-inductor"]), did_you_mean("inductor", ["cpu-inductor"])
    (" (did you mean 'onnxruntime'?)", " (did you mean 'cpu-inductor'?)")
    """
    import difflib

    choices = list(choices)
    if not isinstance(name, str):
        return ""
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    close = close or [c for c in choices if name and (c.endswith(f"-{name}") or c.startswith(f"{name}-"))][:1]
    return f" (did you mean {close[0]!r}?)" if close else ""


_PACKAGE = str(Path(__file__).resolve().parent)


def _short_traceback(shell: Any, etype: type, value: BaseException, tb: Any, tb_offset: Any = None) -> list[str]:
    # IPython's handler for rlx_nb's own errors: the user's line that called rlx_nb, then the message -- not ~25 lines
    # of rlx_nb's source before it.  %tb shows the whole traceback (IPython keeps it as sys.last_traceback).
    frames = [f for f in traceback.extract_tb(tb) if not str(Path(f.filename).resolve()).startswith(_PACKAGE)]
    lines = [f"{frames[-1].filename}, line {frames[-1].lineno}: {frames[-1].line}"] if frames else []
    red, plain = "\x1b[0;31m", "\x1b[0m"
    stb = [
        *lines,
        f"{red}{etype.__module__}.{etype.__name__}{plain}: {value}",
        "(rlx_nb's own error, said in full above; %tb shows where in rlx_nb it was raised)",
    ]
    sys.last_type, sys.last_value, sys.last_traceback = etype, value, tb  # (what %tb and %debug read)
    shell._showtraceback(etype, value, stb)  # (IPython shows what a custom handler shows itself)
    return stb


def short_tracebacks_in_ipython() -> bool:
    """In IPython (a notebook's kernel), show an :class:`RlxError` as the user's line and the message, without
    rlx_nb's source; whether it was set (never over a custom handler the user set)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    if shell is None or not hasattr(shell, "set_custom_exc") or getattr(shell, "custom_exceptions", ()) not in ((),):
        return False
    shell.set_custom_exc((RlxError,), _short_traceback)
    return True


def still_interrupted(exc: BaseException) -> None:
    """Raise the ``KeyboardInterrupt`` (or ``SystemExit``) an exception was raised while handling, if any.

    torch's own cleanup can fail while a Ctrl-C unwinds it (an export whose tracer was cut short raises an
    ``AttributeError`` from its ``finally``): the interrupt then arrives as an ordinary exception, and an
    ``except Exception`` that turns failures into an error row or an :class:`InputError` would swallow the stop.
    Every such handler around torch calls this first.
    """
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if isinstance(link, (KeyboardInterrupt, SystemExit)):
            raise link
        link = link.__cause__ or link.__context__


class NotApplicable(Exception):
    """Raised by a backend that cannot run this kind of model (e.g. an export with no route for a decode step):
    its row is ``skipped`` with the message, not an error."""


class TargetError(RlxError):
    """A CLI target (``file.py:factory`` or ``package.module:factory``) cannot be loaded."""


class ReportFormatError(RlxError):
    """A saved report cannot be read: not this format, another version, truncated or corrupted."""


class FileWriteError(RlxError, OSError):
    """A file rlx_nb was asked to write (a report, a page, a repro, node data) cannot be written there.

    Also an :class:`OSError`, so code that caught those before keeps working.
    """


@contextlib.contextmanager
def writing(path: str | Path, what: str) -> Iterator[None]:
    """Around writing ``what`` to ``path``: an ``OSError`` becomes a :class:`FileWriteError` naming the path and why
    (a directory on the way that is a file, a missing permission), not a traceback from inside a zip writer.

    >>> with writing("/dev/null/report.rlxnb", "the report"):
    ...     Path("/dev/null/report.rlxnb").parent.mkdir(parents=True, exist_ok=True)
    Traceback (most recent call last):
    rlx_nb.errors.FileWriteError: cannot write the report to '/dev/null/report.rlxnb': '/dev/null' is not a directory
    """
    try:
        yield
    except FileWriteError:
        raise
    except OSError as exc:
        where = Path(path)
        blocker = next((p for p in (where, *where.parents) if _exists(p) and not _is_dir(p)), None)
        if blocker is not None and blocker != where:
            why = f"{str(blocker)!r} is not a directory"
        elif _is_dir(where):
            why = "it is a directory"
        elif any(len(part.encode("utf-8", "surrogateescape")) > 255 for part in where.parts):
            why = "a name in it is longer than the file system's 255 bytes"
        else:
            why = exc.strerror or str(exc)
        raise FileWriteError(f"cannot write {what} to {str(path)!r}: {why}") from None


def _exists(p: Path) -> bool:
    # (a name too long for the file system makes the question itself raise)
    try:
        return p.exists()
    except OSError:
        return False


def _is_dir(p: Path) -> bool:
    try:
        return p.is_dir()
    except OSError:
        return False


# Lines of an error message that state a cause rather than where a check sits: converters and
# compilers put the specific line (the unsupported op, the failed conversion) deep in a long message.
_CAUSE = re.compile(
    r"no conversion rule|conversion is failed|failed for|not supported|unsupported|not implemented|"
    r"no (?:kernel|implementation|rule)|could not|couldn't|cannot|can't|unknown|missing|invalid|mismatch|"
    r"out of (?:the )?range|expected|unexpected|does not|doesn't|illegal|overflow|out of memory",
    re.IGNORECASE,
)

_NOISE = re.compile(r"^(?:check '.*' failed at \S+:\d+:?|file \".*\", line \d+.*|\^+|-+|summary:?|traceback.*)$", re.I)

REASON_CHARS = 600


ANSI = re.compile(r"\x1b\[[0-9;]*m")
"""Terminal colour codes (ONNX's exporter colours its messages): no part of a row's text."""


def plain(text: str) -> str:
    """``text`` without terminal colour codes.

    >>> plain("\x1b[96mThis is step 3/3\x1b[0m of exporting")
    'This is step 3/3 of exporting'
    """
    return ANSI.sub("", text)


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message, without colour codes ("" for an empty message).

    >>> first_line(RuntimeError("\x1b[96mFailed\x1b[0m to export\\nsecond line"))
    'Failed to export'
    """
    lines = plain(str(exc)).strip().splitlines()
    return lines[0] if lines else ""


def with_root_cause(exc: BaseException) -> str:
    """The exception's type and first line, and its root cause's where it was raised from another: an exporter
    wraps the model's own error (or the op it could not convert) in a generic "Failed to ..." message.

    >>> try:
    ...     try:
    ...         raise KeyError("no ONNX function for op X")
    ...     except KeyError as inner:
    ...         raise RuntimeError("\x1b[96mFailed\x1b[0m to convert\\nNext steps: ...") from inner
    ... except RuntimeError as outer:
    ...     print(with_root_cause(outer))
    RuntimeError: Failed to convert (caused by KeyError: 'no ONNX function for op X')
    """

    def line(e: BaseException) -> str:
        return f"{type(e).__name__}: {first_line(e)}"

    root, seen = exc, {id(exc)}
    while root.__cause__ is not None and id(root.__cause__) not in seen:
        root = root.__cause__
        seen.add(id(root))
    return line(exc) if root is exc else f"{line(exc)} (caused by {line(root)})"


def _message_lines(exc: BaseException) -> list[str]:
    # The meaningful lines of an exception's message and of the exceptions it was raised from.
    lines: list[str] = []
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        for line in plain(str(exc)).splitlines():
            line = line.strip(" \t-:>")
            if line and not _NOISE.match(line) and line not in lines:
                lines.append(line)
        exc = exc.__cause__ or exc.__context__
    return lines


def describe_error(exc: BaseException) -> str:
    """One readable line for an error row: the exception's type, its first line and the lines that
    state the cause (for a converter, the operations it could not convert), and where it was raised."""
    lines = _message_lines(exc)
    specific = [line for line in lines[1:] if _CAUSE.search(line)]
    # A summary line (the last specific one, e.g. "Conversion is failed for: aten::cat") is the most telling.
    chosen = lines[:1] + (specific[-1:] + specific[:-1] if specific else lines[-1:] if len(lines) > 1 else [])
    text = " | ".join(dict.fromkeys(chosen))
    where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    loc = f" (at {where.name})" if where else ""
    text = f"{type(exc).__name__}: {text}"
    ours = "; ".join(n.removeprefix("rlx_nb: ") for n in getattr(exc, "__notes__", ()) if n.startswith("rlx_nb: "))
    return (
        (text if len(text) <= REASON_CHARS else text[: REASON_CHARS - 3] + "...") + loc + (f", {ours}" if ours else "")
    )


def error_detail(exc: BaseException) -> str:
    """The whole error: every line of the message, chained causes and the traceback."""
    return "".join(traceback.format_exception(exc)).rstrip()
