"""Localization: each catalogue fault, placed in a chosen layer, is found there — and nothing else is."""

from __future__ import annotations

import warnings

import matplotlib

matplotlib.use("Agg")

import itertools

import matplotlib.pyplot as plt
import pytest
import torch

import rlx_nb
from rlx_nb.errors import FileWriteError
from rlx_nb.execution.prepare import normalize_inputs, prepare_model
from rlx_nb.localization.capture import capture_calls
from rlx_nb.models import demo
from tests.conftest import require_live


@pytest.mark.parametrize(
    ("fault", "placement", "backward", "culprit"),
    [
        ("fault:softmax-row", dict(fault_layer=1), False, "blocks.1.attn :: F.softmax"),
        ("fault:softmax-row", dict(fault_layer=2), False, "blocks.2.attn :: F.softmax"),
        ("fault:layernorm-eps", dict(fault_layer=2), False, "blocks.2.ln1 :: F.layer_norm"),
        ("fault:layernorm-eps", dict(fault_layer=0), False, "blocks.0.ln1 :: F.layer_norm"),
        ("fault:rmsnorm-backward", dict(fault_layer=1, norm="rms"), True, "blocks.1.ln1 :: F.rms_norm"),
        ("fault:xent-backward", dict(fault_layer="head"), True, "<root> :: F.cross_entropy"),
    ],
)
def test_each_fault_is_found_where_it_was_placed(fault, placement, backward, culprit):
    model, inputs = demo.layered(**placement)
    loc = rlx_nb.localize(model, inputs, backend=fault, backward=backward)
    assert loc.culprit == culprit
    suspects = loc.frame.query("verdict == 'SUSPECT' and kind == 'module'")["name"].tolist()
    # Only the faulty path is suspect: no sibling block is blamed.
    layer = placement.get("fault_layer")
    if isinstance(layer, int):
        assert all(s == "<root>" or s.startswith(f"blocks.{layer}") for s in suspects), suspects


def test_hierarchical_descent_counts_preparations():
    model, inputs = demo.layered(fault_layer=1)
    loc = rlx_nb.localize(model, inputs, backend="fault:softmax-row")
    # 4 top-level calls (3 blocks, head) + 4 children of blocks.1 + 2 children of its attention
    # + the attention's own ops (matmul, divide, softmax: stop at the first suspect).
    assert loc.preparations == 4 + 4 + 2 + 3
    args, _ = normalize_inputs(inputs)
    every_module = len(capture_calls(prepare_model(model, None, None), args))
    assert loc.preparations - 3 < every_module  # fewer module preparations than modules
    assert loc.frame["kind"].tolist().count("op") == 3


def test_legitimate_backend_has_no_culprit():
    model, inputs = demo.layered()
    for backend in ("cpu-nomkldnn", "onnxruntime"):
        if backend not in rlx_nb.available_backends():
            continue
        loc = rlx_nb.localize(model, inputs, backend=backend)
        assert loc.culprit is None, (backend, loc.frame)
        assert (loc.frame["verdict"] == "round-off").all()


def test_propagated_error_and_amplification_for_eager_backends():
    model, inputs = demo.layered(fault_layer=0)
    loc = rlx_nb.localize(model, inputs, backend="fault:softmax-row")
    rows = loc.frame.set_index("name")
    # The fault is born in blocks.0 and carried by the clean blocks after it.
    assert rows.loc["blocks.0", "local_line"] > 1
    assert rows.loc["blocks.1", "local_line"] <= 1
    assert rows.loc["blocks.1", "propagated_line"] > 1
    assert rows.loc["blocks.1", "amplification"] > 1


def test_compiled_backends_report_local_only():
    if "onnxruntime" not in rlx_nb.available_backends():
        pytest.skip("onnxruntime not installed")
    model, inputs = demo.layered()
    loc = rlx_nb.localize(model, inputs, backend="onnxruntime")
    assert loc.frame["propagated_line"].isna().all()
    assert loc.frame["local_line"].notna().all()


