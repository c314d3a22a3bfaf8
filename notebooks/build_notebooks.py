"""Write the walkthrough notebooks from their cells and execute them so they are committed with outputs.

python notebooks/build_notebooks.py          # all
python notebooks/build_notebooks.py 01       # those whose name starts with 01
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).parent

FIND_THE_SUSPECT = [
    (
        "md",
        """# 01 · Find the suspect

A model gives different numbers on some backend than on the CPU. Is that floating-point round-off, or a kernel bug — and where?

This notebook runs the demo transformer block on **every backend live on this machine** plus one deliberately faulty backend from the catalogue (`fault:softmax-row`: a softmax whose normaliser is wrong on one row), reads the report, walks from the suspect backend to its worst output and the offending element, and contrasts it with a legitimate backend whose differences are round-off.""",
    ),
    (
        "code",
        """import rlx_nb
from rlx_nb.models import demo

model, inputs = demo.transformer()          # one pre-norm encoder block, seeded, random weights
live = [b for b in rlx_nb.available_backends() if b != "cpu"]
print("live candidate backends:", live)
report = rlx_nb.backend_divergence(model, inputs, backends=live + ["fault:softmax-row"], label="transformer")
report""",
    ),
    (
        "md",
        """Each backend is judged against a **float64 reference**: the fp32 oracle's own error against fp64 is the round-off *budget*, and a backend is SUSPECT when its error is many times that budget. One number says how close: `line`, the backend's place on the **SUSPECT line** (1.0 is the line: below it round-off, above it SUSPECT), the same in every table, text line and plot. A backend that could not run the model at all is an `error` row, with the cause in `why` and the whole error in `report.error_detail(name)`.

The seed's fixed rule (`max_rel > 2e-3`) is computed too — `verdict_fixed`, in `report.backends_detail` with every other column — and it gets legitimate backends wrong, because outputs near zero blow the relative error up:""",
    ),
    ("code", """report.backends"""),
    (
        "code",
        """report.backends_detail[["backend", "verdict", "verdict_fixed", "max_rel", "ratio_rmse", "ratio_max"]]""",
    ),
    ("md", """## The suspect and its worst output"""),
    (
        "code",
        """suspect = report.suspects[0]
rec = report.record(suspect)          # the backend's worst output
print(f"{suspect}: output {rec.output!r} — {rec.reason}")
p = rec.pair  # the pair statistics (rec.judgement: the verdict, its cause and figures)
print(f"worst element {p.worst_index}: oracle {p.oracle_value:.7g}, backend {p.backend_value:.7g}, fp64 {p.reference_value:.10g}")""",
    ),
    (
        "md",
        """The heatmap shows every element's error against fp64 on the same scale (`metric="line"`, the default): 1 is the SUSPECT line, blue below it, red above. The whole (4, 128, 256) output folds to 2-D with batch × token on the rows and features on the columns, max-pooled so no outlier can vanish; the worst element is marked:""",
    ),
    ("code", """ax = report.plot.heatmap(suspect, rec.output)"""),
    (
        "md",
        """The faulty row is one of 512, and it shows: a red band at the top, outlined, and a spike in the row profile beside the map (each row's and column's largest error; a bad row, column or channel is a spike there at any output size). Zoom in — the plot functions take plain arrays too — on batch 0, tokens 0 to 15: token 0 is red across all 256 features, tens to hundreds of times the round-off budget, and every other token sits at the oracle's own round-off.""",
    ),
    (
        "code",
        """from rlx_nb.plot.heatmap import plot_heatmap

oracle, backend, fp64 = report.arrays(suspect, rec.output)
from rlx_nb.verdict.types import MAX_LIMIT

line = MAX_LIMIT * rec.judgement.budget_max   # one element this far off makes the output SUSPECT on its own
ax = plot_heatmap(oracle[0, :16], backend[0, :16], fp64[0, :16], metric="line", budget=line,
                  title=f"{suspect} · batch 0, tokens 0-15 · x of the SUSPECT line")""",
    ),
    ("code", """report.elements(suspect, rec.output, top=8)"""),
    (
        "md",
        """Every one of the worst elements is in batch 0, token 0 — the row whose softmax normaliser is off. That is where to look: the attention softmax of the first query.

## A legitimate backend, for contrast

`cpu-nomkldnn` (eager with oneDNN off) computes the same model with other kernels. Its differences are scattered, within the oracle's own round-off, and nowhere concentrated:""",
    ),
    (
        "code",
        """legit = "cpu-nomkldnn"
print(report.record(legit).reason)
ax = report.plot.heatmap(legit, "out")""",
    ),
    ("code", """ax = report.plot.histogram("out", metric="line", highlight=suspect)"""),
    (
        "md",
        """Each element's error in units of the SUSPECT line, one line per backend: the faulty backend (red, the colour of SUSPECT everywhere) has a tail right of the line (dashed, at 1), the legitimate ones sit far left of it. Backends whose histograms are identical say so in the legend.""",
    ),
    (
        "code",
        """import matplotlib.pyplot as plt

fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), layout="constrained")
report.plot.scatter(suspect, "out", ax=axes[0])
report.plot.tolerance_curve("out", ax=axes[1]);""",
    ),
    (
        "md",
        """Left: the suspect's errors against the oracle's magnitude — the dashed line is the seed's `max_rel = 2e-3`. Right: how many elements fail a relative tolerance as it varies: the legitimate backends fail many elements at tight tolerances too, which is why a fixed tolerance cannot separate them.

## Explore

The explorer puts it together: pick a backend (suspects first), an output (worst first), a metric; see the heatmap and histogram; pick an element from the worst list or type an index to inspect its values and neighbourhood. With `%matplotlib widget` (ipympl), click the heatmap to select.""",
    ),
    (
        "code",
        """explorer = rlx_nb.explore(report)
explorer""",
    ),
]

