"""Process-wide switches: the ones a backend may flip, and how rlx_nb never leaves one flipped.

Some backends *are* a process-wide switch: ``cpu-nomkldnn`` is ``torch.backends.mkldnn`` turned off for
the whole process, a precision sweep sets ``torch.set_float32_matmul_precision``, ``cuda-tf32`` the TF32
flags; a user's backend may set anything.  Python cannot stop a thread, so a backend that runs past its
timeout (or is left behind by Ctrl-C) keeps running.  Three rules keep the user's process as it was:

1. **One rlx_nb run at a time in a process** (:class:`exclusive`).  A second thread's call waits for
   the first and says so, instead of running its oracle while the first has oneDNN off (and then
   restoring the flag the first set, which left it off for good).  The threads an rlx_nb run starts
   for its backends belong to that run (a backend may call rlx_nb itself).
2. **Snapshot and restore.**  A run notes every switch of :data:`SWITCHES` (and the calling thread's
   grad, inference and autocast modes) when it starts, puts back what a backend changed after each
   backend, and puts everything back when it ends, an interrupt included.
3. **An abandoned backend cannot flip anything through rlx_nb.**  When a backend's thread is left
   running (timeout, interrupt), :func:`abandon` marks it, under the same lock :func:`flipped` takes:
   from then on :func:`flipped` refuses to set a switch in that thread, and does not "restore" one when
   the backend finally leaves it (which would undo what the user has set since).

A switch a user's backend flips with torch's own API from a thread it was abandoned in cannot be
stopped (the thread runs on); rule 2 still puts it back when the run ends, and a backend that left a
switch changed gets a note saying so.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from rlx_nb._support import quiet
from rlx_nb._support.kept import modes_kept


def _dynamo_get(name: str) -> Callable[[], Any]:
    # A torch._dynamo config value, read only when dynamo is imported already (importing it costs 2.6 s).
    def get() -> Any:
        config = sys.modules.get("torch._dynamo.config")
        return getattr(config, name, None) if config is not None else None

    return get


def _dynamo_set(name: str) -> Callable[[Any], None]:
    def put(value: Any) -> None:
        config = sys.modules.get("torch._dynamo.config")
        if config is not None and value is not None:
            setattr(config, name, value)

    return put


def _attr(owner: Callable[[], Any], name: str) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    return (lambda: getattr(owner(), name)), (lambda v: setattr(owner(), name, v))


def _deterministic() -> tuple[bool, bool]:
    return torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()


SWITCHES: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {
    # float32_matmul_precision first: setting it also sets the per-backend fp32_precision entries below.
    "float32_matmul_precision": (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
    "mkldnn_enabled": (torch._C._get_mkldnn_enabled, torch._C._set_mkldnn_enabled),
    "nnpack_enabled": (torch._C._get_nnpack_enabled, torch._C._set_nnpack_enabled),
    "cuda_matmul_allow_tf32": _attr(lambda: torch.backends.cuda.matmul, "allow_tf32"),
    "cuda_matmul_fp16_reduction": _attr(lambda: torch.backends.cuda.matmul, "allow_fp16_reduced_precision_reduction"),
    "cuda_matmul_bf16_reduction": _attr(lambda: torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction"),
    "cudnn_enabled": _attr(lambda: torch.backends.cudnn, "enabled"),
    "cudnn_allow_tf32": _attr(lambda: torch.backends.cudnn, "allow_tf32"),
    "cudnn_benchmark": _attr(lambda: torch.backends.cudnn, "benchmark"),
    "cudnn_deterministic": _attr(lambda: torch.backends.cudnn, "deterministic"),
    "deterministic_algorithms": (_deterministic, lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1])),
    "default_dtype": (torch.get_default_dtype, torch.set_default_dtype),
    "threads": (torch.get_num_threads, torch.set_num_threads),
    "dynamo_accumulated_recompile_limit": (
        _dynamo_get("accumulated_recompile_limit"),
        _dynamo_set("accumulated_recompile_limit"),
    ),
}
"""Every process-wide switch rlx_nb watches: ``name -> (get, set)``.  Absent ones (an older torch) are skipped."""

for _owner, _prefix in (
    (lambda: torch.backends, "fp32_precision"),
    (lambda: torch.backends.mkldnn, "mkldnn_fp32_precision"),
    (lambda: torch.backends.mkldnn.matmul, "mkldnn_matmul_fp32_precision"),
    (lambda: torch.backends.mkldnn.conv, "mkldnn_conv_fp32_precision"),
    (lambda: torch.backends.cuda.matmul, "cuda_matmul_fp32_precision"),
    (lambda: torch.backends.cudnn, "cudnn_fp32_precision"),
):
    try:
        _owner().fp32_precision  # noqa: B018 - probing the newer precision API (torch >= 2.9)
    except Exception:
        continue
    SWITCHES[_prefix] = _attr(_owner, "fp32_precision")

_AUTOCAST_DEVICES = ("cpu", "cuda")


def snapshot() -> dict[str, Any]:
    """The value of every process-wide switch now (:data:`SWITCHES`)."""
    values = {}
    for name, (get, _) in SWITCHES.items():
        try:
            value = get()
        except Exception:  # a switch this build lacks
            continue
        if value is not None:  # (None: a dynamo setting before dynamo is imported)
            values[name] = value
    return values


def restore(saved: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Put every switch back to ``saved``; returns ``{name: (found, restored)}`` for those that had changed."""
    changed = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about TF32 / the legacy precision API when these are set
        for name, value in saved.items():
            get, put = SWITCHES[name]
            try:
                now = get()
                if now != value:
                    put(value)
                    changed[name] = (now, value)
            except Exception:
                continue
    return changed


