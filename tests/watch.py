"""Say which tests are slow or stuck while the suite runs, in the lines CI keeps.

Under pytest-xdist a test that hangs in C (a lock torch holds, a child process) cannot be interrupted by
pytest-timeout's signal, and the run is cut by CI's own limit with nothing but dots to show for it.  The controller
knows which test each worker started (xdist forwards ``pytest_runtest_logstart``): a thread of the controller writes
one line when a test has run past :data:`STUCK` seconds (and again at each multiple), and a line for every test that
finishes after more than :data:`SLOW` seconds, so the tail of a cut run names what it was doing.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

SLOW = float(os.environ.get("RLX_NB_TEST_SLOW", 90))  # seconds: a finished test this slow is named
STUCK = float(
    os.environ.get("RLX_NB_TEST_STUCK", 300)
)  # seconds: a running test this old is named, again at each multiple


class Watch:
    def __init__(self, reporter) -> None:
        self.reporter = reporter
        self.running: dict[str, float] = {}
        self.told: dict[str, int] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.watch, name="rlx-nb-test-watch", daemon=True)

    def say(self, line: str) -> None:
        self.reporter.write_line(f"[watch {time.strftime('%H:%M:%S')}] {line}")

    def started(self, nodeid: str) -> None:
        with self.lock:
            self.running[nodeid] = time.monotonic()

    def finished(self, nodeid: str) -> None:
        with self.lock:
            began = self.running.pop(nodeid, None)
            self.told.pop(nodeid, None)
        if began is not None and time.monotonic() - began > SLOW:
            self.say(f"slow: {nodeid} took {time.monotonic() - began:.0f} s")

    def watch(self) -> None:
        while not self.stop.wait(min(15.0, STUCK / 4)):
            now = time.monotonic()
            with self.lock:
                late = []
                for nodeid, began in self.running.items():
                    times = int((now - began) // STUCK)
                    if times > self.told.get(nodeid, 0):
                        self.told[nodeid] = times
                        late.append((nodeid, now - began))
            for nodeid, age in late:
                self.say(f"still running after {age:.0f} s: {nodeid}")


_WATCH: Watch | None = None


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    global _WATCH
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    # Only where tests are handed out (the controller, or a run without xdist); never in a worker.
    if reporter is None or hasattr(config, "workerinput"):
        return
    _WATCH = Watch(reporter)
    _WATCH.thread.start()


def pytest_unconfigure(config):
    if _WATCH is not None:
        _WATCH.stop.set()


def pytest_runtest_logstart(nodeid, location):
    if _WATCH is not None:
        _WATCH.started(nodeid)


def pytest_runtest_logfinish(nodeid, location):
    if _WATCH is not None:
        _WATCH.finished(nodeid)
