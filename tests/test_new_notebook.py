"""A new user's notebook, written from scratch: their own model and two faulty backends of their own.

Nothing comes from ``rlx_nb.models.demo``.  The notebook is executed in a real kernel (nbclient) and goes
report -> explorer -> localize, as a person would; the test reads what each cell showed.  One backend
reaches into the model by attribute (``model.head.bias[3] = 0``), so it cannot run a module alone and
``localize`` has to watch full runs; the other changes every LayerNorm's eps (1e-5 -> 1e-4), a kernel
error of the size a reduced precision leaves, which must not be blamed on a precision setting.
"""

from __future__ import annotations

import ast
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


HF_CELLS = [
    """\
import torch, transformers, rlx_nb

config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=200, bos_token_id=0, eos_token_id=0)
torch.manual_seed(0)
model = transformers.GPT2LMHeadModel(config).eval()       # my model, as it is
inputs = {"input_ids": torch.randint(0, 200, (2, 12))}""",
    """\
from torch.overrides import TorchFunctionMode

class BadNorm(TorchFunctionMode):                         # my runtime: its layer norm is off at position 3
    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.nn.functional.layer_norm:
            out = out.clone(); out[..., 3, :] *= 1.001
        return out

def my_runtime(model, inputs):
    with BadNorm():
        return model(*inputs)

rlx_nb.register_backend("my-runtime", my_runtime, hookable=True)""",
    """\
report = rlx_nb.backend_divergence(model, inputs, backends=["cpu-nomkldnn", "my-runtime"])
report""",
    """\
rec = report.record("my-runtime")
print("WORST", rec.output, rec.pair.worst_index, rec.reason)
ax = report.plot.heatmap()""",
    "rlx_nb.explore(report)",
    """\
loc = report.localize()
print("CULPRIT", loc.culprit)""",
]


@pytest.mark.slow
def test_a_new_users_hugging_face_notebook_reaches_the_element_and_module_in_six_cells(tmp_path):
    # A Hugging Face model passed as it is and a faulty backend of the user's own: report, the picture of the
    # offending element, the explorer on it, the module -- six cells, none from rlx_nb's demos.
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in HF_CELLS]
    assert len(nb.cells) <= 6
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", store_widget_state=True)
    client.execute(cwd=str(tmp_path))
    shown = [_text(c) for c in nb.cells]
    assert "suspects=['my-runtime']" in shown[2]
    html = next(o.data["text/html"] for o in nb.cells[2].outputs if "text/html" in o.get("data", {}))
    assert "my-runtime" in html and "SUSPECT" in html  # the backends table, in the report's own view
    worst = next(line for line in shown[3].splitlines() if line.startswith("WORST"))
    output, index = worst.split()[1], ast.literal_eval(worst.split(" ", 2)[2].split(")")[0] + ")")
    # The worst element sits at the faulty position: logits (batch, position, vocab) or a cache (batch, head,
    # position, feature).
    assert index[1 if output == "logits" else 2] == 3, worst
    assert any("image/png" in o.get("data", {}) for o in nb.cells[3].outputs)  # the heatmap drawn
    explorer = [o for o in nb.cells[4].outputs if o.get("data")]
    assert "image/png" in explorer[0].data and "my-runtime" in explorer[0].data["text/html"]  # its snapshot
    assert "application/vnd.jupyter.widget-view+json" in explorer[1].data
    assert "CULPRIT transformer.h.0.ln_1 :: F.layer_norm" in shown[5]  # the first module the fault touches
    assert f"worst {index}" in explorer[0].data["text/html"] or str(index) in explorer[0].data["text/html"]


def test_an_rlx_nb_error_shows_the_users_line_and_the_message_not_rlx_nbs_source():
    # #62: a notebook showed ~25 lines of rlx_nb's source before the message.  In a real kernel: the cell's line and
    # the message, with "did you mean" for a backend name off by a dash; %tb still shows the whole traceback.
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("import torch, rlx_nb"),
        nbformat.v4.new_code_cell(
            "model = torch.nn.Linear(2, 2)\n"
            "rlx_nb.backend_divergence(model, torch.randn(1, 2), backends=['onnx-runtime'], progress=False)"
        ),
        nbformat.v4.new_code_cell("%tb"),
        nbformat.v4.new_code_cell("1 / 0"),  # (any other error: IPython's own traceback, as before)
    ]
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", allow_errors=True).execute()
    error = next(o for o in nb.cells[1].outputs if o.output_type == "error")
    shown = "\n".join(error.traceback)
    assert error.ename == "BackendError" and "did you mean 'onnxruntime'" in error.evalue
    assert len(error.traceback) <= 3 and "backends=['onnx-runtime']" in shown, shown
    assert "rlx_nb/" not in shown and "def " not in shown  # (none of rlx_nb's source)
    full = "".join(o.get("text", "") + "\n".join(o.get("traceback", [])) for o in nb.cells[2].outputs)
    assert "Traceback" in full and "rlx_nb" in full  # (%tb: the whole traceback, into rlx_nb)
    other = next(o for o in nb.cells[3].outputs if o.output_type == "error")
    assert other.ename == "ZeroDivisionError" and len(other.traceback) > 1
