from __future__ import annotations

import pytest
import torch

import rlx_nb
from rlx_nb.backends.registry import get_backend, resolve_backends
from tests.conftest import require_live


def test_available_backends_cpu_first_and_no_reference():
    names = rlx_nb.available_backends()
    assert names[0] == "cpu"
    assert "cpu-f64" not in names
    assert "cpu-bf16" not in names  # opt-in
    assert "cpu-bf16" in rlx_nb.available_backends(include_optin=True)


def test_absent_devices_are_values_not_crashes():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    cuda = get_backend("cuda")
    assert not cuda.live
    assert "CUDA" in cuda.unavailable_reason()
    assert "cuda" not in rlx_nb.available_backends()


def test_register_twice_is_an_error_unless_replace():
    rlx_nb.register_backend("test-twice", lambda m, xs: m(*xs), replace=True)
    with pytest.raises(rlx_nb.RlxError, match="already registered"):
        rlx_nb.register_backend("test-twice", lambda m, xs: m(*xs))
    rlx_nb.register_backend("test-twice", lambda m, xs: m(*xs), replace=True)
    rlx_nb.unregister_backend("test-twice")


@pytest.mark.parametrize("name", ["", "has space", "a,b", None])
def test_invalid_names(name):
    with pytest.raises(rlx_nb.RlxError, match="invalid backend name"):
        rlx_nb.register_backend(name, lambda m, xs: m(*xs))


def test_the_oracle_cannot_be_replaced():
    with pytest.raises(rlx_nb.RlxError, match="oracle"):
        rlx_nb.register_backend("cpu", lambda m, xs: m(*xs), replace=True)


def test_registered_fn_gets_private_eval_float32_cpu_copy():
    seen = {}

    def fn(model, inputs):
        seen["training"] = model.training
        seen["dtype"] = next(model.parameters()).dtype
        seen["inputs"] = inputs
        with torch.no_grad():
            next(model.parameters()).add_(1.0)  # must not leak into the user's model
        return model(*inputs)

    rlx_nb.register_backend("test-copy", fn, replace=True)
    model = torch.nn.Linear(3, 2).double().train()
    before = model.weight.detach().clone()
    report = rlx_nb.backend_divergence(model, torch.ones(2, 3), backends=["test-copy"])
    assert seen["training"] is False
    assert seen["dtype"] == torch.float32
    assert isinstance(seen["inputs"], tuple)
    assert torch.equal(model.weight, before) and model.training
    assert report.suspects == ["test-copy"]  # it really did compute something else
    rlx_nb.unregister_backend("test-copy")


def test_unknown_and_empty_backend_lists():
    with pytest.raises(rlx_nb.RlxError, match="unknown backend 'nope'; live here: cpu"):
        resolve_backends(["nope"])
    with pytest.raises(rlx_nb.RlxError, match="empty"):
        resolve_backends([])
    with pytest.raises(rlx_nb.RlxError, match="empty"):
        resolve_backends(" , ")
    assert [b.name for b in resolve_backends("cpu,cpu-nomkldnn,cpu-nomkldnn")] == ["cpu-nomkldnn"]


def test_backend_table_lists_everything():
    from rlx_nb.backends.registry import backend_table

    rows = {r["backend"]: r for r in backend_table()}
    assert {"cpu", "cpu-f64", "cpu-inductor", "onnxruntime", "cpu-bf16", "cuda"} <= set(rows)
    assert rows["cpu"]["live"]


@pytest.mark.slow
def test_a_compiled_backend_compiles_every_time_it_is_asked():
    # torch.compile gives up after recompile_limit (8) recompilations of one code object and runs eager
    # without an error; every compiled nn.Module enters through one shared wrapper, so nine checks at nine
    # batch sizes were enough to compare eager against eager.  Each run must say its compiled code ran.  (Two
    # linears: Inductor calls its extern addmm for each and generates no C++ kernel, so the ten static-shape compiles
    # cost no compiler run each, about a second of gcc apiece on a machine's first run.)
    require_live("cpu-inductor")
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    for batch in range(1, 11):  # (past the recompile limit of 8 and the compile that hits it)
        report = rlx_nb.backend_divergence(
            model, torch.randn(batch, 8), backends=["cpu-inductor"], check_determinism=False, progress=False
        )
        run = report.results.candidates["cpu-inductor"]
        assert run.status == "ok", run.message
        assert any("compiled call(s) ran" in n for n in run.notes), (batch, run.notes)
        assert "compiled call(s) ran" in report.backends_detail.note.iloc[0]