LOCALIZE = [
    (
        "md",
        """# 02 · Localize the operator

Knowing that `logits` diverge on a backend is half an answer. This notebook goes from the report to the **module and the torch function where the error is born**, and writes a standalone reproduction.

The model is a 3-block transformer classifier (`demo.layered`). The faulty backend `fault:softmax-row` has a softmax whose normaliser is wrong on one row — confined here to block 1 (`fault_layer=1`), so we know the answer to find.""",
    ),
    (
        "code",
        """import matplotlib.pyplot as plt
import rlx_nb
from rlx_nb.models import demo

model, inputs = demo.layered(fault_layer=1)
live = [b for b in rlx_nb.available_backends() if b != "cpu"]
report = rlx_nb.backend_divergence(model, inputs, backends=live + ["fault:softmax-row"], label="layered")
print(report)""",
    ),
    (
        "md",
        """Any `ERROR` line above is a backend that could not run this model at all (an export or a conversion that failed): it is no comparison, and its reason names the cause; `report.error_detail(name)` has the whole error.""",
    ),
    (
        "code",
        """for name in report.errors:
    print(name, "—", report.record(name).reason)
print("backends that did not run:", report.errors or "none")""",
    ),
    (
        "md",
        """## Localize

`report.localize()` takes the first suspect. Each module runs **alone** on the backend, fed the oracle's own inputs to that module: its *local* error is what it introduces, judged by the same round-off budget as the report. Only modules beyond budget are descended into (top-level blocks first), so the number of backend preparations — compiles, for a compiled backend — grows with depth, not with the number of modules. Below the culprit module, each torch function its forward calls is checked the same way.""",
    ),
    (
        "code",
        """loc = report.localize()
print("culprit:", loc.culprit)
print("backend preparations:", loc.preparations)
loc.frame[["name", "kind", "verdict", "local_line", "propagated_line", "amplification"]]""",
    ),
    (
        "md",
        """For an eager backend the full run's activations are compared too (*propagated*): block 1 introduces the error (its bar crosses the SUSPECT line), block 2 only carries it (its local bar is low, its propagated point is high).""",
    ),
    ("code", """ax = loc.plot()"""),
    (
        "md",
        """The culprit op's output, run alone on the faulty backend, as an error heatmap in multiples of the round-off budget: the bad row is the first query of the first (batch, head) pair.""",
    ),
    (
        "code",
        """name = loc.frame.query("kind == 'op' and verdict == 'SUSPECT'")["name"].iloc[0]
ax = loc.plot_heatmap(name, metric="budget", fold=((0, 1, 2), (3,)))""",
    ),
    (
        "md",
        """## A standalone reproduction

`loc.repro(path)` writes **one Python file that needs only torch, numpy and the runtime under test** — what a maintainer of the backend will run, without installing rlx_nb. Before writing, it cuts the culprit's inputs down to the smallest case the verdict still calls SUSPECT (halving one size at a time, each step judged by rlx_nb's verdict, never a fixed tolerance). The script runs the culprit in float32 eager, in float64 and on the backend, prints their errors against float64, and exits 1 past the line rlx_nb measured (written in the file, with how it was measured). rlx_nb runs it once to check it.

For an Inductor backend the file also names the compiler stage and pass (PyTorch's `CompilerBisector`, rlx_nb's verdict its oracle) and a config switch that avoids it, checked; for ExecuTorch, LiteRT or ONNX Runtime, whether the export, the converter or the delegate gives the error.""",
    ),
    (
        "code",
        """import tempfile, pathlib

where = pathlib.Path(tempfile.mkdtemp())
repro = loc.repro(where / "repro")
print(repro)            # what was shrunk, and what the script printed when run without rlx_nb
print(repro.text)       # the file itself""",
    ),
    (
        "md",
        """## On the model's graph

`loc.to_model_explorer(path)` writes the localization as node data for Google's [Model Explorer](https://github.com/google-ai-edge/model-explorer): every op of the model's `torch.export` graph carries its module's (or op's) place on the SUSPECT line, red past it, blue below. With the `graph` extra installed (`pip install 'rlx_nb[graph]'`), `loc.show_model_explorer()` opens the graph with the data on it.""",
    ),
    (
        "code",
        """import json

nodes = loc.to_model_explorer(where.parent / "model_explorer.json")
results = json.loads(nodes.read_text())["graph"]["results"]
print(f"{len(results)} nodes valued; past the SUSPECT line:", [n for n, v in results.items() if v["value"] > 1])
# loc.show_model_explorer()   # opens Model Explorer in the browser (needs rlx_nb[graph])""",
    ),
    (
        "md",
        """## The same, for a legitimate backend

A legitimate backend has no culprit: every module is within its round-off budget.""",
    ),
    (
        "code",
        """legit = rlx_nb.localize(model, inputs, backend="cpu-nomkldnn")
print("culprit:", legit.culprit)
legit.frame[["name", "verdict", "local_line"]]""",
    ),
    (
        "md",
        """## In the explorer

`rlx_nb.explore(report, localization=loc)` adds the per-module bars and a module picker that shows the picked module's output heatmap.""",
    ),
    ("code", """rlx_nb.explore(report, localization=loc)"""),
    (
        "md",
        """## An issue ready to file

`report.issue(backend, path)` writes markdown for the backend's tracker: a title, the environment (torch, the runtime, the CPU), what diverges and by how much against float64 (float32 eager's own error for scale), where it is born, and the standalone repro inline. From the command line: `rlx-nb check models.py:factory --repro DIR` writes one repro and one issue per SUSPECT backend.""",
    ),
    (
        "code",
        """issue = report.issue("fault:softmax-row", where / "issue.md")
print(issue.text[:1500])""",
    ),
]

ROUNDOFF_OR_BUG = [
    (
        "md",
        """# 03 · Round-off or bug?

The whole value of rlx_nb is telling explainable floating-point round-off from a real kernel bug. This notebook shows, on the detection benchmark's data (`bench/results/detection.csv`, written by `python bench/detection.py`), why a fixed tolerance cannot do it and how the fp64-calibrated budget does.""",
    ),
    (
        "code",
        """import pathlib
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import rlx_nb
from rlx_nb.models import demo

df = pd.read_csv(pathlib.Path("..") / "bench" / "results" / "detection.csv")
rules = ["rlx_nb", "seed_max_rel", "assert_close", "dynamo_same", "polygraphy"]
# (cases where the backend did not run at all -- torch.compile traces nothing of the GRU model -- are no comparison)
df = df[df.status.fillna("ok") == "ok"].astype({c: bool for c in ["legit", "detectable", *rules]})
legit, detectable = df[df.legit], df[df.detectable]
pd.DataFrame({
    "false positives (legitimate backends)": legit[rules].mean(),
    "caught (faults > 10x oracle round-off)": detectable[rules].mean(),
}).style.format("{:.0%}")""",
    ),
    (
        "md",
        """## Why a fixed tolerance fails, 1: outputs near zero

The seed's rule divides by `|oracle| + 1e-6`. A legitimate backend — here eager with oneDNN off — differs from the oracle by a few ulps everywhere; where the output is near zero, that is a large *relative* error. Every legitimate fp32 backend crosses `max_rel = 2e-3` somewhere:""",
    ),
    (
        "code",
        """model, inputs = demo.mlp()
report = rlx_nb.backend_divergence(model, inputs, backends=["cpu-nomkldnn", "onnxruntime", "fault:gelu-approx", "fault:linear-bias-channel"])
report.backends_detail[["backend", "verdict", "verdict_fixed", "max_rel", "ratio_rmse", "ratio_max"]]""",
    ),
    (
        "md",
        """Every fault here changes this MLP (it has a GELU and linear layers); a fault whose kernel a model never calls — a softmax fault on this MLP — would change nothing and be round-off, rightly.""",
    ),
    (
        "code",
        """fig, axes = plt.subplots(1, 2, figsize=(13, 4.2), layout="constrained")
report.plot.scatter("cpu-nomkldnn", "out", ax=axes[0])
report.plot.scatter("fault:linear-bias-channel", "out", ax=axes[1]);""",
    ),
    (
        "md",
        """Left, legitimate: the points above the dashed `max_rel` line are all at tiny `|oracle|` — tiny absolute errors. Right, a dropped bias on one output channel: a column of large errors at ordinary magnitudes.

## Why a fixed tolerance fails, 2: reduced precision

`cpu-bf16` (autocast) is a legitimate backend that computes in bfloat16; against fp32 tolerances it always fails. rlx_nb scales the budget to the backend's compute format (2^16 for bfloat16):""",
    ),
    (
        "code",
        """bf16 = rlx_nb.backend_divergence(model, inputs, backends=["cpu-bf16", "cpu-fp16"])
bf16.summary_detail[["backend", "compute_dtype", "max_rel", "verdict_fixed", "ratio_rmse", "ratio_max", "verdict", "reason"]]""",
    ),
    (
        "md",
        """## Two legitimate errors, not one

The oracle's error against fp64 is one sample of round-off, for ATen's summation order. Another legitimate order can drift much further, by an amount that depends on the *terms* of each sum: ATen adds 8,192 equal terms almost exactly, one sequential accumulator drifts by thousands of ulps. On the benchmark's conv net, Inductor's BatchNorm-bias gradient is 36x the oracle's error — bit for bit what a sequential loop gives, because the terms (a pooled gradient) repeat. So rlx_nb runs the model once more with every reduction summed by one sequential accumulator (`rlx_nb.backends.sequential`) and sizes the budget by the larger of the two errors:""",
    ),
    (
        "code",
        """import torch
from rlx_nb.backends.sequential import sequential_sum

terms = torch.full((8192,), 0.1)  # the same term thousands of times, like a pooled gradient
exact = 8192 * float(np.float32(0.1))
print(f"ATen's sum is off by {abs(float(terms.sum()) - exact):.2e}, one sequential accumulator by "
      f"{abs(float(sequential_sum(terms, [0])) - exact):.2e}")
conv_model, conv_inputs = demo.conv(0)
conv = rlx_nb.backend_divergence(conv_model, conv_inputs, backends=["cpu-nomkldnn"], backward=True)
conv.summary_detail[["output", "oracle_max_err", "sequential_max_err", "backend_max_err", "ratio_max", "verdict"]]""",
    ),
    (
        "md",
        """## A slice that leans one way

A budget sized for the whole output can dilute a bug confined to one class or channel. Here class 0 of the conv net's logits loses 1e-5 of its bias: 15x the oracle's error, but within 4x of Inductor's legitimate drift on the same logits (global pooling is a long sum), so RMSE and max stay under their limits. Round-off errs either way on each element, so its mean over a slice (a row, a column, a channel) is small, and how small depends on the slice's size and on how many slices there are; a bug on one class leans one way on every row. rlx_nb compares each slice's mean error with what round-off allows there (`slice_ratio`, limit 4, like RMSE; `slice_at` names the slice; the reasoning is in `docs/verdict.md`):""",
    ),
    (
        "code",
        """from rlx_nb.backends.faults import fault_backend

bias_fault = fault_backend("linear-bias-channel", 1e-5)  # a catalogue fault at a milder severity
rlx_nb.register_backend(bias_fault.name, bias_fault.fn, replace=True, default=False)
sliced = rlx_nb.backend_divergence(conv_model, conv_inputs, backends=["onnxruntime", bias_fault.name])
sliced.summary_detail[["backend", "output", "ratio_rmse", "ratio_max", "slice_ratio", "slice_at", "verdict"]]""",
    ),
    ("code", """print(sliced.record(bias_fault.name, "out").reason)"""),
    (
        "md",
        """## How the budget decides

Each case's *excess* is its worst output's error against fp64 on the SUSPECT line's scale (1 = the line). Legitimate backends sit left of 1, faults right of it — with faults at mild severities crossing over as their error approaches round-off, which is where no rule can see them. A fault confined to one row or channel that stays under the whole output's budget is caught by its slice mean (above), or as *concentrated* (its worst element is 10x beyond the legitimate runs' and stands out from otherwise round-off-sized errors; see the README's verdict rule) — on this benchmark the measured budget and the slice clause already catch every such fault, so the concentration clause is a second line.""",
    ),
    (
        "code",
        """fig, ax = plt.subplots(figsize=(9, 4), layout="constrained")
bins = np.logspace(-3, 7, 61)
ax.hist(df[df.legit].excess.clip(1e-3, 1e7), bins=bins, alpha=0.7, label="legitimate backends")
ax.hist(df[~df.legit & df.fired].excess.clip(1e-3, 1e7), bins=bins, alpha=0.7, label="faults (fired)")
ax.axvline(1.0, color="black", linestyle="--", label="SUSPECT above")
ax.set_xscale("log"); ax.set_xlabel("x of the SUSPECT line"); ax.set_ylabel("cases"); ax.legend();""",
    ),
    ("md", """And the fixed rule on the same cases: legitimate and faulty overlap across the `2e-3` line."""),
    (
        "code",
        """fig, ax = plt.subplots(figsize=(9, 4), layout="constrained")
bins = np.logspace(-9, 4, 53)
ax.hist(df[df.legit].max_rel.clip(1e-9, 1e4), bins=bins, alpha=0.7, label="legitimate backends")
ax.hist(df[~df.legit & df.fired].max_rel.clip(1e-9, 1e4), bins=bins, alpha=0.7, label="faults (fired)")
ax.axvline(2e-3, color="black", linestyle="--", label="seed tol_rel 2e-3")
ax.set_xscale("log"); ax.set_xlabel("max_rel (seed)"); ax.set_ylabel("cases"); ax.legend();""",
    ),
    (
        "code",
        """# Per family: false-positive rate / true-positive rate for each rule
rows = {}
for fam, g in df.groupby("family"):
    l, d = g[g.legit], g[g.detectable]
    rows[fam] = {r: f"{l[r].mean():.0%} / {d[r].mean():.0%}" if len(d) else f"{l[r].mean():.0%} / -" for r in rules}
pd.DataFrame(rows).T""",
    ),
]

