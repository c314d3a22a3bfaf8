"""Interrupts, threads and process-wide switches: nothing swallowed, nothing left changed (rlx_nb._support.switches)."""

from __future__ import annotations

import os
import signal
import threading
import time
import typing

import pytest
import torch

import rlx_nb
from rlx_nb._support import switches


class SlowWithoutOneDNN(torch.nn.Module):
    """A conv whose forward, with oneDNN off (cpu-nomkldnn), signals ``entered`` and then takes ``slow`` seconds."""

    signals: typing.ClassVar[
        dict[int, threading.Event]
    ] = {}  # (outside the module: rlx_nb deep-copies models, not events)

    def __init__(self, slow: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.slow = slow
        self.token = len(self.signals)
        self.signals[self.token] = threading.Event()

    @property
    def entered(self) -> threading.Event:
        return self.signals[self.token]

    def forward(self, x):
        if not torch.backends.mkldnn.enabled:
            self.entered.set()
            end = time.monotonic() + self.slow
            while time.monotonic() < end:
                time.sleep(0.01)
        return self.conv(x)


def _eager(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.conv(x)


@pytest.fixture
def x():
    return torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))


def _register(name, fn):
    rlx_nb.register_backend(name, fn, replace=True)
    return name


@pytest.mark.parametrize("kind", [KeyboardInterrupt, SystemExit])
@pytest.mark.parametrize("timeout_s", [600.0, None])
def test_an_interrupt_raised_inside_a_backend_propagates(kind, timeout_s, x):
    # It was swallowed and reported as "timed out after 600 s", 0.1 s in.
    def raises(model, inputs):
        raise kind()

    name = _register("test-raises-interrupt", raises)
    try:
        start = time.monotonic()
        with pytest.raises(kind):
            rlx_nb.backend_divergence(
                SlowWithoutOneDNN(), x, backends=["cpu-nomkldnn", name], timeout_s=timeout_s, progress=False
            )
        assert time.monotonic() - start < 60
        kept = rlx_nb.interrupted_report()  # what had finished is kept, marked incomplete
        assert kept is not None and list(kept.results.candidates) == ["cpu-nomkldnn"]
        assert f"while {name} ran" in kept.incomplete and kept.lines()[-1].startswith("[SlowWithoutOneDNN] INCOMPLETE")
        assert kept.record("cpu-nomkldnn").verdict == "round-off"
    finally:
        rlx_nb.unregister_backend(name)
    assert torch.backends.mkldnn.enabled


def test_an_interrupt_that_torchs_cleanup_turns_into_another_error_still_stops_the_run(x):
    # torch.export cut short by Ctrl-C can fail in its own cleanup (an AttributeError raised while the interrupt
    # unwinds): that error must not become the backend's error row, nor a repro's "cannot trace".
    def cleanup_fails(model, inputs):
        try:
            raise KeyboardInterrupt()
        finally:
            raise AttributeError("'_ModuleStackTracer' object has no attribute 'graph'")

    name = _register("test-interrupt-in-cleanup", cleanup_fails)
    try:
        with pytest.raises(KeyboardInterrupt):
            rlx_nb.backend_divergence(SlowWithoutOneDNN(), x, backends=[name], progress=False)
    finally:
        rlx_nb.unregister_backend(name)


@pytest.fixture(autouse=True)
def _ctrl_c_as_in_a_terminal():
    # SIGINT raises KeyboardInterrupt here, as in a terminal, even where whoever started the suite ignores it (a job
    # in the background of a shell, whose children start with SIGINT ignored).
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def _interrupt_when(event: threading.Event) -> threading.Thread:
    # A real Ctrl-C: SIGINT to this process once ``event`` is set (the backend is inside its slow part).
    def fire():
        if event.wait(60):
            os.kill(os.getpid(), signal.SIGINT)

    thread = threading.Thread(target=fire, daemon=True)
    thread.start()
    return thread


def test_ctrl_c_while_cpu_nomkldnn_runs_leaves_onednn_on(x):
    # oneDNN stayed disabled process-wide until the abandoned worker ended: the next call's oracle ran
    # without oneDNN.
    model = SlowWithoutOneDNN(slow=3.0)
    _interrupt_when(model.entered)
    with pytest.raises(KeyboardInterrupt) as caught:
        rlx_nb.backend_divergence(model, x, backends=["cpu-nomkldnn"], progress=False)
    assert any("rlx_nb.interrupted_report()" in note for note in getattr(caught.value, "__notes__", []))
    assert torch.backends.mkldnn.enabled  # at once, while the abandoned worker still sleeps with it "off"
    again = rlx_nb.backend_divergence(SlowWithoutOneDNN(), x, backends=["cpu-nomkldnn"], progress=False)
    oracle = again.results.oracle.outputs["out"].value
    assert (torch.from_numpy(oracle) == _eager(SlowWithoutOneDNN(), x)).all()  # the oracle ran with oneDNN
    time.sleep(3.5)  # the abandoned worker has left its switch block by now ...
    assert torch.backends.mkldnn.enabled  # ... without "restoring" anything