class NeverCompiled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    @torch._dynamo.disable
    def forward(self, x):
        return self.lin(x)


@pytest.mark.slow
def test_a_model_torch_compile_runs_eagerly_is_an_error_row_not_a_compiled_result():
    require_live("cpu-inductor")
    report = rlx_nb.backend_divergence(NeverCompiled(), torch.randn(2, 4), backends=["cpu-inductor"])
    rec = report.record("cpu-inductor")
    assert rec.verdict == "error" and rec.output is None
    assert "NotCompiledError" in rec.reason and "ran no compiled code" in rec.reason
    assert report.errors == ["cpu-inductor"] and not report.any_suspect


def test_a_notebook_cell_run_twice_registers_its_backend_again():
    source = "def my_kernel(model, inputs):\n    return model(*inputs)\n"
    for _ in range(2):  # the same cell, executed twice: a new function object of the same code each time
        namespace: dict = {"__name__": "__main__"}
        exec(compile(source, "<cell>", "exec"), namespace)
        rlx_nb.register_backend("test-rerun", namespace["my_kernel"])
    other = {"__name__": "__main__"}
    exec(compile(source.replace("model(*inputs)", "model(*inputs) * 2"), "<cell>", "exec"), other)
    with pytest.raises(rlx_nb.RlxError, match="already registered"):
        rlx_nb.register_backend("test-rerun", other["my_kernel"])  # another kernel under that name still asks
    rlx_nb.unregister_backend("test-rerun")


def test_the_kept_table_of_ops_export_may_keep_whole_is_torchs_and_sees_an_op_registered_since():
    # rlx_nb's exports work torch.export's preservable-op table out once per set of registrations (0.2 s a lowering,
    # torch does not cache it): the same set torch gives, a new op library seen at once, torch's own function after.
    from torch._export import utils as export_utils
    from torch.export import exported_program

    from rlx_nb._support.decomp_tables import cia_ops_kept

    original = export_utils._collect_all_valid_cia_ops
    with cia_ops_kept():
        kept = exported_program._collect_all_valid_cia_ops
        assert kept is not original and kept() == original() and kept() == original()
        lib = torch.library.Library("rlx_nb_test_cia", "DEF")  # (a library loaded while rlx_nb exports)
        lib.define("twice(Tensor x) -> Tensor")
        lib.impl("twice", lambda x: x * 2, "CompositeImplicitAutograd")
        try:
            names = {op.name() for op in kept()}
            assert "rlx_nb_test_cia::twice" in names and kept() == original()
        finally:
            lib._destroy()
    assert exported_program._collect_all_valid_cia_ops is original


@pytest.mark.filterwarnings("ignore::FutureWarning")  # (torch's own, deep-copying the export's tree specs)
def test_inside_rlx_nbs_exports_the_annotations_torch_makes_per_overridden_op_are_made_once_and_answer_the_same():
    # run_decompositions overrides 500+ ops through OperatorBase.py_impl, whose inner function is annotated
    # Callable[_P, _T]: built anew every call (a fifth of a small module's lowering).  Inside rlx_nb's exports each
    # subscript is made once; isinstance, issubclass and the decomposed graph are as without; torch's own after.
    import torch._ops

    from rlx_nb._support.decomp_tables import cia_ops_kept

    real, P, T = torch._ops.Callable, torch._ops._P, torch._ops._T
    assert real[P, T] is not real[P, T]  # (what each py_impl call pays for)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.GELU(), torch.nn.LayerNorm(3))
    exported = torch.export.export(model, (torch.randn(2, 4),))
    outside = exported.run_decompositions().graph_module.code
    with cia_ops_kept():
        kept = torch._ops.Callable
        assert kept is not real and kept[P, T] is kept[P, T] and kept[P, T] == real[P, T]
        assert kept[[kept[P, T]], kept[P, T]] == real[[real[P, T]], real[P, T]]  # (a list: made afresh)
        assert isinstance(len, kept) and not isinstance(3, kept) and issubclass(type(len), kept)
        assert exported.run_decompositions().graph_module.code == outside
    assert torch._ops.Callable is real
