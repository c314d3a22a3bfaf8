"""Training divergence (#64): legitimate training backends read round-off over many steps; planted bugs are found at
their step and phase, down to the op (forward, backward), the buffers (BatchNorm's running statistics) or the
parameters an optimizer update gets wrong, including one the loss curve alone cannot see."""

from __future__ import annotations

import math

import pytest
import torch

import rlx_nb
from rlx_nb.backends.faults import fault_backend
from rlx_nb.errors import InputError
from tests.interrupts import differences, torch_state


def _mse(m, b):
    return torch.nn.functional.mse_loss(m(b[0]), b[1])


def _xent(m, b):
    return torch.nn.functional.cross_entropy(m(b[0]), b[1])


def _mlp(drop: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Dropout(drop), torch.nn.Linear(32, 1))


def _data(n: int = 4) -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)) for _ in range(n)]


def _cnn() -> tuple[torch.nn.Module, list]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(8 * 6 * 6, 4))  # fmt: skip
    g = torch.Generator().manual_seed(1)
    return model, [(torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(4)]


def _sgd(p):
    return torch.optim.SGD(p, lr=0.05, momentum=0.9)


def test_legitimate_training_backends_read_round_off_with_dropout_under_a_fixed_seed():
    # The compiled step (its dropout masks drawn as eager's), the compiled optimizer, oneDNN off, another thread
    # count, and AdamW's foreach, for-loop and fused implementations: every local step within round-off.
    report = rlx_nb.training_divergence(_mlp(0.1), _data(), _mse, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
                                        steps=24, progress=False)  # fmt: skip
    assert report.failed == {}, report.failed
    assert report.suspects == [], report.local[report.local.verdict != "round-off"].to_string()
    local = report.local
    assert set(local.backend) == set(report.backends) and set(local.verdict) == {"round-off"}
    assert set(local.step) >= {0, 1, 2, 4, 8, 16, 23}  # (the first, log-spaced ones, the last)
    steps = report.steps
    assert len(steps) == 24 * len(report.backends) and steps.line.notna().all()
    assert all(ln.split(" vs ")[1].split(":")[1].strip().startswith("round-off") for ln in report.lines()), (
        report.lines()
    )


def test_batchnorms_running_variance_momentum_is_found_in_the_buffers_at_its_module():
    model, images = _cnn()

    def bn_momentum_off(module, inputs):
        saved = {}
        for mod in module.modules():
            if isinstance(mod, torch.nn.BatchNorm2d):
                saved[mod], mod.momentum = mod.momentum, mod.momentum * 1.01
        try:
            return module(*inputs)
        finally:
            for mod, v in saved.items():
                mod.momentum = v

    rlx_nb.register_backend("test-bn-momentum", bn_momentum_off, replace=True, default=False)
    try:
        report = rlx_nb.training_divergence(model, images, _xent, optimizer=_sgd, steps=8,
                                            backends=["test-bn-momentum", "optimizer:foreach"], progress=False)  # fmt: skip
        found = report.localize("test-bn-momentum")
    finally:
        rlx_nb.unregister_backend("test-bn-momentum")
    assert report.suspects == ["test-bn-momentum"]
    assert report.first_suspect_step("test-bn-momentum") == 0
    assert found.phase == "buffers" and found.culprit == "1 (running statistics)", found
    assert any("running_mean" in t or "running_var" in t for t in found.tensors)


def test_one_ops_backward_off_by_1e_4_is_found_in_the_backward_at_its_op():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.LayerNorm(32), torch.nn.GELU(), torch.nn.Linear(32, 5))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 8, generator=g), torch.randint(0, 5, (16,), generator=g)) for _ in range(4)]
    fault = fault_backend("fault:layernorm-backward", 1e-4)
    rlx_nb.register_backend(fault.name, fault.fn, replace=True, default=False)
    try:
        report = rlx_nb.training_divergence(model, data, _xent, optimizer=lambda p: torch.optim.SGD(p, lr=0.05),
                                            steps=6, backends=[fault.name], progress=False)  # fmt: skip
        assert report.suspects == [fault.name]
        found = report.localize(fault.name)
    finally:
        rlx_nb.unregister_backend(fault.name)
    assert found.phase == "backward" and found.culprit == "1 :: F.layer_norm", found
    assert found.localization is not None and "layer_norm" in str(found)


