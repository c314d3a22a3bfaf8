from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

import rlx_nb
from rlx_nb._support.tree import flatten
from rlx_nb.execution.run import reruns_oracle, run, same_bits


class Nested(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, *, scale=1.0):
        y = self.lin(x) * scale
        return {"logits": y, "hidden": [y.relu(), {"attn": y.sigmoid()}], "steps": 3}


def test_flatten_names():
    names = [n for n, _ in flatten({"logits": 1, "hidden": [2, {"attn": 3}]})]
    assert names == ["logits", "hidden[0]", "hidden[1].attn"]
    assert [n for n, _ in flatten((torch.zeros(1), torch.zeros(1)))] == ["out[0]", "out[1]"]
    assert [n for n, _ in flatten(torch.zeros(1))] == ["out"]


def test_nested_outputs_and_dict_inputs():
    report = rlx_nb.backend_divergence(Nested(), {"x": torch.randn(2, 4), "scale": 2.0}, backends=["cpu-nomkldnn"])
    assert report.summary["output"].tolist() == ["logits", "hidden[0]", "hidden[1].attn", "steps"]
    assert not report.any_suspect
    steps = report.record("cpu-nomkldnn", "steps")
    assert steps.reason == "" or "differs" not in steps.reason


def test_plain_callable_model():
    w = torch.randn(4, 4)
    report = rlx_nb.backend_divergence(lambda x: torch.tanh(x @ w), torch.randn(3, 4), backends=["cpu-nomkldnn"])
    assert report.summary["verdict"].tolist() == ["round-off"]


def test_params_are_loaded_and_checked():
    model = torch.nn.Linear(2, 2)
    res = run(
        model,
        torch.ones(1, 2),
        params={"bias": torch.tensor([5.0, 6.0]), "weight": torch.zeros(2, 2)},
        backends=["cpu"],
    )
    np.testing.assert_array_equal(res.oracle.outputs["out"].value, [[5.0, 6.0]])
    with pytest.raises(rlx_nb.InputError, match="unknown name 'nope'; the model has: weight, bias"):
        run(model, torch.ones(1, 2), params={"nope": torch.zeros(1)})
    with pytest.raises(rlx_nb.InputError, match=r"params\['bias'\] has shape \(3,\); the model's bias has \(2,\)"):
        run(model, torch.ones(1, 2), params={"bias": torch.zeros(3)})


def test_inputs_the_model_rejects_are_a_clear_error():
    with pytest.raises(rlx_nb.InputError, match=r"fails on the CPU oracle.*RuntimeError"):
        rlx_nb.backend_divergence(torch.nn.Linear(3, 2), torch.ones(2, 5))
    with pytest.raises(rlx_nb.InputError, match="inputs must be a tensor"):
        rlx_nb.backend_divergence(torch.nn.Linear(3, 2), "text")
    with pytest.raises(rlx_nb.InputError, match="model must be"):
        rlx_nb.backend_divergence(42, torch.ones(1))
    # On the meta device: a shape and no values (NotImplementedError from deep inside the copy)
    with pytest.raises(rlx_nb.InputError, match=r"input 'input\[0\]' is on the meta device"):
        rlx_nb.backend_divergence(torch.nn.Linear(3, 2), torch.ones(2, 3, device="meta"))
    with pytest.raises(rlx_nb.InputError, match=r"the model's parameter 'weight' is on the meta device.*to_empty"):
        rlx_nb.backend_divergence(torch.nn.Linear(3, 2, device="meta"), torch.ones(2, 3))


def test_failing_backend_is_an_error_row_and_others_survive():
    def broken(model, inputs):
        raise RuntimeError("kernel exploded")

    rlx_nb.register_backend("test-broken", broken, replace=True)
    report = rlx_nb.backend_divergence(
        torch.nn.Linear(3, 2), torch.ones(2, 3), backends=["test-broken", "cpu-nomkldnn"]
    )
    rows = report.backends_detail.set_index("backend")
    assert rows.loc["test-broken", "verdict"] == "error"
    assert "kernel exploded" in rows.loc["test-broken", "reason"]
    assert rows.loc["cpu-nomkldnn", "verdict"] == "round-off"
    assert report.errors == ["test-broken"] and not report.any_suspect
    rlx_nb.unregister_backend("test-broken")


