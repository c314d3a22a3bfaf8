"""rlx_nb.snapshot / rlx_nb.diff (#49): where two environments part, module by module, judged on round-off."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import rlx_nb
import rlx_nb.changes.ops
from rlx_nb.errors import InputError, ReportFormatError
from rlx_nb.models import demo
from tests.conftest import compiler_caches_off

ROOT = Path(__file__).resolve().parent.parent
UNTOUCHED = {"moved within round-off", "bit for bit identical"}
"""A module whose change is within round-off: moved within it, or not at all."""


@pytest.fixture(scope="module")
def layered(tmp_path_factory):
    model, inputs = demo.layered(fault_layer=1)
    path = rlx_nb.snapshot(model, inputs, tmp_path_factory.mktemp("snap") / "before", reference=True)
    return model, inputs, path


def test_a_planted_kernel_fault_is_local_in_its_module_and_propagated_in_every_one_after(layered):
    # The second environment: the same CPU with a catalogue-sized fault in one block's softmax.
    model, inputs, path = layered
    d = rlx_nb.diff(path, model, inputs, backend="fault:softmax-row")
    change = dict(zip(d.frame.module, d.frame.change, strict=True))
    assert d.culprit == "blocks.1.attn"
    assert change["blocks.1.attn"] == change["blocks.1"] == "changed here"
    for before in ("blocks.0", "blocks.1.ln1", "blocks.1.attn.qkv"):  # upstream of the softmax: untouched
        assert change[before] == "bit for bit identical", before  # (the same kernels before the fault)
    for after in ("blocks.1.attn.proj", "blocks.1.mlp", "blocks.2", "head"):  # fed the changed values
        assert change[after] == "carried in", after
    assert d.past_line and "blocks.1.attn computes differently here" in d.finding
    assert any(line.startswith("  changed here: blocks.1.attn (") for line in d.lines())


def test_with_ops_the_diff_descends_from_the_module_into_its_own_op(layered, tmp_path):
    # ops=True: each module's own torch function calls are recorded too, named as localize names them; the diff's
    # descent goes on from blocks.1.attn into its ops and names the softmax, the matmul before it untouched and the
    # one after it carrying the change.
    model, inputs, _ = layered
    path = rlx_nb.snapshot(model, inputs, tmp_path / "ops", ops=True)
    snap = rlx_nb.load_snapshot(path)
    assert snap.has_ops and [m for m in snap.modules if m.startswith("blocks.1.attn :: ")] == [
        "blocks.1.attn :: Tensor.matmul", "blocks.1.attn :: Tensor.div", "blocks.1.attn :: F.softmax",
        "blocks.1.attn :: Tensor.matmul#2"]  # fmt: skip
    d = rlx_nb.diff(path, model, inputs, backend="fault:softmax-row")
    change = dict(zip(d.frame.module, d.frame.change, strict=True))
    assert d.culprit == "blocks.1.attn :: F.softmax" and change["blocks.1.attn"] == "changed here"
    assert change["blocks.1.attn :: Tensor.matmul"] == "bit for bit identical"
    assert change["blocks.1.attn :: Tensor.matmul#2"] == "carried in"
    assert d.report().suspects == [d.new_label]  # (the explorer's view of the op, alone)
    legit = rlx_nb.diff(path, model, inputs, backend="cpu-nomkldnn", local="all")
    assert set(legit.frame.change) <= UNTOUCHED and len(legit.frame) == len(snap.modules)
    # Two snapshots with their ops: the softmax was fed bit for bit the same inputs, so its change is its own.
    faulty = rlx_nb.snapshot(model, inputs, tmp_path / "faulty", ops=True, backend="fault:softmax-row")
    reference = rlx_nb.snapshot(model, inputs, tmp_path / "reference", ops=True, reference=True)
    assert rlx_nb.diff(reference, faulty).culprit == "blocks.1.attn :: F.softmax"
    with pytest.raises(InputError, match=r"op 'F\.no_such_op' is not on rlx_nb's list of pure tensor computations"):
        rlx_nb.changes.ops.resolve("F.no_such_op")


def test_a_run_more_accurate_here_is_not_a_change_unless_something_before_it_changed_on_its_own():
    # Past the line only the other way round (the old output against the float64 value here, the new run's round-off
    # much smaller than the old one's) reads a changed function only where a module changed on its own at it, inside
    # it or before it (an edit); with none, the environment computes it more accurately (Mamba's scan under
    # MKL_CBWR=COMPATIBLE read 1.1-1.6x at five ops of 10,960 judged, bench/changes.py --ops).
    from rlx_nb.changes.diff import _explained, _judgements
    from rlx_nb.execution.results import Leaf

    rng = np.random.default_rng(0)
    exact = rng.standard_normal(4096)
    eps = np.finfo(np.float32).eps

    def leaf(x):
        return {"out": Leaf(x.astype(np.float32), "float32", x.shape)}

    old = leaf(exact * (1 + 40 * eps * rng.standard_normal(4096)))  # the old run: 40x its ops' round-off
    new = leaf(exact * (1 + 0.5 * eps * rng.standard_normal(4096)))  # here: more accurate
    ref = {"out": Leaf(exact, "float64", exact.shape)}
    both, forward = _judgements(old, new, ref, "here", "m :: torch.matmul#3")
    assert both.verdict == "SUSPECT" and forward.verdict == "round-off"
    rows = {"": {"order": 0}, "a": {"order": 1}, "m": {"order": 2}, "m :: torch.matmul#3": {"order": 3}}
    judged = {"m :: torch.matmul#3": (both, forward), "": (both, forward)}
    plain = _explained(rows, judged, {"a": (forward, "")})  # nothing changed on its own
    assert plain["m :: torch.matmul#3"].verdict == "round-off" and "computes it more accurately" in plain[""].reason
    for changed in ("a", "m", "m :: torch.matmul#3"):  # before it, around it, at it: an edit explains it
        kept = _explained(rows, judged, {changed: (both, "")})
        assert kept["m :: torch.matmul#3"].verdict == "SUSPECT" and kept[""].verdict == "SUSPECT", changed


def test_the_explorer_walks_a_diff_from_its_culprit_to_the_element_on_either_side(layered):
    # explore(diff): the culprit's change alone opens (the old output the oracle, the new one the backend, the
    # float64 module the reference); the side and module pickers show the whole run's and another module's change.
    pytest.importorskip("ipywidgets")
    model, inputs, path = layered
    d = rlx_nb.diff(path, model, inputs, backend="fault:softmax-row")
    ex = rlx_nb.explore(d)
    assert (ex.module_picker.value, ex.side_picker.value) == ("blocks.1.attn", "local")
    assert ex.report.suspects == [d.new_label] and "SUSPECT" in ex.status.value
    alone = ex.report.record(d.new_label, "out")
    assert alone.judgement.line == pytest.approx(d.frame.set_index("module").local_line["blocks.1.attn"], rel=1e-6)
    assert "old run (" in ex.inspector.value and ex.heatmap_data is not None and ex.heatmap_data.max() > 1
    ex.module_picker.value = "blocks.0"  # upstream: its whole-run output is the old one, bit for bit
    assert not ex.report.suspects and "bit for bit" in ex.status.value
    ex.module_picker.value = "head"  # downstream: within round-off alone, past the line in the whole run
    assert ex.side_picker.value == "local" and not ex.report.suspects
    ex.side_picker.value = "propagated"
    assert ex.report.suspects and "SUSPECT" in ex.status.value
    shot = ex.snapshot()["text/html"]
    assert "blocks.1.attn computes differently here" in shot and "<code>head</code>, in the whole run" in shot
    with pytest.raises(InputError, match="module 'nowhere' is not in this diff"):
        d.report("nowhere")
    with pytest.raises(InputError, match="module= and side= pick a diff's module"):
        rlx_nb.explore(ex.report, module="head")


def test_an_edited_modules_explorer_shows_the_side_past_the_line(tmp_path):
    # An edit is past the line only the other way round (the old output against the float64 value of the new code):
    # the report turns round, the new run as the oracle, so the heatmap shows what is past the line.
    torch.manual_seed(0)
    old = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    x = torch.randn(4, 16)
    path = rlx_nb.snapshot(old, (x,), tmp_path / "old")
    d = rlx_nb.diff(path, nn.Sequential(old[0], nn.GELU(approximate="tanh"), old[2]), (x,))
    assert d.culprit == "1"
    report = d.report()
    assert report.suspects == [f"{d.old_label} (old)"]


def test_a_legitimate_change_in_the_same_process_reads_as_round_off_and_names_what_differs(layered):
    # oneDNN off (ATen's own kernels) and one thread instead of the snapshot's count: every module, alone and in the
    # whole run, within round-off.
    model, inputs, path = layered
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        d = rlx_nb.diff(path, model, inputs, backend="cpu-nomkldnn", local="all")
    finally:
        torch.set_num_threads(threads)
    assert d.culprit is None and d.first_parted is None and not d.past_line
    assert set(d.frame.change) <= UNTOUCHED
    assert d.frame.local_line.notna().all() and d.frame.propagated_line.notna().all()
    assert any(e.startswith("threads: ") for e in d.environment)


_TARGET = """
import os, torch
from rlx_nb.models import demo