class _HeadDecayTooStrong(torch.optim.AdamW):
    # The head's weight decay 5% too strong from step FROM on: 1.5e-5 of each weight per step, inside the loss curve's
    # chaos but about 250x float32's unit round-off in the step's own update.
    FROM = 10

    def step(self, closure=None):
        out = super().step(closure)
        with torch.no_grad():
            head = self.param_groups[0]["params"][-2]
            state = self.state.get(head, {})
            if state and float(state["step"]) > self.FROM:
                head.mul_(1 - self.param_groups[0]["lr"] * self.param_groups[0]["weight_decay"] * 0.05)
        return out


def test_an_optimizer_bug_inside_the_chaos_is_found_at_its_first_step_in_the_optimizer_update():
    def adamw(p):
        return torch.optim.AdamW(p, lr=3e-3, weight_decay=0.1)

    rlx_nb.register_training_backend("test-decay", optimizer=lambda p: _HeadDecayTooStrong(p, lr=3e-3, weight_decay=0.1),
                                     replace=True)  # fmt: skip
    report = rlx_nb.training_divergence(_mlp(), _data(), _mse, optimizer=adamw, steps=20,
                                        backends=["test-decay", "optimizer:foreach"], progress=False)  # fmt: skip
    assert report.suspects == ["test-decay"]
    # (the local steps 8 and 16 bracket it: the steps between are bisected to the first one past the line)
    assert report.first_suspect_step("test-decay") == _HeadDecayTooStrong.FROM
    found = report.localize("test-decay")
    assert found.phase == "optimizer" and found.culprit == "_HeadDecayTooStrong.step :: 3.weight", found
    # The local steps see it at its first step; its trajectory leaves the envelope no earlier (over 20 steps of an MLP
    # there is little chaos to hide in: notebook 10 shows a transformer LM's, where the loss curve stays inside).
    assert report.leaving.get("test-decay", math.inf) >= _HeadDecayTooStrong.FROM


class _DecayIntoTheGradients(torch.optim.Optimizer):
    # A hand-written SGD with weight decay the way many are written: into the gradient, in place.
    TOO_STRONG = 1.0

    def __init__(self, params, lr=0.05, wd=0.01):
        super().__init__(params, {"lr": lr, "wd": wd})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.add_(p, alpha=group["wd"] * self.TOO_STRONG)
                    p.add_(p.grad, alpha=-group["lr"])


class _DecayTooStrongIntoTheGradients(_DecayIntoTheGradients):
    TOO_STRONG = 1.05