def test_concurrent_calls_are_one_at_a_time_and_leave_onednn_on(x):
    # Two threads each calling with cpu-nomkldnn: one's oracle ran while the other had oneDNN off, and
    # oneDNN could be left off afterwards.
    waited: list[str] = []
    exact: dict[int, bool] = {}
    go = threading.Barrier(3)

    def job(i: int) -> None:
        model = SlowWithoutOneDNN(slow=0.3)
        go.wait()
        report = rlx_nb.backend_divergence(model, x, backends=["cpu-nomkldnn"], progress=waited.append)
        exact[i] = bool((torch.from_numpy(report.results.oracle.outputs["out"].value) == _eager(model, x)).all())

    threads = [threading.Thread(target=job, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert exact == {0: True, 1: True, 2: True}
    assert torch.backends.mkldnn.enabled
    assert any("waiting for another rlx_nb run" in m for m in waited)  # and says so


@pytest.mark.parametrize("swallows", [False, True])
def test_a_backend_abandoned_after_its_timeout_stops_and_cannot_flip_a_switch(x, swallows):
    # Abandoned, it is stopped at its next Python step (switches.Stopped); one that swallows even that
    # (``except BaseException``) still cannot flip a switch through rlx_nb.
    events: list[str] = []

    def late(model, inputs):
        try:
            time.sleep(1.0)  # past its timeout: abandoned before it reaches its switch
        except BaseException as exc:
            events.append(type(exc).__name__)
            if not swallows:
                raise
        try:
            with switches.flipped(mkldnn_enabled=False):
                events.append("flipped")
        except switches.Abandoned:
            events.append("refused")
        return model(*inputs)

    name = _register("test-late-flip", late)
    try:
        report = rlx_nb.backend_divergence(SlowWithoutOneDNN(), x, backends=[name], timeout_s=0.2, progress=False)
    finally:
        rlx_nb.unregister_backend(name)
    assert "timed out after 0.2 s" in report.record(name).reason
    time.sleep(1.5)
    assert events == (["Stopped", "refused"] if swallows else ["Stopped"]) and torch.backends.mkldnn.enabled


@pytest.mark.slow
def test_ctrl_c_during_an_onnx_export_keeps_what_finished_and_the_process_exits_cleanly(tmp_path):
    # Ctrl-C while torch.onnx.export ran in its worker thread: the process aborted at exit (SIGABRT: the daemon
    # thread still inside C++ as the interpreter finalized), and the export's redirected output swallowed
    # everything printed after the interrupt.  The export now stops at its next Python step and unwinds.
    script = tmp_path / "interrupt.py"
    script.write_text(
        "import os, signal, torch, rlx_nb\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)  # (Ctrl-C as in a terminal, whoever started us)\n"
        "real = torch.onnx.export\n"
        "def export(*args, **kwargs):\n"
        "    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, once the export has begun\n"
        "    return real(*args, **kwargs)\n"
        "torch.onnx.export = export\n"
        "model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))\n"
        "try:\n"
        "    rlx_nb.backend_divergence(model, torch.randn(3, 16), backends=['cpu-nomkldnn', 'onnxruntime'],\n"
        "                              progress=False)\n"
        "except KeyboardInterrupt:\n"
        "    kept = rlx_nb.interrupted_report()\n"
        "    print('KEPT', list(kept.results.candidates), kept.incomplete, flush=True)\n"
        "import threading\n"
        "print('LEFT', [t.name for t in threading.enumerate() if t.name.startswith('rlx_nb:onnx')], flush=True)\n"
    )
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, RLX_NB_PROGRESS="0"))  # fmt: skip
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "KEPT ['cpu-nomkldnn'] interrupted (KeyboardInterrupt) while onnxruntime ran" in done.stdout
    assert "LEFT []" in done.stdout  # the export's thread unwound before the interrupt propagated


def test_switches_a_backend_leaves_changed_are_restored_and_named(x):
    def careless(model, inputs):
        torch.set_num_threads(1)
        torch.set_float32_matmul_precision("medium")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.mkldnn.enabled = False
        return model(*inputs)

    before = switches.snapshot()
    name = _register("test-careless", careless)
    try:
        report = rlx_nb.backend_divergence(SlowWithoutOneDNN(), x, backends=[name, "cpu-nomkldnn"], progress=False)
    finally:
        rlx_nb.unregister_backend(name)
    after = switches.snapshot()
    assert {k: after[k] for k in before} == before
    note = report.backends_detail.set_index("backend").loc[name, "note"]
    assert "left process-wide switches changed" in note and "mkldnn_enabled (False, restored to True)" in note
    # the next backend ran with the user's settings: oneDNN-off eager differs from oneDNN eager in bits
    assert report.record("cpu-nomkldnn").verdict == "round-off"


