"""What exporters and runtimes print, kept out of the user's output: for the thread that asked, never past its call,
and never hiding the message of a native abort.

Exporters and runtimes print graphs, progress and warnings from Python and from C++ (file descriptors 1 and 2).
:func:`quiet` keeps them out for the thread inside it:

- **File descriptors 1 and 2** go, while any thread is inside, to a pipe read by a small *keeper* process (started
  once per process).  A capture that ends normally tells the keeper to drop what it holds.  If the process dies
  inside one (a runtime's ``abort()`` on an assertion), the keeper writes the last 64 KB it holds to the real
  stderr: the native message is never lost with the process.  (Where the keeper cannot start, a scratch file takes
  its place, as before.)  C++ output is process-wide by nature: another thread's C++ output during a capture is
  kept out too; its Python output is not.
- **Python's streams, warnings and log records** are routed by thread: ``sys.stdout`` and ``sys.stderr`` become
  proxies that drop what the capturing thread writes and pass everything else to the real stream (a terminal's
  stream to the real descriptor); warnings shown and log records up to ``WARNING`` from that thread are dropped.
  Nothing process-wide (``warnings.filters``, ``logging.disable``, ``contextlib.redirect_stdout``) is changed.
- **Never past its call.**  The capture ends when the last thread inside leaves, or when its run gives up on a
  thread (:func:`release`, from :func:`rlx_nb._support.switches.abandon`): a backend left running past its
  timeout inside a C++ call no longer holds the process's output; it leaves later without touching anything.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import logging
import os
import subprocess
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

_LOCK = threading.RLock()
_OWNERS: dict[int, int] = {}  # thread ident -> how deep it is inside quiet()
_ACTIVE: _Capture | None = None

END = b"\0rlx_nb:end-of-capture\0"
"""Written to the keeper when a capture ends normally: it drops what it holds up to here."""

KEEP_BYTES = 1 << 16
"""How much of a capture the keeper holds (the last bytes: an abort's message is the last thing printed)."""

_KEEPER = r"""
import os, signal
signal.signal(signal.SIGINT, signal.SIG_IGN)  # (a Ctrl-C meant for the process it keeps for)
end, keep, most = %r, b"", %d
while True:
    chunk = os.read(0, 1 << 16)
    if not chunk:
        break
    keep += chunk
    if end in keep:
        keep = keep.rsplit(end, 1)[1]
    keep = keep[-(most + len(end)):]
if keep.strip():
    os.write(2, b"\nrlx_nb: the process ended inside a runtime's call whose output rlx_nb kept out of yours; "
                b"what it printed last:\n" + keep + b"\n")
"""


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Keep what the calling thread prints (Python and C++) out of the user's output inside the block.

    Examples
    --------
    >>> with quiet():
    ...     print("an exporter's progress line")
    >>> print("shown")
    shown
    """
    global _ACTIVE
    me = threading.get_ident()
    with _LOCK:
        if _ACTIVE is None:
            _ACTIVE = _Capture()
        _OWNERS[me] = _OWNERS.get(me, 0) + 1
        mine = _ACTIVE
    try:
        yield
    finally:
        with _LOCK:
            if _ACTIVE is mine and me in _OWNERS:  # (else released: its run gave up on this thread)
                _OWNERS[me] -= 1
                if not _OWNERS[me]:
                    del _OWNERS[me]
                if not _OWNERS:
                    _end()


def quiet_first(call: Callable[..., Any]) -> Callable[..., Any]:
    """``call`` with its first run :func:`quiet` (a runtime that announces itself from C++ when it first runs)."""
    first = [True]

    def run(*args: Any, **kwargs: Any) -> Any:
        with quiet() if first[0] else contextlib.nullcontext():
            out = call(*args, **kwargs)
        first[0] = False
        return out

    return run


def release(thread: threading.Thread) -> None:
    """End ``thread``'s part in the capture now (its run gave up on it): the capture ends if no other thread is
    inside, and the thread's own way out later changes nothing."""
    with _LOCK:
        if _OWNERS.pop(thread.ident, None) is not None and not _OWNERS:
            _end()


def capturing(thread: threading.Thread | None = None) -> bool:
    """Whether ``thread`` (default: the calling thread) is inside :func:`quiet`."""
    return (thread.ident if thread is not None else threading.get_ident()) in _OWNERS


def _end() -> None:
    global _ACTIVE
    if _ACTIVE is not None:
        _ACTIVE.end()
        _ACTIVE = None


class _Capture:
    # The process-wide part of a capture: descriptors 1 and 2 on the keeper's pipe, the routing proxies, the hooks.
    def __init__(self) -> None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        self.sink, self.scratch = _sink()
        self.saved = (os.dup(1), os.dup(2))
        os.dup2(self.sink, 1)
        os.dup2(self.sink, 2)
        self.streams = (sys.stdout, sys.stderr)
        sys.stdout, sys.stderr = _Routed(sys.stdout, 1, self.saved[0]), _Routed(sys.stderr, 2, self.saved[1])
        self.showwarning = warnings.showwarning
        warnings.showwarning = _routed_warning(self.showwarning)
        self.filtered = [h for h in _handlers() if _DROP not in h.filters]
        for handler in self.filtered:
            handler.addFilter(_DROP)
        # A native abort inside the capture: Python's traceback of every thread to the real stderr (unless the user
        # has faulthandler on already), beside what the keeper says the runtime printed.
        self.faulthandler = not faulthandler.is_enabled()
        if self.faulthandler:
            faulthandler.enable(file=self.saved[1], all_threads=True)

    def end(self) -> None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        if self.faulthandler:
            faulthandler.disable()
        if self.scratch is None:  # (the keeper drops what this capture printed)
            with contextlib.suppress(OSError):
                os.write(self.sink, END)
        os.dup2(self.saved[0], 1)
        os.dup2(self.saved[1], 2)
        for fd in self.saved:
            os.close(fd)
        if self.scratch is not None:
            self.scratch.close()
        routed = (sys.stdout, sys.stderr)
        for k, name in enumerate(("stdout", "stderr")):
            if isinstance(routed[k], _Routed) and routed[k].stream is self.streams[k]:
                setattr(sys, name, self.streams[k])  # (a stream someone set since is theirs: left)
        if getattr(warnings.showwarning, "_rlx_nb_routed", None) is self.showwarning:
            warnings.showwarning = self.showwarning
        for handler in self.filtered:
            handler.removeFilter(_DROP)


_KEEPER_PROC: subprocess.Popen | None = None


def _sink() -> tuple[int, Any]:
    # The descriptor captured output goes to: the keeper's pipe, or a scratch file where no keeper can run.
    global _KEEPER_PROC
    proc = _KEEPER_PROC
    if proc is None or proc.poll() is not None:
        proc = _KEEPER_PROC = None
        with contextlib.suppress(Exception):
            err = getattr(sys.stderr, "_original_stdstream_copy", None)  # (a notebook kernel's real stderr)
            proc = _KEEPER_PROC = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _KEEPER % (END, KEEP_BYTES)],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=err if isinstance(err, int) else None,
                start_new_session=True,  # (a terminal's Ctrl-C or a kernel's shutdown reaches its process only)
            )
    if proc is not None and proc.stdin is not None:
        if not _STOP_REGISTERED:
            atexit.register(_stop_keeper)
            _STOP_REGISTERED.append(True)
        return proc.stdin.fileno(), None
    scratch = tempfile.TemporaryFile()
    return scratch.fileno(), scratch