def test_backward_compares_param_and_input_grads():
    x = torch.randn(4, 3, requires_grad=True)
    report = rlx_nb.backend_divergence(torch.nn.Linear(3, 2), x, backends=["cpu-nomkldnn"], backward=True)
    assert report.summary["output"].tolist() == ["out", "grad:weight", "grad:bias", "grad:input[0]"]
    assert set(report.summary["kind"]) == {"forward", "grad"}
    assert not report.any_suspect


def test_custom_loss():
    report = rlx_nb.backend_divergence(
        torch.nn.Linear(3, 2),
        torch.randn(4, 3),
        backends=["cpu-nomkldnn"],
        backward=True,
        loss=lambda out: out.pow(2).mean(),
    )
    assert "grad:weight" in report.summary["output"].tolist()


def test_user_model_and_inputs_untouched():
    model = torch.nn.BatchNorm1d(3).train()
    x = torch.randn(5, 3)
    x0, mean0 = x.clone(), model.running_mean.clone()
    rlx_nb.backend_divergence(model, x, backends=["cpu-nomkldnn"])
    assert torch.equal(x, x0) and torch.equal(model.running_mean, mean0) and model.training


def test_fingerprints_are_computed_only_when_read(monkeypatch, tmp_path):
    from rlx_nb.execution import fingerprints

    hashed = []
    real = fingerprints.fingerprint
    monkeypatch.setattr(fingerprints, "fingerprint", lambda obj: hashed.append(1) or real(obj))
    torch.manual_seed(0)
    model, x = torch.nn.Linear(8, 4), torch.randn(3, 8)
    report = rlx_nb.backend_divergence(model, x, backends=["cpu-nomkldnn"], progress=False)
    print(report)  # the text, the frames: nothing reads the fingerprints
    assert len(report.backends) == 1
    assert hashed == []
    report.save(tmp_path / "r.rlxnb")  # saving does
    assert len(hashed) == 2
    fp = dict(report.results.fingerprints)
    assert fp["inputs"] == real((x,)) and fp["model"] is not None
    assert fp["input_structure"].startswith("1 tensor(s), 24 element(s): out[0] float32 (3, 8)")
    assert rlx_nb.load_report(tmp_path / "r.rlxnb").results.fingerprints == fp


def test_inputs_changed_in_place_after_the_run_have_no_fingerprint():
    torch.manual_seed(0)
    model, x = torch.nn.Linear(8, 4), torch.randn(3, 8)
    report = rlx_nb.backend_divergence(model, x, backends=["cpu-nomkldnn"], progress=False)
    x.add_(1.0)  # the run's bytes are gone: better no fingerprint than a wrong one
    assert report.results.fingerprints["inputs"] is None


def test_a_model_changed_or_dropped_after_the_run_has_no_model_fingerprint_and_is_not_kept_alive():
    import gc
    import weakref

    torch.manual_seed(0)
    model, x = torch.nn.Linear(8, 4), torch.randn(3, 8)
    replaced = rlx_nb.backend_divergence(model, x, backends=["cpu-nomkldnn"], progress=False)
    model.weight = torch.nn.Parameter(torch.zeros(4, 8))  # a new tensor, version 0: not the run's weights
    assert replaced.results.fingerprints["model"] is None
    assert replaced.results.fingerprints["inputs"] is not None
    model = torch.nn.Linear(8, 4)
    dropped = rlx_nb.backend_divergence(model, x, backends=["cpu-nomkldnn"], progress=False)
    weight = weakref.ref(model.weight)
    del model
    gc.collect()
    assert weight() is None  # the unread fingerprints hold no strong reference to the weights
    assert dropped.results.fingerprints["model"] is None