def factory():
    model, _ = getattr(demo, os.environ["RLX_TEST_MODEL"])()
    saved = torch.load(os.environ["RLX_TEST_STATE"])
    model.load_state_dict(saved["model"])
    return model, tuple(saved["inputs"])
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("variable", "model", "moves"),
    [
        ("MKL_CBWR=COMPATIBLE", "conv", "head"),  # MKL's GEMM on its SSE2 path: the classifier's linear
        ("ONEDNN_MAX_CPU_ISA=SSE41", "conv", "features.0"),  # oneDNN's convolutions on SSE4.1
        ("ATEN_CPU_CAPABILITY=default", "transformer", None),  # ATen's scalar kernels (layer norm, softmax, GELU)
    ],
)
def test_another_dispatch_path_in_another_process_reads_as_round_off(tmp_path, variable, model, moves):
    # A second environment for real: a fresh process with the library's dispatch moved by its variable.  The weights
    # and inputs travel in a file (the demo draws them with vectorized kernels, which a dispatch change moves too).
    built, inputs = getattr(demo, model)()
    torch.save({"model": built.state_dict(), "inputs": list(inputs)}, tmp_path / "state.pt")
    (tmp_path / "target.py").write_text(_TARGET)
    env = {**os.environ, "RLX_TEST_MODEL": model, "RLX_TEST_STATE": str(tmp_path / "state.pt")}
    env.pop("MKL_CBWR", None)
    env.pop("ONEDNN_MAX_CPU_ISA", None)
    env.pop("ATEN_CPU_CAPABILITY", None)
    snap = tmp_path / "before.rlxsnap"
    rlx_nb.snapshot(built, inputs, snap)
    key, _, value = variable.partition("=")
    cli = [sys.executable, "-c", "import sys, rlx_nb.cli as c; sys.exit(c.main())"]
    done = subprocess.run([*cli, "diff", str(snap), f"{tmp_path / 'target.py'}:factory", "--all", "--html",
                           str(tmp_path / "diff.html")], env={**env, key: value}, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "every module moved within round-off" in done.stdout
    assert f"variables.{key}: unset -> {value}" in done.stdout
    assert "weights differ" not in done.stdout and "inputs' values differ" not in done.stdout
    page = (tmp_path / "diff.html").read_text()
    assert "class='SUSPECT'" not in page and "class='round-off'" in page and "<img" in page
    if moves is not None:  # the variable did move the kernels: the module's output is not bit for bit the old one
        shown = next(line for line in page.split("<tr>") if f"<td>{moves}</td>" in line)
        assert "bit for bit identical" not in shown, shown


def test_an_edit_of_the_models_code_with_the_same_weights_is_found_in_the_edited_module(tmp_path):
    class Exact(nn.Module):
        def forward(self, x):
            return torch.nn.functional.gelu(x)

    class Approximate(nn.Module):  # the edit: GELU by its sigmoid approximation
        def forward(self, x):
            return x * torch.sigmoid(1.702 * x)

    torch.manual_seed(0)
    old = nn.Sequential(nn.Linear(16, 32), Exact(), nn.Linear(32, 8))
    x = torch.randn(4, 16)
    path = rlx_nb.snapshot(old, (x,), tmp_path / "old")
    new = nn.Sequential(old[0], Approximate(), old[2])
    d = rlx_nb.diff(path, new, (x,))
    assert d.culprit == "1"
    assert dict(zip(d.frame.module, d.frame.change, strict=True)) == {
        "<root>": "carried in", "0": "bit for bit identical", "1": "changed here", "2": "carried in"}  # fmt: skip
    assert not d.notes  # same weights, same inputs


@contextlib.contextmanager
def _inductor_upgrade_that_breaks_gelu():
    # The next version of a compiler, as a regression would ship it: Inductor decomposes GELU as x * sigmoid(1.702 x).
    # (Its caches off: a new version's cache keys differ, and a cached compile of the old one would be reused; a
    # compile under the plant must not be kept for later ones either.)
    from torch._inductor import decomposition

    gelu = torch.ops.aten.gelu.default
    saved = decomposition.decompositions.get(gelu)
    decomposition.decompositions[gelu] = lambda x, approximate="none": x * torch.sigmoid(1.702 * x)
    decomposition.fast_random_decomps.cache_clear()
    try:
        with compiler_caches_off():
            yield
    finally:
        decomposition.decompositions.pop(gelu)
        if saved is not None:
            decomposition.decompositions[gelu] = saved
        decomposition.fast_random_decomps.cache_clear()


def test_a_compiler_upgrade_is_diffed_module_by_module_though_it_compiles_the_whole_model(tmp_path):
    # A backend with no module boundaries in its run (Inductor compiles the whole model): the snapshot runs each
    # module alone on it, fed the oracle's inputs; the next version, run the same way, is judged module by module.
    from rlx_nb.backends.registry import get_backend

    if get_backend("cpu-inductor").unavailable_reason():
        pytest.skip(f"cpu-inductor: {get_backend('cpu-inductor').unavailable_reason()}")
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)), torch.randn(4, 16)
    path = rlx_nb.snapshot(model, (x,), tmp_path / "inductor-now", backend="cpu-inductor", reference=True)
    snap = rlx_nb.load_snapshot(path)
    assert snap.meta["alone"] and snap.backend == "cpu-inductor" and snap.has_reference
    assert set(snap.modules) == {"", "0", "1", "2"} and all(snap.outputs(n) for n in snap.modules)
    same = rlx_nb.diff(path, model, (x,))
    assert same.culprit is None and set(same.frame.change) - {"not judged"} <= UNTOUCHED
    assert any("ran each module alone on cpu-inductor" in n for n in same.notes)
    with _inductor_upgrade_that_breaks_gelu():
        upgraded = rlx_nb.diff(path, model, (x,), local="all")
        report = upgraded.report()
    change = dict(zip(upgraded.frame.module, upgraded.frame.change, strict=True))
    assert upgraded.culprit == "1" and change == {"<root>": "changed here", "0": "bit for bit identical",
                                                  "1": "changed here", "2": "bit for bit identical"}  # fmt: skip
    assert report.suspects == [upgraded.new_label]
    with pytest.raises(InputError, match="1 has no propagated change judged"):
        upgraded.report("1", "propagated")