def test_from_a_report_and_the_plot():
    model, inputs = demo.layered(fault_layer=1, norm="rms")
    report = rlx_nb.backend_divergence(model, inputs, backends=["fault:rmsnorm-backward"], backward=True)
    loc = report.localize()  # the first suspect; its worst output is a gradient, so the backward
    assert loc.backward and loc.culprit == "blocks.1.ln1 :: F.rms_norm"
    ax = loc.plot()
    # One readable row per module and op (it was ~40 bars in 100 px under labels taller than the plot), the culprit
    # marked, and a legend entry per colour (it had one, in whichever colour the first bar had).
    bars = [p for p in ax.patches if p.get_height() == 0.7]
    assert len(bars) == len(loc.frame)
    assert ax.figure.get_figheight() >= 0.24 * len(loc.frame)
    assert any(line.get_xdata()[0] == 1.0 for line in ax.lines)  # the SUSPECT line
    names = [t.get_text() for t in ax.get_yticklabels()]
    assert ax.get_yticklabels()[names.index(loc.culprit)].get_fontweight() == "bold"
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert {"module alone: round-off", "module alone: SUSPECT", f"culprit: {loc.culprit}"} <= set(legend)
    plt.close("all")


def test_model_explorer_data_to_a_path_that_cannot_be_written_is_named(tmp_path):
    # (the standalone repro's own tests: tests/test_repro.py)
    model, inputs = demo.layered(fault_layer=1)
    loc = rlx_nb.localize(model, inputs, backend="fault:softmax-row")
    (tmp_path / "a_file").write_text("")
    with pytest.raises(FileWriteError, match=r"cannot write the Model Explorer node data to '.*a_file/n.json'"):
        loc.to_model_explorer(tmp_path / "a_file" / "n")


def test_no_culprit_no_repro_and_bad_backend():
    model, inputs = demo.layered()
    loc = rlx_nb.localize(model, inputs, backend="cpu-nomkldnn", propagated=False)
    with pytest.raises(rlx_nb.RlxError, match="nothing is beyond round-off"):
        loc.repro("unused")
    with pytest.raises(rlx_nb.RlxError, match="unknown backend"):
        rlx_nb.localize(model, inputs, backend="nope")
    with pytest.raises(rlx_nb.RlxError, match="the oracle"):
        rlx_nb.localize(model, inputs, backend="cpu")


def test_progress_bars_for_localize_backends_and_compare(monkeypatch, capsys):
    # Bars appear after progress.DELAY_S; at 0 every bar shows, so each step's bar can be seen on stderr.
    from rlx_nb._support import progress

    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    model, inputs = demo.layered(n_layers=2, fault_layer=1)
    loc = rlx_nb.localize(model, inputs, backend="fault:softmax-row")
    err = capsys.readouterr().err
    assert "rlx_nb localize fault:softmax-row" in err and "check" in err and loc.culprit
    assert "rlx_nb backends" not in err  # no bar per check inside localize's own
    rlx_nb.backend_divergence(model, inputs, backends=["cpu-nomkldnn", "fault:softmax-row"])
    err = capsys.readouterr().err
    assert "rlx_nb backends" in err and "/2" in err and "cpu-nomkldnn" in err  # the running backend's name
    assert "rlx_nb compare" not in err  # each backend is judged as it lands, within its step of that bar
    assert "rlx_nb: [Layered] fault:softmax-row vs cpu" in err  # and its verdict shown then
    rlx_nb.backend_divergence(model, inputs, backends=["cpu-nomkldnn"], progress=False)
    assert "rlx_nb" not in capsys.readouterr().err  # progress=False: quiet
    monkeypatch.setenv("RLX_NB_PROGRESS", "0")
    rlx_nb.localize(model, inputs, backend="fault:softmax-row")
    assert "rlx_nb" not in capsys.readouterr().err  # RLX_NB_PROGRESS=0: every bar off