def test_the_callers_grad_and_autocast_modes_are_theirs_after_a_call(x):
    with torch.no_grad():
        report = rlx_nb.backend_divergence(SlowWithoutOneDNN(), x, backends=["cpu-nomkldnn"], backward=True)
        assert not torch.is_grad_enabled()
    assert any(n.startswith("grad:") for n in report.results.oracle.outputs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = rlx_nb.backend_divergence(SlowWithoutOneDNN(), x, backends=["cpu-nomkldnn"])
        assert torch.is_autocast_enabled("cpu")
    assert report.results.oracle.outputs["out"].dtype == "float32"  # the oracle is float32 even so


def test_flipped_refuses_unknown_switches():
    with pytest.raises(KeyError, match="unknown switch"), switches.flipped(no_such_switch=True):
        pass


class InterruptedInFloat64(torch.nn.Module):
    """A linear layer whose float64 run (the fp64 reference) is interrupted, as Ctrl-C there would."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        if self.lin.weight.dtype == torch.float64:
            raise KeyboardInterrupt
        return self.lin(x)


def test_an_interrupt_before_any_backend_finished_keeps_nothing_of_an_earlier_call(x):
    # interrupted_report() handed out the report an earlier interrupted call had kept, as if it were this one's.
    def interrupting(model, inputs):
        raise KeyboardInterrupt

    name = _register("test-interrupting", interrupting)
    try:
        with pytest.raises(KeyboardInterrupt):
            rlx_nb.backend_divergence(SlowWithoutOneDNN(), x, backends=["cpu-nomkldnn", name], progress=False)
    finally:
        rlx_nb.unregister_backend(name)
    assert list(rlx_nb.interrupted_report().results.candidates) == ["cpu-nomkldnn"]
    with pytest.raises(KeyboardInterrupt) as caught:
        rlx_nb.backend_divergence(InterruptedInFloat64(), torch.randn(2, 4), backends=["cpu-nomkldnn"])
    assert rlx_nb.interrupted_report() is None
    assert "rlx_nb: interrupted while cpu-f64 ran, before any backend had finished: nothing was kept" in (
        caught.value.__notes__
    )


def test_a_second_ctrl_c_while_the_run_waits_for_an_abandoned_backend_leaves_it_waited_for_at_exit(tmp_path):
    # #46: a second Ctrl-C landed inside abandon()'s wait, before the thread was registered to be waited for at
    # exit: the interpreter then finalized while the backend was inside C++ code ("Fatal Python error: Aborted").
    # Here the backend's thread sits in a C call (time.sleep: the Stopped raised into it lands only after it).
    script = tmp_path / "twice.py"
    script.write_text(
        "import os, signal, threading, time\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)  # (Ctrl-C as in a terminal, whoever started us)\n"
        "from rlx_nb._support import switches\n"
        "entered = threading.Event()\n"
        "def backend():\n"
        "    entered.set()\n"
        "    time.sleep(2.0)  # one long C call\n"
        "thread = switches.worker(backend, 'rlx_nb:long-call')\n"
        "thread.start()\n"
        "entered.wait()\n"
        "threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()  # the second Ctrl-C, during the wait\n"
        "try:\n"
        "    switches.abandon(thread, {}, wait_s=10.0)\n"
        "except KeyboardInterrupt:\n"
        "    print('INTERRUPTED', thread.is_alive(), thread in switches._LEFT_RUNNING, flush=True)\n"
    )
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "Fatal Python error" not in done.stderr, (done.returncode, done.stderr[-2000:])
    assert "INTERRUPTED True True" in done.stdout, done.stdout
    assert "waiting for the abandoned backend thread 'rlx_nb:long-call' to stop before exiting" in done.stderr


@pytest.mark.slow
def test_two_ctrl_c_while_a_backend_is_inside_a_long_cpp_call_keep_what_finished_and_exit_cleanly(tmp_path):
    # The timer starts before the first Ctrl-C: a thread started while the backend is being stopped can take the
    # Stopped meant for the backend (CPython 3.11 gives a new thread's state its creator's id until it runs), and
    # the backend then waits forever for that thread to start -- the exit's whole minute, on a loaded machine.
    script = tmp_path / "twice.py"
    script.write_text(
        "import os, signal, threading, torch, rlx_nb\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)  # (Ctrl-C as in a terminal, whoever started us)\n"
        "def long_cpp(model, inputs):\n"
        "    a = torch.randn(1500, 1500)\n"
        "    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()  # again while the run waits, and\n"
        "    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C as the backend enters a long C++ call\n"
        "    torch.linalg.matrix_power(a, 16)  # (~1 s in one C++ call)\n"
        "    return model(*inputs)\n"
        "rlx_nb.register_backend('long-cpp', long_cpp)\n"
        "try:\n"
        "    rlx_nb.backend_divergence(torch.nn.Linear(8, 4), torch.randn(2, 8), backends=['cpu-nomkldnn', 'long-cpp'],\n"
        "                              progress=False)\n"
        "except KeyboardInterrupt:\n"
        "    print('KEPT', list(rlx_nb.interrupted_report().results.candidates), flush=True)\n"
        "print('AFTER', flush=True)\n"
    )
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, RLX_NB_PROGRESS="0"))  # fmt: skip
    assert done.returncode == 0 and "Fatal Python error" not in done.stderr, (done.returncode, done.stderr[-2000:])
    assert "KEPT ['cpu-nomkldnn']" in done.stdout and "AFTER" in done.stdout


def test_a_stop_swallowed_by_a_destructor_is_raised_again_until_the_abandoned_thread_stops(tmp_path):
    # #62: a timed-out runtime's thread took the Stopped inside jax's garbage-collector callback, which printed
    # "Exception ignored ... Stopped" and ran on -- beside the next backend's export, or into the interpreter's
    # shutdown (SIGABRT once in several runs of executorch-xnnpack then litert at timeout_s=0.5).  Here the
    # backend spends its time in destructors: the Stopped lands there, is raised again at its next step, and the
    # thread stops within the wait; nothing is printed.
    script = tmp_path / "swallowed.py"
    script.write_text(
        "import threading\n"
        "from rlx_nb._support import switches\n"
        "entered = threading.Event()\n"
        "class Slow:\n"
        "    def __del__(self):\n"
        "        total = 0\n"
        "        for i in range(3000):\n"
        "            total += i\n"
        "def backend():\n"
        "    entered.set()\n"
        "    try:\n"
        "        while True:\n"
        "            Slow()\n"
        "            for i in range(300):\n"
        "                pass\n"
        "    except BaseException as exc:  # (as rlx_nb's backend threads take it)\n"
        "        print('RAISED', type(exc).__name__, flush=True)\n"
        "thread = switches.worker(backend, 'rlx_nb:destructors')\n"
        "thread.start()\n"
        "entered.wait()\n"
        "stopped = switches.abandon(thread, {}, wait_s=20.0)\n"
        "thread.join(5.0)\n"
        "print('STOPPED', stopped, thread.is_alive(), flush=True)\n"
    )
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "RAISED Stopped\nSTOPPED True False" in done.stdout, done.stdout + done.stderr[-2000:]
    assert "Exception ignored" not in done.stderr, done.stderr[-2000:]


def test_an_interrupt_at_any_call_of_a_runs_entry_or_exit_gives_the_run_lock_back():
    # The class behind a suite that hung: an interrupt landing in what takes the run lock or puts torch back kept
    # the lock, and the next run of another thread waited for ever.  Every call of an empty run, interrupted in turn.
    import threading

    from rlx_nb._support import switches
    from tests.interrupts import count_calls, interrupt_at

    def call():
        with switches.exclusive():
            pass

    total = count_calls(call)
    assert total > 3
    for n in range(1, total + 1):
        interrupt_at(call, n)
        assert not switches._RUN_LOCK.held, f"the run lock kept after an interrupt at call {n} of {total}"
    other = threading.Thread(target=call, daemon=True)
    other.start()
    other.join(30)
    assert not other.is_alive(), "another thread's run still waits for the lock"


def test_the_thread_that_raises_a_swallowed_stop_again_sleeps_until_one_is_swallowed():
    # It polled every 2 ms for the life of every process that ever abandoned a backend (0.8% of a core, idle or not):
    # it now waits on an event, set when a destructor swallows a stop (the test above raises one through it).
    import sys

    switches._hook_swallowed_stops()
    stopper = next(t for t in threading.enumerate() if t.name == "rlx_nb:stopper")
    deadline = time.monotonic() + 5
    while switches._SWALLOWED_NOW.is_set() and time.monotonic() < deadline:  # (one an earlier test left, raised)
        time.sleep(0.01)
    where = set()
    for _ in range(20):
        frame = sys._current_frames()[stopper.ident]
        where.add(frame.f_code.co_name)
        time.sleep(0.003)
    assert where == {"wait"}, where  # (Condition.wait, under Event.wait: never in its own loop)
