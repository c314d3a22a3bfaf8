"""The fp64 reference computes every model: ops PyTorch has no float64 kernel for (``_grouped_mm``: mixture-of-experts
models), and tensors the model makes as it runs (float64 like the rest)."""

from __future__ import annotations

import pytest
import torch

import rlx_nb
from rlx_nb.backends.emulated import RoundMatmulOperands, round_mantissa
from rlx_nb.backends.float64_kernels import Float64Kernels, grouped_mm

F = torch.nn.functional
pytestmark = pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="this torch has no grouped_mm")

OFFS = torch.tensor([8, 8, 20], dtype=torch.int32)  # (an empty group in the middle; rows past 20 unused)
CASES = {
    "2D x 3D": ((24, 8), (3, 8, 12), OFFS),
    "3D x 3D": ((3, 4, 8), (3, 8, 12), None),
    "2D x 2D": ((4, 24), (24, 12), OFFS),
    "3D x 2D": ((3, 4, 8), (8, 24), OFFS),
}


@pytest.mark.parametrize("case", list(CASES))
def test_grouped_mm_in_float64_is_pytorchs_grouped_mm_from_its_definition(case):
    a_shape, b_shape, offs = CASES[case]
    torch.manual_seed(0)
    a, b = torch.randn(a_shape), torch.randn(b_shape)
    native = F.grouped_mm(a, b, offs=offs).double()  # PyTorch's own float32 kernel
    with pytest.raises(RuntimeError, match="Double"):
        F.grouped_mm(a.double(), b.double(), offs=offs)  # what the reference met before
    with Float64Kernels():
        wide = F.grouped_mm(a.double(), b.double(), offs=offs)
    assert wide.dtype == torch.float64 and wide.shape == native.shape
    # (rows, or columns, past offs[-1] are left unwritten by PyTorch's kernel: compared where both are defined)
    used = {"2D x 3D": (slice(0, 20),), "3D x 2D": (slice(None), slice(0, 20))}.get(case, (...,))
    assert torch.allclose(wide[used], native[used], rtol=0, atol=1e-5)
    assert not torch.equal(wide[used], native[used])  # float64 products, not float32 ones cast
    if case == "2D x 3D":  # each group's rows are its own matmul, exactly
        assert torch.equal(wide[:8], a[:8].double() @ b[0].double())
        assert torch.equal(wide[8:20], a[8:20].double() @ b[2].double())
        assert torch.equal(wide[20:], torch.zeros(4, 12, dtype=torch.float64))


def test_other_dtypes_go_to_pytorchs_kernel_bit_for_bit():
    torch.manual_seed(1)
    a, b = torch.randn(24, 8), torch.randn(3, 8, 12)
    with Float64Kernels():
        inside = F.grouped_mm(a, b, offs=OFFS)
    assert torch.equal(inside[:20], F.grouped_mm(a, b, offs=OFFS)[:20])
    with pytest.raises(NotImplementedError, match="needs offs"):
        grouped_mm(a.double(), b.double())


def test_the_precision_anchors_round_the_grouped_matmuls_operands():
    torch.manual_seed(2)
    a, b = torch.randn(24, 8), torch.randn(3, 8, 12)
    with RoundMatmulOperands(8, results=True):
        got = F.grouped_mm(a, b, offs=OFFS)
    expected = round_mantissa(F.grouped_mm(round_mantissa(a, 8), round_mantissa(b, 8), offs=OFFS), 8)
    assert torch.equal(got[:20], expected[:20])
    assert not torch.equal(got[:20], F.grouped_mm(a, b, offs=OFFS)[:20])


def _mixtral():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
    )  # fmt: skip
    return transformers.MixtralForCausalLM(config).eval()


def test_a_mixture_of_experts_model_gets_its_fp64_reference_and_budget_verdicts():
    # Hugging Face's experts run F.grouped_mm on the CPU; in float64 it raised, and every verdict on the model
    # fell back to the fixed tolerance (bfloat16 "SUSPECT" at max_rel 18).
    model = _mixtral()
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    report = rlx_nb.backend_divergence(model, ids, backends=["cpu-bf16", "fault:softmax-row"], progress=False)
    assert report.results.reference.status == "ok", report.results.reference.message
    rows = report.summary
    assert (rows[rows.backend == "cpu-bf16"].verdict == "round-off").all()
    assert report.suspects == ["fault:softmax-row"]
    assert not any("tol_rel" in line for line in report.lines())  # the budget verdicts, not the fixed one

    gen = rlx_nb.generation_divergence(model, ids[:1, :8], max_new_tokens=8, backends=["cpu-bf16"], progress=False)
    assert gen.logits.results.reference.status == "ok"
    assert gen.first_divergence.loc["cpu-bf16", "verdict"] == "round-off"
    assert gen.steps.top2_gap_fp64.notna().all()