def test_the_environment_names_the_cpu_its_simd_flags_the_settings_and_each_backend(tmp_path):
    import platform

    torch.manual_seed(0)
    report = rlx_nb.backend_divergence(torch.nn.Linear(8, 4), torch.randn(3, 8), backends=["cpu-nomkldnn"])
    env = report.results.environment
    assert env["machine"] == platform.machine() and env["cpu"]
    assert env["aten_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    if platform.machine() == "x86_64":
        assert "sse4_2" in env["cpu_simd"] and all(not f.startswith(("vme", "pae")) for f in env["cpu_simd"])
    assert env["settings"]["float32_matmul_precision"] == torch.get_float32_matmul_precision()
    assert env["settings"]["mkldnn_enabled"] is torch.backends.mkldnn.enabled
    assert env["backends"] == {"cpu-nomkldnn": "torch eager with oneDNN and NNPACK disabled (ATen's native kernels)"}
    loaded = rlx_nb.load_report(report.save(tmp_path / "r.rlxnb")).results.environment
    assert {k: loaded[k] for k in ("cpu_simd", "settings", "backends")} == {
        k: env[k] for k in ("cpu_simd", "settings", "backends")
    }


def test_the_report_says_which_extra_runs_were_made_and_why():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    extra = rlx_nb.backend_divergence(model, torch.randn(4, 8), backends=["cpu-nomkldnn"], progress=False)
    runs = extra.results.environment["extra_runs"]
    assert runs[0].startswith("fp64 reference") and any(r.startswith("oracle, again") for r in runs)
    assert any(r.startswith("precision anchors (8 bits, 11 bits)") for r in runs)  # a matmul: anchors ran
    plain = rlx_nb.backend_divergence(torch.nn.GELU(), torch.randn(4, 8), backends=["cpu-nomkldnn"], progress=False,
                                      check_determinism=False)  # fmt: skip
    assert plain.results.environment["extra_runs"] == ["fp64 reference: every verdict's yardstick"]


# -- the determinism check: the oracle's rerun, or a run of the oracle's own code that repeats it bit for bit ---


def test_cpu_nomkldnn_repeating_the_oracle_bit_for_bit_is_the_determinism_check():
    # Linear and LayerNorm: kernels oneDNN's switch does not change, so cpu-nomkldnn computes what the oracle does.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    for backward in (False, True):
        results = run(model, torch.randn(4, 8), backends=["cpu-bf16", "cpu-nomkldnn"], backward=backward,
                      progress=False)  # fmt: skip
        phases = list(results.environment["timings"])
        assert "determinism rerun" not in phases
        assert phases.index("fp64 reference") < phases.index("cpu-nomkldnn") < phases.index("cpu-bf16")  # run first
        assert list(results.candidates) == ["cpu-bf16", "cpu-nomkldnn"]  # and its row where it was asked for
        assert results.environment["nondeterministic"] == {}
        assert any(e.startswith("oracle, again: not run; cpu-nomkldnn") for e in results.environment["extra_runs"])
        same = results.candidates["cpu-nomkldnn"]
        assert same_bits(results.oracle, same, backward)
        assert all(same.outputs[n] is leaf for n, leaf in results.oracle.outputs.items())  # no second copy kept
        assert not backward or any(n.startswith("grad:") for n in results.candidates["cpu-nomkldnn"].outputs)


class _Noisy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + 1e-3 * torch.randn(4)


def test_a_model_that_does_not_repeat_itself_still_gets_the_oracles_rerun():
    # cpu-nomkldnn's run differs from the oracle's: that alone marks nothing; the oracle runs again, and the
    # outputs its two runs disagree on are the model's own nondeterminism.
    results = run(_Noisy(), torch.randn(2, 8), backends=["cpu-nomkldnn"], progress=False)
    assert "determinism rerun" in results.environment["timings"]
    assert set(results.environment["nondeterministic"]) == {"out"}
    report = rlx_nb.backend_divergence(_Noisy(), torch.randn(2, 8), backends=["cpu-nomkldnn"], progress=False)
    assert report.record("cpu-nomkldnn").verdict == "nondeterministic" and not report.any_suspect
    # A deterministic model whose kernels oneDNN does change (a convolution): the oracle's rerun, nothing marked.
    torch.manual_seed(0)
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3))
    x = torch.randn(2, 3, 16, 16)
    results = run(conv, x, backends=["cpu-nomkldnn"], progress=False)
    assert not same_bits(results.oracle, results.candidates["cpu-nomkldnn"], False)
    assert "determinism rerun" in results.environment["timings"]
    assert results.environment["nondeterministic"] == {}


