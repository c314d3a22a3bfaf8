"""Shared fixtures: seeded RNG, the live candidate backends, cached demo reports.

``RLX_NB_TEST_BACKENDS`` (comma-separated) picks the candidate backends the
verdict tests run; by default every live default backend.  A backend that is
not live here is skipped, never failed.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys

import numpy as np
import pytest
import torch

import rlx_nb
from rlx_nb.models import demo
from tests.watch import (  # noqa: F401  (hooks: the slow and stuck tests named as the suite runs)
    pytest_configure,
    pytest_pyfunc_call,
    pytest_runtest_logfinish,
    pytest_runtest_logstart,
    pytest_unconfigure,
)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def candidate_backends() -> list[str]:
    live = [b for b in rlx_nb.available_backends() if b != "cpu"]
    wanted = os.environ.get("RLX_NB_TEST_BACKENDS")
    if not wanted:
        return live
    return [b.strip() for b in wanted.split(",") if b.strip()]


@contextlib.contextmanager
def compiler_caches_off():
    """Around a planted compiler fault: Inductor's FX graph cache and AOTAutograd's off.  Their keys hold the graph
    and the config, not the decomposition or lowering tables a plant changes, so a compile made under the plant was
    kept on disk and served later to the same graph compiled correctly, in any process of the machine (a correct
    Tanh compiled as the planted sigmoid, a GELU as its planted approximation)."""
    import torch._functorch.config as functorch_config
    from torch._inductor import config as inductor_config

    with functorch_config.patch(enable_autograd_cache=False), inductor_config.patch(fx_graph_cache=False):
        yield


def require_live(name: str) -> None:
    if name not in rlx_nb.available_backends(include_optin=True):
        pytest.skip(f"backend {name} is not live here")


@contextlib.contextmanager
def numpy_metrics():
    """Run :func:`rlx_nb.numerics.pairs.pair_stats` on its numpy path (as without numba) inside the block."""
    from rlx_nb.numerics import fused as _fused

    saved = _fused.kernel
    _fused.kernel = lambda: None
    try:
        yield
    finally:
        _fused.kernel = saved


@pytest.fixture(params=["fused", "numpy"])
def metrics_path(request):
    """Each metric test twice: the numba kernel and the numpy fallback must agree with the reference."""
    if request.param == "fused":
        from rlx_nb.numerics import fused as _fused

        if _fused.kernel() is None:
            pytest.skip("numba is not installed")
        yield "fused"
    else:
        with numpy_metrics():
            yield "numpy"


def per_notebook(paths, ids: bool = True) -> list:
    """Parameters for tests over the walkthrough notebooks, each in the xdist group of its notebook: under
    ``pytest -n`` (``make test``) a notebook's tests run in one worker, which executes it once for all of them
    (:func:`executed_notebook`), and different notebooks run in parallel."""
    return [
        pytest.param(p if ids else p.name, id=p.name, marks=pytest.mark.xdist_group(f"notebook-{p.name}"))
        for p in paths
    ]


@pytest.hookimpl(optionalhook=True)  # (a hook of pytest-xdist's: without it, as with -p no:xdist, it is never called)
def pytest_xdist_node_collection_finished(node, ids):
    # Under ``--dist loadgroup`` a grouped test's id carries its group (``...@notebook-01_...``), or pytest-xdist
    # spreads the group over every worker, each executing the notebooks and building the shared fixtures again:
    # pytest 9.2 with pytest-xdist 3.8 does that silently (pytest-dev/pytest-xdist#1386) and the suite took 1.5x
    # its time.  Every test of tests/test_html_report.py is in one group (its pytestmark): say so if their ids came
    # without it.
    if getattr(node.config.option, "dist", None) == "loadgroup":
        grouped = [i for i in ids if i.startswith("tests/test_html_report.py::")]
        if grouped and not any("@" in i for i in grouped):
            pytest.exit(
                f"--dist loadgroup lost the tests' xdist_group (e.g. {grouped[0]}): pytest {pytest.__version__} with "
                "this pytest-xdist does not group (pytest-dev/pytest-xdist#1386); install the pinned pytest "
                "(pip install -e '.[dev]')",
                returncode=4,
            )


def pytest_collection_modifyitems(config, items):
    # Under ``--dist loadgroup`` the workers take the tests in this order, a group as one unit: the groups first
    # (int8's takes minutes in one worker), then the tests marked slow, then the rest, which fill the gaps at the end
    # (in collection order the int8 group came late, and one worker ran it alone for its last minute).
    if getattr(config.option, "dist", None) == "loadgroup":
        items.sort(key=lambda i: (i.get_closest_marker("xdist_group") is None, i.get_closest_marker("slow") is None))


REFREEZE_MODULES = 200
"""A worker freezes what it holds again once this many modules were imported since it last did (:func:`_freeze`)."""

_FROZEN = {"modules": 0}


def _freeze() -> None:
    # What a worker has loaded (torch, its exporters and compilers, transformers: 600,000 objects and more) is moved out
    # of the collector's reach (``gc.freeze``): a full collection walked all of it, 0.6 s and more a time, and rlx_nb
    # collects on purpose where cycles hold what it lets go (after a training run's envelope, a dropped preparation),
    # besides the collections allocation starts (a fifth of an ExecuTorch lowering in a loaded worker).  What is
    # frozen stays alive; what a test makes after it is collected as ever.  Collected first, so no garbage is kept.
    gc.collect()
    gc.freeze()
    _FROZEN["modules"] = len(sys.modules)


def pytest_collection_finish(session):
    _freeze()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    # Between tests, once a test imported much more (an exporter, a model zoo): frozen too.
    if len(sys.modules) - _FROZEN["modules"] >= REFREEZE_MODULES:
        _freeze()


NO_IRI_CHECKER = "rfc3987_syntax"
"""jsonschema loads this package, where it is installed, for its "iri" format checker, and the package builds a Lark
parser from its grammar as it is imported: 3.1 s of every process that imports nbformat (each worker, at collection,
and the browser test's JupyterLab).  No schema the suite validates has that format; without the package jsonschema
leaves the format unchecked, as where it is not installed.  (None in ``sys.modules``: its import raises ImportError.)"""
sys.modules.setdefault(NO_IRI_CHECKER, None)

collect_ignore = ["_torchrun_job.py", "_torchrun_diff_job.py"]  # run by torchrun, not imported by pytest

_REPORTS: dict[tuple, rlx_nb.DivergenceReport] = {}


class SelfAttention(torch.nn.Module):
    """Attention of ``q`` over itself under a boolean mask: what LiteRT converts wrong where a row keeps no key."""

    def forward(self, q, keep):
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=keep)


def fully_masked_row(heads: int = 2) -> tuple[torch.nn.Module, tuple]:
    """:class:`SelfAttention` with a causal mask whose last row keeps no key (PyTorch gives zeros there)."""
    q = torch.randn(1, heads, 4, 8, generator=torch.Generator().manual_seed(0))
    keep = torch.tril(torch.ones(4, 4, dtype=torch.bool))
    keep[3] = False
    return SelfAttention(), (q, keep)


def demo_report(family: str, backends: tuple[str, ...], *, backward: bool = True) -> rlx_nb.DivergenceReport:
    """One report per (family, backends, backward), shared across tests (compiles are slow)."""
    key = (family, backends, backward)
    if key not in _REPORTS:
        model, inputs = demo.MODELS[family]()
        _REPORTS[key] = rlx_nb.backend_divergence(
            model, inputs, backends=list(backends), backward=backward, label=family
        )
    return _REPORTS[key]


@pytest.fixture(scope="session")
def executed_notebook(tmp_path_factory):
    """Execute a walkthrough notebook once per session (nbclient, a real kernel) and return the executed copy.

    ``test_notebooks`` checks each ran without an error; ``test_browser`` opens the same executed copies in
    JupyterLab to look at their figures, so no notebook is executed twice.
    """
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    out = tmp_path_factory.mktemp("executed")
    done: dict[str, object] = {}

    def execute(path):
        if path.name not in done:
            nb = nbformat.read(path, as_version=4)
            client = nbclient.NotebookClient(
                nb,
                timeout=900,
                kernel_name="python3",
                store_widget_state=True,
                resources={"metadata": {"path": str(path.parent)}},
            )
            try:
                client.execute()  # raises CellExecutionError on the first failing cell
            except Exception as error:
                done[path.name] = error
                raise
            target = out / path.name
            nbformat.write(nb, target)
            done[path.name] = target
        result = done[path.name]
        if isinstance(result, Exception):
            raise result
        return result

    return execute