def test_a_kept_step_starts_from_the_oracles_state_and_its_gradients_are_the_backwards_own():
    # The oracle's judged steps are its trajectory's own (no copy of its state) and a step kept past the line keeps
    # its state as the oracle trained again to it.  What that must not lose: the gradients of an optimizer that
    # writes into them (the judge sees the backward's, not the update's), the kept state (the oracle's at that step,
    # bit for bit), and the caller's model, trained on after the call, which the kept state must not follow.
    model, data = _mlp(), _data()
    rlx_nb.register_training_backend("test-decay-in-grads", optimizer=_DecayTooStrongIntoTheGradients,
                                     replace=True)  # fmt: skip
    report = rlx_nb.training_divergence(model, data, _mse, optimizer=lambda p: _DecayIntoTheGradients(p), steps=6,
                                        backends=["test-decay-in-grads", "threads"], progress=False)  # fmt: skip
    assert report.suspects == ["test-decay-in-grads"] and report.first_suspect_step("test-decay-in-grads") == 0
    assert set(report.local[report.local.backend == "threads"].verdict) == {"round-off"}
    kept = sorted(s for b, s in report.kept if b == "test-decay-in-grads")
    assert kept[:2] == [0, 1], kept
    with torch.no_grad():  # (the caller trains their model on: the report's kept states are its own)
        for p in model.parameters():
            p.mul_(0.5)
    step = kept[1]
    trained, opt = _mlp(), None
    opt = _DecayIntoTheGradients(list(trained.parameters()))
    for t in range(step + 1):  # (the oracle's steps, by hand: up to the kept step's, then that step's backward)
        torch.manual_seed(t)
        opt.zero_grad(set_to_none=True)
        loss = _mse(trained, data[t % len(data)])
        loss.backward()
        if t < step:
            opt.step()
    state = report.kept[("test-decay-in-grads", step)][1].resolved()
    assert all(torch.equal(a, b) for a, b in zip(state.model.parameters(), trained.parameters(), strict=True))
    local = report.local_report("test-decay-in-grads", step)
    for name, p in trained.named_parameters():
        assert torch.equal(torch.from_numpy(local.results.oracle.outputs[f"grad:{name}"].value), p.grad), name
    assert report.localize("test-decay-in-grads", step).phase == "optimizer"


def test_a_forward_op_wrong_from_step_k_is_found_at_that_step_at_its_op():
    # A runtime whose GELU goes wrong (the tanh approximation) once BatchNorm has counted K batches:
    # state the model carries, so a local step starting from step s's state sees s of them.  The runtime keeps what it
    # last saw for the parts a localization runs alone (they hold no BatchNorm).
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.GELU(), torch.nn.Flatten(),
                                torch.nn.Linear(8 * 6 * 6, 4))  # fmt: skip
    _, images = _cnn()
    k, wrong, seen = 5, fault_backend("fault:gelu-approx", 1.0), {"late": False}

    def gelu_wrong_late(module, inputs):
        counts = [int(m.num_batches_tracked) for m in module.modules() if isinstance(m, torch.nn.BatchNorm2d)]
        if counts:
            seen["late"] = counts[0] >= k
        return (wrong.fn if seen["late"] else (lambda m, x: m(*x)))(module, inputs)

    rlx_nb.register_backend("test-late-gelu", gelu_wrong_late, replace=True, default=False)
    try:
        report = rlx_nb.training_divergence(model, images, _xent, optimizer=_sgd, steps=12,
                                            backends=["test-late-gelu"], progress=False)  # fmt: skip
        assert report.suspects == ["test-late-gelu"]
        assert report.first_suspect_step("test-late-gelu") == k
        found = report.localize("test-late-gelu")
    finally:
        rlx_nb.unregister_backend("test-late-gelu")
    assert found.phase == "forward" and found.culprit == "2 :: F.gelu", found


def test_a_hugging_face_model_from_a_config_trains_on_kwargs_batches_with_its_own_loss():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=32)
    model = transformers.GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(2):
        ids = torch.randint(0, 64, (2, 12), generator=g)
        batches.append({"input_ids": ids, "labels": ids})
    report = rlx_nb.training_divergence(model, batches, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), steps=4,
                                        backends=["optimizer:foreach", "cpu-nomkldnn"], progress=False)  # fmt: skip
    assert report.suspects == [] and report.failed == {}, report.local.to_string()
    assert all(math.isfinite(x) for x in report.oracle_losses) and len(report.oracle_losses) == 4