def thread_modes() -> dict[str, Any]:
    """The calling thread's own modes: grad, inference, autocast per device."""
    modes: dict[str, Any] = {"grad": torch.is_grad_enabled(), "inference": torch.is_inference_mode_enabled()}
    for device in _AUTOCAST_DEVICES:
        with contextlib.suppress(Exception):
            modes[f"autocast_{device}"] = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
    return modes


def restore_thread_modes(saved: dict[str, Any]) -> None:
    """Put the calling thread's grad and autocast modes back (inference mode is left by its own context)."""
    torch.set_grad_enabled(saved["grad"])
    for device in _AUTOCAST_DEVICES:
        if f"autocast_{device}" in saved:
            enabled, dtype = saved[f"autocast_{device}"]
            with contextlib.suppress(Exception):
                torch.set_autocast_enabled(device, enabled)
                torch.set_autocast_dtype(device, dtype)


# -- rule 1: one run at a time ----------------------------------------------------------------------

_OWNER_ATTR = "_rlx_nb_owner"
_ABANDONED_ATTR = "_rlx_nb_abandoned"
_DONE_ATTR = "_rlx_nb_done"


def _run_owner() -> threading.Thread:
    # The thread a run belongs to: a backend's worker thread belongs to the run that started it.
    me = threading.current_thread()
    return getattr(me, _OWNER_ATTR, None) or me


def worker(target: Callable[[], None], name: str) -> threading.Thread:
    """A daemon thread for one backend, belonging to the calling thread's run (started by the caller)."""
    done = threading.Event()  # (set when it ends: Thread.join is not to be trusted once an interrupt cut one short)

    def run() -> None:
        try:
            target()
        finally:
            done.set()

    thread = threading.Thread(target=run, daemon=True, name=name)
    setattr(thread, _OWNER_ATTR, _run_owner())
    setattr(thread, _DONE_ATTR, done)
    return thread


def finished(thread: threading.Thread, wait_s: float) -> bool:
    """Whether ``thread`` (one :func:`worker` made) ended within ``wait_s`` seconds.  A worker's own event, not
    Thread.join: on Python 3.11 a join that Ctrl-C interrupts marks the thread stopped while it runs on (CPython's
    gh-90882 fix of bpo-45274)."""
    done = getattr(thread, _DONE_ATTR, None)
    if done is None:
        thread.join(wait_s)
        return not thread.is_alive()
    return done.wait(wait_s)


class _RunLock:
    # Re-entrant for the thread that holds it and for the worker threads its run started.
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._owner: threading.Thread | None = None
        self._depth = 0

    def acquire(self, say: Callable[[str], None]) -> None:
        me = _run_owner()
        with self._cond:
            if self._owner is me:
                self._depth += 1
                return
            if self._owner is not None:
                say(
                    f"waiting for another rlx_nb run in this process (thread {self._owner.name!r}) to finish: "
                    "runs are one at a time, because backends such as cpu-nomkldnn flip process-wide switches"
                )
            while self._owner is not None:
                self._cond.wait()
            self._owner, self._depth = me, 1

    def release(self) -> None:
        with self._cond:
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._cond.notify_all()

    @property
    def held(self) -> bool:
        return self._owner is not None


_RUN_LOCK = _RunLock()


