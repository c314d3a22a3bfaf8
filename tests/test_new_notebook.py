"""A new user's notebook, written from scratch: their own model and two faulty backends of their own.

Nothing comes from ``rlx_nb.demo``.  The notebook is executed in a real kernel (nbclient) and goes
report -> explorer -> localize, as a person would; the test reads what each cell showed.  One backend
reaches into the model by attribute (``model.head.bias[3] = 0``), so it cannot run a module alone and
``localize`` has to watch full runs; the other changes every LayerNorm's eps (1e-5 -> 1e-4), a kernel
error of the size a reduced precision leaves, which must not be blamed on a precision setting.
"""

from __future__ import annotations

import json

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

CELLS = [
    """\
import torch
import rlx_nb


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(16, 32)
        self.norm1 = torch.nn.LayerNorm(32)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
        self.norm2 = torch.nn.LayerNorm(32)
        self.head = torch.nn.Linear(32, 10)

    def forward(self, x):
        h = self.norm1(self.embed(x))
        h = self.norm2(h + self.mlp(h))
        return self.head(h)


torch.manual_seed(0)
model, x = Net(), torch.randn(8, 16)""",
    """\
def head_bias_dropped(model, inputs):
    with torch.no_grad():
        model.head.bias[3] = 0.0
    return model(*inputs)


def layernorm_eps_1e4(model, inputs):
    for m in model.modules():
        if isinstance(m, torch.nn.LayerNorm):
            m.eps = 1e-4
    return model(*inputs)


rlx_nb.register_backend("mine:head-bias", head_bias_dropped, default=False)
rlx_nb.register_backend("mine:ln-eps", layernorm_eps_1e4, default=False)""",
    # Run twice, as a person re-running the cell does: the registrations replace themselves.
    """\
rlx_nb.register_backend("mine:head-bias", head_bias_dropped, default=False)
rlx_nb.register_backend("mine:ln-eps", layernorm_eps_1e4, default=False)""",
    """\
report = rlx_nb.backend_divergence(model, x, backends=["cpu-nomkldnn", "mine:head-bias", "mine:ln-eps"])
print(report)""",
    "report.backends",
    "rlx_nb.explore(report)",
    """\
import warnings

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    loc_bias = rlx_nb.localize(model, x, backend="mine:head-bias")
print("WARNED:", [str(w.message)[:80] for w in caught])
print("CULPRIT head-bias:", loc_bias.culprit, loc_bias.suspects)""",
    """\
loc_eps = report.localize("mine:ln-eps", model=model, inputs=x)
print("CULPRIT ln-eps:", loc_eps.culprit, loc_eps.suspects)
loc_eps.plot();""",
]


def _text(cell) -> str:
    parts = []
    for out in cell.outputs:
        if out.output_type == "stream" and out.name == "stdout":
            parts.append(out.text)
        elif "data" in out and "application/vnd.jupyter.widget-view+json" not in out.data:  # not a progress bar
            parts.append(out.data.get("text/plain", ""))
    return "".join(parts)


@pytest.mark.slow
def test_a_new_users_notebook_goes_from_report_to_culprit(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in CELLS]
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", store_widget_state=True)
    client.execute(cwd=str(tmp_path))  # raises on the first failing cell (a re-registration included)
    shown = [_text(c) for c in nb.cells]

    lines = {line.split()[1]: line for line in shown[3].splitlines() if " vs cpu: " in line}
    assert "round-off" in lines["cpu-nomkldnn"]
    assert "SUSPECT" in lines["mine:head-bias"] and "SUSPECT" in lines["mine:ln-eps"]
    # The eps error is a kernel error, not a precision mode: the report must not send the user to TF32/autocast.
    assert "is likely on" not in shown[3]
    assert "mine:ln-eps" in shown[4] and "SUSPECT" in shown[4]

    # The explorer opened and drew its heatmap and histogram (PNGs in the saved widget state).
    assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in nb.cells[5].outputs)
    assert json.dumps(nb.metadata["widgets"]).count("image/png") >= 2

    # localize never fails silently: it warned that the backend cannot run modules alone, and still named the culprit.
    assert "cannot run the model's modules alone" in shown[6]
    assert "CULPRIT head-bias: head" in shown[6]
    assert "CULPRIT ln-eps: norm1" in shown[7] and "'norm2'" in shown[7]  # the first of both, both listed
    assert any("image/png" in o.get("data", {}) for o in nb.cells[7].outputs)
    assert not [o for c in nb.cells for o in c.outputs if o.output_type == "error"]