def test_bad_input_is_refused_with_what_is_allowed():
    model, data = _mlp(), _data()

    def sgd(p):
        return torch.optim.SGD(p, lr=0.1)

    def call(**kw):
        args = {"model": model, "batches": data, "loss_fn": _mse, "optimizer": sgd, "steps": 3,
                "backends": ["optimizer:foreach"], "progress": False, **kw}  # fmt: skip
        return rlx_nb.training_divergence(args.pop("model"), args.pop("batches"), args.pop("loss_fn"), **args)

    with pytest.raises(InputError, match="steps must be a whole number of steps >= 1; got 0"):
        call(steps=0)
    with pytest.raises(InputError, match="optimizer must be a factory"):
        call(optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(InputError, match=r"must return a torch\.optim\.Optimizer; it returned int"):
        call(optimizer=lambda p: 3)
    with pytest.raises(InputError, match="got one Tensor"):
        call(batches=torch.randn(4, 8))
    with pytest.raises(InputError, match="batches ran out after 2 of the 3 steps"):
        call(batches=iter(data[:2]))
    with pytest.raises(InputError, match=r"unknown training backend 'optimizer:foreech'.*optimizer:foreach"):
        call(backends=["optimizer:foreech"])
    with pytest.raises(InputError, match=r"local_steps \[7\] are outside the 3 steps"):
        call(local_steps=[7])

    def in_place(m, b):
        b[0].mul_(1.0001)  # (the batch changed by its own loss: the next run of the step sees another)
        return _mse(m, b)

    with pytest.raises(InputError, match="step 0 changed its batch in place"):
        call(loss_fn=in_place, batches=[tuple(t.clone() for t in b) for b in data])

    class Growing(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 1)

        def forward(self, x):
            if self.training:  # (a model that adds a parameter as it trains)
                self.extra = torch.nn.Parameter(torch.zeros(1))
            return self.fc(x)

    with pytest.raises(InputError, match=r"parameters changed between steps \(at step 0: extra absent -> \(1,\)"):
        call(model=Growing())


class _LateNoise(torch.nn.Module):
    # A model that draws random numbers from its fourth forward on (a schedule turning noise on).
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 1)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        y = self.lin(x)
        return y + 1e-3 * torch.rand_like(y) if self.calls > 3 else y


def test_the_envelopes_run_on_another_thread_count_steps_beside_a_one_ulp_run_and_reads_the_same(monkeypatch):
    # On two threads the run on another thread count runs on one, and a one-ulp run steps beside it on the other
    # core, on one thread too.  Stepping them at once changes no bit: every figure is the one the same two runs give
    # one after the other on the same thread counts.  A step of the pair that drew random numbers (dropout from the
    # first step, noise from the fourth) starts the envelope again one run at a time: the call reads as unpaired.
    from rlx_nb._support import switches
    from rlx_nb.training import paired

    real_step, real_pair = paired.step_pair, paired.pair_of
    outcomes: list = []

    def counted(*args):
        outcomes.append(real_step(*args))
        return outcomes[-1]

    def one_after_the_other(pair, spec, step, batch, step_of):
        alone, other = pair
        with switches.flipped(threads=alone.backend.threads):
            return {alone.name: step_of(alone, spec, step, batch), other.name: step_of(other, spec, step, batch)}

    ways = {"paired": (real_pair, counted), "one after the other": (real_pair, one_after_the_other),
            "unpaired": (lambda runs, model: None, counted)}  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for name, make, drew_at in (("plain", _mlp, None), ("dropout", lambda: _mlp(0.1), 0),
                                    ("noise from step 3", lambda: _LateNoise(), 3)):  # fmt: skip
            seen = {}
            for way, (pair_of, step_pair) in ways.items():
                monkeypatch.setattr(paired, "pair_of", pair_of)
                monkeypatch.setattr(paired, "step_pair", step_pair)
                outcomes.clear()
                report = rlx_nb.training_divergence(make(), _data(), _mse, steps=10, progress=False,
                                                    optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
                                                    backends=["optimizer:foreach"])  # fmt: skip
                assert torch.get_num_threads() == 2
                seen[way] = (report.steps, [o is not None for o in outcomes])
            assert seen["unpaired"][1] == [], name
            steps, stepped = seen["paired"]
            assert steps.loss_envelope.max() > 0 and steps.param_envelope.iloc[-1] > 0, name
            if drew_at is None:
                assert stepped == [True] * 10, name
                assert steps.equals(seen["one after the other"][0]), name
            else:
                assert stepped == [True] * drew_at + [False], (name, stepped)
                assert steps.equals(seen["unpaired"][0]), name
    finally:
        torch.set_num_threads(threads)


