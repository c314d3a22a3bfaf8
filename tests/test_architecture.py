"""The package layers of docs/architecture.md hold: each package imports only its own layer or lower ones, no
file imports another in a circle, each name is imported from where it is defined."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import rlx_nb

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rlx_nb"
DOC = ROOT / "docs" / "architecture.md"


def _layers() -> dict[str, int]:
    # The table in docs/architecture.md: "| <layer> | `package`, `module` | ..." -- the document is the source.
    layers: dict[str, int] = {}
    for line in DOC.read_text().splitlines():
        m = re.match(r"^\| (\d+) \| ([^|]+) \|", line)
        if m:
            for name in re.findall(r"`([\w.]+)`", m.group(2)):
                layers[name] = int(m.group(1))
    return layers


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _package(module: str) -> str:
    # The package a module belongs to: rlx_nb.verdict.rule -> verdict; a top-level module is its own (api, cli ...).
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "rlx_nb"


def _imports(path: Path, *, typing: bool = True) -> set[str]:
    # Every rlx_nb module this file imports, at module level or inside functions; ``typing=False`` leaves
    # out the imports under ``if TYPE_CHECKING:``, which never run.
    out: set[str] = set()
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    if not typing:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
                skip.update(id(n) for n in ast.walk(node))
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rlx_nb"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                out.add(full if (PACKAGE.parent / (full.replace(".", "/") + ".py")).exists() else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("rlx_nb"))
    return out


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def test_every_package_has_a_layer_in_the_architecture_document():
    layers = _layers()
    missing = sorted({_package(m) for m in _modules()} - set(layers))
    assert not missing, f"docs/architecture.md does not place: {missing}"


def test_no_package_imports_a_later_one():
    layers = _layers()
    upward = []
    for module, path in _modules().items():
        own = layers[_package(module)]
        for target in _imports(path):
            theirs = layers.get(_package(target), -1)
            if theirs > own:
                upward.append(f"{module} (layer {own}) imports {target} (layer {theirs})")
    assert not upward, "\n".join(upward)


def test_no_import_cycle():
    modules = _modules()
    graph = {m: {t for t in _imports(p, typing=False) if t in modules and t != m} for m, p in modules.items()}
    # a package imports its own submodules; that is its job, not a cycle
    graph = {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in graph.items()}
    seen: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        seen[m] = 1
        stack.append(m)
        for t in graph[m]:
            if seen.get(t) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*stack[stack.index(t) :], t]))
            if t not in seen:
                visit(t)
        stack.pop()
        seen[m] = 2

    for m in graph:
        if m not in seen:
            visit(m)


def _defined(path: Path) -> set[str]:
    # The names a module defines at its top level (functions, classes, assignments, also under if/try).
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        for sub in [node, *(ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else ())]:
            if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(sub.name)
            elif isinstance(sub, (ast.Assign, ast.AnnAssign)):
                for target in sub.targets if isinstance(sub, ast.Assign) else [sub.target]:
                    names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def test_each_name_has_one_import_path():
    # Every name is imported from the module that defines it, and no module's __all__ lists another's: a name
    # reached two ways (a re-export) is two paths to keep.  (rlx_nb itself hands out the public names.)
    modules = _modules()
    defined = {m: _defined(p) for m, p in modules.items()}
    through = []
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in modules and node.module != "rlx_nb":
                for a in node.names:
                    if f"{node.module}.{a.name}" not in modules and a.name not in defined[node.module]:
                        through.append(f"{module}: from {node.module} import {a.name}")
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
                listed = [e.value for e in node.value.elts]
                if module != "rlx_nb":
                    through += [f"{module}.__all__ lists {n}" for n in listed if n not in defined[module]]
    assert not through, "\n".join(through)


def test_packages_are_nouns_that_shadow_no_public_function():
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert packages & set(rlx_nb.__all__) == set()
    for name in ("run", "compare", "localize", "explore"):  # (these were modules a function of the name hid)
        assert callable(getattr(rlx_nb, name)), name


def test_modules_stay_small():
    big = {m: len(p.read_text().splitlines()) for m, p in _modules().items()}
    assert {m: n for m, n in big.items() if n > 500} == {}, "a module past ~400 lines is asking to be split"


# Functions whose signature is someone else's, or the public API a user calls with keywords.
WIDE_SIGNATURES = {
    "rlx_nb.api.backend_divergence": "the public entry point: its keywords are the user's options",
    "rlx_nb.execution.run.run": "public (rlx_nb.run): backend_divergence's run without the comparison",
    "rlx_nb.generation.divergence.generation_divergence": "the public entry point for a decode: backend_divergence's options and its own",
    "rlx_nb.training.divergence.training_divergence": "the public entry point for training: the user's options",
    "rlx_nb.configurations.run.invariance": "the public entry point for invariance: the user's options",
    "rlx_nb.backends.registry.register_backend": "public: a backend's description, every field a keyword",
    "rlx_nb.plot.heatmap.plot_heatmap": "public: a plot's keywords, as matplotlib's are",
    "rlx_nb.backends.faults.attention": "torch.nn.functional.scaled_dot_product_attention's own signature",
    "rlx_nb.int8.requantization.quantize": "quantized_decomposed.quantize_per_tensor's own signature (it takes that op's place)",
    "rlx_nb.int8.faults.quantize": "the same signature, rounding ties half up",
    "rlx_nb.int8.decisive.quantize": "the same signature, rounding as a plan says (decisive elements flipped, held)",
}


def _signatures():
    # Every function and method: (qualified module.name, positional count, total count, is an autograd forward).
    for module, path in _modules().items():
        tree = ast.parse(path.read_text())
        forwards = {
            id(f)
            for c in ast.walk(tree)
            if isinstance(c, ast.ClassDef)
            and any(getattr(b, "attr", getattr(b, "id", "")) == "Function" for b in c.bases)
            for f in c.body
            if isinstance(f, ast.FunctionDef) and f.name in ("forward", "backward")
        }
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                positional = [x for x in a.posonlyargs + a.args if x.arg not in ("self", "cls")]
                yield (
                    f"{module}.{node.name}",
                    len(positional),
                    len(positional) + len(a.kwonlyargs),
                    id(node) in forwards,
                )


def test_no_function_takes_more_than_five_positional_or_ten_parameters():
    # (numba kernels aside: rlx_nb/_fused.py; an autograd Function's forward takes the op's inputs)
    wide = [
        f"{name}: {pos} positional, {total} in all"
        for name, pos, total, autograd in _signatures()
        if (pos > 5 or total > 10)
        and not autograd
        and name not in WIDE_SIGNATURES
        and not name.startswith("rlx_nb.numerics.fused")
    ]
    assert not wide, "\n".join(wide)


def test_a_new_metric_is_two_files():
    # docs/development.md: a metric is a PairStats name (numerics/pairs.py) and a PairFields field
    # (verdict/records.py); the comparator copies it by name and every table and saved file carries it.
    import dataclasses

    from rlx_nb.comparison import comparators, tables
    from rlx_nb.numerics.pairs import PairStats
    from rlx_nb.verdict.records import PairFields

    worst = {"worst_index", "oracle_value", "backend_value", "reference_value", "mismatched_frac"}
    statistics = [f.name for f in dataclasses.fields(PairFields) if f.name not in worst]
    assert [
        n for n in statistics if not hasattr(PairStats, n) and n not in {f.name for f in dataclasses.fields(PairStats)}
    ] == []
    assert set(comparators._FROM_STATS) == set(statistics)
    assert [n for n in (f.name for f in dataclasses.fields(PairFields)) if n not in tables.SUMMARY_COLUMNS] == []
    saved = {name for name, _, _ in tables.record_fields()}
    assert set(statistics) <= saved


def test_a_new_cause_is_two_files():
    # docs/development.md: a cause is its constant and its words (verdict/words.py) and its clause (verdict/rule.py).
    from rlx_nb.verdict.words import WORDS, Cause

    causes = {v for k, v in vars(Cause).items() if k.isupper()}
    assert causes == set(WORDS), causes ^ set(WORDS)
    # the rule names no words: every sentence comes from the table
    rule = (ROOT / "rlx_nb" / "verdict" / "rule.py").read_text()
    assert "WORDS" not in rule and "def reason" not in rule


def test_each_output_record_is_built_once():
    # An OutputRecord is made whole in three places only -- from a finding (verdict/records.py), for a backend that
    # could not run (comparison/compare.py), from a saved row (comparison/tables.py) -- and no module copies one
    # with changes (dataclasses.replace of a record): nothing patches a record after it is built.
    makers, patched = set(), []
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "id", getattr(node.func, "attr", ""))
            if name == "OutputRecord":
                makers.add(module)
            if name == "replace" and node.args and "rec" in ast.unparse(node.args[0]).lower():
                patched.append(f"{module}: {ast.unparse(node)[:80]}")
    assert makers == {"rlx_nb.verdict.records", "rlx_nb.comparison.compare", "rlx_nb.comparison.tables"}, makers
    assert not patched, patched