CLUSTER = [
    (
        "md",
        """# 04 · Across machines

The diagnostic exists because a heterogeneous cluster — CUDA boxes, Macs with MPS, CPU-only nodes — gives different numbers than one machine. Each node runs the same model on the same inputs on its own live backends; rank 0 gathers everything and judges it against **one** oracle (its CPU fp32) and **one** fp64 reference.

Here three local processes stand in for three nodes (`torchrun`, gloo on 127.0.0.1). Node 2 has a "vendor runtime" the others lack — with a softmax bug. Results travel as the safe report format's bytes, never pickled objects.""",
    ),
    (
        "code",
        '''import os, pathlib, subprocess, sys, tempfile, textwrap
import rlx_nb
from rlx_nb.distributed import free_local_port

work = pathlib.Path(tempfile.mkdtemp())
(work / "job.py").write_text(textwrap.dedent("""
    import os
    import rlx_nb
    from rlx_nb.models import demo
    from rlx_nb.backends.registry import get_backend
    from rlx_nb.distributed import gather_report

    rank = int(os.environ["RANK"])
    backends = ["cpu-nomkldnn"]
    if rank == 2:  # a runtime only node 2 has
        rlx_nb.register_backend("vendor-npu", get_backend("fault:softmax-row").fn)
        backends.append("vendor-npu")
    model, inputs = demo.transformer()
    report = gather_report(model, inputs, backends=backends, label="cluster")
    if rank == 0:
        report.save(os.environ["OUT"] + "/merged.rlxnb")
"""))
port = free_local_port()
done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=3", "--master-addr=127.0.0.1",
                       f"--master-port={port}", str(work / "job.py")], env={**os.environ, "OUT": str(work)},
                      capture_output=True, text=True)
print("torchrun exit code:", done.returncode)
print(sorted(p.name for p in work.iterdir()))''',
    ),
    (
        "md",
        """## The cross-node table

Every backend is named by its node. `nodeK/cpu` is node K's own CPU oracle compared with node 0's: the three "nodes" here are processes on one machine, so those rows are bit for bit identical to the oracle (`max_abs` 0, "identical"); on a real cluster they show how far two CPU builds drift.""",
    ),
    (
        "code",
        """report = rlx_nb.load_report(work / "merged.rlxnb")   # arrays stay on disk until used
report""",
    ),
    (
        "code",
        """report.backends_detail[["backend", "verdict", "worst_output", "max_abs", "max_rel", "ratio_rmse", "ratio_max", "reason"]]""",
    ),
    ("md", """## Drill into the suspect node"""),
    (
        "code",
        """suspect = report.suspects[0]
rec = report.record(suspect)
print(suspect, "—", rec.output, "—", rec.reason)
ax = report.plot.heatmap(suspect, rec.output, select={0: 0})""",
    ),
    ("code", """report.elements(suspect, rec.output, top=5)"""),
    (
        "md",
        """## Without torchrun: files from each node

Each node runs `rlx-nb check TARGET --save DIR` and any machine merges the files: `rlx-nb merge DIR/*.rlxnb`, or in Python `rlx_nb.merge_reports([...])`. Inputs must be identical: a node whose input fingerprint differs is refused, naming the node.""",
    ),
    (
        "code",
        """from rlx_nb.models import demo

model, inputs = demo.transformer()
for node, backends in {"mac-mini": ["cpu-nomkldnn"], "gpu-box": ["cpu-nomkldnn", "fault:layernorm-eps"]}.items():
    rlx_nb.backend_divergence(model, inputs, backends=backends).save(work / "files" / f"{node}.rlxnb")
merged = rlx_nb.merge_reports(sorted((work / "files").glob("*.rlxnb")))
print(merged)""",
    ),
    ("code", """rlx_nb.explore(report)"""),
]