def test_each_module_alone_on_an_exporting_runtime_is_its_own_export(tmp_path):
    # A snapshot on ONNX Runtime exports every module alone: a GELU, a Tanh and a Sigmoid on inputs of one shape, and
    # three linears whose private copies are freed in turn (the next copy's weights at the last one's address), are
    # six exports, each module's recorded output its own (one export had served all three activations: both the
    # snapshot and a diff on it then agreed on the GELU's values for the Tanh).
    from rlx_nb.backends.registry import get_backend

    if get_backend("onnxruntime").unavailable_reason():
        pytest.skip(f"onnxruntime: {get_backend('onnxruntime').unavailable_reason()}")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Sigmoid())
    path = rlx_nb.snapshot(model, (torch.randn(4, 16),), tmp_path / "ort", backend="onnxruntime", progress=False)
    snap = rlx_nb.load_snapshot(path)
    named = dict(model.named_modules())
    for name in snap.modules:
        args, kwargs = snap.call(name)
        with torch.no_grad():
            eager = named[name](*args, **kwargs)
        assert np.abs(snap.outputs(name)["out"].value - eager.numpy()).max() < 1e-5, name
    # Two such snapshots compare where a module was fed the same inputs in both; elsewhere its change needs the model.
    again = rlx_nb.snapshot(model, (snap.tensors("")[0],), tmp_path / "again", backend="onnxruntime", reference=True,
                            progress=False)  # fmt: skip
    assert set(rlx_nb.diff(again, path).frame.change) <= UNTOUCHED
    eager_run = rlx_nb.snapshot(model, (snap.tensors("")[0] + 1,), tmp_path / "eager")
    apart = rlx_nb.diff(again, eager_run)
    assert set(apart.frame.change) == {"not judged"} and apart.finding.startswith("no module could be judged")
    assert "a snapshot ran each module alone" in apart.frame.note.iloc[1]