def test_two_runs_differ_by_their_largest_difference_chunk_by_chunk_nan_equal_to_nan():
    from rlx_nb.execution.results import BackendRun, Leaf, nondeterministic

    def run_of(**arrays):
        return BackendRun("cpu", "ok", {k: Leaf(v, str(v.dtype), v.shape) for k, v in arrays.items()})

    a = np.zeros(3_000_001, np.float32)
    a[[5, 2_500_000]] = np.nan
    b = a.copy()
    assert nondeterministic(run_of(x=a), run_of(x=b)) == {}
    b[[0, 2_999_999]] = [1e-3, 2.0]  # in the first chunk and in the last
    b[1_000_000] = np.nan  # NaN against a number: no difference can say how far
    c = np.arange(6, dtype=np.int64)
    d = c.copy()
    d[4] = 9
    got = nondeterministic(run_of(x=a, n=c, same=c), run_of(x=b, n=d, same=c))
    assert got == {"x": math.inf, "n": 5.0}
    b[1_000_000] = 0.0
    assert nondeterministic(run_of(x=a), run_of(x=b)) == {"x": 2.0}
    # Whether two runs are the same stops at the first difference: the first output, its first chunk.
    assert nondeterministic(run_of(x=a, n=c), run_of(x=b, n=d), any_only=True) == {"x": pytest.approx(1e-3)}


def test_only_rlx_nbs_eager_float32_cpu_runs_stand_in_for_the_rerun():
    from rlx_nb.backends.base import Backend
    from rlx_nb.backends.registry import get_backend

    assert reruns_oracle(get_backend("cpu-nomkldnn")) and reruns_oracle(get_backend("cpu-nnpack"))
    for name in ("cpu-inductor", "cpu-bf16", "cpu-fp16", "cpu-tf32-emulated", "cpu-f64", "onnxruntime",
                 "fault:gelu-approx", "cuda"):  # fmt: skip
        assert not reruns_oracle(get_backend(name)), name
    assert not reruns_oracle(Backend("users-own", lambda m, x: m(*x)))  # (a registered backend: its own code)
    # Every output, gradients too, and a run that ran.
    results = run(torch.nn.Linear(4, 2), torch.randn(3, 4), backends=["cpu-nomkldnn"], backward=True, progress=False)
    oracle, same = results.oracle, results.candidates["cpu-nomkldnn"]
    assert same_bits(oracle, same, True)
    assert not same_bits(oracle, dataclasses.replace(same, grad_status="error"), True)
    assert same_bits(oracle, dataclasses.replace(same, grad_status="error"), False)
    assert not same_bits(oracle, dataclasses.replace(same, status="error"), False)
    fewer = {k: v for k, v in same.outputs.items() if not k.startswith("grad:")}
    assert not same_bits(oracle, dataclasses.replace(same, outputs=fewer), True)


# -- the user's own state: inference mode, default dtype, memory layout ------------------------------


def test_inference_mode_inputs_and_calls_are_honoured():
    # A raw "Inference tensors do not track version counter" before.
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
    with torch.inference_mode():
        x = torch.randn(3, 4)
    report = rlx_nb.backend_divergence(model, x, backends=["cpu-nomkldnn"], backward=True, progress=False)
    assert report.record("cpu-nomkldnn").verdict == "round-off" and "grad:0.weight" in report.results.oracle.outputs
    assert report.results.fingerprints["inputs"] is not None  # hashed at once: no version counter to watch
    with torch.inference_mode():
        inside = rlx_nb.backend_divergence(model, torch.randn(3, 4), backends=["cpu-nomkldnn"], backward=True)
        assert torch.is_inference_mode_enabled()  # still the user's block afterwards
    assert inside.record("cpu-nomkldnn").verdict == "round-off"
    with torch.inference_mode():
        built = torch.nn.Linear(4, 4)  # parameters that are inference tensors too
    report = rlx_nb.backend_divergence(built, torch.randn(2, 4), backends=["cpu-nomkldnn"], backward=True)
    assert report.results.fingerprints["model"] is not None


class MakesTensors(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) + torch.ones(4)  # created in the default dtype


def test_a_float64_default_dtype_runs_the_oracle_in_float32_and_is_restored():
    # "mat1 and mat2 must have the same dtype, but got Double and Float", with no word on what to change.
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model, x = MakesTensors(), torch.randn(3, 4)
        assert x.dtype == torch.float64
        with pytest.warns(UserWarning, match="default dtype is float64.*input\\[0\\] cast from float64 to float32"):
            report = rlx_nb.backend_divergence(model, x, backends=["cpu-nomkldnn"], backward=True, progress=False)
        assert torch.get_default_dtype() == torch.float64  # the user's, after
        assert report.record("cpu-nomkldnn").verdict == "round-off"
        assert report.results.oracle.outputs["out"].dtype == "float32"
        assert "input[0] cast from float64" in report.results.environment["inputs_cast"]
        assert x.dtype == torch.float64  # the user's tensor is untouched
    finally:
        torch.set_default_dtype(before)