PRECISION = [
    (
        "md",
        """# 05 · Effective precision

A very common "kernel bug" report is no bug at all but a precision mode switched on behind the user's back: TF32 matmuls on Ampere and later GPUs (pytorch/pytorch#58434, #61890), MPS fast math (pytorch/pytorch#84936), autocast, or a runtime's own default — OpenVINO's CPU plugin runs bfloat16 by default on CPUs with bfloat16 support.

For every (backend, output) rlx_nb reads the **effective mantissa bits**: the backend's error against fp64 placed on a scale calibrated on this very model — the fp32 oracle is 24 bits, and two runs with matmul/convolution operands rounded to 11 and 8 bits mark those points — next to the format the backend claims.""",
    ),
    (
        "code",
        """import matplotlib.pyplot as plt
import rlx_nb
from rlx_nb.models import demo

model, inputs = demo.mlp()
backends = [b for b in ["cpu-nomkldnn", "onnxruntime", "openvino", "openvino-default", "cpu-tf32-emulated",
                        "cpu-fp16", "cpu-bf16"] if b in rlx_nb.available_backends(include_optin=True)]
report = rlx_nb.backend_divergence(model, inputs, backends=backends)
report.summary_detail[["backend", "compute_dtype", "effective_bits", "closest_format", "verdict", "reason"]]""",
    ),
    ("code", """ax = report.plot.effective_bits()"""),
    (
        "md",
        """Bars are coloured by verdict (red only for SUSPECT); the dashed lines mark the standard formats. A backend that claims a reduced format (`cpu-bf16`, `cpu-fp16`, `cpu-tf32-emulated`) is judged against it and is round-off at its own bits.""",
    ),
    (
        "md",
        """## The OpenVINO default

`openvino` compiles with `INFERENCE_PRECISION_HINT=f32`; `openvino-default` with the plugin's own defaults, and is judged as the fp32 it claims to be. On a CPU with bfloat16 support the default is bfloat16 and the reading says so (on the machine where the design notes were measured: max_abs 3.1e-3, ~9,400x the fp32 round-off); on one without it, the default is fp32 and both read as fp32. What did the plugin choose here?""",
    ),
    (
        "code",
        """if "openvino" in rlx_nb.available_backends():
    from rlx_nb.backends.openvino import openvino_default_precision
    print("OpenVINO CPU plugin default precision on this machine:", openvino_default_precision())
    print(report.record("openvino-default").reason)
else:
    print("openvino is not installed here: pip install 'rlx_nb[openvino]'")""",
    ),
    (
        "md",
        """## Which switch causes the drift? The sweep

`rlx_nb.precision_sweep` runs the model under each precision switch present on this machine — every setting judged as the fp32 it claims — and reads its effective bits. A switch that silently lowers precision shows as SUSPECT with "behaves like …" in the reason.""",
    ),
    (
        "code",
        """sweep = rlx_nb.precision_sweep(model, inputs)
sweep""",
    ),
    (
        "code",
        """from rlx_nb.plot.charts import plot_effective_bits

ax = plot_effective_bits(dict(zip(sweep.setting, sweep.effective_bits)), verdicts=dict(zip(sweep.setting, sweep.verdict)),
                        title="precision sweep: effective bits per setting")""",
    ),
    (
        "md",
        """A backend that claims fp32 but computes like TF32 is still SUSPECT — its numbers are not fp32 numbers — but the verdict names the likely cause instead of a kernel bug:""",
    ),
    (
        "code",
        """from rlx_nb.backends.registry import get_backend

rlx_nb.register_backend("vendor-gpu", get_backend("cpu-tf32-emulated").fn, replace=True)  # claims fp32
print(rlx_nb.backend_divergence(model, inputs, backends=["vendor-gpu"]))""",
    ),
]


SHARE_AND_GATE = [
    (
        "md",
        """# 06 · Share, gate, and compare with a baseline

Three things people do with a divergence once they have found it: **hand it to someone** who does not have the model (a runtime team, a vendor, an upstream issue), **gate on it** in a test suite, and **compare** today's stack (torch, ONNX Runtime, OpenVINO, drivers) with the one before an upgrade.

The model is a small MLP written here; the "stack" is a backend registered here, so the notebook can simulate an upgrade that changes the numbers.""",
    ),
    (
        "code",
        """import torch
import rlx_nb

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
inputs = torch.randn(32, 64)


def stack_v1(model, inputs):          # today's runtime: plain eager
    return model(*inputs)


rlx_nb.register_backend("my-stack", stack_v1, default=False, replace=True)
report = rlx_nb.backend_divergence(model, inputs, backends=["cpu-nomkldnn", "my-stack", "fault:gelu-approx"], label="mlp")
print(report)""",
    ),
    (
        "md",
        """## Share: one HTML file

`report.to_html(path)` writes a self-contained page — the verdict lines, the backends and summary tables, each SUSPECT output's heatmap, histogram and worst elements, and the environment (versions, CPU flags, backend settings). Images are inline, there is no script and no model weight in it: it opens in any browser and can be attached to an issue. From a shell: `rlx-nb check ... --html FILE`, or `rlx-nb show saved.rlxnb --html FILE`.""",
    ),
    (
        "code",
        """import pathlib, tempfile

out = pathlib.Path(tempfile.mkdtemp())
page = report.to_html(out / "mlp.html")
print(f"{page.name}: {page.stat().st_size / 1e3:.0f} kB, {page.read_text().count('<img')} figures, "
      f"scripts: {page.read_text().count('<script')}")""",
    ),
    (
        "md",
        """## Gate: an assertion for the test suite

`rlx_nb.testing.assert_backends_agree` raises `AssertionError` when a backend is SUSPECT (or a backend you named cannot run), with the seed's lines in the message and where the report was saved. Under pytest, `--rlx-nb-report-dir DIR` keeps every failing check's report, named after its test. Here the faulty backend fails the gate and the legitimate ones pass it:""",
    ),
    (
        "code",
        """from rlx_nb.testing import assert_backends_agree

assert_backends_agree(model, inputs, backends=["cpu-nomkldnn", "my-stack"])   # passes: returns the report
try:
    assert_backends_agree(model, inputs, backends=["fault:gelu-approx"], report_dir=out, label="mlp")
except AssertionError as failure:
    print(str(failure).replace(str(out), "OUT"))   # OUT: the temporary directory made above""",
    ),
    (
        "md",
        """## Compare with a baseline

Save the report before an upgrade; after it, compare. Here the "upgrade" re-registers `my-stack` with a GELU that became the tanh approximation — a real kind of change a kernel library makes. `compare_reports` matches (backend, output) pairs and shows how each error moved, in multiples of its round-off budget (`excess`, SUSPECT above 1). A pair is **worse** only when it became SUSPECT, or was SUSPECT and more than doubled; movement within round-off is shown but never called worse. `rlx-nb check ... --baseline old.rlxnb` exits 1 only then.""",
    ),
    (
        "code",
        """baseline = report.save(out / "before.rlxnb")


def stack_v2(model, inputs):          # after the upgrade
    for m in model.modules():
        if isinstance(m, torch.nn.GELU):
            m.approximate = "tanh"
    return model(*inputs)


rlx_nb.register_backend("my-stack", stack_v2, default=False, replace=True)
after = rlx_nb.backend_divergence(model, inputs, backends=["cpu-nomkldnn", "my-stack", "fault:gelu-approx"], label="mlp")
moved = rlx_nb.compare_reports(baseline, after)
print("\\n".join(moved.lines()))
moved.frame""",
    ),
    (
        "md",
        """`my-stack` went from round-off to SUSPECT: **worse**. `cpu-nomkldnn` is unchanged, and the catalogue fault was SUSPECT before and after at the same size, so it is the same — a known bug does not fail a baseline gate, a new one does. The plot puts every pair's old excess against its new one; red points got worse, and the dashed line is the budget's limit.""",
    ),
    (
        "code",
        """moved.plot();""",
    ),
]