def test_two_snapshots_compare_without_the_model(layered, tmp_path):
    model, inputs, path = layered
    faulty = rlx_nb.snapshot(model, inputs, tmp_path / "faulty", backend="fault:softmax-row")
    d = rlx_nb.diff(path, faulty)
    change = dict(zip(d.frame.module, d.frame.change, strict=True))
    # blocks.1.attn was fed bit for bit the inputs it had before, and its output moved: it changed itself.
    assert change["blocks.1.attn"] == "changed here" and d.culprit == "blocks.1.attn"
    assert change["blocks.1.attn.proj"] == change["head"] == "carried in"
    assert change["blocks.0"] in UNTOUCHED
    assert rlx_nb.diff(path, path).culprit is None
    with pytest.raises(InputError, match="neither snapshot holds its float64 reference"):
        rlx_nb.diff(faulty, faulty)


def test_a_model_that_steps_its_state_is_diffed_from_the_state_it_had(tmp_path):
    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("count", torch.zeros(()))
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            self.count += 1
            return self.lin(x) + self.count

    model, x = Counting(), torch.randn(2, 8)
    path = rlx_nb.snapshot(model, (x,), tmp_path / "s")
    d = rlx_nb.diff(path, model, (x,), local="all")
    assert set(d.frame.change) <= UNTOUCHED, d.frame