def test_ctrl_c_keeps_the_steps_already_judged_and_torch_as_it_was():
    model, data = _mlp(), _data()
    calls = []

    def interrupting(m, b):
        calls.append(1)
        if len(calls) == 120:  # (after the envelope's 3 runs of 30 steps: inside the oracle's and backends')
            raise KeyboardInterrupt
        return _mse(m, b)

    # (torch's own first compile in this process sets itself up: Dynamo's hooks, Inductor's variables)
    rlx_nb.training_divergence(model, data, _mse, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), steps=1,
                               backends=["cpu-inductor"], progress=False)  # fmt: skip
    before = torch_state()
    with pytest.raises(KeyboardInterrupt):
        rlx_nb.training_divergence(model, data, interrupting, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), steps=30,
                                   backends=["cpu-inductor", "optimizer:foreach"], progress=False)  # fmt: skip
    assert differences(before, torch_state()) == {}
    kept = rlx_nb.interrupted_training()
    assert kept is not None and kept.incomplete.startswith("interrupted at step ")
    judged = len(kept.oracle_losses)
    assert 0 < judged < 30 and f"interrupted at step {judged} of 30" == kept.incomplete
    assert set(kept.steps.step) <= set(range(judged + 1)) and len(kept.local) > 0


def test_the_pictures_and_the_html_report_show_the_steps_the_envelope_and_the_local_steps(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    rlx_nb.register_training_backend("test-decay", optimizer=lambda p: _HeadDecayTooStrong(p, lr=3e-3, weight_decay=0.1),
                                     replace=True)  # fmt: skip
    report = rlx_nb.training_divergence(_mlp(), _data(), _mse, optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3,
                                        weight_decay=0.1), steps=14, backends=["test-decay", "optimizer:foreach"],
                                        progress=False)  # fmt: skip
    top = report.plot()
    assert top.get_ylabel() == "loss" and top.collections, "the loss curves with the envelope as a band"
    (below,) = [ax for ax in top.figure.axes if ax is not top]
    assert below.get_yscale() == "log" and "line" in below.get_ylabel()  # (the distance, on the line's scale)
    from matplotlib.colors import to_rgba

    from rlx_nb.plot.style import SUSPECT_COLOUR

    red = to_rgba(SUSPECT_COLOUR)
    assert any(tuple(c.get_facecolor()[0]) == red for c in below.collections), "the local step past the line, marked"
    path = report.to_html(tmp_path / "training.html")
    text = path.read_text()
    assert "test-decay" in text and "SUSPECT" in text and "<img" in text
    assert "SUSPECT" in report._repr_html_()


_TARGET = """
import torch


def _mse(m, b):
    return torch.nn.functional.mse_loss(m(b[0]), b[1])


class DecayTooStrong(torch.optim.SGD):
    def step(self, closure=None):
        out = super().step(closure)
        with torch.no_grad():
            self.param_groups[0]["params"][0].mul_(1 - 1e-5)
        return out


def job():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)) for _ in range(3)]
    return {"model": model, "batches": data, "loss_fn": _mse, "optimizer": lambda p: torch.optim.SGD(p, lr=0.1)}


def not_a_job():
    return (1, 2)
"""