def test_float64_inputs_under_a_float32_default_are_a_clear_error():
    with pytest.raises(rlx_nb.InputError, match=r"input\[0\] is float64, while the oracle runs the model in float32"):
        rlx_nb.backend_divergence(torch.nn.Linear(4, 4), torch.randn(3, 4, dtype=torch.float64), backends=["cpu"])


def test_private_copies_keep_the_users_memory_layout():
    seen = []

    def spy(model, inputs):
        seen.append((inputs[0].stride(), inputs[0].data_ptr() % 64))
        return model(*inputs)

    rlx_nb.register_backend("test-layout-spy", spy, replace=True)
    try:
        base = torch.randn(9, 16)
        for view in (
            base[:, ::2],
            base[1:, 1:],
            base.t(),
            torch.randn(2, 8, 3, 3).to(memory_format=torch.channels_last),
        ):
            seen.clear()
            model = torch.nn.Identity()
            rlx_nb.backend_divergence(model, view, backends=["test-layout-spy"], progress=False)
            assert seen == [(view.stride(), view.data_ptr() % 64)], view.stride()
    finally:
        rlx_nb.unregister_backend("test-layout-spy")


def test_a_layout_dependent_kernel_bug_shows_inside_rlx_nb():
    # pytorch/pytorch#177839: logit(eps=0.51) gave -0.04 on a sliced tensor and +0.04 on a contiguous copy.
    # The private copy made inputs contiguous, so such a bug vanished inside rlx_nb.  This backend's kernel
    # is wrong only on non-contiguous inputs, as that one was.
    def strided_bug(model, inputs):
        out = model(*inputs)
        return out if inputs[0].is_contiguous() else -out

    rlx_nb.register_backend("test-strided-bug", strided_bug, replace=True)
    try:
        x = torch.rand(2, 20, generator=torch.Generator().manual_seed(0))[:, :17]
        model = lambda t: torch.special.logit(t, eps=0.1)  # noqa: E731
        report = rlx_nb.backend_divergence(model, x, backends=["test-strided-bug", "cpu-nomkldnn"], progress=False)
    finally:
        rlx_nb.unregister_backend("test-strided-bug")
    assert report.suspects == ["test-strided-bug"]


# -- real sizes: the per-phase account, memory, anchors only where a verdict needs them, early verdicts ---


def test_a_phase_that_raises_the_process_peak_has_that_peak_however_short():
    # The meter samples every SAMPLE_S; a phase that reaches a new process-wide peak has it exactly (ru_maxrss),
    # even one far shorter than a sample's interval.  (A fresh interpreter, the meter alone: its peak is small.)
    import subprocess
    import sys
    from pathlib import Path

    meter = Path(rlx_nb.__file__).parent / "_support" / "meter.py"
    code = f"""
import importlib.util, time
spec = importlib.util.spec_from_file_location("meter", {str(meter)!r}); m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
m.SAMPLE_S = 60.0  # (no sample after the first)
meter = m.Meter()
with meter.phase("spike"):
    time.sleep(0.3)  # (the sampler's first sample taken: the next is a minute away)
    spike = b"x" * (256 << 20)  # (every page written)
    del spike
print(meter.phases["spike"]["peak_bytes"], meter.phases["spike"]["rss_after_bytes"])
"""
    # (Through a shell that forks it: a process exec'd straight from this one starts with this one's peak as its own.)
    run = [sys.executable, "-c", code]
    done = subprocess.run(["/bin/sh", "-c", '"$0" "$@"; exit $?', *run], capture_output=True, text=True, timeout=120)
    peak, after = map(int, done.stdout.split())
    assert peak >= 256 << 20 > after, (peak, after, done.stderr)