def test_the_file_is_checked_on_load_and_never_unpickled(layered, tmp_path):
    _, _, path = layered
    snap = rlx_nb.load_snapshot(path)
    assert snap.has_reference and "blocks.1.attn" in snap.modules and snap.nbytes > 0
    model, _, _ = layered
    args, kwargs = snap.call("blocks.1.attn")  # the module's first call, replayed as recorded
    with torch.no_grad():
        again = model.blocks[1].attn(*args, **kwargs)
    assert torch.equal(again, torch.from_numpy(snap.outputs("blocks.1.attn")["out"].value))
    with pytest.raises(ReportFormatError, match="not a readable zip"):
        rlx_nb.load_snapshot(ROOT / "README.md")
    report = rlx_nb.backend_divergence(nn.Linear(2, 2), (torch.randn(1, 2),), backends=["cpu-nomkldnn"])
    with pytest.raises(ReportFormatError, match=r"a report: rlx_nb\.load_report reads it"):
        rlx_nb.load_snapshot(report.save(tmp_path / "r"))
    meta = json.loads(zipfile.ZipFile(path).read("meta.json"))
    for breaks, match in (
        (lambda m: m["modules"][1].update(call={"slot": 99}), "a slot below"),
        (lambda m: m["modules"][1].update(call={"pickle": "x"}), "a template node"),
        (lambda m: m.update(version=7), "version 7 is not supported"),
        (lambda m: m["arrays"]["arrays/0.npy"].update(shape=[10**9]), "has shape"),
    ):
        bad = json.loads(json.dumps(meta))
        breaks(bad)
        target = tmp_path / "bad.rlxsnap"
        with zipfile.ZipFile(path) as src, zipfile.ZipFile(target, "w") as dst:
            for item in src.infolist():
                dst.writestr(item, json.dumps(bad) if item.filename == "meta.json" else src.read(item.filename))
        with pytest.raises(ReportFormatError, match=match):
            rlx_nb.load_snapshot(target)