def test_keep_arrays_auto_drops_large_round_off_modules(monkeypatch):
    from rlx_nb.localization import search

    model, inputs = demo.layered(n_layers=2, fault_layer=1)
    monkeypatch.setattr(search, "KEEP_ARRAYS_BYTES", 0)  # every module counts as large
    loc = rlx_nb.localize(model, inputs, backend="fault:softmax-row")
    o, b, _ = loc.arrays("blocks.1.attn")  # SUSPECT: kept
    assert o.shape == b.shape
    with pytest.raises(rlx_nb.RlxError, match="keep_arrays='all'"):
        loc.arrays("blocks.0")  # within round-off and "large": record only
    assert "blocks.0" in set(loc.frame["name"])
    every = rlx_nb.localize(model, inputs, backend="fault:softmax-row", keep_arrays="all", ops=False)
    assert every.arrays("blocks.0")[0].size > 0
    with pytest.raises(rlx_nb.RlxError, match="keep_arrays must be"):
        rlx_nb.localize(model, inputs, backend="fault:softmax-row", keep_arrays="some")


def test_a_mild_gradient_fault_the_verdict_now_catches_is_localized_too():
    # A 1e-3 slip in LayerNorm's backward: within the old sqrt(K) gradient floor, caught by the
    # measured budget end to end; localize's backward descent names the LayerNorm.
    from rlx_nb.backends.faults import fault_backend
    from rlx_nb.backends.registry import _REGISTRY

    backend = fault_backend("layernorm-backward", 1e-3)
    _REGISTRY[backend.name] = backend
    model, inputs = demo.transformer(0)
    report = rlx_nb.backend_divergence(model, inputs, backends=[backend.name], backward=True, progress=False)
    assert report.suspects == [backend.name]
    assert report.record(backend.name).output.startswith("grad:")
    loc = report.localize(backend.name)
    assert loc.culprit == "ln1 :: F.layer_norm"


@pytest.mark.slow
def test_localize_on_a_compiled_backend_compiles_every_module_it_checks():
    # Twelve modules of twelve shapes: with dynamo's shared caches, the ninth compile and every later
    # one ran eagerly and was compared as if compiled (ratio exactly 1).
    require_live("cpu-inductor")
    widths = list(range(4, 17))
    model = torch.nn.Sequential(*(torch.nn.Linear(a, b) for a, b in itertools.pairwise(widths)))
    loc = rlx_nb.localize(model, torch.randn(3, 4), backend="cpu-inductor", ops=False)
    modules = loc.frame[loc.frame.kind == "module"]
    assert len(modules) == 13  # the twelve layers, then the root (nothing below it was beyond round-off)
    assert (modules.verdict != "error").all(), modules.reason.tolist()
    assert modules.notes.str.contains("compiled call\\(s\\) ran").all(), modules.notes.tolist()


def test_a_report_holds_its_model_weakly_and_localizes_with_one_passed_in():
    import gc
    import weakref

    model, inputs = demo.layered(n_layers=2, fault_layer=1)
    report = rlx_nb.backend_divergence(model, inputs, backends=["fault:softmax-row"], progress=False)
    alive = weakref.ref(model)
    assert report.localize().culprit == "blocks.1.attn :: F.softmax"  # while the caller holds the model
    del model
    gc.collect()
    assert alive() is None  # the report kept nothing alive
    with pytest.raises(rlx_nb.RlxError, match=r"no longer alive.*model=model, inputs=inputs"):
        report.localize()
    model, inputs = demo.layered(n_layers=2, fault_layer=1)
    assert report.localize(model=model, inputs=inputs).culprit == "blocks.1.attn :: F.softmax"


class _Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16))
        self.head = torch.nn.Linear(16, 5)

    def forward(self, x):
        return self.head(self.body(x))


def _zero_one_bias(model, inputs):
    # A backend that reaches into the whole model by attribute: it cannot run a module alone.
    with torch.no_grad():
        model.head.bias[3] = 0.0
    return model(*inputs)


