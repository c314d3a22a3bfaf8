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

# Seconds: a finished test this slow is named; a running test this old is named, and again at each multiple.
SLOW = float(os.environ.get("RLX_NB_TEST_SLOW", 90))
STUCK = float(os.environ.get("RLX_NB_TEST_STUCK", 300))


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


# -- tests run in a process of their own ----------------------------------------------------------------------------

ISOLATED_TIMEOUT_S = float(os.environ.get("RLX_NB_ISOLATED_TIMEOUT", 480))
"""A test marked ``isolated`` that runs longer than this in its own process is stopped, its stacks printed."""


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """A test marked ``isolated`` runs in a fresh process of its own (``pytest`` on that one test), with a deadline.

    The Ctrl-C tests trace every Python call of a long call (``sys.settrace``) and raise inside torch: after other
    tests in the same worker, one such run spun in CPython's eval loop holding the GIL, where pytest-timeout's signal
    handler never finished (seen here once in eight full runs: the repro test's counting pass, 10 minutes at 93% CPU;
    most likely what cut two CI runs at 96% and 99.7%).  In a process of its own the test starts from a fresh torch,
    and a hang is ended (SIGABRT: faulthandler prints every thread's stack) and failed, not left to stall the suite."""
    import signal
    import subprocess
    import sys

    if pyfuncitem.get_closest_marker("isolated") is None or os.environ.get("RLX_NB_ISOLATED"):
        return None
    target = f"{pyfuncitem.path}::{pyfuncitem.name}"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", "-o", "addopts=",
               "-o", f"timeout={max(1, int(ISOLATED_TIMEOUT_S - 60))}", target]  # fmt: skip
    env = {**os.environ, "RLX_NB_ISOLATED": "1"}
    proc = subprocess.Popen(command, cwd=pyfuncitem.config.rootpath, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=ISOLATED_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)  # (pytest's faulthandler prints every thread's stack)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        pytest.fail(f"{target} ran past {ISOLATED_TIMEOUT_S} s in its own process and was stopped:\n{out[-6000:]}")
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    if proc.returncode != 0:
        pytest.fail(f"{target} failed in its own process (exit {proc.returncode}):\n{out[-6000:]}")
    return True
