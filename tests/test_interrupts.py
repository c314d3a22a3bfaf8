"""Ctrl-C at several points of each long call leaves torch as it was (#62): its mode stacks, Inductor's config,
decomposition table, lowerings and fallbacks, the compiler bisector, the switches, os.environ, and the functions
of torch's namespaces.  The interrupts fall at spread points of the call (tests/interrupts.py); after each, torch
still computes what it computed before, and the same call runs whole."""

from __future__ import annotations

import contextlib
import os
import threading

import pytest
import torch

import rlx_nb
from rlx_nb.backends.registry import get_backend
from rlx_nb.localization.attribution import bisect_compiler
from rlx_nb.localization.capture import OpModule, Slot
from rlx_nb.localization.culprit import Culprit
from rlx_nb.models import demo
from tests.conftest import compiler_caches_off, require_live
from tests.interrupts import (
    RAISED_AT,
    call_windows,
    count_calls,
    differences,
    first_of_each,
    interrupt_at,
    interrupt_entering_mode,
    mode_entries,
    torch_state,
)

# Each test traces every Python call of a long call and raises inside torch: in a process of its own (tests/watch.py).
pytestmark = pytest.mark.isolated

SPREAD = (0.03, 0.2, 0.45, 0.7, 0.93)
"""Where in a call the interrupts fall, as shares of its Python calls inside torch and rlx_nb."""


def _still_computes() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.nn.Linear(8, 8)(torch.randn(2, 8))


def _interrupted_everywhere(call, spread=SPREAD) -> list[bool | None]:
    # The call once whole (what it warms up is torch's state from then on), once counted, then interrupted at each
    # point: torch's state after each as before it; every interrupt raised comes out of the call (none swallowed),
    # and all but one at most are raised (a call's first run makes more calls than the next: its lazy imports, its
    # caches; the count varies a little from run to run).
    call()
    total = count_calls(call)
    before, computes = torch_state(), _still_computes()
    outcomes = []
    swallowed = []
    for share in spread:
        outcomes.append(interrupt_at(call, max(1, int(total * share))))
        if outcomes[-1] is False:
            swallowed.append(f"at {share:.0%}, entering {RAISED_AT[0] if RAISED_AT else '?'}")
        assert differences(before, torch_state()) == {}, f"after an interrupt at {share:.0%} of the call"
        assert torch.equal(_still_computes(), computes)
    call()  # (and the call runs whole again)
    assert differences(before, torch_state()) == {}
    assert False not in outcomes, f"an interrupt was swallowed: {outcomes} ({'; '.join(swallowed)})"
    assert outcomes.count(None) <= 1, f"the interrupts did not fall inside the call: {outcomes}"
    return outcomes


def test_ctrl_c_during_a_snapshot_with_its_reference_and_ops_leaves_torch_as_it_was(tmp_path):
    model, inputs = demo.layered(fault_layer=1)
    n = [0]

    def call():
        n[0] += 1
        rlx_nb.snapshot(model, inputs, tmp_path / f"s{n[0]}", reference=True, ops=True)

    _interrupted_everywhere(call)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # (no partial file or scratch folder left)


def test_ctrl_c_during_a_diff_leaves_torch_as_it_was(tmp_path):
    model, inputs = demo.layered(fault_layer=1)
    path = rlx_nb.snapshot(model, inputs, tmp_path / "s", reference=True, ops=True)
    _interrupted_everywhere(lambda: rlx_nb.diff(path, model, inputs, local="all", backend="fault:softmax-row"))


def test_ctrl_c_during_an_invariance_with_its_ops_and_kernel_paths_leaves_torch_and_the_process_output_as_they_were():
    # The kernel path routes the process's stdout and stderr to a file while MKL and oneDNN print their verbose lines
    # and the profiler runs: an interrupt anywhere in it leaves both descriptors where they were.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 256))
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    fds = [(os.fstat(fd).st_dev, os.fstat(fd).st_ino) for fd in (1, 2)]
    outcomes = _interrupted_everywhere(lambda: rlx_nb.invariance(model, x, batch_sizes=(2,), rows=[0], progress=False),
                                       spread=(0.05, 0.3, 0.55, 0.75, 0.85, 0.95))  # fmt: skip
    assert [(os.fstat(fd).st_dev, os.fstat(fd).st_ino) for fd in (1, 2)] == fds, outcomes
    from rlx_nb.configurations.kernels import kernel_path  # (and inside the kernel path itself, at every share)

    args = (x[:1], model[0].weight, model[0].bias)
    _interrupted_everywhere(lambda: kernel_path(torch.nn.functional.linear, args, {}), spread=(0.1, 0.3, 0.5, 0.7, 0.9))
    assert [(os.fstat(fd).st_dev, os.fstat(fd).st_ino) for fd in (1, 2)] == fds
    assert "MKL SGEMM" in rlx_nb.invariance(model, x, batch_sizes=(2,), rows=[0], progress=False).summary.kernel_path[0]


def test_ctrl_c_during_a_repro_and_its_shrinking_leaves_torch_as_it_was(tmp_path):
    model, inputs = demo.layered(fault_layer=1)
    loc = rlx_nb.localize(model, inputs, backend="fault:softmax-row")
    _interrupted_everywhere(lambda: loc.repro(tmp_path, attribute=False, check=False))