def test_localize_never_fails_silently_when_the_backend_cannot_run_modules_alone():
    rlx_nb.register_backend("test:head-bias", _zero_one_bias, replace=True, default=False)
    torch.manual_seed(0)
    model, x = _Classifier(), torch.randn(6, 8)
    report = rlx_nb.backend_divergence(model, x, backends=["test:head-bias"], progress=False)
    assert report.suspects == ["test:head-bias"]
    with pytest.warns(RuntimeWarning, match="cannot run the model's modules alone.*AttributeError"):
        loc = rlx_nb.localize(model, x, backend="test:head-bias")
    assert loc.culprit == "head" and "head" in loc.suspects
    assert "AttributeError" in loc.full_run
    assert loc.frame.notes.str.startswith("full run").all()


def _fails_on_layernorm(model, inputs):
    if isinstance(getattr(model, "module", model), torch.nn.LayerNorm):
        raise RuntimeError("no kernel for layer_norm on this device")
    return model(*inputs)


def test_checks_that_fail_are_listed_and_warned_about():
    rlx_nb.register_backend("test:no-layernorm", _fails_on_layernorm, replace=True, default=False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 4))
    with pytest.warns(RuntimeWarning, match=r"1 of \d+ checks .* failed to run.*no kernel for layer_norm"):
        loc = rlx_nb.localize(model, torch.randn(4, 8), backend="test:no-layernorm")
    assert loc.errors.name.tolist() == ["1"] and loc.culprit is None


def test_every_suspect_is_listed_and_the_culprit_is_the_first_born():
    model, inputs = demo.layered(n_layers=3, fault_layer=None)  # the fault in every block
    loc = rlx_nb.localize(model, inputs, backend="fault:softmax-row", ops=False)
    blocks = [s for s in loc.suspects if s.startswith("blocks.") and s.count(".") == 1]
    assert blocks == ["blocks.0", "blocks.1", "blocks.2"]
    assert loc.culprit == "blocks.0.attn"


class _Cache:
    """Keys appended by each layer, as a decoder's cache object is (it is passed to every layer)."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []


class _Layer(torch.nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.key = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x, cache):
        # Like an attention mask built for the positions so far: the layer needs the cache it was given.
        if len(cache.keys) != self.index:
            raise ValueError(f"layer {self.index} got a cache holding {len(cache.keys)} layers' keys")
        cache.keys.append(self.key(x))
        seen = torch.stack(cache.keys, dim=-1)  # every key so far
        return self.norm(x + seen.mean(-1))


class _Decoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([_Layer(i) for i in range(3)])

    def forward(self, x):
        cache = _Cache()
        for layer in self.layers:
            x = layer(x, cache)
        return x


def test_each_layer_is_replayed_with_the_cache_as_it_saw_it():
    # The cache a layer is called with is changed by every later layer: captured by reference, a replay of
    # layer 0 read all three layers' keys and failed ("the model fails on the CPU oracle"), and so did every
    # decoder layer of Hugging Face's OPT.  Captured as it was at the call, and copied for each replay.
    # (Forward, the search fell back to watching full runs, with a warning; backward, it raised InputError.)
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        loc = rlx_nb.localize(_Decoder(), x, backend="fault:layernorm-eps")
        backward = rlx_nb.localize(_Decoder(), x, backend="cpu-fp16", backward=True)
    assert loc.full_run == "" and backward.full_run == ""
    rows = loc.frame.set_index("name")
    for i in range(3):
        assert rows.loc[f"layers.{i}", "verdict"] == "SUSPECT", rows.loc[f"layers.{i}", "reason"]
    assert loc.culprit is not None and loc.culprit.startswith("layers.0")
    assert set(backward.frame.name) >= {"layers.0", "layers.1", "layers.2"}
    assert not (backward.frame.verdict == "error").any(), backward.frame.reason.tolist()


def test_with_no_suspect_localize_names_a_backend_the_report_ran():
    # #46: it suggested report.localize('cpu-inductor'), which this report never ran.
    model, inputs = demo.mlp()
    report = rlx_nb.backend_divergence(model, inputs, backends=["cpu-nomkldnn"], progress=False)
    with pytest.raises(rlx_nb.InputError, match=r"no SUSPECT backend to localize .*report\.localize\('cpu-nomkldnn'\)"):
        report.localize()