GENERATION = [
    (
        "md",
        """# 07 · Where generation parts

An exported or compiled language model generates other text than eager. After how many tokens — and is that a bug, or a near-tie broken by rounding?

`rlx_nb.generation_divergence` decodes greedily on the CPU oracle (float32, the model's own cache), then runs the float64 reference and every backend **teacher-forced** on the oracle's tokens, each with its own cache. Every step's logits are judged by the same round-off budget as a forward pass, and every token flip is classed: a **near-tie** (the fp64 logits of the two tokens are within the step's round-off allowance: explainable) or a **real disagreement** (SUSPECT).

The model here is a small Llama-architecture decoder with random weights, passed as it is. One backend has a subtle bug of the kind that only shows once the cache has grown: an attention kernel that mis-scales the scores of keys past position 24 (a tile boundary) by 3%. A forward pass over the 8-token prompt never meets it.""",
    ),
    (
        "code",
        """import rlx_nb
from rlx_nb.models import demo
from rlx_nb.models import zoo

model, prompt = zoo.decoder("llama", batch=1, seed=1)     # LlamaForCausalLM, an 8-token prompt
tiled = demo.long_context_fault(after=24, severity=3e-2)   # the subtle bug, as a user's own backend


class Words:  # a toy tokenizer: one word per id (any tokenizer with .decode works)
    words = [f"{a}{b}" for a in ("ka", "lo", "mi", "nu", "po", "ra", "si", "tu", "vo", "we", "xi", "yu", "za", "be", "co", "du")
             for b in ("n", "r", "s", "t", "l", "m", "k", "p", "d", "g", "f", "h", "b", "v", "z", "x")]

    def decode(self, ids):
        return " ".join(self.words[i] for i in ids)


print("forward pass on the prompt:", rlx_nb.backend_divergence(model, prompt, backends=[tiled], progress=False).lines()[0])
report = rlx_nb.generation_divergence(model, prompt, max_new_tokens=48, tokenizer=Words(),
                                      backends=["cpu-nomkldnn", "cpu-bf16", "cpu-inductor", "onnxruntime", "openvino", tiled])
report""",
    ),
    (
        "md",
        """The forward pass over the prompt says round-off: the bug is not there yet. The generation report has one line per backend. `cpu-inductor` compiled the model's step once (dynamic shapes) and ran every step through it; ONNX Runtime and OpenVINO ran the prefill and the decode step exported to ONNX with the cache as inputs and outputs, each keeping its own cache, as a deployment does. The step plot shows each backend's logits error per step on the SUSPECT-line scale (1 is the line); token flips are marked — a hollow circle for a near-tie, a cross for a real disagreement:""",
    ),
    ("code", """report.plot();"""),
    (
        "md",
        """The faulty backend is round-off for the first steps, then jumps above the line at the step whose cache first holds more than 24 keys — and stays there. `first_divergence` says where each backend's greedy token first differs from the oracle's, and what kind of flip that is:""",
    ),
    ("code", """report.first_divergence"""),
    (
        "md",
        """`report.steps` has every (backend, step, sequence): both tokens, the fp64 top-1/top-2 gap, the gap between the two tokens when they differ, the step's allowance, and the step's verdict. Around the onset:""",
    ),
    (
        "code",
        """steps = report.steps
onset = report.focus_step(tiled.name)
steps[(steps.backend == tiled.name) & steps.step.between(onset - 2, onset + 3)][
    ["step", "oracle_token", "backend_token", "flip_kind", "top2_gap_fp64", "line", "verdict"]]""",
    ),
    (
        "md",
        """## That step's logits

`rlx_nb.explore(report)` opens the explorer on the worst backend at its first SUSPECT step (`step=` picks another): the step's logits (batch × vocabulary) as a heatmap, the histogram of their errors, the worst tokens. `report.logits` is an ordinary forward report whose outputs are the steps, so everything that works on a forward report (`summary`, `arrays`, `elements`, `save`) works here.""",
    ),
    ("code", """rlx_nb.explore(report)"""),
    (
        "md",
        """## Localize the step

`report.localize()` replays that one step — the model fed that step's token, with the oracle's cache of the steps before — on the backend, module by module and op by op, against the oracle and fp64:""",
    ),
    (
        "code",
        """loc = report.localize()
print(loc.finding)
loc.plot();""",
    ),
    (
        "md",
        """## The text itself

With `mode="free"` each backend also decodes on its own, and `report.free` shows where its text parts from the oracle's, with both continuations. The verdict stays the teacher-forced one: once the texts differ, later steps compare two different computations.""",
    ),
    (
        "code",
        """free = rlx_nb.generation_divergence(model, prompt, max_new_tokens=48, tokenizer=Words(), mode="free",
                                    backends=["cpu-bf16", tiled], progress=False)
free.free[["parts_at", "oracle_text", "backend_text"]]""",
    ),
]

INT8 = [
    (
        "md",
        """# 08 · int8: requantization rounding, or a kernel bug?

An int8 model on a device runtime never matches the float model: quantization moves every output by whole quanta, so on a float model's round-off budget every correct int8 kernel reads as a bug. `rlx_nb.quantized_divergence` judges an int8 runtime against what it is meant to compute instead, the quantized model's own **Q/DQ simulation** (PT2E's quantize/dequantize ops run on the CPU: the oracle), with the same graph in float64 as the reference. Its **round-off** is requantization rounding: where a value sits within a correct kernel's arithmetic of a rounding boundary, the kernel may land one quantum away, and that quantum travels on. Everything else is notebook 01's: the same report, lines, tables, plots, explorer and `localize()`.

The model is the demo MLP (512 → 2048 → 512, GELU), quantized by PT2E with ExecuTorch's XNNPACK quantizer (per-channel weights, per-tensor activations).""",
    ),
    (
        "code",
        """import warnings
warnings.filterwarnings("ignore")
import rlx_nb
from rlx_nb.int8 import faults
from rlx_nb.int8.quantize import quantize_pt2e
from rlx_nb.models import demo

model, inputs = demo.mlp()
converted = quantize_pt2e(model, inputs)   # calibrated on these inputs
as_fp32 = rlx_nb.backend_divergence(converted, inputs, backends=["executorch-xnnpack"], progress=False)
as_fp32.backends[["backend", "verdict", "line", "why"]]""",
    ),
    (
        "md",
        """Judged as an fp32 backend, XNNPACK's correct int8 kernels are far past the line: a false alarm. (No float64 reference runs through quantize ops, so the seed's fixed rule decides there: the row's "seed's line".) Judged as int8, beside ExecuTorch's portable kernels and a planted kernel bug (one weight of the output layer's channel 1 with its sign flipped, through XNNPACK):""",
    ),
    (
        "code",
        """fault = faults.weight_sign_fault(layer=-1, channel=1)
report = rlx_nb.quantized_divergence(converted, inputs, label="MLP", progress=False,
                                     backends=["executorch-xnnpack", "executorch-portable", fault])
report.backends""",
    ),
    (
        "md",
        """One scale, as for a float model: `line` is each backend's place on the SUSPECT line (1.0 is the line), and `max_quanta` its largest error in quanta of the output. XNNPACK lands a quantum off the simulation here and there, within the int8 round-off budget; the portable kernels match the simulation bit for bit. The planted bug is past the line, the same lines as any report:""",
    ),
    ("code", """for line in report.lines():
    print(line)"""),
    (
        "md",
        """The int8 round-off budget is measured, not assumed: the simulation runs 4 more times, each requantization rounding elements near a rounding boundary the other way at random, as often as a correct kernel does, and what those trials leave is the budget, never less than one element one quantum off. Two figures are measured for each requantization. Its **width** is how close to a boundary a value must sit for a correct kernel to round it the other way: half a step of the integer accumulator that feeds a linear (a kernel rounds its bias to that grid), a whole step for a mean, or 8x the fp32 simulation's largest error there against float64, whichever is larger. Its **spread** is how far a trial jitters, which sets how often it flips: the accumulator's half step plus 4x the simulation's *mean* error, never more than the width (jitter over the whole width flipped 10x as often as correct kernels do):""",
    ),
    ("code", """report.requantizations"""),
    (
        "md",
        """On some models one near-boundary value moves the output more than all the others together (on the zoo's Llama, one element of layer 0's attention output, 3.8e-6 quanta from a boundary, moves the logits 25x what the rest do): trials that round it at random would leave that spread, and hide faults. Such *decisive* elements are found first (the candidates bisected for single elements that alone move an output by a quarter of what all of them move it), and each way of rounding them is a world of its own: the trials hold them as the oracle does, and a runtime is judged from the world nearest it, its record saying which element it rounded the other way. The search is used only when it finds them all (at most 4); where the output moves through many small flips instead, as on this MLP, no element is held and the trials keep their chance, as above. `candidates` counts the elements within their width of a boundary:""",
    ),
    ("code", """{k: report.int8[k] for k in ("decisive", "decisive_search", "candidates")}"""),
    (
        "md",
        """The planted bug's error, element by element, on the line's scale:""",
    ),
    ("code", """report.plot.heatmap(fault.name);"""),
    ("code", """report.elements(fault.name, top=5)"""),
    (
        "md",
        """The explorer walks it as it walks a float model's report: pick a backend and an output, see its heatmap, histogram and worst elements (live in a running kernel; a static snapshot in the saved notebook):""",
    ),
    ("code", """rlx_nb.explore(report)"""),
    (
        "md",
        """## From the verdict to the module

`report.localize()` cuts the graph after each requantization, lowers each cut to the runtime, judges it on its own trials, and bisects to the first cut past the line: the op that computed the value it rounds, in its module. It is the `Localization` notebook 02 walks:""",
    ),
    (
        "code",
        """found = report.localize()
print(found.finding)
found.frame[["name", "verdict", "local_line", "reason"]]""",
    ),
    (
        "md",
        """A legitimate runtime is past the line at no point:""",
    ),
    ("code", """report.localize("executorch-xnnpack").finding"""),
    (
        "md",
        """## In CI

The same gates as a float model's: `assert_backends_agree(model, inputs, int8=True)` in a test, `rlx-nb check model.py:build --int8` on the command line (exit 1 on a SUSPECT), and `report.save` / `rlx_nb.load_report`, `merge_reports` and `compare_reports` as in notebook 06.""",
    ),
    (
        "code",
        """from rlx_nb.testing import assert_backends_agree

assert_backends_agree(converted, inputs, int8=True, backends=["executorch-portable"]).backends[["backend", "verdict", "line"]]""",
    ),
]

