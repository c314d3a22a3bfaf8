"""Odd outputs, misbehaving backends and models, bad inputs: nothing crashes, nothing is lost or misattributed."""

from __future__ import annotations

import copy
import threading
import time
import warnings

import numpy as np
import pytest
import torch

import rlx_nb
from rlx_nb.verdict.types import NONDETERMINISTIC, ROUNDOFF, SUSPECT
from tests.conftest import require_live


def _with_backend(name, fn, model, inputs, **kwargs):
    rlx_nb.register_backend(name, fn, replace=True)
    try:
        return rlx_nb.backend_divergence(model, inputs, backends=[name, "cpu-nomkldnn"], **kwargs)
    finally:
        rlx_nb.unregister_backend(name)


class Returns(torch.nn.Module):
    """A model whose output is made by ``make(x)``."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def forward(self, x):
        return self.make(x)


OUTPUT_CASES = {
    "zero-dim": lambda x: x.sum(),
    "empty": lambda x: x[:0],
    "int": lambda x: (x * 100).long(),
    "bool": lambda x: x > 0,
    "float16": lambda x: x.half(),
    "bfloat16": lambda x: x.bfloat16(),
    "float64": lambda x: x.double() * 3,
    "complex": lambda x: torch.complex(x, -x),
    "strided": lambda x: x.t()[::2],
    "negative-zero": lambda x: x * 0 - 0.0,
    "subnormal": lambda x: x * 1e-40,
    "nan-and-inf": lambda x: torch.where(x > 0.5, torch.full_like(x, float("nan")), x / (x > 0).float()),
}


@pytest.mark.parametrize("case", sorted(OUTPUT_CASES))
def test_odd_outputs_are_compared_not_crashed_on(case):
    torch.manual_seed(0)
    report = rlx_nb.backend_divergence(Returns(OUTPUT_CASES[case]), torch.randn(6, 4), backends=["cpu-nomkldnn"])
    rec = report.record("cpu-nomkldnn")
    assert rec.verdict == ROUNDOFF, rec.reason  # the same eager kernels: identical, including NaN/Inf patterns
    assert report.elements("cpu-nomkldnn", top=3) is not None
    assert str(report)
    try:  # every element, or a clear refusal (complex, integer, bool) -- a 0-d output used to crash it
        frame = report.element_frame("cpu-nomkldnn")
    except rlx_nb.InputError as exc:
        assert "real floating output" in str(exc)
    else:
        assert len(frame) == rec.numel and not (frame.abs_err > 0).any()


def test_an_error_backend_says_it_did_not_run_when_asked_for_an_output():
    report = _with_backend("test-broken", lambda m, x: 1 / 0, torch.nn.Linear(3, 3), torch.ones(2, 3))
    with pytest.raises(rlx_nb.InputError, match="'test-broken' did not run, so it has no output 'out': ZeroDivision"):
        report.record("test-broken", "out")


def test_nan_where_the_oracle_has_a_number_is_a_mismatch_nan_in_both_is_not():
    make = lambda x: torch.where(x > 0, torch.full_like(x, float("nan")), x)  # noqa: E731
    report = _with_backend(
        "test-nan-one",
        lambda m, xs: torch.nan_to_num(m(*xs), nan=1.0).index_fill(0, torch.tensor([0]), float("nan")),
        Returns(make),
        torch.randn(5, 3),
    )
    rec = report.record("test-nan-one")
    assert rec.verdict == SUSPECT and rec.pair.nonfinite_mismatch > 0
    assert report.record("cpu-nomkldnn").pair.nonfinite_mismatch == 0


def test_structure_or_shape_differences():
    model = torch.nn.Linear(3, 3)
    r = _with_backend("test-tuple", lambda m, xs: (m(*xs), m(*xs)), model, torch.randn(2, 3))
    assert r.record("test-tuple").verdict == SUSPECT  # extra/missing outputs
    r = _with_backend("test-shape", lambda m, xs: m(*xs).T, model, torch.randn(2, 3))
    assert "shape" in r.record("test-shape").reason
    assert r.record("cpu-nomkldnn").verdict == ROUNDOFF


def test_misbehaving_backends_are_rows_and_others_survive():
    model, x = torch.nn.Linear(4, 4), torch.randn(3, 4)

    woke = threading.Event()

    def hangs(m, xs):
        time.sleep(60)
        woke.set()
        return m(*xs)

    def exhausts_memory(m, xs):
        return torch.empty(1 << 50)  # a real allocation failure, not a simulated one

    def raises(m, xs):
        raise ValueError("unsupported dtype in kernel")

    for name, fn in [
        ("test-hang", hangs),
        ("test-oom", exhausts_memory),
        ("test-raise", raises),
        ("test-nan-all", lambda m, xs: m(*xs) * float("nan")),
    ]:
        rlx_nb.register_backend(name, fn, replace=True)
    report = rlx_nb.backend_divergence(
        model, x, backends=["test-hang", "test-oom", "test-raise", "test-nan-all", "cpu-nomkldnn"], timeout_s=2
    )
    assert not woke.is_set()  # the call went on without the hung backend (however loaded the machine)
    rows = report.backends_detail.set_index("backend")
    assert "timed out after 2 s" in rows.loc["test-hang", "reason"]
    assert rows.loc["test-oom", "verdict"] == "error" and "RuntimeError" in rows.loc["test-oom", "reason"]
    assert "unsupported dtype in kernel" in rows.loc["test-raise", "reason"]
    assert rows.loc["test-nan-all", "verdict"] == SUSPECT
    assert rows.loc["cpu-nomkldnn", "verdict"] == ROUNDOFF
    for name in ["test-hang", "test-oom", "test-raise", "test-nan-all"]:
        rlx_nb.unregister_backend(name)


def test_rlx_nbs_own_eager_runs_stay_on_the_calling_thread_and_registered_ones_get_a_worker():
    # A worker thread's second OpenMP team made libgomp throttle its spin: every parallel region woke its
    # threads from sleep, and eager backends ran 25-40% slower than on the caller's thread.
    import threading

    where: dict[str, set[bool]] = {}
    caller = threading.get_ident()

    class Where(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            kind = str(x.dtype) if torch.backends.mkldnn.enabled else "nomkldnn"
            where.setdefault(kind, set()).add(threading.get_ident() == caller)
            return self.lin(x)

    rlx_nb.register_backend("test-registered", lambda m, xs: m(*xs.__class__(t * 1.0 for t in xs)), replace=True)
    try:
        rlx_nb.backend_divergence(Where(), torch.randn(3, 4), backends=["cpu-nomkldnn", "test-registered"],
                                  progress=False)  # fmt: skip
    finally:
        rlx_nb.unregister_backend("test-registered")
    # the oracle, its rerun, the sequential sums and the anchors (float32), the fp64 reference, oneDNN off:
    # all on the caller's thread; the registered backend (float32 too) in a worker
    assert where["torch.float64"] == {True} and where["nomkldnn"] == {True}
    assert where["torch.float32"] == {True, False}
    from rlx_nb.backends.registry import get_backend

    assert get_backend("cpu-inductor").on_caller and get_backend("fault:softmax-row").on_caller
    assert not get_backend("onnxruntime").on_caller and not get_backend("cuda").on_caller


def test_an_eager_run_on_the_calling_thread_past_its_timeout_is_a_row_and_the_call_goes_on():
    steps = []

    class SlowWithoutOneDNN(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(200 if not torch.backends.mkldnn.enabled else 0):
                time.sleep(0.05)  # 10 s in all, in Python steps
                steps.append(1)
            return self.lin(x)

    report = rlx_nb.backend_divergence(SlowWithoutOneDNN(), torch.randn(3, 4), backends=["cpu-nomkldnn"],
                                       timeout_s=0.5, progress=False)  # fmt: skip
    rec = report.record("cpu-nomkldnn")
    assert rec.verdict == "error" and "timed out after 0.5 s" in rec.reason and "next Python step" in rec.reason
    assert len(steps) < 200  # stopped at a Python step, not waited out (a count, not a clock: a loaded machine)
    assert torch.backends.mkldnn.enabled  # its switch restored on the way out
    time.sleep(0.2)
    again = rlx_nb.backend_divergence(SlowWithoutOneDNN(), torch.randn(3, 4), backends=["cpu-bf16"], progress=False)
    assert again.record("cpu-bf16").verdict == ROUNDOFF  # nothing left pending lands in a later call


def test_nondeterministic_model_is_not_blamed_on_a_backend():
    class Noisy(torch.nn.Module):
        def forward(self, x):
            return x + torch.randn_like(x) * 1e-3  # randomness inside forward

    report = rlx_nb.backend_divergence(Noisy(), torch.randn(4, 4), backends=["cpu-nomkldnn"])
    rec = report.record("cpu-nomkldnn")
    assert rec.verdict == NONDETERMINISTIC and not report.any_suspect
    assert "seed" in rec.reason and "eval" in rec.reason


def test_a_compiled_model_runs_eagerly_for_the_oracle_and_says_so():
    # A torch.compile'd model used to run compiled on the oracle and eagerly under the determinism
    # rerun's counting modes: its outputs differed by ~2e-7, were called the model's own
    # nondeterminism, and a real fault (GELU's tanh approximation) was reported as nondeterministic.
    from rlx_nb.models import demo

    model, x = demo.mlp(0)
    eager = rlx_nb.run(model, x, backends=["fault:gelu-approx"], backward=True, progress=False)
    expected = {name: leaf.value for name, leaf in eager.oracle.outputs.items()}
    sub = copy.deepcopy(model)
    sub.fc1 = torch.compile(sub.fc1)
    # A compiled function is a plain callable: its outputs, not the model's parameter gradients.
    cases = [(torch.compile(model), expected), (sub, expected)]
    cases.append((torch.compile(model.forward), {"out": expected["out"]}))
    for compiled, want in cases:
        with pytest.warns(UserWarning, match="compiled with torch.compile.*cpu-inductor"):
            report = rlx_nb.backend_divergence(compiled, x, backends=["fault:gelu-approx"], backward=True)
        assert report.results.environment["nondeterministic"] == {}
        assert report.record("fault:gelu-approx").verdict == SUSPECT
        outputs = report.results.oracle.outputs
        assert outputs.keys() == want.keys(), list(outputs)
        for name, value in want.items():
            np.testing.assert_array_equal(outputs[name].value, value, err_msg=name)
    assert isinstance(sub.fc1, torch._dynamo.eval_frame.OptimizedModule)  # the user's model is untouched
    # Module.compile() in place: the private deep copy drops it, so the runs are eager with no warning.
    in_place = copy.deepcopy(model)
    in_place.compile()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = rlx_nb.backend_divergence(in_place, x, backends=["fault:gelu-approx"], backward=True)
    assert report.results.environment["nondeterministic"] == {}
    np.testing.assert_array_equal(report.results.oracle.outputs["out"].value, expected["out"])
    # params named as the compiled model names them load where the eager names would
    weight = torch.full_like(model.fc1.weight, 0.01)
    with pytest.warns(UserWarning):
        named = rlx_nb.run(
            torch.compile(model), x, params={"_orig_mod.fc1.weight": weight}, backends=["cpu-nomkldnn"], progress=False
        )
    plain = rlx_nb.run(model, x, params={"fc1.weight": weight}, backends=["cpu-nomkldnn"], progress=False)
    np.testing.assert_array_equal(named.oracle.outputs["out"].value, plain.oracle.outputs["out"].value)
    assert not np.array_equal(plain.oracle.outputs["out"].value, expected["out"])
    with pytest.warns(UserWarning), pytest.raises(rlx_nb.InputError, match=r"unknown name 'fc9\.weight'"):
        rlx_nb.run(
            torch.compile(model), x, params={"_orig_mod.fc9.weight": weight}, backends=["cpu-nomkldnn"], progress=False
        )


def test_training_mode_dropout_is_compared_in_eval_mode_and_said_so():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5)).train()
    report = rlx_nb.backend_divergence(model, torch.randn(8, 4), backends=["cpu-nomkldnn"])
    assert not report.any_suspect
    assert report.results.environment["model_was_training"] is True
    assert model.training  # the user's model is untouched


def test_models_that_mutate_inputs_or_buffers_get_fresh_copies():
    class Mutates(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("calls", torch.zeros(1))

        def forward(self, x):
            self.calls += 1
            x.mul_(2)
            return x + self.calls

    x = torch.ones(3)
    report = rlx_nb.backend_divergence(Mutates(), x, backends=["cpu-nomkldnn"])
    assert report.record("cpu-nomkldnn").verdict == ROUNDOFF
    assert torch.equal(x, torch.ones(3))


def test_inputs_of_odd_kinds():
    class Mixed(torch.nn.Module):
        def forward(self, x, scale, mode):
            return x * scale if mode == "mul" else x + scale

    x = torch.randn(3, requires_grad=True)  # requires grad without backward=True: compared detached
    report = rlx_nb.backend_divergence(Mixed(), (x, 2, "mul"), backends=["cpu-nomkldnn"])
    assert report.record("cpu-nomkldnn").verdict == ROUNDOFF
    with pytest.raises(rlx_nb.InputError, match="fails on the CPU oracle"):
        rlx_nb.backend_divergence(torch.nn.Linear(3, 3), torch.ones(2, 3, dtype=torch.float64))
    with pytest.raises(rlx_nb.InputError, match="is on the meta device: it has a shape but no values"):
        rlx_nb.backend_divergence(torch.nn.Linear(3, 3), torch.ones(2, 3, device="meta"))
    with pytest.raises(rlx_nb.InputError, match="timeout_s must be a positive number"):
        rlx_nb.backend_divergence(torch.nn.Linear(3, 3), torch.ones(2, 3), timeout_s=0)


def test_huge_output_is_fine():
    report = rlx_nb.backend_divergence(
        Returns(lambda x: x.expand(4000, 4000) * 1.5), torch.randn(1, 4000), backends=["cpu-nomkldnn"]
    )
    rec = report.record("cpu-nomkldnn")
    assert rec.numel == 16_000_000 and rec.verdict == ROUNDOFF
    assert np.isfinite(rec.pair.p99_abs)


def _deep_failure(model, inputs):
    try:
        raise KeyError("kernel table lookup")
    except KeyError as cause:
        raise RuntimeError(
            "Check 'false' failed at src/frontend/convert.cpp:151:\n"
            "FrontEnd API failed with ConversionFailure:\n"
            "Model wasn't fully converted. Failed operations detailed log:\n"
            "-- aten::frobnicate with a message:\n"
            "Check 'is_valid(axis)' failed at src/core/validation.cpp:336:\n\n"
            "Summary:\n"
            "-- No conversion rule found for operations: aten::frobnicate\n"
        ) from cause


def test_an_error_row_keeps_the_root_cause_and_the_whole_error_on_request():
    rlx_nb.register_backend("test:deep-failure", _deep_failure, replace=True, default=False)
    report = rlx_nb.backend_divergence(torch.nn.Linear(2, 2), torch.ones(1, 2), backends=["test:deep-failure"])
    rec = report.record("test:deep-failure")
    assert rec.verdict == "error"
    assert "No conversion rule found for operations: aten::frobnicate" in rec.reason
    assert "Check 'false' failed at" not in rec.reason  # a check's location is not its cause
    assert "aten::frobnicate" in report.lines()[0]
    detail = report.error_detail("test:deep-failure")
    assert "Traceback" in detail and "KeyError: 'kernel table lookup'" in detail and "convert.cpp:151" in detail
    with pytest.raises(rlx_nb.InputError, match="no backend 'nope'"):
        report.error_detail("nope")


class Diff(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.diff(self.lin(x), dim=-1)  # OpenVINO's PyTorch frontend has no rule for aten::diff


def test_openvino_takes_the_onnx_route_when_its_direct_conversion_fails_and_says_so():
    require_live("openvino")
    report = rlx_nb.backend_divergence(Diff(), torch.randn(4, 8), backends=["openvino"])
    assert report.record("openvino").verdict == "round-off"
    note = report.backends_detail.note.iloc[0]
    assert "converted through the ONNX export" in note and "No conversion rule found for operations: aten::diff" in note
    direct = rlx_nb.backend_divergence(torch.nn.Linear(8, 8), torch.randn(4, 8), backends=["openvino"])
    assert "converted directly from PyTorch" in direct.backends_detail.note.iloc[0]


def test_an_error_row_carries_no_terminal_colour_codes():
    # ONNX's exporter colours its messages ("\x1b[96mThis is step 3/3\x1b[0m"); a row's text is read in reports
    # and HTML, where the codes are noise.
    def coloured(model, inputs):
        raise RuntimeError("Failed to convert.\n\x1b[96mThis is step 3/3\x1b[0m of exporting the model to ONNX.")

    report = _with_backend("coloured", coloured, torch.nn.Linear(4, 4), torch.ones(2, 4), progress=False)
    message = report.results.candidates["coloured"].message
    assert "Failed to convert." in message
    assert "\x1b" not in message and "[96m" not in message
    assert not any("\x1b" in line for line in report.lines())