def test_the_cli_and_the_pytest_helper_gate_on_a_local_step_past_the_line(tmp_path, capsys):
    from rlx_nb import cli
    from rlx_nb.testing import assert_training_agrees

    target = tmp_path / "job.py"
    target.write_text(_TARGET)
    assert cli.main(["train", f"{target}:job", "--steps", "6", "--backends", "optimizer:foreach,cpu-nomkldnn",
                     "--html", str(tmp_path / "t.html")]) == cli.EXIT_OK  # fmt: skip
    out = capsys.readouterr().out
    assert "optimizer:foreach vs cpu over 6 step(s): round-off" in out and (tmp_path / "t.html").exists()

    import importlib.util

    spec = importlib.util.spec_from_file_location("rlx_nb_test_job", target)
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    rlx_nb.register_training_backend("test-job-decay", optimizer=lambda p: job.DecayTooStrong(p, lr=0.1), replace=True)
    assert cli.main(["train", f"{target}:job", "--steps", "6", "--backends", "test-job-decay"]) == cli.EXIT_SUSPECT
    assert "test-job-decay vs cpu over 6 step(s): SUSPECT" in capsys.readouterr().out
    assert cli.main(["train", f"{target}:not_a_job", "--steps", "2"]) == cli.EXIT_USAGE
    assert "must return a dict with model, batches, optimizer" in capsys.readouterr().err
    assert cli.main(["train", f"{target}:job", "--steps", "0"]) == cli.EXIT_USAGE

    parts = job.job()
    kept = assert_training_agrees(parts["model"], parts["batches"], parts["loss_fn"], optimizer=parts["optimizer"],
                                  steps=4, backends=["optimizer:foreach"])  # fmt: skip
    assert kept.suspects == []
    with pytest.raises(AssertionError, match="training backends past the line at a local step: test-job-decay"):
        assert_training_agrees(parts["model"], parts["batches"], parts["loss_fn"], optimizer=parts["optimizer"],
                               steps=4, backends=["test-job-decay"])  # fmt: skip


def test_the_explorer_goes_from_a_local_step_to_an_output_to_the_element():
    pytest.importorskip("ipywidgets")
    rlx_nb.register_training_backend("test-decay", optimizer=lambda p: _HeadDecayTooStrong(p, lr=3e-3, weight_decay=0.1),
                                     replace=True)  # fmt: skip
    report = rlx_nb.training_divergence(_mlp(), _data(), _mse, optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3,
                                        weight_decay=0.1), steps=14, backends=["test-decay"], progress=False)  # fmt: skip
    explorer = rlx_nb.explore(report)
    assert explorer.pickers["backend"].value == "test-decay" and explorer.pickers["step"].value == 10
    assert explorer.output_picker.value == "param:3.weight"  # (the output past the line, worst first)
    assert [v for _, v in explorer.pickers["step"].options] == sorted(s for b, s in report.kept if b == "test-decay")
    explorer.pickers["step"].value = max(s for b, s in report.kept)
    assert explorer.report is report.local_report("test-decay", max(s for b, s in report.kept))
    assert "error" in explorer.inspector.value  # (its worst element, inspected against float64's)
    shot = explorer.snapshot()["text/html"]
    assert "test-decay vs cpu over 14 step(s): SUSPECT" in shot and "step: <code>" in shot


def test_the_norms_of_a_step_are_within_a_few_float32_ulps_of_exact_on_millions_of_elements():
    # A float32 norm of a whole large tensor accumulates over millions of terms: 0.5% off on the difference of two
    # runs' parameters (8.4M elements), which swamped the difference of two runs' gradient norms.
    from rlx_nb.training.step import l2_distance, l2_norm

    g = torch.Generator().manual_seed(0)
    a = [torch.randn(2048, 4096, generator=g), torch.randn(4097, generator=g) * 1e3, torch.randn(3, 5, generator=g)]
    b = [t + 1e-6 for t in a]  # (differences of a few ulps: many the same, the hard case for an accumulation)

    def exact(ts):
        return math.sqrt(sum(float(t.double().square().sum()) for t in ts))

    assert abs(l2_norm(a) / exact(a) - 1) < 1e-7  # (one float32 norm a tensor: 5.3e-7 here)
    difference = [x.double() - y.double() for x, y in zip(a, b, strict=True)]
    assert abs(l2_distance(a, b) / exact(difference) - 1) < 1e-7  # (4.9e-4 here)
    assert l2_distance(a, a) == 0.0 and l2_norm([torch.zeros(0)]) == 0.0
    # (the float64 reference's norms in float64, a bfloat16 run's in float32)
    assert abs(l2_norm([t.double() for t in a]) / exact(a) - 1) < 1e-12
    assert abs(l2_norm([t.bfloat16() for t in a]) / exact([t.bfloat16() for t in a]) - 1) < 1e-7