def test_a_mixture_of_experts_models_gradients_get_their_fp64_reference():
    # Autograd runs the reference's backward after run_float64's own mode has closed: the grouped matmuls'
    # gradients raised there, and every gradient fell back to the fixed tolerance (Inductor's expert gradient
    # "SUSPECT" at max_rel 0.13, at 0.26 of the SUSPECT line on the budget).
    model = _mixtral()
    ids = torch.randint(0, 256, (4, 12), generator=torch.Generator().manual_seed(0))
    report = rlx_nb.backend_divergence(model, {"input_ids": ids, "labels": ids}, backward=True,
                                       backends=["cpu-nomkldnn", "fault:rmsnorm-backward"], progress=False)  # fmt: skip
    ref, oracle = report.results.reference, report.results.oracle
    assert ref.grad_status == "ok", ref.grad_message
    experts = [k for k in oracle.outputs if k.startswith("grad:") and ".experts." in k]
    assert len(experts) == 4 and set(oracle.outputs) == set(ref.outputs)
    for k in experts:  # the float64 gradient is the float32 one's, to float32's round-off
        want, got = ref.outputs[k].value, oracle.outputs[k].value.astype("float64")
        assert abs(got - want).max() <= 1e-5 * abs(want).max(), k
    assert report.suspects == ["fault:rmsnorm-backward"]
    assert not any("tol_rel" in line for line in report.lines())


class _MakesTensors(torch.nn.Module):
    # Tensors made as it runs, without a dtype: a floor at the dtype's most negative value (XGLM's attention) and
    # a constant.  Under a float32 default the first overflowed in the reference, the second held float32's 0.1.
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8, generator=torch.Generator().manual_seed(3)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.maximum(x @ self.w, torch.full((), torch.finfo(x.dtype).min))
        return y + torch.full((), 0.1)


def test_tensors_the_model_makes_as_it_runs_are_float64_in_the_reference():
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(4))
    before = torch.get_default_dtype()
    report = rlx_nb.backend_divergence(_MakesTensors(), x, backends=["cpu-nomkldnn"], progress=False)
    assert torch.get_default_dtype() == before
    ref = report.results.reference
    assert ref.status == "ok", ref.message
    leaf = next(iter(ref.outputs.values()))
    model = _MakesTensors()
    assert leaf.value.dtype.name == "float64"
    expected = (x.double() @ model.w.detach().double()) + 0.1
    assert (leaf.value == expected.numpy()).all()  # 0.1 itself, not float32's


def test_xglm_gets_its_fp64_reference():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config = transformers.XGLMConfig(vocab_size=256, d_model=64, ffn_dim=128, num_layers=2, attention_heads=4,
                                     max_position_embeddings=256)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.XGLMForCausalLM(config).eval()
    ids = torch.randint(3, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    report = rlx_nb.backend_divergence(model, ids, backends=["cpu-bf16"], progress=False)
    assert report.results.reference.status == "ok", report.results.reference.message
    assert report.suspects == []


def test_large_float64_pointwise_results_take_huge_pages_and_the_same_bits():
    # #62: the reference's float64 temporaries were torch's 4 KB pages, faulted in one at a time (a SiLU then a scale
    # over 5e7 elements: 0.45 s, 0.17 s on huge pages).  The out= overload runs the same kernel: the same bits.
    import rlx_nb.backends.float64_kernels as fk

    x = torch.randn(1024, 1024, dtype=torch.float64)  # (8 MB: past HUGE_COPY_BYTES)
    y = torch.randn(1, 1024, dtype=torch.float64)
    taken = []
    original = fk._huge_result

    def spy(func, args, kwargs):
        got = original(func, args, kwargs)
        taken.append((str(func), got is not None))
        return got

    fk._huge_result = spy
    try:
        cases = [lambda a: torch.nn.functional.silu(a) * 1.5, lambda a: torch.nn.functional.gelu(a, approximate="tanh"),
                 lambda a: torch.exp(a) + y, lambda a: torch.where(a > 0, a, y), lambda a: a.tanh().clamp(-0.5, 0.5)]  # fmt: skip
        for f in cases:
            with fk.Float64Kernels():
                got = f(x)
            assert torch.equal(got, f(x)) and got.dtype == torch.float64
        assert ("aten.silu.default", True) in taken and ("aten.mul.Tensor", True) in taken
        assert ("aten.gelu.default", True) in taken and ("aten.add.Tensor", True) in taken
        taken.clear()
        with fk.Float64Kernels():
            torch.nn.functional.silu(x[:, :8])  # (small, and not contiguous: as it is)
        assert not any(hit for _, hit in taken)
        w = x.clone().requires_grad_()  # (below autograd: a backward through it gives the same gradient, bit for bit)
        with fk.Float64Kernels():
            (torch.nn.functional.silu(w) * 1.5).sum().backward()
        grad, w.grad = w.grad, None
        (torch.nn.functional.silu(w) * 1.5).sum().backward()
        assert torch.equal(grad, w.grad) and any(hit for _, hit in taken)
    finally:
        fk._huge_result = original


def test_nested_and_sparse_float64_operands_run_as_torch_runs_them():
    # (a nested tensor has no one shape: asking for it raised inside the reference, which then did not run)
    import rlx_nb.backends.float64_kernels as fk

    rows = [torch.randn(600, 1024, dtype=torch.float64), torch.randn(500, 1024, dtype=torch.float64)]
    nested = torch.nested.nested_tensor(rows)  # (8.9 MB: past HUGE_COPY_BYTES)
    sparse = torch.randn(1100, 1024, dtype=torch.float64).relu().to_sparse()
    with fk.Float64Kernels():
        got_nested = torch.nn.functional.gelu(nested)
        got_sparse = sparse * 1.5
    assert all(torch.equal(g, torch.nn.functional.gelu(r)) for g, r in zip(got_nested.unbind(), rows, strict=True))
    assert torch.equal(got_sparse.to_dense(), (sparse * 1.5).to_dense())