@contextlib.contextmanager
def exclusive(say: Callable[[str], None] = lambda _: None) -> Iterator[dict[str, Any]]:
    """One rlx_nb run at a time (rule 1), every switch and the caller's modes restored at the end (rule 2),
    torch's mode stacks as they were however the run ends.

    Yields the values every backend's run returns the switches to (what :func:`restore` puts back after
    each backend): the switches as they were on entry, unless the run itself sets one for all its runs
    (:func:`hold`).  Nested entries (``localize`` runs inside a run, a backend calling rlx_nb) share the
    outer run's lock.  Inside, the calling thread runs without the user's ``torch.autocast`` and
    ``torch.inference_mode`` (their blocks are theirs again after).
    """
    _RUN_LOCK.acquire(say)
    # (the lock is given back however the run ends, even where an interrupt lands in what takes it or puts things
    # back: a lock an interrupt kept made the next run of another thread wait for ever)
    entered = False
    try:
        before, modes = snapshot(), thread_modes()
        entered = True
        # (a mode whose __enter__ an interrupt cut short, after torch pushed it, is left by no ``with``)
        with modes_kept(), _neutral():
            yield dict(before)
    finally:
        try:
            if entered:
                try:
                    with _FLIP_LOCK:
                        restore(before)
                finally:
                    restore_thread_modes(modes)
        finally:
            # (given back whatever interrupt lands while it is, raised again once it is: no call of rlx_nb's own
            # stands between here and the release, where an interrupt could land first)
            interrupted: BaseException | None = None
            while True:
                try:
                    _RUN_LOCK.release()
                    break
                except (KeyboardInterrupt, SystemExit) as exc:
                    interrupted = exc
            if interrupted is not None:
                raise interrupted


def guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run inside :func:`exclusive`: for rlx_nb's long calls that are not runs themselves (a repro, a shrink,
    a compiler bisection), so that torch's switches and mode stacks come back however they end."""
    import functools

    @functools.wraps(fn)
    def inside(*args: Any, **kwargs: Any) -> Any:
        with exclusive():
            return fn(*args, **kwargs)

    return inside


@contextlib.contextmanager
def _neutral() -> Iterator[None]:
    # The calling thread's own modes off for the run: the oracle is float32 eager even inside the user's
    # torch.autocast or torch.inference_mode block (the backends' worker threads start without them).
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.inference_mode(False))
        for device in _AUTOCAST_DEVICES:
            if device == "cpu" or (device == "cuda" and torch.cuda.is_available()):
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


def hold(during: dict[str, Any], name: str, value: Any) -> None:
    """Set switch ``name`` for the rest of a run: its backends return to ``value``, the run's end to the user's."""
    SWITCHES[name][1](value)
    during[name] = value


# -- rule 3: abandoned threads flip nothing ---------------------------------------------------------

_FLIP_LOCK = threading.Lock()


class Abandoned(RuntimeError):
    """Raised in a backend's thread that its run has given up on, where it would flip a switch."""


class Stopped(BaseException):
    """Raised into a backend's thread its run gave up on, so that it stops at its next Python step and unwinds
    its own ``finally`` blocks (an exporter's redirected output, its temporary files) instead of running on under
    the next backend, or under the interpreter's shutdown, which aborts a process whose daemon thread is inside
    C++ code.  A BaseException: a model's or an exporter's ``except Exception`` does not swallow it."""


_LEFT_RUNNING: set[threading.Thread] = set()  # abandoned threads not yet seen to stop (waited for at exit)
EXIT_WAIT_S = 60.0
"""How long the interpreter's exit waits, in all, for abandoned backend threads to stop."""


_HOOK_LOCK = threading.Lock()
_SWALLOWED: list[int] = []  # threads whose Stopped a destructor swallowed, to be raised into again
_SWALLOWED_NOW = threading.Event()  # set when one is added: _stopper waits on it (no polling while none is)


def _again_where_swallowed(unraisable: Any) -> None:
    # sys.unraisablehook: a Stopped that landed in a destructor or a garbage-collector callback (jax's runs on every
    # collection) is printed and dropped there, and the abandoned thread ran on -- under the next backend's export,
    # or past the exit's wait into the interpreter's shutdown, which aborts the process.  It is raised again (by
    # _stopper, from outside: raised here it would land in this hook), and not printed; anything else goes to the
    # hook that was there before.
    if unraisable.exc_type is not None and issubclass(unraisable.exc_type, Stopped) and abandoned():
        _SWALLOWED.append(threading.get_ident())
        _SWALLOWED_NOW.set()
        return
    _again_where_swallowed.previous(unraisable)


def _stopper() -> None:
    # Raises Stopped again into each thread that swallowed one, a moment after (the destructor has returned).  It
    # sleeps until one is added (it polled every 2 ms: 0.8% of a core in every process that ever abandoned a thread).
    while True:
        _SWALLOWED_NOW.wait()
        time.sleep(0.002)
        _SWALLOWED_NOW.clear()  # (one added from here on is raised below, or sets it again for the next turn)
        while _SWALLOWED:
            raise_in(_SWALLOWED.pop(), Stopped)