def test_a_local_step_whose_float64_reference_fails_reads_error_not_a_tolerances_verdict(monkeypatch):
    # Without its float64 reference a step would be judged against a fixed tolerance (2e-3 relative), where a bug
    # 250x float32's round-off reads within it: the reading says the reference failed instead.
    from rlx_nb.training import local

    def failing():
        raise RuntimeError("no float64 here")

    monkeypatch.setattr(local, "float64_kernels", failing)
    report = rlx_nb.training_divergence(_mlp(), _data(), _mse, optimizer=_sgd, steps=2, backends=["optimizer:foreach"],
                                        progress=False)  # fmt: skip
    assert set(report.local.verdict) == {"error"}, report.local.to_string()
    assert all("float64 reference failed: RuntimeError: no float64 here" in r for r in report.local.reason)


_OPTIMIZERS = {  # (every elementwise optimizer of torch, with the options that add state or change its arithmetic)
    "SGD": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "Adam": lambda p: torch.optim.Adam(p, lr=1e-3, weight_decay=0.01, amsgrad=True),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=1e-3, maximize=True),
    "Adamax": lambda p: torch.optim.Adamax(p, weight_decay=0.1),
    "NAdam": lambda p: torch.optim.NAdam(p, decoupled_weight_decay=True, weight_decay=0.1),
    "RAdam": lambda p: torch.optim.RAdam(p, decoupled_weight_decay=True, weight_decay=0.1),
    "RMSprop": lambda p: torch.optim.RMSprop(p, momentum=0.5, centered=True),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr_decay=0.01),
    "Adadelta": lambda p: torch.optim.Adadelta(p, weight_decay=0.1),
    "ASGD": lambda p: torch.optim.ASGD(p, t0=1),
    "Rprop": lambda p: torch.optim.Rprop(p),
}