def test_ctrl_c_as_any_torch_mode_is_entered_leaves_no_mode_on_torchs_stack(tmp_path):
    # The class behind a CI run that lost every later compile: an interrupt as a mode's __enter__ returns (the mode
    # pushed, its flags set, no ``with`` reached) left the reference's op counter on torch's dispatch stack, and
    # Dynamo then compiled nothing.  Every mode every long call enters, interrupted there in turn.
    model, inputs = demo.layered(fault_layer=1)
    loc = rlx_nb.localize(model, inputs, backend="fault:softmax-row")
    calls = {
        "backend_divergence": lambda: rlx_nb.backend_divergence(
            model, inputs, backends=["fault:softmax-row"], backward=True, progress=False
        ),
        "snapshot": lambda: rlx_nb.snapshot(
            model, inputs, tmp_path / f"s{len(list(tmp_path.iterdir()))}", reference=True, ops=True
        ),
        "repro": lambda: loc.repro(tmp_path, attribute=False, check=False),
        "training_divergence": lambda: rlx_nb.training_divergence(
            torch.nn.Sequential(torch.nn.Linear(4, 4)),
            [(torch.ones(2, 4), torch.zeros(2, 4))],
            lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
            steps=2,
            backends=["optimizer:foreach"],
            progress=False,
        ),
    }
    rows = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    linears = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64))
    calls["invariance"] = lambda: rlx_nb.invariance(linears, rows, batch_sizes=(2,), rows=[0], progress=False)
    for name, call in calls.items():
        call()
        entries = mode_entries(call)
        assert entries, f"{name} entered no torch mode: the test would test nothing"
        before = torch_state()
        # (each mode at each place it is entered from, once: the same mode entered again from the same line -- one
        # per module, one per run -- is the same case)
        for n in first_of_each(entries):
            outcome = interrupt_entering_mode(call, n)
            assert differences(before, torch_state()) == {}, f"{name}: after an interrupt as mode {n} was entered"
            assert outcome is not False, f"{name}: the interrupt at mode {n} was swallowed"


def _small_training(backends: list[str]):
    # A call of training_divergence on a small MLP, 3 steps (made once: each call trains it again from the same state).
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    data = [(torch.randn(8, 8), torch.randn(8, 1)) for _ in range(2)]

    def call():
        rlx_nb.training_divergence(model, data, lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
                                   optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2), steps=3, backends=backends,
                                   progress=False)  # fmt: skip

    return call


def test_ctrl_c_during_a_training_divergence_leaves_torch_as_it_was():
    _interrupted_everywhere(_small_training(["optimizer:foreach", "threads"]))


def _threads_a_new_thread_gets() -> int:
    got = []
    thread = threading.Thread(target=lambda: got.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    return got[0]


def test_ctrl_c_while_two_envelope_runs_step_at_once_leaves_torch_as_it_was():
    # On two threads, the envelope's run on another thread count steps beside a one-ulp run (rlx_nb.training.paired):
    # an interrupt in the caller's thread, anywhere in a pair's step, waits for the other run's step, then gives torch
    # back its thread count.
    call = _small_training(["optimizer:foreach"])
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        call()
        before = torch_state()
        windows = call_windows(call, "step_pair")
        assert len(windows) == 3, f"the pair stepped {len(windows)} times in 3 steps: the test would test nothing"
        for first, last in windows[:2]:
            for share in (0.02, 0.3, 0.6, 0.98):
                at = first + int((last - first) * share)
                assert interrupt_at(call, at) is True, f"the interrupt at call {at} (in {first}-{last}) was swallowed"
                left = [t.name for t in threading.enumerate() if t.name == "rlx_nb:envelope"]
                assert left == [], f"after an interrupt at call {at} ({first}-{last}), still running: {left}"
                assert _threads_a_new_thread_gets() == 2, f"after an interrupt at call {at} ({first}-{last})"
                assert differences(before, torch_state()) == {}, f"after an interrupt at call {at} ({first}-{last})"
        call()
        assert differences(before, torch_state()) == {}
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def _planted_gelu_decomposition():
    from torch._inductor import decomposition

    aten = torch.ops.aten
    saved = decomposition.decompositions[aten.gelu.default]
    decomposition.decompositions[aten.gelu.default] = lambda x, approximate="none": x * torch.sigmoid(1.702 * x)
    decomposition.fast_random_decomps.cache_clear()
    try:
        yield
    finally:
        decomposition.decompositions[aten.gelu.default] = saved
        decomposition.fast_random_decomps.cache_clear()


@pytest.mark.slow
def test_ctrl_c_during_a_compiler_bisection_and_its_workaround_leaves_torch_as_it_was():
    # A wrong decomposition: the bisection walks torch.compile's stages, bisects the decompositions, then checks the
    # workaround (the op taken out of the table, compiled by Inductor: it adds the op to its lowerings and fallbacks).
    require_live("cpu-inductor")
    op = OpModule(torch.nn.functional.gelu, ((Slot(0),), {}))
    culprit = Culprit("gelu", "cpu-inductor", False, op, (torch.randn(4, 8),), lent=get_backend("cpu-inductor"))
    found = []
    with _planted_gelu_decomposition(), compiler_caches_off():
        _interrupted_everywhere(lambda: found.append(bisect_compiler(culprit, lambda _: None)), spread=(0.05, 0.4, 0.8))
    assert "in its decompositions, at aten.gelu" in found[-1].sentence and found[-1].workaround


def test_the_mode_guard_takes_back_a_mode_a_hook_left_on_torchs_stack():
    # What tripped the snapshot: torch runs an always_call forward hook on an Exception, not on a KeyboardInterrupt.
    from rlx_nb._support.kept import modes_kept
    from rlx_nb.changes.ops import OpCalls

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    recorder = OpCalls(lambda op: None)
    model.register_forward_hook(lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt), modes_kept(), recorder.attached(model):
        model(torch.randn(1, 2))
    assert torch._C._len_torch_function_stack() == 0