def _hook_swallowed_stops() -> None:
    with _HOOK_LOCK:
        if sys.unraisablehook is not _again_where_swallowed:
            _again_where_swallowed.previous = sys.unraisablehook
            sys.unraisablehook = _again_where_swallowed
            threading.Thread(target=_stopper, name="rlx_nb:stopper", daemon=True).start()


def abandon(thread: threading.Thread, saved: dict[str, Any], *, wait_s: float = 0.0) -> bool:
    """Give up on ``thread`` (still running a backend): put every switch back to ``saved`` at once, end its part in
    any output capture (:func:`rlx_nb._support.quiet.release`), raise :class:`Stopped` in it (it lands at its next
    Python step) and wait up to ``wait_s`` seconds for it to unwind.  Returns whether it has stopped.

    The thread is registered to be waited for at exit *before* the wait: a second Ctrl-C that lands inside the
    wait still leaves it registered (else the interpreter finalizes while it is inside C++ code, and aborts)."""
    with _FLIP_LOCK:
        setattr(thread, _ABANDONED_ATTR, True)
        restore(saved)
        if not finished(thread, 0.0):
            if not _LEFT_RUNNING:
                atexit.register(_wait_at_exit)
            _LEFT_RUNNING.add(thread)
    quiet.release(thread)
    if finished(thread, 0.0):
        _LEFT_RUNNING.discard(thread)
        return True
    _hook_swallowed_stops()
    raise_in(thread.ident, Stopped)
    if finished(thread, wait_s):
        _LEFT_RUNNING.discard(thread)
        return True
    return False


def raise_in(thread_id: int | None, exc: type[BaseException] | None) -> None:
    """Raise ``exc`` in the thread ``thread_id`` at its next Python step (``None``: clear one still pending)."""
    if thread_id is not None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc else None)


def _wait_at_exit() -> None:
    # A daemon thread still inside torch's C++ code when the interpreter finalizes aborts the process (SIGABRT,
    # the finished work and the exit code lost): give abandoned backends, stopped at their next Python step,
    # the time to get there.
    # A Ctrl-C during this wait does not cut it short: the process would abort instead of exiting.
    deadline = time.monotonic() + EXIT_WAIT_S
    for thread in list(_LEFT_RUNNING):
        if not finished(thread, 0.0):
            print(f"rlx_nb: waiting for the abandoned backend thread {thread.name!r} to stop before exiting",
                  file=sys.stderr, flush=True)  # fmt: skip
            raise_in(thread.ident, Stopped)
            while time.monotonic() < deadline:
                try:
                    if finished(thread, max(0.0, deadline - time.monotonic())):
                        break
                except KeyboardInterrupt:
                    print("rlx_nb: still waiting (up to a minute): exiting now would abort the process",
                          file=sys.stderr, flush=True)  # fmt: skip
    _LEFT_RUNNING.clear()


def abandoned() -> bool:
    """Whether the calling thread is a backend's thread its run has given up on."""
    return bool(getattr(threading.current_thread(), _ABANDONED_ATTR, False))


@contextlib.contextmanager
def flipped(**values: Any) -> Iterator[None]:
    """Set switches of :data:`SWITCHES` (``mkldnn_enabled=False``) inside the block, restored after.

    In an abandoned thread (rule 3) it raises :class:`Abandoned` instead of setting anything, and on the
    way out of a block its thread was abandoned in, it leaves the switches as the run restored them.
    """
    unknown = [n for n in values if n not in SWITCHES]
    if unknown:
        raise KeyError(f"unknown switch(es) {unknown}; known: {', '.join(SWITCHES)}")
    with _FLIP_LOCK:
        if abandoned():
            raise Abandoned("this backend's run gave up on it (timeout or interrupt); it may not flip switches")
        before = {name: SWITCHES[name][0]() for name in values}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name, value in values.items():
                SWITCHES[name][1](value)
    try:
        yield
    finally:
        with _FLIP_LOCK:
            if not abandoned():
                restore(before)


def describe_changes(changed: dict[str, tuple[Any, Any]]) -> str:
    """One note for switches a backend left changed: ``mkldnn_enabled (False, restored to True)``."""
    return ", ".join(f"{name} ({found!r}, restored to {value!r})" for name, (found, value) in changed.items())


__all__ = [
    "SWITCHES",
    "Abandoned",
    "Stopped",
    "abandon",
    "abandoned",
    "exclusive",
    "finished",
    "flipped",
    "hold",
    "raise_in",
    "restore",
    "snapshot",
    "worker",
]