@pytest.mark.parametrize("name", sorted(_OPTIMIZERS))
def test_the_float64_references_update_a_piece_at_a_time_is_the_whole_updates_bit_for_bit(name):
    # The local step's float64 reference converts each parameter's optimizer state as its update comes to it, in
    # pieces of PIECE elements (rlx_nb.training.reference): the parameters after it are those of the update with the
    # whole state converted first, bit for bit, for a parameter cut in pieces (one of 1.1 PIECEs), a small one and a
    # 0-d one, from a state three steps in.
    from rlx_nb.training.local import for_loop
    from rlx_nb.training.reference import PIECE, PiecewiseUpdate
    from rlx_nb.training.step import ELEMENTWISE, State, checked_spec

    make = _OPTIMIZERS[name]
    assert getattr(torch.optim, name) in ELEMENTWISE
    torch.manual_seed(0)
    big = torch.nn.Parameter(torch.randn(PIECE // 1000 + 100, 1000) * 0.1)
    small, scalar = torch.nn.Parameter(torch.randn(7, 3)), torch.nn.Parameter(torch.tensor(0.5))
    model = torch.nn.ParameterList([big, small, scalar])

    def loss_of(m, x):
        return (m[0] * x).sin().sum() + (m[1] * x[:7, :3]).square().sum() * m[2]

    x = torch.randn(big.shape)
    opt = make(list(model.parameters()))
    for _ in range(3):
        opt.zero_grad()
        loss_of(model, x).backward()
        opt.step()
    spec = checked_spec(model, [x], loss_of, make, 1)
    assert spec.elementwise
    state = State(model, opt.state_dict())

    def update(piecewise: bool) -> list[torch.Tensor]:
        m, o = state.start(spec, dtype=torch.float64, load=not piecewise)
        o = PiecewiseUpdate(for_loop(o), state.optimizer) if piecewise else for_loop(o)
        loss_of(m, x.double()).backward()
        o.step()
        return [p.detach() for p in m.parameters()]

    whole, pieces = update(False), update(True)
    assert all(p.dtype == torch.float64 for p in pieces)
    assert all(torch.equal(a, b) for a, b in zip(whole, pieces, strict=True)), name
    assert not torch.equal(pieces[0], big.detach().double())  # (the update moved every piece)


def test_an_optimizer_whose_update_is_not_elementwise_has_its_whole_state_converted():
    from rlx_nb.training.reference import PiecewiseUpdate
    from rlx_nb.training.step import checked_spec

    class Mine(torch.optim.SGD):  # (a subclass may step otherwise: not taken for elementwise)
        pass

    for make in (lambda p: Mine(p, lr=0.1), lambda p: torch.optim.Adafactor(p, lr=0.01)):
        assert not checked_spec(_mlp(), _data(), _mse, make, 1).elementwise
        with pytest.raises(TypeError, match="not elementwise"):
            PiecewiseUpdate(make(list(_mlp().parameters())), {})
    report = rlx_nb.training_divergence(_mlp(), _data(), _mse, optimizer=lambda p: torch.optim.Adafactor(p, lr=0.01),
                                        steps=3, backends=["optimizer:foreach"], progress=False)  # fmt: skip
    assert set(report.local.verdict) == {"round-off"}, report.local.to_string()


def test_autocast_bfloat16_trains_as_its_own_backend_and_its_local_steps_are_judged_on_bfloat16s_budget():
    # #64 item 1: autocast bf16 "with its own budget".  Its trajectory drifts past float32's envelope (as it
    # should: it rounds to 8 bits); every local step is judged against bfloat16's round-off budget, not float32's.
    report = rlx_nb.training_divergence(_mlp(), _data(), _mse, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
                                        steps=12, backends=["cpu-bf16"], progress=False)  # fmt: skip
    assert report.failed == {} and report.suspects == [], report.local.to_string()
    local = report.local
    assert set(local.verdict) == {"round-off"} and len(local) >= 5
    assert all("bfloat16 round-off budget" in r for r in local.reason), local.reason.tolist()
    assert local.line.max() > 0.01  # (bfloat16's error, measured: not a run that stayed float32)


@pytest.mark.parametrize("make", [lambda p: torch.optim.AdamW(p, lr=1e-2), lambda p: torch.optim.Adafactor(p, lr=1e-2)],
                         ids=["elementwise", "whole-state"])  # fmt: skip
def test_a_float64_models_judged_steps_leave_the_oracles_optimizer_state_as_it_was(make):
    # A float64 model's optimizer state is already in the reference's dtype: converting it was no copy, and the
    # float64 reference's update stepped the oracle's live state in place (its trajectory left the envelope 1.8e4x).
    import copy

    model = _mlp().double()
    data = [tuple(t.double() for t in b) for b in _data()]
    report = rlx_nb.training_divergence(copy.deepcopy(model), data, _mse, optimizer=make, steps=6,
                                        backends=["optimizer:for-loop"], progress=False)  # fmt: skip
    opt, plain = make(list(model.parameters())), []
    for step in range(6):
        opt.zero_grad(set_to_none=True)
        loss = _mse(model, data[step % len(data)])
        plain.append(float(loss))
        loss.backward()
        opt.step()
    assert report.steps.oracle_loss.tolist() == plain  # (bit for bit: the judge moved nothing of the oracle's)
    assert set(report.local.verdict) == {"round-off"}, report.local.to_string()
