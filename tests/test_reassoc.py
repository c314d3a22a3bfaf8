"""The plain-sequential run that measures how far another summation order can drift."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import rlx_nb
from rlx_nb.backends import sequential as reassoc
from rlx_nb.backends.known_bugs import known_bug
from rlx_nb.backends.registry import get_backend
from rlx_nb.backends.sequential import CountReductions, SequentialSums, sequential_sum
from rlx_nb.models import demo
from rlx_nb.verdict.types import ROUNDOFF
from tests.conftest import require_live


def _left_to_right(x: np.ndarray, dims: list[int]) -> np.ndarray:
    # The definition, one float32 add at a time, terms in memory order.
    kept = [d for d in range(x.ndim) if d not in dims]
    rows = np.transpose(x, kept + dims).reshape(int(np.prod([x.shape[d] for d in kept])), -1)
    out = np.empty(rows.shape[0], np.float32)
    for i, row in enumerate(rows):
        acc = np.float32(0)
        for v in row:
            acc = np.float32(acc + v)
        out[i] = acc
    return out.reshape([x.shape[d] for d in kept])


@pytest.fixture(params=["numba", "numpy"])
def kernel_path(request, monkeypatch):
    if request.param == "numpy":
        monkeypatch.setattr(reassoc, "sequential_kernel", lambda: None)
    return request.param


@pytest.mark.parametrize(
    ("shape", "dims"), [((6, 5, 7), [1]), ((6, 5, 7), [0, 2]), ((4, 3, 8, 8), [0, 2, 3]), ((300,), [0]), ((3, 0), [1])]
)
def test_sequential_sum_adds_left_to_right_in_memory_order(kernel_path, shape, dims, rng):
    # Terms of mixed magnitude, so the order changes the float32 result.
    x = (rng.standard_normal(shape) * 10.0 ** rng.integers(-4, 4, shape)).astype(np.float32)
    got = sequential_sum(torch.from_numpy(x), dims)
    assert got.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy(), _left_to_right(x, dims))
    kept = sequential_sum(torch.from_numpy(x), dims, keepdim=True)
    assert tuple(kept.shape) == tuple(torch.from_numpy(x).sum(dims, keepdim=True).shape)


def test_sequential_sum_differs_from_a_pairwise_sum_where_the_order_matters():
    # 4096 equal terms: ATen's cascade is exact, one accumulator drifts.
    x = torch.full((4096,), 0.1, dtype=torch.float32)
    exact = 4096 * np.float64(np.float32(0.1))
    assert abs(float(x.sum()) - exact) < abs(float(sequential_sum(x, [0])) - exact)
    assert float(sequential_sum(torch.tensor(2.5), [])) == 2.5  # a 0-d "sum" is the value
    assert sequential_sum(torch.tensor(2.5, dtype=torch.float16), []).dtype == torch.float32


def test_a_sum_longer_than_a_block_is_summed_block_by_block_then_pairwise(monkeypatch):
    # One accumulator over 2**26 terms (pytorch#154703's kernel) stops growing past 2**24: that run had widened the
    # budget of a mean of 2**28 floats until Inductor's bug read round-off.  Blocks of SEQUENTIAL_BLOCK, then pairs.
    monkeypatch.setattr(reassoc, "SEQUENTIAL_BLOCK", 4)
    x = torch.arange(1.0, 11.0).reshape(1, 10) * torch.tensor([[1.0], [1e-3]])  # two rows of 10 terms
    blocks = [_left_to_right(x[:, i : i + 4].numpy(), [1]) for i in (0, 4, 8)]
    want = (blocks[0] + blocks[1]) + blocks[2]
    np.testing.assert_array_equal(sequential_sum(x, [1]).numpy(), want)
    monkeypatch.undo()
    big = torch.rand(2**25, generator=torch.Generator().manual_seed(0))
    exact = big.double().sum().item()
    assert abs(float(sequential_sum(big, [0])) - exact) / exact < 8 * 2.0**-24  # (one accumulator: ~0.5 off)


@pytest.mark.slow
def test_a_sum_without_a_cascade_is_suspect_and_a_sequential_run_far_off_is_said():
    class Mean(torch.nn.Module):
        def forward(self, x):
            return x.mean()

    x = torch.randn(2**22, generator=torch.Generator().manual_seed(0)).abs()
    bug = known_bug("fault:sum-no-cascade")
    report = rlx_nb.backend_divergence(Mean(), x, backends=["cpu-nomkldnn", bug], progress=False)
    assert report.suspects == ["fault:sum-no-cascade"]  # (pytorch#154703's kernel: 16 lanes, no cascade)

    class OuterSum(torch.nn.Module):  # a pooled gradient's sum: equal terms in runs of 64 (coherent rounding)
        def forward(self, g):
            return g.sum(0)

    g = torch.rand(128, 64, generator=torch.Generator().manual_seed(1)).repeat_interleave(64, dim=0)
    report = rlx_nb.backend_divergence(OuterSum(), g, backends=["cpu-nomkldnn"], progress=False)
    rec = report.record("cpu-nomkldnn")
    assert rec.judgement.sequential_rmse > 8 * rec.judgement.oracle_rmse
    assert "the budget rests on the sequential-sums run" in rec.note


def test_sequential_sums_only_changes_float32_cpu_reductions():
    x = torch.randn(64, 32)
    with SequentialSums():
        a = x.sum(0)
        b = x.double().sum(0)
        c = (x * 2).relu()
        d = x.sum(0, dtype=torch.float64)
    np.testing.assert_array_equal(a.numpy(), _left_to_right(x.numpy(), [0]))
    h = x.half()
    with SequentialSums():
        e = h.sum(0, dtype=torch.float32)  # half terms into a float32 accumulator
    np.testing.assert_array_equal(e.numpy(), _left_to_right(h.float().numpy(), [0]))
    assert (
        torch.equal(b, x.double().sum(0))
        and torch.equal(c, (x * 2).relu())
        and torch.equal(d, x.sum(0, dtype=torch.float64))
    )


def test_count_reductions_sees_forward_and_backward_reductions():
    lin = torch.nn.Linear(8, 4)
    x = torch.randn(16, 8)
    with CountReductions() as plain:
        torch.nn.functional.gelu(x)
    assert plain.calls == 0
    with CountReductions() as both:
        lin(x).square().sum().backward()  # the loss's sum, and the bias gradient's sum over rows
    assert both.calls >= 2


def test_the_float64_reference_run_counts_what_the_float32_run_would():
    # backend_divergence counts during the fp64 reference run: its float64 reductions and matmuls are the ones
    # the float32 model computes there, forward and backward; a float32-only count there sees none.
    from rlx_nb.backends.sequential import CountCalls

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.GroupNorm(2, 8), torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 4),
        torch.nn.LayerNorm(4),
    )  # fmt: skip
    x = torch.randn(2, 3, 8, 8)

    def count(m: torch.nn.Module, dtype: torch.dtype, counter: CountCalls) -> CountCalls:
        with counter:
            m.to(dtype)(x.to(dtype)).square().sum().backward()
        return counter

    f32 = count(model, torch.float32, CountCalls())
    f64 = count(model, torch.float64, CountCalls(dtypes=(torch.float32, torch.float64)))
    assert f32.calls > 0 and f32.matmuls > 0
    assert (f64.calls, f64.matmuls, f64.ops) == (f32.calls, f32.matmuls, f32.ops)
    assert count(model, torch.float64, CountCalls()).calls == 0


def test_the_oracles_runs_are_not_run_under_the_counting_mode():
    # The oracle's run and its determinism rerun are timed like a backend's: nothing passes their ops through
    # Python.  The fp64 reference run counts, and its counts still decide the sequential-sums run.
    seen: dict[str, bool] = {}

    class Spy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(6, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

            seen[str(x.dtype)] = seen.get(str(x.dtype), False) or any(
                isinstance(m, reassoc.CountReductions) for m in _get_current_dispatch_mode_stack()
            )
            return self.lin(x).sum(-1)

    report = rlx_nb.backend_divergence(Spy(), torch.randn(5, 6), backends=["cpu-nomkldnn"], progress=False)
    assert seen == {"torch.float32": False, "torch.float64": True}
    assert any(
        r.startswith("sequential sums: a second legitimate error (") for r in report.results.environment["extra_runs"]
    )
    assert report.results.sequential is not None


def test_norm_backwards_match_eager_within_round_off():
    # The rewritten LayerNorm / BatchNorm / GroupNorm / softmax backwards are the same maths.
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.BatchNorm2d(8),
        torch.nn.GroupNorm(2, 8),
        torch.nn.Flatten(),
        torch.nn.LayerNorm(8 * 6 * 6),
        torch.nn.Linear(8 * 6 * 6, 10),
        torch.nn.LogSoftmax(-1),
    )
    x = torch.randn(5, 3, 6, 6)
    for train in (False, True):
        model.train(train)
        grads = []
        for scope in (None, SequentialSums):
            model.zero_grad()
            if scope is None:
                out = model(x)
                (out * torch.linspace(-1, 1, 10)).sum().backward()
            else:
                with scope():
                    out = model(x)
                    (out * torch.linspace(-1, 1, 10)).sum().backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        for name, g in grads[0].items():
            torch.testing.assert_close(grads[1][name], g, rtol=1e-4, atol=1e-5, msg=name)


def test_the_run_carries_a_sequential_run_when_there_are_reductions_to_change():
    model, inputs = demo.mlp(0)
    fwd = rlx_nb.run(model, inputs, backends=["cpu-nomkldnn"], progress=False)
    assert fwd.sequential is not None  # the Linear layers' products, summed in two halves
    elementwise = rlx_nb.run(torch.nn.GELU(), inputs, backends=["cpu-nomkldnn"], progress=False)
    assert elementwise.sequential is None  # nothing it would sum differently
    bwd = rlx_nb.run(model, inputs, backends=["cpu-nomkldnn"], backward=True, progress=False)
    assert bwd.sequential is not None and "grad:fc2.bias" in bwd.sequential.outputs


def _fast_path_encoder():
    # PyTorch's inference fast path (eval, no grad, batch_first): one fused aten op for the whole layer,
    # which a torch-function mode turns off.
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    return layer, (torch.randn(2, 16, 64),)


def _fast_path_attention():
    torch.manual_seed(0)
    attention = torch.nn.MultiheadAttention(64, 4, batch_first=True)
    x = torch.randn(2, 16, 64)
    return attention, (x, x, x)


@pytest.mark.parametrize("family", ["mlp", "conv", "transformer", "fast-path-encoder", "fast-path-attention"])
def test_counting_changes_nothing_and_without_the_rerun_the_oracle_counts(family):
    # The counting run (the determinism rerun, or the oracle itself with check_determinism=False)
    # gives the oracle's outputs bit for bit -- including PyTorch's fused inference fast paths, which a
    # torch-function mode had turned off, so a plain TransformerEncoderLayer was called
    # nondeterministic -- and both ways run the same helper runs.
    make = {"fast-path-encoder": _fast_path_encoder, "fast-path-attention": _fast_path_attention}
    model, inputs = make[family]() if family in make else getattr(demo, family)(0)
    for backward in (False, True):
        full = rlx_nb.run(model, inputs, backends=["cpu-nomkldnn"], backward=backward, progress=False)
        lean = rlx_nb.run(
            model, inputs, backends=["cpu-nomkldnn"], backward=backward, progress=False, check_determinism=False
        )
        assert full.environment["nondeterministic"] == {} and lean.environment["nondeterministic"] == {}
        assert (lean.sequential is None) == (full.sequential is None), (family, backward)
        assert lean.anchors.keys() == full.anchors.keys(), (family, backward)
        assert lean.anchors  # every family makes matmul/convolution calls
        if not family.startswith("fast-path"):  # (a fused inference kernel has no product it could re-sum)
            assert lean.sequential is not None  # matrix products (and reductions) to re-sum
        assert lean.oracle.outputs.keys() == full.oracle.outputs.keys()
        for name, leaf in full.oracle.outputs.items():
            np.testing.assert_array_equal(lean.oracle.outputs[name].value, leaf.value, err_msg=f"{family} {name}")


def test_a_model_without_matmuls_runs_no_anchors():
    model = torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.GELU())
    for check in (True, False):
        results = rlx_nb.run(
            model, torch.randn(4, 16), backends=["cpu-nomkldnn"], progress=False, check_determinism=check
        )
        assert results.anchors == {}


def test_inductor_sums_a_batchnorm_bias_gradient_like_the_sequential_run():
    # The case that needed it: Inductor's BatchNorm-bias gradient on the conv net is far beyond
    # the oracle's error (which an oracle-only budget would call a bug), and it is what one
    # sequential accumulator gives, so the measured budget calls it round-off.
    require_live("cpu-inductor")
    model, inputs = demo.conv(0)
    report = rlx_nb.backend_divergence(model, inputs, backends=["cpu-inductor"], backward=True, progress=False)
    rec = report.record("cpu-inductor", "grad:features.4.bias")
    assert rec.judgement.backend_max_err > 8 * rec.judgement.oracle_max_err
    assert rec.judgement.sequential_max_err > rec.judgement.backend_max_err / 2
    assert rec.verdict == ROUNDOFF and rec.judgement.excess <= 1.0


def test_a_failing_sequential_run_falls_back_to_the_length_guess_and_says_so(monkeypatch):
    def broken(args, kwargs, out):
        raise RuntimeError("no plain kernel here")

    monkeypatch.setitem(reassoc._SEQUENTIAL, torch.ops.aten.sum.dim_IntList, broken)
    model, inputs = demo.mlp(0)
    report = rlx_nb.backend_divergence(model, inputs, backends=["cpu-nomkldnn"], backward=True, progress=False)
    assert report.results.sequential.grad_status == "error"  # the forward ran; its backward did not
    assert "grad:fc2.bias" not in report.results.sequential.outputs
    assert "no plain kernel here" in report.results.environment["sequential_failed"]
    rec = report.record("cpu-nomkldnn", "grad:fc2.bias")
    assert rec.verdict == ROUNDOFF and "guessed from the sum's length" in rec.note
    assert rec.judgement.sequential_max_err != rec.judgement.sequential_max_err  # NaN: not measured


def test_an_eager_run_never_imports_dynamo_and_a_compiling_one_still_compiles():
    # TorchDispatchMode's own wrapper imported torch._dynamo (2.6 s) on the first counted op of every
    # process; rlx_nb's modes only turn dynamo off once it is imported (QuietDispatchMode).  A large float64
    # pointwise result's shape and dtype, worked out by torch's meta kernels (Python: torch._refs), imported dynamo
    # and sympy too (1.6 s of the first report on a transformer block).
    import subprocess
    import sys

    code = (
        "import sys, torch, rlx_nb\n"
        "m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))\n"
        "x = torch.randn(4, 8)\n"
        "res = rlx_nb.run(m, x, backends=['cpu-nomkldnn'], backward=True, progress=False)\n"
        "assert res.sequential is not None and res.anchors, 'the counting mode saw no op'\n"
        "big = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.GELU())  # (float64 results past 4 MB)\n"
        "res = rlx_nb.run(big, torch.randn(1100, 64), backends=['cpu-nomkldnn'], progress=False)\n"
        "assert res.reference.status == 'ok', res.reference.message\n"
        "print('eager', 'torch._dynamo' in sys.modules, 'sympy' in sys.modules)\n"
        "res = rlx_nb.run(m, x, backends=['cpu-inductor'], progress=False)\n"
        "print('compiling', 'torch._dynamo' in sys.modules, res.candidates['cpu-inductor'].status)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.split("\n")
    assert "eager False False" in lines, out.stdout
    if get_backend("cpu-inductor").live:
        assert "compiling True ok" in lines, out.stdout


def test_the_counting_modes_turn_dynamo_off_once_it_is_imported():
    import torch._dynamo

    seen = []

    class Probe(reassoc.QuietDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(torch._dynamo.is_compiling())
            return func(*args, **(kwargs or {}))

    compiled = torch.compile(lambda x: (x * 2).sum(0), backend="eager")
    with Probe(), CountReductions() as counting:
        y = compiled(torch.ones(4, 3))
    torch.testing.assert_close(y, torch.full((3,), 8.0))
    assert counting.calls == 1 and seen and not any(seen)


def test_the_sequential_run_reorders_convolutions_and_matrix_products_forward_and_backward():
    # Its error had equalled the oracle's on every output of convolutional models, forward and backward:
    # convolutions and matrix products were left to the library, so the budget knew one order.
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.GELU(), torch.nn.Conv2d(16, 8, 3), torch.nn.Flatten(),
        torch.nn.Linear(8 * 14 * 14, 10),
    )  # fmt: skip
    x = torch.randn(4, 3, 16, 16)
    report = rlx_nb.backend_divergence(model, x, backends=["cpu-nomkldnn"], backward=True, progress=False)
    for output in ("out", "grad:0.weight", "grad:2.weight", "grad:4.weight", "grad:2.bias"):
        rec = report.record("cpu-nomkldnn", output)
        assert (
            rec.judgement.sequential_rmse == rec.judgement.sequential_rmse
            and rec.judgement.sequential_rmse != rec.judgement.oracle_rmse
        ), output
    sequential = report.results.sequential.outputs["out"].value
    assert not np.array_equal(sequential, report.results.oracle.outputs["out"].value)