CHANGES = [
    (
        "md",
        """# 09 · What changed after the upgrade

"My results changed after I upgraded torch, moved to another machine or changed a setting -- which op?" Backends compared in one process cannot answer that: the two runs happen in two environments. `rlx_nb.snapshot` records one environment's run of the model **module by module** (each module's inputs and outputs, the versions, CPU features, BLAS and oneDNN, threads and dispatch variables); `rlx_nb.diff` runs the model in another environment and judges every module's change against **that module's own round-off**:

- **local**: the module alone, fed the inputs it had in the old environment -- past the line, it computes differently here;
- **propagated**: its output in the whole run -- past the line but within it locally, the change was carried in.

Both are judged by the verdict every report uses, on the same one scale (1.0 is the SUSPECT line).""",
    ),
    (
        "code",
        """import os, subprocess, sys, tempfile
import rlx_nb
from rlx_nb.models import demo

model, inputs = demo.layered()          # three encoder blocks and a head, seeded, random weights
folder = tempfile.mkdtemp()
before = rlx_nb.snapshot(model, inputs, os.path.join(folder, "before"))   # the old environment
rlx_nb.load_snapshot(before)""",
    ),
    (
        "md",
        """## A legitimate change reads as round-off

Here the new environment is this one with oneDNN off (`cpu-nomkldnn`: ATen's own kernels) and another thread count than the snapshot's (the `threads` line of the environment differences). `local="all"` checks every module alone (the default descends only into those past the line, as `localize` does). Most modules move, some stay bit for bit the same (their `change` says so), none past the line:""",
    ),
    (
        "code",
        """import torch

threads = torch.get_num_threads()
torch.set_num_threads(1 if threads > 1 else 2)   # (another count than the snapshot's, whatever this machine runs)
legit = rlx_nb.diff(before, model, inputs, backend="cpu-nomkldnn", local="all")
torch.set_num_threads(threads)
print(legit)
legit.frame[["module", "change", "local_line", "propagated_line", "reason"]].head(8)""",
    ),
    (
        "md",
        """## Another process, another dispatch path

A real second environment: a fresh process where MKL takes its SSE2 code path (`MKL_CBWR=COMPATIBLE`, what an older CPU would run). The command line does the same as the call, with `check`'s exit codes (0: every module within round-off; 1: a module past the line):""",
    ),
    (
        "code",
        """done = subprocess.run([sys.executable, "-m", "rlx_nb.cli", "diff", str(before), "rlx_nb.models.demo:layered", "--all"],
                      env={**os.environ, "MKL_CBWR": "COMPATIBLE"}, capture_output=True, text=True)
print(done.stdout, "exit code", done.returncode)""",
    ),
    (
        "md",
        """## A kernel that changed is found where it changed

Now the new environment computes one op wrongly: a catalogue fault in block 1's softmax (the fault backend runs the model eagerly, with that one kernel changed). The diff names the module whose own change is past the line, and every module after it carries the change:""",
    ),
    (
        "code",
        """faulty_model, _ = demo.layered(fault_layer=1)   # the same weights; the fault backend perturbs block 1's softmax only
changed = rlx_nb.diff(before, faulty_model, inputs, backend="fault:softmax-row")
print(changed.finding)
changed.plot();""",
    ),
    (
        "code",
        """moved = ~changed.frame.change.isin(["moved within round-off", "bit for bit identical"])
changed.frame[moved][["module", "change", "local_line", "propagated_line"]]""",
    ),
    (
        "md",
        """The culprit is the attention of block 1 -- its own change is far past the line, fed the inputs it had before -- while the query/key/value projection inside it, before the softmax, is within round-off. `localize` can take it from there (down to `F.softmax`) on a backend of this process; `changed.to_html(path)` writes the whole diff as one page.

## Down to the element

`rlx_nb.explore(changed)` opens on the culprit's change alone: its old output is the oracle, its output here the backend, the float64 module on the same inputs the reference -- the heatmap, histogram, worst elements and inspector of any report. The module picker and the side picker (alone, fed the old inputs / in the whole run) show any other module's change; `changed.report(module, side)` is the same view as a report.""",
    ),
    (
        "code",
        """rlx_nb.explore(changed)""",
    ),
    (
        "md",
        """## Down to the op

A snapshot written with `ops=True` also records each module's own torch function calls (`F.softmax`, `torch.matmul`, `Tensor.__add__`...: data movement and in-place ops left out), named as `localize` names them. The diff then goes on from a module past the line into its ops, and judges each op in the whole run too (it writes every op's output: several times the activations, so it is off by default):""",
    ),
    (
        "code",
        """detailed = rlx_nb.snapshot(model, inputs, os.path.join(folder, "before-ops"), ops=True)
to_op = rlx_nb.diff(detailed, faulty_model, inputs, backend="fault:softmax-row")
print(to_op.finding)
to_op.frame[to_op.frame.module.str.startswith("blocks.1.attn")][["module", "change", "local_line", "propagated_line"]]""",
    ),
    (
        "md",
        """## A runtime or compiler upgrade

A backend that compiles or exports the whole model (`cpu-inductor`, `onnxruntime`, ExecuTorch, LiteRT) has no module boundaries in its run. Snapshot on it, and each module runs on it *alone*, fed the inputs it had in the oracle's run (an export or compile per module); after the upgrade the diff runs each module alone on the new version and judges it against the old one's round-off there (local changes only):

```python
rlx_nb.snapshot(model, inputs, "ort-old.rlxsnap", backend="onnxruntime")   # before: onnxruntime 1.x
# ... upgrade onnxruntime; then:
print(rlx_nb.diff("ort-old.rlxsnap", model, inputs))                         # the module whose kernels changed
```

`tests/test_changes.py` plants an Inductor upgrade that decomposes GELU wrongly and finds it at the GELU.""",
    ),
    (
        "md",
        """## Two snapshots, no model

Each node of a cluster (or each machine in CI) can write its own snapshot; one written with `reference=True` (each module's float64 value: one float64 forward more) lets two be compared without the model. Only propagated changes can be judged then -- except where a module was fed bit for bit the same inputs in both, which makes its change its own:""",
    ),
    (
        "code",
        """reference = rlx_nb.snapshot(model, inputs, os.path.join(folder, "node0"), reference=True)
node1 = rlx_nb.snapshot(faulty_model, inputs, os.path.join(folder, "node1"), backend="fault:softmax-row")
apart = rlx_nb.diff(reference, node1)
print(apart.finding)""",
    ),
]