def test_the_report_accounts_for_every_phase():
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    report = rlx_nb.backend_divergence(model, torch.randn(32, 64), backends=["cpu-nomkldnn", "onnxruntime"])
    frame = report.timings
    phases = list(frame.phase)
    for phase in ("private copy", "oracle", "determinism rerun", "fp64 reference", "anchor 8 bits", "cpu-nomkldnn",
                  "onnxruntime", "onnxruntime: prepare", "ONNX export", "onnxruntime: first run"):  # fmt: skip
        assert phase in phases, phase
    assert (frame.seconds >= 0).all() and (frame.peak_bytes >= frame.rss_after_bytes * 0.5).all()
    assert (
        frame.set_index("phase").loc["onnxruntime", "seconds"] >= frame.set_index("phase").loc["ONNX export", "seconds"]
    )
    memory = report.results.environment["memory"]
    assert memory["weights_bytes"] == 4 * sum(p.numel() for p in model.parameters())


def test_a_phase_that_would_not_fit_in_memory_is_a_row_that_says_so():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 2048))  # 134 MB
    x = torch.randn(8, 2048)
    report = rlx_nb.backend_divergence(model, x, backends=["cpu-nomkldnn", "onnxruntime"], memory_budget=120e6)
    rows = report.backends_detail.set_index("backend")
    assert rows.loc["onnxruntime", "verdict"] == "skipped"
    assert "not run for memory: its conversion needs ~" in rows.loc["onnxruntime", "reason"]
    assert "memory_budget= to override" in rows.loc["onnxruntime", "reason"]
    assert rows.loc["cpu-nomkldnn", "verdict"] == "round-off"  # what fits still runs
    assert "onnxruntime vs cpu: SKIPPED — not run for memory" in "\n".join(report.lines())
    assert report.errors == []  # not a failure of the backend ...
    assert report.not_run == ["onnxruntime"]  # ... but not run: a gate exits 3 (rlx_nb.cli)
    unlimited = rlx_nb.backend_divergence(model, x, backends=["cpu-nomkldnn"], memory_budget=float("inf"))
    assert unlimited.record("cpu-nomkldnn").verdict == "round-off"  # no limit (it raised OverflowError)
    with pytest.raises(rlx_nb.InputError, match="memory_budget must be a positive number of bytes"):
        rlx_nb.backend_divergence(model, x, backends=["cpu-nomkldnn"], memory_budget=-1)
    # An int past any float (#46: a raw OverflowError), through the call and through rlx_nb.run.
    for call in (rlx_nb.backend_divergence, rlx_nb.run):
        with pytest.raises(rlx_nb.InputError, match=r"got an int of 401 digits, past any float: use float\('inf'\)"):
            call(model, x, backends=["cpu-nomkldnn"], memory_budget=10**400, progress=False)


def test_on_a_large_model_the_anchors_run_only_where_a_verdict_needs_them(monkeypatch):
    import sys

    monkeypatch.setattr(sys.modules["rlx_nb.execution.run"], "ANCHORS_CHEAP_S", -1.0)  # every model counts as large
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    x = torch.randn(16, 32)
    clean = rlx_nb.backend_divergence(model, x, backends=["cpu-nomkldnn"], progress=False)
    assert clean.results.anchors == {} and clean.record("cpu-nomkldnn").verdict == "round-off"
    assert any("precision anchors not run" in e for e in clean.results.environment["extra_runs"])
    faulty = rlx_nb.backend_divergence(model, x, backends=["cpu-nomkldnn", "fault:gelu-approx"], progress=False)
    assert sorted(faulty.results.anchors) == [8, 11]  # run after the candidates: a backend was SUSPECT
    assert any("run because a backend was SUSPECT" in e for e in faulty.results.environment["extra_runs"])
    monkeypatch.setattr(sys.modules["rlx_nb.execution.run"], "ANCHORS_CHEAP_S", 1e9)
    eager = rlx_nb.backend_divergence(model, x, backends=["cpu-nomkldnn", "fault:gelu-approx"], progress=False)
    assert faulty.summary_detail.drop(columns="note").equals(
        eager.summary_detail.drop(columns="note")
    )  # the same judgement
    monkeypatch.setattr(sys.modules["rlx_nb.execution.run"], "ANCHORS_CHEAP_S", -1.0)
    bf16 = rlx_nb.backend_divergence(model, x, backends=["cpu-bf16"], progress=False)
    assert sorted(bf16.results.anchors) == [8, 11]  # a reduced-precision budget is its anchor: always run