_STOP_REGISTERED: list[bool] = []


def _stop_keeper() -> None:
    # At exit, with no capture on: the keeper sees the end of its pipe with nothing held, and exits.  (With one on, a
    # thread left inside it, the keeper is left to say what it holds once the process is gone.)
    proc = _KEEPER_PROC
    with _LOCK:
        if proc is None or _ACTIVE is not None or proc.stdin is None:
            return
        with contextlib.suppress(Exception):
            proc.stdin.close()
            proc.wait(5)


class _Routed:
    # sys.stdout/sys.stderr while a capture is on: what a capturing thread writes is dropped, the rest goes to the
    # real stream (a stream on descriptor 1 or 2 writes to the real descriptor, which is on the keeper meanwhile).
    def __init__(self, stream: Any, fd: int, real_fd: int) -> None:
        self.stream, self._fd, self._real = stream, fd, real_fd

    def write(self, text: str) -> int:
        if threading.get_ident() in _OWNERS:
            return len(text)
        with _LOCK:
            on_fd = _ACTIVE is not None and _fileno(self.stream) == self._fd
            if on_fd:
                with contextlib.suppress(OSError):
                    os.write(self._real, text.encode(getattr(self.stream, "encoding", None) or "utf-8", "replace"))
                return len(text)
        return self.stream.write(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if threading.get_ident() not in _OWNERS:
            with contextlib.suppress(Exception):
                self.stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def _fileno(stream: Any) -> int | None:
    try:
        return stream.fileno()
    except Exception:
        return None


def _routed_warning(show: Any) -> Any:
    def showwarning(*args: Any, **kwargs: Any) -> None:  # (warnings.showwarning's own arguments)
        if threading.get_ident() not in _OWNERS:
            show(*args, **kwargs)

    showwarning._rlx_nb_routed = show
    return showwarning


class _DropCapturing(logging.Filter):
    # Log records up to WARNING from a thread inside quiet() (an exporter's progress), on every handler.
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno <= logging.WARNING and record.thread in _OWNERS)


_DROP = _DropCapturing()


def _handlers() -> list[logging.Handler]:
    loggers = [
        logging.getLogger(),
        *(v for v in logging.Logger.manager.loggerDict.values() if isinstance(v, logging.Logger)),
    ]
    found = {id(h): h for lg in loggers for h in lg.handlers}
    if logging.lastResort is not None:
        found[id(logging.lastResort)] = logging.lastResort
    return list(found.values())


__all__ = ["capturing", "quiet", "quiet_first", "release"]
