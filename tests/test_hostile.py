"""Hostile names and files (#62): nothing from a name, a label or a received file runs as code, writes outside its
folder or calls a function outside rlx_nb's allowlist.  Each test covers a class of input, not one example."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import zipfile

import pytest
import torch
from torch.overrides import TorchFunctionMode

import rlx_nb
from rlx_nb._support.safe import code_text, docstring, file_stem, inside, md_code, md_fence, md_text, write_new
from rlx_nb.changes.pure_ops import PURE_OPS
from rlx_nb.errors import InputError, ReportFormatError

HOSTILE = [
    'x\n    open("PWN", "w")\n    #',  # a line of the function, after a comment
    'q"""\nopen("PWN", "w")\n"""',  # out of the docstring
    "s'\"\\",  # quotes and a backslash
    "t\\N{bad}",  # an escape that does not compile
    "h#i",
    "```\n# heading\n<img src=x onerror=alert(1)>",  # a fence, a heading and raw HTML in the markdown
    "c\r\nd\x0be",  # other line ends
]
"""Module names a model may register (``add_module`` refuses only ``.`` and ``""``)."""


class _Wrong(TorchFunctionMode):
    # A runtime whose GELU is 0.1% off: a SUSPECT op, found at its module.
    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out * 1.001 if func is torch.nn.functional.gelu else out


def _wrong_gelu(model, inputs):
    with _Wrong():
        return model(*inputs)


class _Inner(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.nn.functional.gelu(self.lin(x))


def _hostile_model(name: str) -> torch.nn.Module:
    model = torch.nn.Sequential()
    model.add_module(name, _Inner())
    return model


@pytest.fixture(scope="module")
def wrong_gelu():
    rlx_nb.register_backend("test:wrong-gelu", _wrong_gelu, default=False, replace=True)
    return "test:wrong-gelu"


def _calls(tree: ast.AST) -> set[str]:
    # Every name a script calls (``open``, ``torch.compile``, ``print``...).
    def name(f: ast.AST) -> str:
        if isinstance(f, ast.Name):
            return f.id
        if isinstance(f, ast.Attribute):
            return f"{name(f.value)}.{f.attr}"
        return type(f).__name__

    return {name(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}


# -- generated code ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", HOSTILE, ids=[f"name{i}" for i in range(len(HOSTILE))])
def test_a_hostile_module_name_never_becomes_code_in_a_repro(name, wrong_gelu, tmp_path, monkeypatch):
    # The culprit's label (and the module names in it) enters the script's comment and docstring: the script
    # compiles, calls only what a repro calls, and its run (rlx_nb's check, in its own folder) writes nothing.
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    model = _hostile_model(name)
    loc = rlx_nb.localize(model, torch.randn(4, 8), backend=wrong_gelu)
    assert loc.culprit == f"{name} :: F.gelu"
    repro = loc.repro(tmp_path / "out", shrink=False, attribute=False)
    tree = ast.parse(repro.text)  # (compiles)
    assert ast.get_docstring(tree).startswith(f"{wrong_gelu} diverges from float64 on {code_text(loc.culprit)}")
    assert "open" not in _calls(tree) and not any("PWN" in n for n in _calls(tree))
    assert repro.reproduces is True, repro.ran
    assert not list(tmp_path.rglob("PWN*")), "the repro ran code from a module name"
    assert max(len(line) for line in ast.get_docstring(tree, clean=False).splitlines()) <= 100


def test_code_text_and_docstring_give_literals_that_are_the_text(tmp_path):
    # The two ways a string enters generated code, over every class of character a name can hold.
    texts = [*HOSTILE, "plain.name :: F.softmax", "\udc80 lone surrogate", "tab\there", "\x00nul", "é ü 中"]
    for text in texts:
        commented = code_text(text)
        assert "\n" not in commented and "\r" not in commented
        if commented != text:
            assert ast.literal_eval(commented) == text
        source = f"def f():  # {commented}\n    return 1\n"
        assert ast.parse(source).body[0].body[0].value.value == 1  # (nothing after the comment is code)
        doc = docstring(text)
        assert ast.literal_eval(doc) == text and doc.encode("utf-8")
        assert len(ast.parse(f"{doc}\nx = 1\n").body) == 2


# -- markdown ----------------------------------------------------------------------------------------------------


def test_markdown_from_names_stays_on_its_line_and_holds_no_markup():
    for text in HOSTILE:
        for made in (md_text(text), md_code(text)):
            assert "\n" not in made and "\r" not in made
        assert "<img" not in md_text(text) and not md_text(text).startswith("#")
        ticks = re.match(r"`+", md_code(text)).group()  # (one code span: its content is shown, never rendered)
        assert md_code(text).endswith(ticks) and ticks not in md_code(text)[len(ticks) : -len(ticks)]
        body = "x\n```python\ny\n````\n" + text
        fenced = md_fence(body, "python")
        fence = fenced.splitlines()[0].removesuffix("python")
        inner = fenced.splitlines()[1:-1]
        assert all(not line.startswith(fence) for line in inner)  # (no line of the text closes the fence)


def test_an_issue_for_a_hostile_name_injects_no_heading_html_or_fence(wrong_gelu, tmp_path):
    name = HOSTILE[5]  # a fence, a heading and raw HTML
    torch.manual_seed(0)
    model = _hostile_model(name)
    x = torch.randn(4, 8)
    report = rlx_nb.backend_divergence(model, x, backends=[wrong_gelu], progress=False)
    issue = report.issue(wrong_gelu, tmp_path, shrink=False, attribute=False)
    headings = [line for line in issue.text.splitlines() if line.startswith("#")]
    in_fences, fence = [], None
    for line in issue.text.splitlines():
        if fence is None and line.startswith("```"):
            fence = re.match(r"`+", line).group()
            in_fences.append(line)
        elif fence is not None and line.rstrip() == fence:
            fence = None
        elif fence is None and line.startswith("#"):
            assert line in headings
    assert [h.split(" ", 1)[0] for h in headings] == ["#", "##", "##", "##"], headings
    outside = re.sub(r"(`{3,})[^\n]*\n.*?\n\1\n", "", issue.text + "\n", flags=re.S)
    assert "<img" not in outside and fence is None
    assert issue.path.name == "issue_test_wrong-gelu.md"


# -- file names --------------------------------------------------------------------------------------------------

ESCAPING = ["evil/../../../ESCAPED", "../up", "/abs/olute", "a\\b", "..", ".", "x" * 300, "a:b+c@d"]


@pytest.mark.parametrize("name", ESCAPING, ids=[f"name{i}" for i in range(len(ESCAPING))])
def test_a_file_name_made_from_a_name_stays_in_its_folder(name, tmp_path):
    stem = file_stem(name)
    assert re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", stem) and len(stem) <= 100
    path = inside(tmp_path, f"repro_{stem}.py")
    assert path.parent == tmp_path
    with pytest.raises(InputError, match="outside its folder"):
        inside(tmp_path / "a", name if "/" in name or name == ".." else "../" + name)


def test_a_backend_named_like_a_path_writes_its_repro_and_issue_inside_the_folder(tmp_path):
    rlx_nb.register_backend("evil/../../../ESCAPED", _wrong_gelu, default=False, replace=True)
    torch.manual_seed(0)
    model, x = _hostile_model("m"), torch.randn(4, 8)
    report = rlx_nb.backend_divergence(model, x, backends=["evil/../../../ESCAPED"], progress=False)
    deep = tmp_path / "deep" / "a" / "b"
    issue = report.issue("evil/../../../ESCAPED", deep, shrink=False, attribute=False)
    written = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert written == ["deep/a/b/issue_evil_.._.._.._ESCAPED.md", "deep/a/b/repro_evil_.._.._.._ESCAPED.py"]
    assert issue.path.parent == deep


def test_the_repro_replaces_a_link_at_its_name_and_leaves_no_stale_data(wrong_gelu, tmp_path):
    torch.manual_seed(0)
    model, x = _hostile_model("m"), torch.randn(4, 8)
    loc = rlx_nb.localize(model, x, backend=wrong_gelu)
    out = tmp_path / "out"
    out.mkdir()
    target = tmp_path / "victim.txt"
    target.write_text("keep me")
    script = out / f"repro_{file_stem(wrong_gelu)}.py"
    script.symlink_to(target)
    (out / script.with_suffix(".npz").name).write_bytes(b"stale")  # (an earlier, larger repro's data)
    repro = loc.repro(out, shrink=False, attribute=False, check=False)
    assert target.read_text() == "keep me" and not repro.path.is_symlink()
    assert repro.data is None and not script.with_suffix(".npz").exists()  # (inline data: the stale file is gone)
    issue = rlx_nb.backend_divergence(model, x, backends=[wrong_gelu], progress=False)
    text = issue.issue(wrong_gelu, out, shrink=False, attribute=False, check=False).text
    assert ".npz" not in text.split("## Repro", 1)[1].split("```", 1)[0]  # (not cited)


def test_write_new_writes_whole_files_and_never_through_a_link(tmp_path):
    target = tmp_path / "victim"
    target.write_text("keep")
    (tmp_path / "link").symlink_to(target)
    write_new(tmp_path / "link", "new")
    assert target.read_text() == "keep" and (tmp_path / "link").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "victim"]  # (no partial file left)


def test_odd_issue_and_repro_paths_are_refused_or_taken_as_files(wrong_gelu, tmp_path):
    torch.manual_seed(0)
    model, x = _hostile_model("m"), torch.randn(4, 8)
    report = rlx_nb.backend_divergence(model, x, backends=[wrong_gelu], progress=False)
    with pytest.raises(InputError, match=r"no backend 'nope' in this report"):
        report.issue("nope", tmp_path / "never")
    with pytest.raises(
        InputError, match=r"no backend 'test:wrong_gelu' in this report \(did you mean 'test:wrong-gelu'"
    ):
        report.issue("test:wrong_gelu", tmp_path / "never")
    assert not (tmp_path / "never").exists()  # (no empty folder left)
    repro = report.repro(wrong_gelu, tmp_path / "x.PY", shrink=False, attribute=False, check=False)
    assert repro.path == tmp_path / "x.PY" and repro.path.is_file()
    with pytest.raises(rlx_nb.errors.FileWriteError, match="longer than the file system's 255 bytes"):
        report.issue(wrong_gelu, tmp_path / ("n" * 300) / "issue.md")


# -- a received snapshot names only pure ops ---------------------------------------------------------------------

FORBIDDEN = ["torch.save", "torch.load", "torch.from_file", "Tensor.apply_", "Tensor.map_", "Tensor.__setstate__",
             "Tensor.register_hook", "torch.manual_seed", "torch.rand", "F.dropout", "Tensor.numpy", "Tensor.storage",
             "Tensor.copy_", "Tensor.to", "Tensor.cuda", "os.system", "builtins.open", "torch.hub.load",
             "Tensor.__reduce_ex__", "torch.set_num_threads", "torch.ops.aten.from_file"]  # fmt: skip


def test_the_allowlist_holds_no_function_that_reaches_past_tensors():
    assert not set(FORBIDDEN) & PURE_OPS
    deny = re.compile(r"save|load|file|seed|rand|dropout|hook|storage|numpy|setstate|^__reduce|apply_|map_|cuda|_$")
    assert not [n for n in PURE_OPS if deny.search(n.rpartition(".")[2]) and not n.endswith("__")]
    assert {"F.softmax", "F.gelu", "F.avg_pool2d", "torch.matmul", "Tensor.__add__", "Tensor.matmul"} <= PURE_OPS


@pytest.fixture(scope="module")
def with_ops(tmp_path_factory):
    torch.manual_seed(0)
    model, x = _hostile_model("m"), torch.randn(4, 8)
    path = rlx_nb.snapshot(model, x, tmp_path_factory.mktemp("snap") / "ops", ops=True)
    return model, x, path


def _forged(path, where, op: str):
    with zipfile.ZipFile(path) as zf:
        meta = json.loads(zf.read("meta.json"))
        entries = {n: zf.read(n) for n in zf.namelist() if n != "meta.json"}
    entry = next(m for m in meta["modules"] if m.get("op"))
    entry["op"] = op
    entry["call"] = {"tuple": [{"tuple": [{"slot": 0}, {"value": "PWNED.pt"}]}, {"dict": {}}]}
    forged = where / f"forged-{file_stem(op)}.rlxsnap"
    with zipfile.ZipFile(forged, "w") as zf:
        zf.writestr("meta.json", json.dumps(meta))
        for n, data in entries.items():
            zf.writestr(n, data)
    return forged


@pytest.mark.parametrize("op", FORBIDDEN)
def test_a_forged_snapshot_op_is_refused_before_anything_runs(op, with_ops, tmp_path, monkeypatch):
    model, x, path = with_ops
    monkeypatch.chdir(tmp_path)
    forged = _forged(path, tmp_path, op)
    with pytest.raises(ReportFormatError, match="list of pure tensor computations"):
        rlx_nb.diff(forged, model, x, local="all")
    with pytest.raises(InputError, match="not on rlx_nb's list of pure tensor computations"):
        rlx_nb.changes.ops.resolve(op)
    assert not list(tmp_path.glob("PWNED*"))


def test_a_forged_snapshot_is_refused_by_the_command_line_too(with_ops, tmp_path):
    path = with_ops[2]
    forged = _forged(path, tmp_path, "torch.save")
    target = tmp_path / "models.py"
    target.write_text(
        "import torch\n\n"
        "class _Inner(torch.nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.lin = torch.nn.Linear(8, 8)\n\n"
        "    def forward(self, x):\n        return torch.nn.functional.gelu(self.lin(x))\n\n"
        "def make():\n    torch.manual_seed(0)\n    model = torch.nn.Sequential()\n"
        "    model.add_module('m', _Inner())\n    return model, torch.randn(4, 8)\n"
    )
    done = subprocess.run([sys.executable, "-m", "rlx_nb.cli", "diff", str(forged), f"{target}:make"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 2 and "list of pure tensor computations" in done.stderr, done.stderr
    assert not list(tmp_path.glob("PWNED*"))


def _rewritten(path, where, edit):
    # The file at ``path`` with its meta.json edited by ``edit(meta)``, written to ``where``.
    with zipfile.ZipFile(path) as zf:
        meta = json.loads(zf.read("meta.json"))
        entries = {n: zf.read(n) for n in zf.namelist() if n != "meta.json"}
    edit(meta)
    with zipfile.ZipFile(where, "w") as zf:
        zf.writestr("meta.json", json.dumps(meta))
        for n, data in entries.items():
            zf.writestr(n, data)
    return where


@pytest.mark.parametrize("declared", ["complex128", "float64", "int32", "float16", "uint8"])
def test_a_declared_dtype_the_stored_array_does_not_have_is_refused(declared, with_ops, tmp_path):
    # #62: a complex128 declared over float32 data was read as is.  Snapshots and reports alike (bfloat16 is the one
    # dtype stored as another: float32, exactly).
    model, x, path = with_ops

    def snapshot_edit(meta):
        for spec in meta["arrays"].values():
            spec["dtype"] = declared

    forged = _rewritten(path, tmp_path / "dtype.rlxsnap", snapshot_edit)
    with pytest.raises(ReportFormatError, match=f"holds float32, but meta.json declares it {declared}"):
        rlx_nb.load_snapshot(forged)
    report = rlx_nb.backend_divergence(model, x, backends=["cpu-nomkldnn"], progress=False)

    def report_edit(meta):
        for out in meta["runs"]["oracle"]["outputs"].values():
            out["dtype"] = declared

    forged = _rewritten(report.save(tmp_path / "r.rlxnb"), tmp_path / "dtype.rlxnb", report_edit)
    with pytest.raises(ReportFormatError, match=f"holds float32, but meta.json declares it {declared}"):
        rlx_nb.load_report(forged)


def test_a_snapshot_to_a_folder_is_refused_before_the_model_runs(tmp_path):
    ran = []

    def model(x):
        ran.append(1)
        return x * 2

    (tmp_path / "there.rlxsnap").mkdir()
    for path in (tmp_path, tmp_path / "there.rlxsnap", tmp_path / "there"):
        with pytest.raises(InputError, match="is a folder; give a file to write"):
            rlx_nb.snapshot(model, torch.ones(2), path)
    assert ran == []