def test_a_byte_budget_leaves_later_modules_out_and_the_diff_says_so(tmp_path):
    model, inputs = demo.layered()
    full = rlx_nb.load_snapshot(rlx_nb.snapshot(model, inputs, tmp_path / "full"))
    budget = full.nbytes // 3
    part = rlx_nb.load_snapshot(rlx_nb.snapshot(model, inputs, tmp_path / "part", byte_budget=budget))
    assert 0 < part.nbytes <= budget
    d = rlx_nb.diff(part, model, inputs, local="all")
    left_out = d.frame[d.frame.note.str.contains("byte budget")]
    assert len(left_out) and not d.past_line
    assert d.frame.change.isin(UNTOUCHED).sum() >= 1


def test_bad_arguments_are_named(layered, tmp_path):
    model, inputs, path = layered
    with pytest.raises(InputError, match="byte_budget must be"):
        rlx_nb.snapshot(model, inputs, tmp_path / "x", byte_budget=-1)
    with pytest.raises(InputError, match="ops must be True or False, got 'yes'"):
        rlx_nb.snapshot(model, inputs, tmp_path / "x", ops="yes")
    with pytest.raises(InputError, match="local must be 'descend' or 'all'"):
        rlx_nb.diff(path, model, inputs, local="some")
    with pytest.raises(InputError, match="pass the model's inputs"):
        rlx_nb.diff(path, model)
    with pytest.raises(InputError, match="must be a snapshot"):
        rlx_nb.diff(42, model, inputs)


def test_the_command_line_gates_on_the_diff(tmp_path):
    target = "rlx_nb.models.demo:transformer"
    from rlx_nb.cli import main

    snap = tmp_path / "a.rlxsnap"
    assert main(["snapshot", target, "-o", str(snap)]) == 0
    assert main(["diff", str(snap), target]) == 0
    assert main(["diff", str(snap), target, "--backend", "fault:softmax-row"]) == 1
    assert main(["diff", str(snap), str(snap)]) == 2  # (two snapshots need a reference in one)
    assert main(["snapshot", target, "-o", str(snap), "--reference", "--ops"]) == 0
    assert main(["diff", str(snap), str(snap)]) == 0
    assert main(["diff", str(tmp_path / "missing.rlxsnap"), target]) == 2


def test_the_readme_block_runs_as_written(tmp_path, monkeypatch):
    text = (ROOT / "README.md").read_text()
    block = text.split("## After an upgrade")[1].split("```python\n")[1].split("```")[0]
    monkeypatch.chdir(tmp_path)
    shown = {}
    exec(compile(block, "README.md", "exec"), shown)
    change = shown["change"]
    assert change.culprit is None and set(change.frame.change) <= UNTOUCHED
    assert (tmp_path / "before.rlxsnap").is_file()