TRAINING = [
    (
        "md",
        """# 10 · Where training parts: chaos or a bug, and at which step

"My loss curve with the fused optimizer (torch.compile, another GPU, a new torch) drifts from eager after N steps -- bug or chaos?" Over many steps, training amplifies round-off: two correct runs that differ by one ulp of one weight part visibly after a hundred steps. A band around the loss curve cannot tell a small bug from that chaos. `rlx_nb.training_divergence` judges each backend twice, on the verdict's one scale (1.0 is the SUSPECT line):

- **trajectory**: per step, the loss, the gradient norm and the parameters' distance from the oracle (float32 eager), against the *envelope* -- the drift of the oracle's own run started one ulp off, and on another thread count: round-off by construction, and its growth is the chaos;
- **local steps**: at chosen steps (the first, log-spaced ones, where a trajectory leaves, any you name) the backend starts from the oracle's *exact* state -- parameters, optimizer state, buffers, random numbers -- and that one step (forward, backward, update) is judged against float64 of the same step. A bug is a local step past the line; chaos is local steps within round-off under a drifting trajectory.""",
    ),
    (
        "code",
        """import torch, rlx_nb

torch.manual_seed(0)
V, D, T, B = 64, 64, 32, 8          # a one-block transformer LM: vocabulary 64, width 64, batches of 8x32 tokens

class LM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.pos = torch.nn.Embedding(V, D), torch.nn.Parameter(torch.randn(T, D) * 0.02)
        self.block = torch.nn.TransformerEncoderLayer(D, 4, 4 * D, dropout=0.0, batch_first=True, norm_first=True)
        self.norm, self.head = torch.nn.LayerNorm(D), torch.nn.Linear(D, V)

    def forward(self, ids):
        mask = torch.nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        return self.head(self.norm(self.block(self.emb(ids) + self.pos, src_mask=mask, is_causal=True)))

def next_token_loss(model, ids):
    logits = model(ids[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, V), ids[:, 1:].reshape(-1))

batches = [torch.randint(0, V, (B, T + 1)) for _ in range(8)]     # cycled over the steps
adamw = lambda params: torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1)""",
    ),
    (
        "md",
        """## A bug hidden inside the chaos

The planted bug: an AdamW whose weight decay on the head is 5% too strong from step 60 on. It shrinks each head weight by an extra 1.5e-5 of itself per step -- about 250 times float32's unit round-off in the step's own update, but in the loss curve it stays inside the band two correct runs make. It is registered as a training backend of its own (`register_training_backend`: a user's optimizer, a forward through a registered runtime, or both); `optimizer:foreach` (AdamW's other implementation) is a legitimate backend beside it:""",
    ),
    (
        "code",
        """class HeadDecayTooStrong(torch.optim.AdamW):
    def step(self, closure=None):
        out = super().step(closure)
        with torch.no_grad():
            head = self.param_groups[0]["params"][-2]                   # head.weight
            if self.state[head] and float(self.state[head]["step"]) > 60:
                head.mul_(1 - 3e-3 * 0.1 * 0.05)                        # its decay 5% too strong
        return out

rlx_nb.register_training_backend("adamw-head-decay", optimizer=lambda p: HeadDecayTooStrong(p, lr=3e-3, weight_decay=0.1),
                                 replace=True)
report = rlx_nb.training_divergence(LM(), batches, next_token_loss, optimizer=adamw, steps=160,
                                    backends=["adamw-head-decay", "optimizer:foreach"])
report""",
    ),
    (
        "md",
        """In the figure below: the loss curves, with the oracle's loss plus or minus the envelope as a grey band (the envelope grows: that is the chaos); below, each backend's trajectory in units of the line (log scale) and its local steps as marks (a red cross: past the line). The buggy optimizer's trajectory never leaves the envelope -- the loss curve alone cannot see it -- while its local steps from step 60 on are 30x past the line. Between the local steps 32 and 64 the call bisected (from the oracle's states again) to the first step past the line:""",
    ),
    (
        "code",
        """report.plot();""",
    ),
    (
        "code",
        """report.local[report.local.backend == "adamw-head-decay"][["step", "verdict", "line", "phase", "output"]]""",
    ),
    (
        "md",
        """`report.steps` has one row per step and backend (loss, gradient norm, parameters' distance, each with its envelope, and the trajectory's place on the line).

## Down to the phase and the parameter

`report.localize(backend)` takes the first local step past the line to where its error is born: the **phase** (forward, buffers such as BatchNorm's running statistics, backward, optimizer update), then the module and op for a forward or backward, or the parameters whose update is past the line while their gradients are round-off:""",
    ),
    (
        "code",
        """found = report.localize("adamw-head-decay")
print(found)""",
    ),
    (
        "md",
        """## Down to the element

A local step is a report like any other -- its outputs are the step's loss, gradients, buffers and updated parameters -- so the explorer opens on it, from the output to the element:""",
    ),
    (
        "code",
        """rlx_nb.explore(report.local_report("adamw-head-decay", 60))""",
    ),
    (
        "md",
        """## A kernel's backward, down to the op

A bug in one op's backward, off by 1e-4 of its size: the LayerNorm backward of the catalogue's `fault:layernorm-backward` run as a training backend (any differentiable backend of the registry runs a step's forward and backward). Its local steps are past the line in the gradients; the localization of that step's loss, from the step's own state, names the op -- and `found.repro(folder)` writes the standalone repro of it, fed what it was fed at that step:""",
    ),
    (
        "code",
        """from rlx_nb.backends.faults import fault_backend

torch.manual_seed(0)
mlp = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.LayerNorm(32), torch.nn.GELU(), torch.nn.Linear(32, 5))
classes = [(torch.randn(16, 8), torch.randint(0, 5, (16,))) for _ in range(4)]
xent = lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])
fault = fault_backend("fault:layernorm-backward", 1e-4)
rlx_nb.register_backend(fault.name, fault.fn, replace=True, default=False)
backward_bug = rlx_nb.training_divergence(mlp, classes, xent, optimizer=lambda p: torch.optim.SGD(p, lr=0.05), steps=10,
                                          backends=[fault.name, "cpu-nomkldnn", "threads"])
print(backward_bug)
print(backward_bug.localize(fault.name))""",
    ),
    (
        "md",
        """## Gate on it

In CI, `rlx-nb train path/to/job.py:factory --steps 200` (the factory returns `dict(model=, batches=, loss_fn=, optimizer=)`) and `rlx_nb.testing.assert_training_agrees(...)` fail only on a local step past the line; `--trajectory` / `trajectory=True` also fail on a trajectory that leaves its envelope (drift, which chaos alone can make). The built-in training backends are `cpu-nomkldnn`, `cpu-inductor` (the step compiled, its dropout masks drawn as eager's), `cpu-inductor-optimizer`, `threads`, `optimizer:foreach`, `optimizer:for-loop`, `optimizer:fused` and `cpu-bf16` (its own budget); `report.to_html(path)` writes the whole report as one page.""",
    ),
]

