"""Invariance (#65): the same rows alone and in other configurations of one computation, bit for bit first, then on
the verdict's scale against float64, with the first op that parts named."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

import rlx_nb
from rlx_nb.configurations.report import certificate_changes
from rlx_nb.errors import InputError


def _linears() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.GELU(), torch.nn.Linear(512, 512))


def test_the_small_batch_path_of_f_linear_is_named_as_the_first_op_and_read_as_round_off():
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(1))
    model = _linears().train()
    report = rlx_nb.invariance(model, x, batch_sizes=(2, 16), progress=False)
    assert all(m.training for m in model.modules())  # (run in eval mode, the user's modes put back)
    summary = report.summary
    assert set(summary.verdict) == {"round-off"}, summary.to_string()
    assert set(summary.first_op) == {"0 :: F.linear"}
    sizes = report.summary[summary.config == "batch of 16, at 0"].op_shapes.item()
    assert sizes.startswith("(1x512, 512x512, 512) alone against (16x512, 512x512, 512) here"), sizes
    # (the kernel path where torch says it: the GEMM's shapes as MKL took them, one row against sixteen)
    path = report.summary[summary.config == "batch of 16, at 0"].kernel_path.item()
    assert path.startswith("addmm"), path
    if torch.backends.mkl.is_available():
        assert "MKL SGEMM(T,N,512,1,512) alone against" in path and "SGEMM(T,N,512,16,512) here" in path, path
    assert report.certificate["pairs"]["cpu | batch of 16, at 0"]["kernel_path"] == path
    assert report.verdict() == "round-off" and report.suspects == []
    line = report.lines()[0]
    assert "within round-off: a legitimate kernel choice" in line and "first op that parts: 0 :: F.linear" in line


def test_invariant_models_read_bit_for_bit_with_no_op_named():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.LayerNorm(64), torch.nn.Softmax(-1))
    report = rlx_nb.invariance(model, torch.randn(4, 64), progress=False)
    assert report.verdict() == "bit for bit" and report.ops == {}
    assert report.lines() == ["[Sequential] cpu: bit for bit invariant over 10 configuration(s)"]


class _BatchChunkedSum(torch.nn.Module):
    # A reduction whose chunking depends on the batch size: past 2 rows its sum is taken in two chunks (23 elements,
    # then the rest), and the row is scaled by it: other bits, within round-off.
    def forward(self, x):
        if x.shape[0] > 2:
            total = x[..., :23].sum(-1, keepdim=True) + x[..., 23:].sum(-1, keepdim=True)
        else:
            total = x.sum(-1, keepdim=True)
        return x * total


class _LeakyAttention(torch.nn.Module):
    # Self-attention over token embeddings whose padding mask is dropped for padded rows: the padded tokens leak.
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.qkv, self.out = torch.nn.Embedding(32, 16), torch.nn.Linear(16, 48), torch.nn.Linear(16, 32)

    def forward(self, input_ids, attention_mask):
        q, k, v = self.qkv(self.emb(input_ids)).chunk(3, -1)
        scores = q @ k.transpose(-1, -2) / 4.0
        leak = bool((attention_mask == 0).any())  # (the bug: a padded batch loses its mask)
        if not leak:
            scores = scores.masked_fill(attention_mask[:, None, :] == 0, float("-inf"))
        return self.out(torch.softmax(scores, -1) @ v)


def test_a_reduction_chunked_by_the_batch_is_round_off_and_a_padding_leak_is_past_the_line():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1)) * 3 + 1
    model = torch.nn.Sequential(torch.nn.Tanh(), _BatchChunkedSum(), torch.nn.Softmax(-1))
    split = rlx_nb.invariance(model, x, batch_sizes=(2, 3), progress=False)
    by_config = split.summary.set_index("config")
    assert by_config.loc["batch of 2, at 0", "verdict"] == "bit for bit"  # (2 rows: the whole-row sum still)
    assert by_config.loc["batch of 3, at 0", "verdict"] == "round-off", split.summary.to_string()
    assert by_config.loc["batch of 3, at 0", "first_op"] == "1 (module: its ops' shapes depend on the configuration)"

    ids = torch.randint(1, 32, (3, 10), generator=torch.Generator().manual_seed(2))
    leaky = rlx_nb.invariance(_LeakyAttention(), {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                              configs=["padding"], progress=False)  # fmt: skip
    assert leaky.suspects == ["cpu"], leaky.summary.to_string()
    worst = leaky.summary.set_index("config")
    assert worst.loc["left-padded by 3", "verdict"] == "SUSPECT" and worst.loc["left-padded by 3", "line"] > 10
    assert "past the line: a bug" in leaky.lines()[0]
    # (where the row is moved: the softmax that now reads the padded keys, not the projection's other path before it)
    assert worst.loc["left-padded by 3", "moved_at"] == "<root> :: torch.softmax"
    assert worst.loc["beside a padded row", "verdict"] != "SUSPECT"  # (row 0 has no padding: its mask is not lost)


def test_gpt2_from_a_config_is_batch_invariant_and_its_cache_and_left_padding_part_within_round_off(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 128, (4, 24), generator=torch.Generator().manual_seed(1))
    report = rlx_nb.invariance(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, rows=[0],
                               progress=False)  # fmt: skip
    verdicts = dict(zip(report.summary.config, report.summary.verdict, strict=True))
    assert all(v == "bit for bit" for c, v in verdicts.items() if c.startswith("batch of")), verdicts
    for config in ("left-padded by 3", "prefilled in two chunks", "decoded token by token"):
        assert verdicts[config] == "round-off", verdicts
    ops = report.summary.set_index("config").first_op
    assert ops["left-padded by 3"] == "transformer.h.0.attn :: F.scaled_dot_product_attention"
    # The cache: the decode step's own ops (the cache filled first) against the same position of the row computed
    # whole: the first that parts is the attention's input projection, its GEMM at one row against 24.
    assert ops["decoded token by token"] == "transformer.h.0.attn.c_attn :: torch.addmm"
    shapes = report.summary.set_index("config").op_shapes["decoded token by token"]
    assert shapes == "(192, 24x64, 64x192) alone against (192, 1x64, 64x192) here", shapes
    assert ops["prefilled in two chunks"].startswith("transformer.h.")
    # ... marked on the module tree: the ops before it bit for bit, the ones after it not.
    tree = report.tree(config="decoded token by token").splitlines()
    assert tree[0] == "cpu | decoded token by token"
    first = next(i for i, ln in enumerate(tree) if "first that parts" in ln)
    assert tree[first].strip() == "<< torch.addmm  first that parts" and tree[first - 1].strip() == "c_attn"
    assert all(ln.strip().startswith("= ") for ln in tree[1:first] if ln.strip().startswith(("= ", "~ ")))
    assert any(ln.strip().startswith("~ ") for ln in tree[first + 1 :])
    with pytest.raises(InputError, match="no pair of nope"):
        report.tree(backend="nope")
    # The certificate: data only, saved, and its changes against another environment's said.
    cert = json.loads(report.save_certificate(tmp_path / "c.json").read_text())
    assert cert["pairs"]["cpu | left-padded by 3"]["first_op"].endswith("F.scaled_dot_product_attention")
    other = json.loads(json.dumps(cert))
    other["pairs"]["cpu | batch of 2, at 0"]["verdict"] = "round-off"
    assert certificate_changes(cert, other) == ["cpu | batch of 2, at 0: bit for bit (None) -> round-off (None)"]
    # Down to the element: a pair as a report the explorer opens.
    pair = report.report(config="left-padded by 3")
    assert pair.record(pair.results.candidates and next(iter(pair.results.candidates))).verdict == "round-off"


def test_backends_run_every_configuration_and_pictures_and_page_show_the_map(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(1))
    report = rlx_nb.invariance(_linears(), x, backends=["cpu-nomkldnn"], batch_sizes=(2, 4), rows=[0],
                               progress=False)  # fmt: skip
    assert set(report.summary.backend) == {"cpu", "cpu-nomkldnn"} and report.failed == {}
    ax = report.plot()
    assert [t.get_text() for t in ax.get_yticklabels()] == ["row 0"]
    assert len(ax.get_xticklabels()) == 4 and any(t.get_text().endswith("x") for t in ax.texts)
    page = report.to_html(tmp_path / "inv.html").read_text()
    assert "<img" in page and "F.linear" in page
    assert "on the module tree</h2>" in page and "&lt;&lt; F.linear  first that parts" in page


def test_bad_input_is_refused_with_what_is_allowed():
    model = _linears()
    with pytest.raises(InputError, match="need at least 2 rows"):
        rlx_nb.invariance(model, torch.randn(1, 512), progress=False)
    with pytest.raises(InputError, match="cache configurations need a decoder with a cache"):
        rlx_nb.invariance(model, torch.randn(2, 512), configs=["cache"], progress=False)
    with pytest.raises(InputError, match=r"unknown configuration 'bacth'.*batch"):
        rlx_nb.invariance(model, torch.randn(2, 512), configs=["bacth"], progress=False)
    with pytest.raises(InputError, match="not per row"):
        rlx_nb.invariance(lambda_sum(), torch.randn(2, 8), progress=False)
    with pytest.raises(InputError, match=r"batch_sizes must be whole numbers >= 2 \(1 is the row alone\)"):
        rlx_nb.invariance(model, torch.randn(2, 512), batch_sizes=(1, 4), progress=False)
    with pytest.raises(InputError, match="first dimensions differ"):
        rlx_nb.invariance(model, (torch.randn(2, 512), torch.randn(3, 512)), progress=False)


def lambda_sum() -> torch.nn.Module:
    class Total(torch.nn.Module):  # (one number for the whole batch: no row of it is the row's own)
        def forward(self, x):
            return x.sum()

    return Total()


def test_ctrl_c_keeps_the_configurations_already_compared():
    from tests.interrupts import differences, torch_state

    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(1))
    model, calls = _linears(), []

    def count(*_):
        calls.append(1)
        if len(calls) == 6:  # (the sixth run of the first layer: a few configurations in)
            raise KeyboardInterrupt

    hook = model[0].register_forward_hook(count)
    before = torch_state()
    with pytest.raises(KeyboardInterrupt):
        rlx_nb.invariance(model, x, ops=False, progress=False)
    hook.remove()
    assert differences(before, torch_state()) == {}
    kept = rlx_nb.interrupted_invariance()
    assert kept is not None and 0 < len(kept.pairs) < 10 and kept.incomplete.startswith("interrupted after")
    assert kept.failed == {} and kept.lines()[-1].startswith("[Sequential] INCOMPLETE: interrupted after")


def test_the_cli_and_the_pytest_helper_gate_on_bits_or_on_the_line(tmp_path, capsys):
    from rlx_nb import cli
    from rlx_nb.testing import assert_invariant

    target = tmp_path / "models.py"
    target.write_text(
        "import torch\n\n"
        "def linears():\n"
        "    torch.manual_seed(0)\n"
        "    return torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 8)), torch.randn(3, 512)\n\n"
        "def norms():\n"
        "    return torch.nn.Sequential(torch.nn.LayerNorm(32), torch.nn.Softmax(-1)), torch.randn(3, 32)\n"
    )
    cert = tmp_path / "c.json"
    assert cli.main(["invariance", f"{target}:linears", "--certificate", str(cert)]) == cli.EXIT_SUSPECT
    assert "first op that parts: 0 :: F.linear" in capsys.readouterr().out and cert.exists()
    assert cli.main(["invariance", f"{target}:linears", "--past-line"]) == cli.EXIT_OK
    assert cli.main(["invariance", f"{target}:norms"]) == cli.EXIT_OK
    assert cli.main(["invariance", f"{target}:norms", "--configs", "cache"]) == cli.EXIT_USAGE

    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(1))
    with pytest.raises(AssertionError, match="not bit for bit invariant"):
        assert_invariant(_linears(), x, batch_sizes=(2,))
    assert assert_invariant(_linears(), x, batch_sizes=(2,), past_line_only=True).verdict() == "round-off"


def test_the_explorer_goes_from_a_configuration_pair_to_the_element():
    pytest.importorskip("ipywidgets")
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(1))
    report = rlx_nb.invariance(_linears(), x, batch_sizes=(2, 16), rows=[0], progress=False)
    explorer = rlx_nb.explore(report)
    configs = [v for _, v in explorer.pickers["configuration"].options]
    assert configs == ["batch of 2, at 0", "batch of 2, at 1", "batch of 16, at 0", "batch of 16, at 15"]
    explorer.pickers["configuration"].value = "batch of 16, at 15"
    assert explorer.backend_picker.value == "cpu · batch of 16, at 15" and explorer.output_picker.value == "out"
    assert "first op that parts: 0 :: F.linear" in explorer.snapshot()["text/html"]
    # The picked pair's own op, its shapes and kernel path, beside its pickers (and following them).
    about = explorer.part_about.value
    assert "first op that parts: <code>0 :: F.linear</code> (1x512, 512x512, 512) alone against (16x512" in about
    assert "kernel path: <code>addmm" in about and about in explorer.snapshot()["text/html"]
    explorer.pickers["configuration"].value = "batch of 2, at 0"
    assert "(2x512, 512x512, 512) here" in explorer.part_about.value
    with pytest.raises(InputError, match="bit for bit"):
        torch.manual_seed(0)
        rlx_nb.explore(rlx_nb.invariance(torch.nn.Softmax(-1), torch.randn(3, 8), progress=False))


class _BatchLeakingBackward(torch.autograd.Function):
    # Identity forward; a backward that mixes in the batch's mean gradient: each row's gradient depends on the batch.
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad + 0.01 * grad.mean(0, keepdim=True)


class _LeakyBackward(torch.nn.Module):
    def forward(self, x):
        return _BatchLeakingBackward.apply(x)


def test_per_sample_gradients_find_a_backward_that_leaks_across_the_batch_where_the_forward_is_bit_for_bit():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.LayerNorm(64), _LeakyBackward(), torch.nn.Linear(64, 8))
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    forward = rlx_nb.invariance(model, x, batch_sizes=(2, 4), rows=[0], progress=False)
    assert forward.verdict() != "SUSPECT"  # (the forward alone cannot see it)
    report = rlx_nb.invariance(model, x, batch_sizes=(2, 4), rows=[0], backward=True, progress=False)
    frame = report.frame
    grads = frame[frame.output.str.startswith("grad:")]
    assert set(grads.output) == {"grad:0.weight", "grad:0.bias", "grad:2.weight", "grad:2.bias"}
    assert report.suspects == ["cpu"]
    bad = grads[grads.verdict == "SUSPECT"]
    # (below the leak: LayerNorm's weight, whose gradient weighs each row's by its own input; its bias's sums the
    # rows, leak and all, as the row alone's does; above it the head's, bit for bit)
    assert set(bad.output) == {"grad:0.weight"}, grads.to_string()
    assert (grads[grads.output.str.startswith("grad:2.")].verdict == "bit for bit").all()
    assert (frame[~frame.output.str.startswith("grad:")].verdict != "SUSPECT").all()
    with pytest.raises(InputError, match="backward must be True or False"):
        rlx_nb.invariance(model, x, backward="yes", progress=False)


class _TinyDecoder(torch.nn.Module):
    # A decoder with its own cache (keys and values by position); ``drop_oldest``: the planted bug, a cache that
    # keeps one position too few (the oldest key dropped, as a sliding window off by one would).
    def __init__(self, drop_oldest: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.pos = torch.nn.Embedding(32, 16), torch.nn.Embedding(64, 16)
        self.qkv, self.out = torch.nn.Linear(16, 48), torch.nn.Linear(16, 32)
        self.drop_oldest = drop_oldest

    def forward(self, input_ids, attention_mask=None, past_key_values=None, use_cache=False, position_ids=None):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        n = input_ids.shape[1]
        past = 0 if past_key_values is None else past_key_values[0].shape[1] + int(self.drop_oldest)
        if position_ids is None:
            position_ids = torch.arange(past, past + n)[None]
        q, k, v = self.qkv(self.emb(input_ids) + self.pos(position_ids)).chunk(3, -1)
        if past_key_values is not None:
            k, v = torch.cat([past_key_values[0], k], 1), torch.cat([past_key_values[1], v], 1)
        m = k.shape[1]
        scores = (q @ k.transpose(-1, -2) / 4.0).masked_fill(torch.arange(m)[None] > torch.arange(m - n, m)[:, None],
                                                             float("-inf"))  # fmt: skip
        logits = self.out(torch.softmax(scores, -1) @ v)
        cache = (k[:, 1:], v[:, 1:]) if self.drop_oldest else (k, v)
        return CausalLMOutputWithPast(logits=logits, past_key_values=cache if use_cache else None)


def test_a_cache_off_by_one_position_is_past_the_line_and_named_at_the_op_that_reads_it():
    pytest.importorskip("transformers")
    ids = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    good = rlx_nb.invariance(_TinyDecoder().eval(), inputs, configs=["cache"], rows=[0], progress=False)
    assert good.verdict() == "round-off" and good.suspects == [], good.lines()
    assert good.summary.moved_at.isna().all()
    bad = rlx_nb.invariance(_TinyDecoder(drop_oldest=True).eval(), inputs, configs=["cache"], rows=[0], progress=False)
    assert bad.suspects == ["cpu"]
    summary = bad.summary.set_index("config")
    # (the attention's score product: the decode step reads 11 keys where the row computed whole reads 12)
    assert summary.moved_at["decoded token by token"] == "<root> :: Tensor.matmul", summary.to_string()
    assert "the row's positions part at <root> :: Tensor.matmul (its output 1x12x12 alone against" in bad.lines()[0]


class _ChunkedSoftmax(torch.overrides.TorchFunctionMode):
    # A backend's softmax whose sum is split by the batch: past 2 rows, in two chunks (its own kernel, not an op any
    # recording of the oracle sees).
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.softmax, torch.nn.functional.softmax, torch.Tensor.softmax):
            x = args[0]
            e = (x - x.amax(-1, keepdim=True)).exp()
            if x.shape[0] > 2:
                total = e[..., :23].sum(-1, keepdim=True) + e[..., 23:].sum(-1, keepdim=True)
            else:
                total = e.sum(-1, keepdim=True)
            return e / total
        return func(*args, **kwargs)


def _chunked_softmax_backend(module, inputs):
    with _ChunkedSoftmax():
        return module(*inputs)


def test_a_backend_whose_own_kernel_splits_by_the_batch_is_named_at_its_module_run_alone_through_it():
    # #65: a backend's ops are its own (a compiler's generated code, a runtime's kernels): each leaf module is run
    # alone through it in both configurations, on the same bits of the row; the first that parts is named.
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1)) * 3
    model = torch.nn.Sequential(torch.nn.Tanh(), torch.nn.Softmax(-1))  # (the oracle's: bit for bit at any batch)
    rlx_nb.register_backend("test:chunked-softmax", _chunked_softmax_backend, replace=True, default=False)
    try:
        report = rlx_nb.invariance(model, x, backends=["test:chunked-softmax"], configs=["batch"], batch_sizes=(2, 3),
                                   rows=[0], progress=False)  # fmt: skip
    finally:
        rlx_nb.unregister_backend("test:chunked-softmax")
    mine = report.summary.set_index(["backend", "config"])
    assert mine.loc[("cpu", "batch of 3, at 0"), "verdict"] == "bit for bit", report.summary.to_string()
    parted = mine.loc[("test:chunked-softmax", "batch of 3, at 0")]
    assert parted.verdict == "round-off", report.summary.to_string()
    assert parted.first_op == "1 :: Softmax alone on test:chunked-softmax", parted.first_op
    assert parted.op_shapes == "1x64 against 3x64", parted.op_shapes
    assert mine.loc[("test:chunked-softmax", "batch of 2, at 0"), "verdict"] == "bit for bit"
    ops = report.ops[("test:chunked-softmax", "batch of 3, at 0")]
    assert ops.invariant == ["0 :: Tanh alone on test:chunked-softmax"]  # (alone on the backend: the same bits)
    tree = report.tree("test:chunked-softmax", "batch of 3, at 0")
    assert "=  Tanh alone on test:chunked-softmax" in tree and "<< Softmax alone on test:chunked-softmax" in tree, tree


@pytest.mark.slow
def test_inductors_compiled_linear_is_named_at_its_module_with_the_kernel_inductor_generated():
    # The measure: a torch.compile'd linear is not batch invariant.  Inductor's code for the linear alone
    # calls its extern GEMM at each batch size; MKL takes it at one row against sixteen.
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(1))
    report = rlx_nb.invariance(_linears(), x, backends=["cpu-inductor"], configs=["batch"], batch_sizes=(16,),
                               rows=[0], progress=False)  # fmt: skip
    parted = report.summary.set_index(["backend", "config"]).loc[("cpu-inductor", "batch of 16, at 0")]
    assert parted.verdict == "round-off", report.summary.to_string()
    assert parted.first_op == "0 :: Linear alone on cpu-inductor", parted.first_op
    assert parted.op_shapes == "1x512 against 16x512"
    assert "Inductor extern_kernels.addmm" in parted.kernel_path, parted.kernel_path
    if torch.backends.mkl.is_available():
        assert "SGEMM(T,N,512,1,512)" in parted.kernel_path and "SGEMM(T,N,512,16,512)" in parted.kernel_path
    assert "first op that parts: 0 :: Linear alone on cpu-inductor" in "\n".join(report.lines())


def _chunked_only_whole(module, inputs):
    # A backend that splits the softmax's sum only when it runs the whole model (as a compiler fusing across
    # modules): each module alone runs as eager does.
    if isinstance(module, torch.nn.Sequential) or isinstance(getattr(module, "model", None), torch.nn.Sequential):
        return _chunked_softmax_backend(module, inputs)
    return module(*inputs)


def test_a_backend_that_parts_only_across_modules_says_so_and_names_no_module():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1)) * 3
    model = torch.nn.Sequential(torch.nn.Tanh(), torch.nn.Softmax(-1))
    rlx_nb.register_backend("test:fused-only", _chunked_only_whole, replace=True, default=False)
    try:
        report = rlx_nb.invariance(model, x, backends=["test:fused-only"], configs=["batch"], batch_sizes=(3,),
                                   rows=[0], progress=False)  # fmt: skip
    finally:
        rlx_nb.unregister_backend("test:fused-only")
    parted = report.summary.set_index(["backend", "config"]).loc[("test:fused-only", "batch of 3, at 0")]
    assert parted.verdict == "round-off" and parted.first_op is None, report.summary.to_string()
    line = next(x for x in report.lines() if "test:fused-only" in x)
    assert "no module alone parts on test:fused-only: it parts only across modules" in line, line
    if importlib.util.find_spec("ipywidgets") is not None:  # (the explorer says why beside the pair's pickers)
        explorer = rlx_nb.explore(report, backend="test:fused-only")
        assert "No op named for this pair: no module alone parts on test:fused-only" in explorer.part_about.value
