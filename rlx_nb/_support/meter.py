"""What each phase of a call cost: seconds and peak memory, and how much memory is free for the next.

A call runs the oracle, a determinism rerun, the fp64 reference, a sequential-sums run, precision
anchors, and each backend's preparation and run.  :class:`Meter` times each phase and samples the
process's resident memory while it runs (every :data:`SAMPLE_S` seconds, from ``/proc/self/statm``;
where that does not exist, the process's peak so far); a phase in which the process reached a new peak gets
that peak exactly (``ru_maxrss``), however short it was, so a report can say where a large model's
minutes and gigabytes went (``report.timings``).  :func:`available_bytes` is what the kernel says a new
allocation can still get (``MemAvailable``), which the run checks before each phase that would need a
lot of it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import resource
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

SAMPLE_S = 0.02
"""Seconds between samples.  A phase's new process-wide peak is exact whatever this is (``ru_maxrss``); sampling
finds the peak of a phase that stays below an earlier one.  (Every 5 ms cost 4.5% of a small model's call.)"""
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """The process's resident memory now (its peak so far where the platform cannot say)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return peak_so_far()


def peak_so_far() -> int:
    """The process's peak resident memory so far, in bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def available_bytes() -> int | None:
    """Memory a new allocation can get without swapping (Linux ``MemAvailable``), or ``None`` if unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class Meter:
    """Seconds and peak resident memory of each named phase; phases may nest (a backend's preparation
    inside the backend's phase) and run in other threads (a backend's worker).

    Examples
    --------
    >>> meter = Meter()
    >>> with meter.phase("oracle"):
    ...     _ = bytearray(1 << 20)
    >>> sorted(meter.phases["oracle"])
    ['peak_bytes', 'rss_after_bytes', 'seconds']
    """

    def __init__(self) -> None:
        self.phases: dict[str, dict[str, float]] = {}
        self._open: dict[int, int] = {}  # phase token -> peak so far
        self._lock = threading.Lock()
        self._sampler: threading.Thread | None = None
        self._tokens = itertools.count()
        self.on_start: Callable[[str], None] | None = None
        """Told each phase's name as it starts (the progress bar shows which phase runs: a compile, an export)."""

    def _sample(self) -> None:
        while True:
            now = rss_bytes()
            with self._lock:
                if not self._open:
                    self._sampler = None
                    return
                for token, peak in self._open.items():
                    if now > peak:
                        self._open[token] = now
            time.sleep(SAMPLE_S)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time ``name`` and sample its peak memory (a repeated name adds up its seconds)."""
        if self.on_start is not None:
            self.on_start(name)
        with self._lock:
            token = next(self._tokens)
            self._open[token] = rss_bytes()
            high = peak_so_far()
            if self._sampler is None:
                self._sampler = threading.Thread(target=self._sample, daemon=True, name="rlx_nb:memory")
                self._sampler.start()
        start = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - start
            after, now_high = rss_bytes(), peak_so_far()
            with self._lock:
                peak = max(self._open.pop(token), after)
                if now_high > high:  # (the process's peak was reached in this phase: exact, not sampled)
                    peak = max(peak, now_high)
                found = self.phases.setdefault(name, {"seconds": 0.0, "peak_bytes": 0, "rss_after_bytes": 0})
                found["seconds"] += seconds
                found["peak_bytes"] = max(found["peak_bytes"], peak)
                found["rss_after_bytes"] = after

    def as_dict(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {name: dict(values) for name, values in self.phases.items()}


_CURRENT: dict[str, Meter | None] = {"meter": None}


@contextlib.contextmanager
def measuring(meter: Meter) -> Iterator[Meter]:
    """Make ``meter`` the one :func:`step` records into (runs are one at a time: :mod:`rlx_nb._support.switches`)."""
    before, _CURRENT["meter"] = _CURRENT["meter"], meter
    try:
        yield meter
    finally:
        _CURRENT["meter"] = before


_HELPER = {"depth": 0}


@contextlib.contextmanager
def helper_run(on: bool = True) -> Iterator[None]:
    """Mark a run as one of rlx_nb's own helper runs (the fp64 reference, the sequential-sums run, the
    precision anchors): runs whose *values* matter, not the computation that gives them.  A model that can
    compute the same values another way may (:class:`rlx_nb.generation.decode.Decode` runs every step at once there)."""
    _HELPER["depth"] += int(on)
    try:
        yield
    finally:
        _HELPER["depth"] -= int(on)


def in_helper_run() -> bool:
    """Whether the run in progress is one of rlx_nb's helper runs (:func:`helper_run`)."""
    return _HELPER["depth"] > 0


def step(name: str) -> contextlib.AbstractContextManager:
    """A phase of the current run's meter (nothing when no run is measuring)."""
    meter = _CURRENT["meter"]
    return meter.phase(name) if meter is not None else contextlib.nullcontext()