INVARIANCE = [
    (
        "md",
        """# 11 · Same model, another batch: where bit for bit breaks

"The rollout engine's log-probs differ from the trainer's" -- "a prompt gives other tokens alone than inside a batch" -- "the answer changes with padding, or with the KV cache". Here one backend is compared with *itself* under another **configuration** of the same computation. `rlx_nb.invariance` computes each row alone (the reference configuration) and

- inside batches of other sizes (odd ones and powers of two), first and last in them;
- padded by masked tokens, left and right, and beside a row that is all padding;
- for a decoder with a cache, prefilled in two chunks (a prefix-cache hit) and decoded token by token,

and compares every output **bit for bit**. Where they differ it says whether the difference is **round-off** (a legitimate kernel choice: the fix is a batch-invariant kernel) or **past the line** (a real bug: a mask that leaks, a cache that holds the wrong positions), on the verdict's one scale against float64 of the row alone, and names the **first op** whose inputs are bit for bit the row's in both configurations but whose output is not.""",
    ),
    (
        "code",
        """import torch, rlx_nb

torch.manual_seed(0)
linears = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.GELU(), torch.nn.Linear(512, 512))
rows = torch.randn(4, 512)
report = rlx_nb.invariance(linears, rows)
print(report)
report.summary""",
    ),
    (
        "md",
        """Every row gives other bits alone than inside any batch here: the first op that parts is `F.linear`, its input one row (1x512) alone against 2, 3 ... 16 rows (a matrix product takes another path by size). Within round-off each time -- a legitimate kernel choice. Where torch says which kernel ran, `kernel_path` says it: the ATen ops the op ran and the library calls MKL and oneDNN report, here MKL's SGEMM with the product's shapes as it took them (one row against sixteen):""",
    ),
    (
        "code",
        """print(report.summary.set_index("config").kernel_path["batch of 16, at 0"])""",
    ),
    (
        "md",
        """The map shows each row (down) in each configuration (across), its place on the line written in the cells that differ:""",
    ),
    (
        "code",
        """report.plot();""",
    ),
    (
        "md",
        """## Down to the element

A pair (the row alone against the row in one configuration) is a report like any other, with float64 of the row alone as its reference. The explorer of the invariance report picks a backend and a configuration, says the pair's first op, its shapes and kernel path, and opens the pair down to the element:""",
    ),
    (
        "code",
        """rlx_nb.explore(report, config="batch of 16, at 0")""",
    ),
    (
        "md",
        """## A GPT-2: batches, padding and the cache

A 2-layer GPT-2 built from a config (random weights: nothing downloads). Inside batches it is bit for bit the row alone's; left-padded (with its attention mask and positions) and decoded with its KV cache it gives other bits -- within round-off, and the first op that parts under padding is the attention (its mask takes another kernel path):""",
    ),
    (
        "code",
        """import transformers

config = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                 bos_token_id=0, eos_token_id=0)
gpt2 = transformers.GPT2LMHeadModel(config).eval()
ids = torch.randint(0, 128, (4, 24))
lm = rlx_nb.invariance(gpt2, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, rows=[0])
print(lm)
lm.summary[lm.summary.verdict != "bit for bit"]""",
    ),
    (
        "md",
        """For the cache the ops compared are the decode step's own (the cache filled first) against the same positions of the row computed whole: the first that parts is the attention's input projection, `c_attn`'s matrix product at one row against 24. `lm.tree(...)` marks it on the module tree -- every op before it bit for bit (`=`), every op after it not (`~`):""",
    ),
    (
        "code",
        """for line in lm.tree(config="decoded token by token").splitlines()[:22]:
    print(line)""",
    ),
    (
        "md",
        """## A padding mask that leaks

A planted bug: a self-attention that drops its padding mask for a padded batch, so the padded tokens leak into the row. Its padded configurations are past the line -- a bug, not a kernel choice. The first op that parts is still a matrix product (13 tokens take another path than 10, within round-off: the projection or the attention's product, by thread count); where a pair is past the line the report also names the op that *moves* the row -- its output a million times further from the row alone's than its inputs: the softmax that now reads the padded keys. Beside a padded row, row 0 keeps its mask (it has no padding of its own): not past the line:""",
    ),
    (
        "code",
        """class LeakyAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.qkv, self.out = torch.nn.Embedding(32, 16), torch.nn.Linear(16, 48), torch.nn.Linear(16, 32)

    def forward(self, input_ids, attention_mask):
        q, k, v = self.qkv(self.emb(input_ids)).chunk(3, -1)
        scores = q @ k.transpose(-1, -2) / 4.0
        if not (attention_mask == 0).any():           # the bug: a padded batch loses its mask
            scores = scores.masked_fill(attention_mask[:, None, :] == 0, float("-inf"))
        return self.out(torch.softmax(scores, -1) @ v)

tokens = torch.randint(1, 32, (3, 10))
leak = rlx_nb.invariance(LeakyAttention(), {"input_ids": tokens, "attention_mask": torch.ones_like(tokens)},
                         configs=["padding"])
print(leak)
leak.plot();""",
    ),
    (
        "md",
        """## Per-sample gradients

A trainer computes its gradients from a rollout's rows inside a batch. `backward=True` adds each row's per-sample gradients (outputs `grad:<parameter>`: the gradient of the row's outputs against a fixed cotangent, taken inside the batch where only the row reaches it) and judges them the same way:""",
    ),
    (
        "code",
        """grads = rlx_nb.invariance(linears, rows, batch_sizes=(2, 16), rows=[0], backward=True, progress=False).frame
grads[grads.output.str.startswith("grad:")][["config", "output", "bitwise", "verdict", "line"]]""",
    ),
    (
        "md",
        """## A certificate, and a gate

`report.certificate` lists, per backend and configuration, whether it was bit for bit and (where ops were recorded) the ops seen invariant for the shapes tried and those not; `report.save_certificate(path)` writes it as JSON, and `rlx_nb.configurations.report.certificate_changes(old, new)` says what changed between two environments. In CI, `rlx_nb.testing.assert_invariant(model, inputs)` and `rlx-nb invariance path/to/models.py:factory` fail when something is not bit for bit (`past_line_only=True` / `--past-line`: only when a difference is past the line); `backends=[...]` runs every configuration on other backends too, `report.to_html(path)` writes the page.""",
    ),
    (
        "code",
        """import json, os, tempfile
from rlx_nb.configurations.report import certificate_changes

path = report.save_certificate(os.path.join(tempfile.mkdtemp(), "linears.json"))
now = json.loads(path.read_text())
print(json.dumps(now["pairs"]["cpu | batch of 16, at 0"], indent=1)[:400])

threads = torch.get_num_threads()
torch.set_num_threads(1 if threads > 1 else 2)   # another environment: another thread count
again = rlx_nb.invariance(linears, rows, progress=False)
torch.set_num_threads(threads)
print(certificate_changes(now, again.certificate) or "the same certificate on another thread count")""",
    ),
]

NOTEBOOKS = {
    "01_find_the_suspect.ipynb": FIND_THE_SUSPECT,
    "02_localize_the_operator.ipynb": LOCALIZE,
    "03_roundoff_or_bug.ipynb": ROUNDOFF_OR_BUG,
    "04_cluster.ipynb": CLUSTER,
    "05_precision.ipynb": PRECISION,
    "06_share_gate_baseline.ipynb": SHARE_AND_GATE,
    "07_where_generation_parts.ipynb": GENERATION,
    "08_int8.ipynb": INT8,
    "09_what_changed.ipynb": CHANGES,
    "10_where_training_parts.ipynb": TRAINING,
    "11_batch_invariance.ipynb": INVARIANCE,
}


def kernelspec() -> dict[str, str]:
    """The python3 kernel's spec as JupyterLab writes it into a notebook it opens: a notebook that says otherwise
    ("Python 3" where the kernel is "Python 3 (ipykernel)") opens marked modified."""
    from jupyter_client.kernelspec import KernelSpecManager

    spec = KernelSpecManager().get_kernel_spec("python3")
    return {"name": "python3", "display_name": spec.display_name, "language": spec.language}


def build(name: str, cells: list[tuple[str, str]]) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = kernelspec()
    nb.cells = [
        nbformat.v4.new_markdown_cell(src) if kind == "md" else nbformat.v4.new_code_cell(src) for kind, src in cells
    ]
    NotebookClient(
        nb, timeout=900, kernel_name="python3", store_widget_state=True, resources={"metadata": {"path": str(HERE)}}
    ).execute()
    path = HERE / name
    nbformat.write(nb, path)
    return path


if __name__ == "__main__":
    # The committed outputs are static: a progress bar there would only show as a stale 0% line.
    os.environ["RLX_NB_PROGRESS"] = "0"
    prefix = sys.argv[1] if len(sys.argv) > 1 else ""
    for name, cells in NOTEBOOKS.items():
        if name.startswith(prefix):
            print("built", build(name, cells))