def test_each_backends_verdict_is_shown_as_it_lands(monkeypatch, capsys):
    from rlx_nb._support import progress

    monkeypatch.setattr(progress, "DELAY_S", -1.0)  # (a call is quiet for its first 2 s)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU())
    report = rlx_nb.backend_divergence(model, torch.randn(8, 32), backends=["cpu-nomkldnn", "fault:gelu-approx"])
    err = capsys.readouterr().err
    shown = [line for line in err.splitlines() if line.startswith("rlx_nb: [Sequential]")]
    assert len(shown) == 2 and "cpu-nomkldnn vs cpu" in shown[0] and "SUSPECT" in shown[1]
    assert [line.removeprefix("rlx_nb: ") for line in shown] == report.lines()  # the report's own lines
    quiet = rlx_nb.backend_divergence(model, torch.randn(8, 32), backends=["cpu-nomkldnn"], progress=False)
    assert "rlx_nb: [" not in capsys.readouterr().err and quiet.lines()


@pytest.mark.slow
def test_the_bar_names_the_phase_a_backend_is_in(monkeypatch, capsys):
    # A long first call said only which backend ran (62 s on the README's GPT-2, most of it Inductor compiling):
    # the bar now names the phase, an export or a compile.
    from rlx_nb._support import progress

    monkeypatch.setattr(progress, "DELAY_S", -1.0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU())
    rlx_nb.backend_divergence(model, torch.randn(8, 32), backends=["onnxruntime"])
    err = capsys.readouterr().err
    assert "onnxruntime: prepare" in err and "ONNX export" in err


def test_the_backends_judged_as_they_land_share_one_set_of_output_contexts(monkeypatch):
    # The oracle's, the sequential and the anchor runs' statistics are what every backend is judged against:
    # built once for the call, and the records are those a comparison of the whole results gives.
    from rlx_nb.comparison.compare import compare
    from rlx_nb.report import judged

    built: list[int] = []

    def counted(results):
        built.append(1)
        return api_contexts(results)

    api_contexts = judged.contexts
    monkeypatch.setattr(judged, "contexts", counted)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8))
    backends = ["cpu-nomkldnn", "cpu-bf16", "fault:gelu-approx", "fault:linear-bias-channel"]
    report = rlx_nb.backend_divergence(model, torch.randn(8, 32), backends=backends, progress=False)
    assert len(built) == 1
    again = compare(report.results, progress=False)
    assert [(r.backend, r.output, r.verdict, r.judgement.line) for r in report.records] == [
        (r.backend, r.output, r.verdict, r.judgement.line) for r in again
    ]
    assert report.suspects == ["fault:linear-bias-channel"]


class _Counter(torch.nn.Module):
    """A model that steps its own state in forward (a buffer ``count += 1``), as a step counter or a running
    statistic does."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(8, 8)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count += 1
        return self.fc(x) * self.count


@pytest.mark.slow
def test_a_model_that_steps_its_own_state_gives_every_backend_the_state_the_oracle_started_from():
    # #46: every converted backend was SUSPECT (+1 or +2: its copy stepped while the exporter traced it; a kept
    # ExecuTorch program +1 at each reuse).  Each call of each backend's copy now starts from the oracle's state.
    live = set(rlx_nb.available_backends(include_optin=True))
    wanted = ["cpu-nomkldnn", "cpu-inductor", "onnxruntime", "onnxruntime-noopt", "openvino", "executorch-xnnpack",
              "executorch-portable", "litert"]  # fmt: skip
    backends = [b for b in wanted if b in live]
    model, x = _Counter(), torch.randn(4, 8)
    for _ in range(2):  # (the second call reuses the kept preparations)
        report = rlx_nb.backend_divergence(model, x, backends=backends, progress=False)
        assert report.suspects == [] and set(report.results.candidates) == set(backends), report.lines()
        oracle = report.results.oracle.outputs["out"].value
        assert np.allclose(oracle, (model.fc(x) * 1).detach().numpy(), atol=1e-6)  # (the oracle stepped once)
    assert float(model.count) == 0.0  # the user's model as it was
    (note,) = [n for n in report.results.oracle.notes if "writes to its own state" in n]
    assert "(count)" in note and "starts from the state the oracle started from" in note