def test_a_model_that_fails_leaves_no_file_behind(tmp_path):
    class Fails(nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    with pytest.raises(InputError, match="the model failed on 'cpu': RuntimeError: boom"):
        rlx_nb.snapshot(Fails(), (torch.zeros(1),), tmp_path / "s", reference=True)
    assert list(tmp_path.iterdir()) == []  # (no snapshot, no half-written zip, no scratch folder)


def test_the_top_level_modules_own_ops_are_named_root_everywhere(tmp_path):
    # #62: ops the top-level module calls itself were " :: F.silu" (a blank module), and change.report("<root> ::
    # F.silu") failed; they read "<root> :: F.silu" in the frame, the lines and report().
    class Top(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return torch.nn.functional.silu(self.lin(x)) * 2

    torch.manual_seed(0)
    model, x = Top(), torch.randn(4, 8)
    path = rlx_nb.snapshot(model, x, tmp_path / "top", ops=True)
    d = rlx_nb.diff(path, model, x, backend="cpu-nomkldnn", local="all")
    assert "<root> :: F.silu" in list(d.frame.module) and not any(m.startswith(" ") for m in d.frame.module)
    assert d.report("<root> :: F.silu").suspects == []


def test_a_changes_words_follow_the_diffs_reading_in_lines_page_and_explorer(layered, tmp_path):
    # #62: carried-in modules and an edited one were "likely a kernel bug" (in to_html and the diff explorer's
    # heading); with local="all" every ancestor of the culprit was a "changed here" line of its own; a module bit
    # for bit the same read "moved within round-off" beside "bit for bit identical".
    model, inputs, path = layered
    d = rlx_nb.diff(path, model, inputs, backend="fault:softmax-row", local="all")
    change = dict(zip(d.frame.module, d.frame.change, strict=True))
    assert change["blocks.1.mlp"] == "carried in" and change["blocks.0"] == "bit for bit identical"
    carried = d.report("blocks.1.mlp", "propagated").record(d.new_label).reason
    assert "likely a kernel bug" not in carried and "carried in: within round-off alone" in carried
    here = d.report("blocks.1.attn").record(d.new_label).reason
    assert "computes differently here on its own" in here and "likely a kernel bug" not in here
    changed_lines = [ln for ln in d.lines() if ln.startswith("  changed here:")]
    assert [ln.split()[2] for ln in changed_lines] == ["blocks.0.attn", "blocks.1.attn", "blocks.2.attn"]
    assert "holding it: blocks.1, <root>" in changed_lines[1]  # (the ancestors, said with what they hold)
    for _, r in d.frame.iterrows():
        assert not (r.change == "moved within round-off" and "bit for bit identical" in r.reason), r.module
    page = d.to_html(tmp_path / "diff.html").read_text()
    assert "likely a kernel bug" not in page and "<h1>rlx_nb diff: " in page and "<h2>Environment</h2>" in page
    assert "<td class='changed'>changed here</td>" in page and "<td class='carried'>carried in</td>" in page
    assert "<td class='identical'>bit for bit identical</td>" in page
    assert d.new_label.startswith(d.environments[1]["host"]) and "torch " in d.new_label and " here" not in d.new_label
    explorer = rlx_nb.explore(d, module="blocks.1.mlp", side="propagated")
    assert "likely a kernel bug" not in explorer.status.value and "carried in" in explorer.status.value


def test_environment_differences_put_torch_and_the_backends_packages_first():
    from rlx_nb.changes.environment import differences

    old = {"torch": "2.12", "onnxruntime": "1.31", "openvino": "2026.3", "threads": 2, "zzz": 1, "litert-torch": "0.9"}
    new = {"torch": "2.13", "onnxruntime": "1.32", "threads": 4, "zzz": 2}
    lines = differences(old, new, "onnxruntime")
    assert [ln.split(":")[0] for ln in lines[:4]] == ["torch", "onnxruntime", "threads", "zzz"]
    assert lines[-1] == "packages onnxruntime does not run on: litert-torch 0.9 -> unset; openvino 2026.3 -> unset"
    assert differences(old, new, "cpu")[0].startswith("torch: 2.12 -> 2.13")
