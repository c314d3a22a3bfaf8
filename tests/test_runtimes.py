"""Device runtimes as backends: ExecuTorch (XNNPACK and portable), LiteRT (XNNPACK and reference kernels) and ONNX
Runtime with its graph optimizations off; faults caught through each; an absent runtime is a skipped row."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

import rlx_nb
from rlx_nb.backends import executorch_runtime, litert_runtime
from rlx_nb.backends.exported_faults import fault_through
from rlx_nb.backends.registry import get_backend
from rlx_nb.errors import BackendError
from rlx_nb.models import demo
from rlx_nb.verdict.types import ROUNDOFF, VERDICT_ERROR, VERDICT_SKIPPED
from tests.conftest import fully_masked_row, require_live

pytestmark = pytest.mark.filterwarnings("ignore")

EXECUTORCH = ("executorch-xnnpack", "executorch-portable")
LITERT = ("litert", "litert-reference")
needs_executorch = pytest.mark.skipif(executorch_runtime.executorch_reason() is not None, reason="no ExecuTorch")
needs_litert = pytest.mark.skipif(litert_runtime.litert_reason() is not None, reason="no LiteRT")


def _live(names):
    return [n for n in names if get_backend(n).live]


@pytest.mark.parametrize("name", ["mlp", "conv", "transformer"])
def test_legitimate_device_runtimes_are_round_off(name):
    backends = _live([*EXECUTORCH, *LITERT, "onnxruntime-noopt"])
    if not backends:
        pytest.skip("no device runtime installed")
    model, inputs = getattr(demo, name)()
    report = rlx_nb.backend_divergence(model, inputs, backends=backends, progress=False)
    verdicts = dict(zip(report.backends["backend"], report.backends["verdict"], strict=True))
    assert verdicts == dict.fromkeys(backends, ROUNDOFF), report.summary[["backend", "verdict", "why"]]


@needs_executorch
def test_executorch_says_which_ops_ran_on_portable_kernels():
    model, inputs = demo.conv()
    report = rlx_nb.backend_divergence(model, inputs, backends=list(EXECUTORCH), progress=False)
    xnnpack = report.results.candidates["executorch-xnnpack"].notes
    portable = report.results.candidates["executorch-portable"].notes
    # the conv net's global average pool (a mean) is the one computing op XNNPACK leaves to portable kernels
    assert any("portable kernels outside the XNNPACK delegate" in n and "aten.mean.dim" in n for n in xnnpack), xnnpack
    assert any("(no delegate)" in n and "aten.convolution.default x2" in n for n in portable), portable


class _Attention(torch.nn.Module):
    # Attention as Hugging Face's GPT-2 writes it: heads split by a view, scaled_dot_product_attention, the heads
    # joined by a reshape, then a view of that.
    def __init__(self, width: int = 32, heads: int = 4):
        super().__init__()
        self.heads, self.qkv, self.out = heads, torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, c).view(-1, c))


@needs_executorch
def test_attention_then_a_reshape_lowers_at_any_batch_and_leaves_torchs_attention_kernels_as_they_were():
    # The lowering decomposes attention into its math kernel; traced on the CPU's fused kernel, the reshape after it
    # was fixed as a view the math kernel's layout cannot give, and GPT-2 at batch 4 did not lower.
    flags = [torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
             torch.backends.cuda.math_sdp_enabled(), torch.backends.cuda.cudnn_sdp_enabled()]  # fmt: skip
    torch.manual_seed(0)
    for batch in (1, 4):
        report = rlx_nb.backend_divergence(_Attention().eval(), torch.randn(batch, 16, 32), backends=list(EXECUTORCH),
                                           progress=False)  # fmt: skip
        verdicts = dict(zip(report.backends["backend"], report.backends["verdict"], strict=True))
        assert verdicts == dict.fromkeys(EXECUTORCH, ROUNDOFF), report.summary[["backend", "verdict", "why"]]
    assert flags == [torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
                     torch.backends.cuda.math_sdp_enabled(), torch.backends.cuda.cudnn_sdp_enabled()]  # fmt: skip


@needs_executorch
def test_a_delegate_bug_is_told_from_an_export_bug():
    # ExecuTorch 1.5.1's XNNPACK delegate computes gelu(approximate="tanh") as the exact gelu (max_abs 4.7e-4 on
    # N(0, 3) inputs, the whole difference of the two formulas); its portable kernels compute the tanh form.
    class TanhGelu(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.gelu(x, approximate="tanh")

    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * 3
    report = rlx_nb.backend_divergence(TanhGelu(), (x,), backends=list(EXECUTORCH), progress=False)
    assert report.suspects == ["executorch-xnnpack"]
    assert report.record("executorch-portable").verdict == ROUNDOFF


@needs_litert
def test_litert_attention_over_a_row_that_masks_every_key_is_caught():
    # PyTorch's scaled_dot_product_attention returns zeros for a query whose boolean mask keeps no key; LiteRT's
    # conversion (litert-torch 0.10) does not: its XNNPACK delegate returns NaN there, its reference kernels the
    # mean of the values.  Hugging Face's Mistral meets it on padded positions whose sliding window holds only
    # padding (bench/device_runtimes.py, batch 16): a real difference, caught, never called round-off.
    model, (q, keep) = fully_masked_row()
    report = rlx_nb.backend_divergence(model, (q, keep), backends=["litert", "litert-reference"], progress=False)
    assert report.suspects == ["litert", "litert-reference"]
    assert "NaN" in report.record("litert").reason
    kept = (q, torch.tril(torch.ones(4, 4, dtype=torch.bool)))  # every row keeps a key: round-off
    again = rlx_nb.backend_divergence(model, kept, backends=["litert", "litert-reference"], progress=False)
    assert again.suspects == []


@pytest.mark.parametrize("runtime", ["executorch-xnnpack", "executorch-portable", "litert", "onnxruntime"])
def test_inputs_laid_out_otherwise_are_round_off_on_every_runtime(runtime):
    # A channels-last image and a transposed operand: the private copies keep the user's layout, and ExecuTorch's
    # program kept the dim order it was exported with while the runner fed contiguous memory (SUSPECT at 3e6x the
    # line on a plain convolution; a localization's op check of attention's q @ k^T met it too).
    require_live(runtime)

    class MatMul(torch.nn.Module):
        def forward(self, a, b):
            return a.matmul(b)

    torch.manual_seed(0)
    image = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    operands = (torch.randn(2, 3, 4), torch.randn(2, 5, 4).transpose(-2, -1))
    for model, inputs in ((torch.nn.Conv2d(3, 4, 3), image), (MatMul(), operands)):
        report = rlx_nb.backend_divergence(model, inputs, backends=[runtime], progress=False)
        assert report.record(runtime).verdict == ROUNDOFF, report.record(runtime).reason


@pytest.mark.parametrize("runtime", ["executorch-xnnpack", "litert", "onnxruntime-noopt"])
def test_faults_are_caught_through_each_runtime(runtime):
    if get_backend(runtime).unavailable_reason() is not None:
        pytest.skip(f"{runtime} not installed")
    model, inputs = demo.transformer()
    faults = ["fault:softmax-row", "fault:layernorm-unbiased", "fault:linear-bias-channel"]
    through = [fault_through(f, get_backend(runtime)) for f in faults]
    report = rlx_nb.backend_divergence(model, inputs, backends=[runtime, *through], progress=False)
    assert report.suspects == [b.name for b in through], report.summary[["backend", "verdict", "why"]]
    assert report.record(runtime).verdict == ROUNDOFF


@needs_litert
def test_litert_says_the_int64_inputs_it_cut_to_int32():
    class Embed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(50, 16)

        def forward(self, ids):
            return self.embed(ids).sum(-1)

    ids = torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(0))
    report = rlx_nb.backend_divergence(Embed(), (ids,), backends=list(LITERT), progress=False)
    assert not report.suspects
    for name in LITERT:
        notes = report.results.candidates[name].notes
        assert any("cut int64 to int32 for input 0" in n for n in notes), notes


@needs_executorch
def test_localize_finds_the_faulty_block_through_executorch():
    model, inputs = demo.layered(fault_layer=1, n_layers=2)
    through = fault_through("fault:linear-bias-channel", get_backend("executorch-xnnpack"))
    report = rlx_nb.backend_divergence(model, inputs, backends=[through], progress=False)
    assert report.suspects == [through.name]
    loc = report.localize(through.name, ops=False, propagated=False)  # (modules only: each one exported alone)
    assert loc.culprit is not None and loc.culprit.startswith("blocks.1"), loc.finding


def test_an_absent_runtime_is_a_skipped_row_with_its_pip_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "executorch" else real(name, *a))
    reason = executorch_runtime.executorch_reason()
    assert reason is not None and "pip install 'rlx_nb[executorch]'" in reason
    model, inputs = demo.mlp()
    report = rlx_nb.backend_divergence(model, inputs, backends=["executorch-xnnpack"], progress=False)
    row = report.record("executorch-xnnpack")
    assert row.verdict == VERDICT_SKIPPED and "pip install 'rlx_nb[executorch]'" in row.reason
    assert report.judged_nothing()


@needs_executorch
def test_listing_the_live_backends_finds_executorch_without_loading_its_exporter():
    # Its Python runtime imports the whole exporter (5 s of every command-line run and notebook kernel that listed
    # the live backends): the probe finds the runtime, and loading it waits for a run.
    import subprocess

    code = (
        "import sys, rlx_nb\n"
        "live = rlx_nb.available_backends(include_optin=True)\n"
        "print('executorch-xnnpack' in live, 'executorch-portable' in live, 'executorch.exir' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.stdout.split() == ["True", "True", "False"], done.stdout + done.stderr[-2000:]


@needs_executorch
def test_a_runtime_that_is_installed_and_does_not_load_is_an_error_row_with_its_pip_line(monkeypatch):
    # (None in sys.modules: the import fails as a broken install's would)
    monkeypatch.setitem(sys.modules, "executorch.runtime", None)
    assert executorch_runtime.executorch_reason() is None  # found: the probe does not load it
    model = torch.nn.Sequential(torch.nn.Linear(5, 3, dtype=torch.float32))  # (one no earlier test prepared)
    report = rlx_nb.backend_divergence(model, (torch.randn(2, 5),), backends=["executorch-portable"], progress=False)
    row = report.record("executorch-portable")
    assert row.verdict == VERDICT_ERROR, row
    assert "ExecuTorch's runtime does not load" in row.reason and "pip install 'rlx_nb[executorch]'" in row.reason
    monkeypatch.setitem(sys.modules, "executorch.backends.xnnpack.quantizer.xnnpack_quantizer", None)
    with pytest.raises(BackendError, match=r"XNNPACK quantizer, which does not load: .*pip install"):
        rlx_nb.quantized_divergence(model, (torch.randn(2, 5),), backends=["executorch-xnnpack"], progress=False)


def test_the_torch_range_declared_is_the_one_tested():
    # pyproject asks for the oldest torch the suite runs on (CI: the Makefile's pin); an older one stops at import
    # with the range and the pip line, not with an AttributeError deep in the fp64 kernels.
    import re
    from pathlib import Path

    from rlx_nb._version import TORCH_OLDEST, check_torch

    root = Path(__file__).resolve().parents[1]
    declared = re.search(r'"torch>=(\d+)\.(\d+)"', (root / "pyproject.toml").read_text())
    pinned = re.search(r"TORCH_PIN := torch==(\d+)\.(\d+)", (root / "Makefile").read_text())
    assert declared and pinned
    assert tuple(map(int, declared.groups())) == TORCH_OLDEST == tuple(map(int, pinned.groups()))
    with pytest.raises(ImportError, match=r"needs torch>=2\.13 .* torch 2\.5\.1 is installed"):
        check_torch("2.5.1")
    check_torch(torch.__version__)


def test_onnxruntime_noopt_opens_its_session_with_every_graph_optimization_off(monkeypatch):
    ort = pytest.importorskip("onnxruntime")
    from rlx_nb.backends import onnx

    levels = []
    real = ort.InferenceSession

    def recording(path, options, **kwargs):
        levels.append(options.graph_optimization_level)
        return real(path, options, **kwargs)

    monkeypatch.setattr(ort, "InferenceSession", recording)
    model, inputs = demo.mlp()
    for prepare in (onnx.prepare_onnxruntime, onnx.prepare_onnxruntime_noopt):
        prepare(model.eval(), tuple(inputs))(tuple(inputs))
    onnx.forget_exports()
    level = ort.GraphOptimizationLevel
    assert levels == [level.ORT_ENABLE_ALL, level.ORT_DISABLE_ALL]
