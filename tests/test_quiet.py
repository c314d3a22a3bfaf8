"""What exporters and runtimes print is kept out for their thread only, never past their call, and a native abort's
message is never lost with it (rlx_nb._support.quiet)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import warnings

import torch

import rlx_nb
from rlx_nb._support.quiet import capturing, quiet


def test_the_capturing_threads_output_is_kept_out_and_another_threads_is_not(capfd):
    said = threading.Event()
    go = threading.Event()

    def other() -> None:
        go.wait()
        print("another thread's line", flush=True)
        warnings.warn("another thread's warning", stacklevel=1)
        said.set()

    t = threading.Thread(target=other)
    t.start()
    before = (sys.stdout, os.fstat(1).st_ino)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with quiet():
            assert capturing()
            print("an exporter's progress")
            os.write(1, b"a runtime's C++ banner\n")
            warnings.warn("an exporter's warning", stacklevel=1)
            go.set()
            assert said.wait(10)
        t.join()
    assert [str(w.message) for w in shown] == ["another thread's warning"]
    assert not capturing() and (sys.stdout, os.fstat(1).st_ino) == before
    print("the user's line", flush=True)
    out, err = capfd.readouterr()
    assert "another thread's line" in out and "the user's line" in out
    assert "progress" not in out + err and "banner" not in out + err


def test_a_native_abort_inside_a_capture_still_says_what_it_printed():
    # #46: ExecuTorch's assertion on an uncalibrated graph aborted the process, its message in the capture's
    # scratch file: the process died saying nothing.  The keeper process writes what the capture held.
    code = (
        "import os\n"
        "from rlx_nb._support.quiet import quiet\n"
        "with quiet():\n"
        "    print('an exporter line')\n"
        "    os.write(2, b'op_dequantize.cpp: scale.numel() 1 != input.size(axis) 32\\n')\n"
        "    os.abort()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "scale.numel() 1 != input.size(axis) 32" in done.stderr, done.stderr
    assert "the process ended inside a runtime's call" in done.stderr
    # A capture that ends normally leaves nothing for the keeper to say.
    code = "from rlx_nb._support.quiet import quiet\nwith quiet():\n    print('kept out')\nprint('shown')\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == "shown\n" and done.stderr == "", (done.stdout, done.stderr)


def test_a_backend_left_running_past_its_timeout_inside_a_capture_holds_no_output_after_the_call(capfd):
    # #46: after litert or executorch-xnnpack timed out, the abandoned thread's capture stayed on: sys.stdout was a
    # StringIO and descriptor 1 a deleted file, and every later line of the process could be lost.
    left = threading.Event()

    def stuck(model, inputs):
        try:
            with quiet():
                time.sleep(1.5)  # (one C call: the run's Stopped lands only after it)
        finally:
            left.set()  # (the Stopped unwinds it from here: it never returns)
        return model(*inputs)

    rlx_nb.register_backend("test-stuck-quiet", stuck, default=False, replace=True)
    before = (sys.stdout, sys.stderr, os.fstat(1).st_ino, os.fstat(2).st_ino)
    try:
        report = rlx_nb.backend_divergence(
            torch.nn.Linear(4, 2), torch.randn(3, 4), backends=["test-stuck-quiet"], timeout_s=0.3, progress=False
        )
        assert report.record("test-stuck-quiet").verdict == "error"
        assert (sys.stdout, sys.stderr, os.fstat(1).st_ino, os.fstat(2).st_ino) == before
        assert not capturing()
        print("right after the call", flush=True)
        assert left.wait(10)
        time.sleep(0.1)
        print("after the backend left", flush=True)
        assert (sys.stdout, sys.stderr, os.fstat(1).st_ino, os.fstat(2).st_ino) == before
    finally:
        rlx_nb.unregister_backend("test-stuck-quiet")
    out = capfd.readouterr().out
    assert "right after the call" in out and "after the backend left" in out
