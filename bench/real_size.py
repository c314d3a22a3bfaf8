"""Real model sizes: rlx_nb against checking by hand, wall time and peak memory, in fresh processes.

Models at the sizes people use, built by ``transformers`` from their configs with random weights
(nothing downloads), float32, batch 1:

| name | what | parameters |
|---|---|---|
| ``gpt2`` | GPT-2 small, 128 tokens | 124M |
| ``gpt2-medium`` | GPT-2 medium, 128 tokens | 355M |
| ``llama-1b`` | a Llama-architecture decoder (TinyLlama's shape: 22 layers, hidden 2048, vocabulary 32000), 128 tokens | 1.1B |
| ``vit-base`` | ViT-Base/16, one 224x224 image | 86M |

Each (model, workflow) runs in a fresh interpreter; its peak RSS is the kernel's (``wait4``), its
time is the call's alone (building the model is outside both).  The two workflows, on the default
backends (``cpu-nomkldnn``, ``cpu-inductor``, ``onnxruntime``, ``openvino``), forward only:

- ``rlx_nb``: ``rlx_nb.backend_divergence(model, inputs)``.
- ``manual``: what an engineer writes by hand, in one function: eager; ``torch.compile``; ONNX export
  (dynamo exporter, to a file with external data) + an ONNX Runtime session; OpenVINO ``convert_model`` +
  ``compile_model`` with the f32 hint; eager with oneDNN off -- each against eager with
  ``torch.testing.assert_close`` (failures printed, as a person would read them).  Every object stays
  alive until the function returns, as in a notebook cell.

    python bench/real_size.py [--models gpt2,gpt2-medium,llama-1b,vit-base] [--workflows rlx_nb,manual]

Writes ``bench/results/real_size.md``, ``real_size.csv`` and ``real_size.png`` (peak RSS against
parameters, log-log, with the fitted slopes).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _child import RESULTS, write_result

MODELS = ("gpt2", "gpt2-medium", "llama-1b", "vit-base")
WORKFLOWS = ("rlx_nb", "manual")
TOKENS = 128


def build(name: str):
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    if name in ("gpt2", "gpt2-medium"):
        config = (
            transformers.GPT2Config() if name == "gpt2" else transformers.GPT2Config(n_embd=1024, n_layer=24, n_head=16)
        )
        model = transformers.GPT2LMHeadModel(config)
        inputs = {"input_ids": torch.randint(0, config.vocab_size, (1, TOKENS), generator=gen)}
    elif name == "llama-1b":
        config = transformers.LlamaConfig(
            vocab_size=32000,
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=22,
            num_attention_heads=32,
            num_key_value_heads=4,
            max_position_embeddings=2048,
        )
        model = transformers.LlamaForCausalLM(config)
        inputs = {"input_ids": torch.randint(0, config.vocab_size, (1, TOKENS), generator=gen)}
    elif name == "vit-base":
        config = transformers.ViTConfig()
        model = transformers.ViTForImageClassification(config)
        inputs = {"pixel_values": torch.randn(1, 3, 224, 224, generator=gen)}
    else:
        raise SystemExit(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    return model.eval(), inputs


def _check(name: str, expected, got) -> str:
    import torch

    try:
        torch.testing.assert_close(got, expected)
        return f"{name}: close"
    except AssertionError as exc:
        return f"{name}: {str(exc).splitlines()[0]}"


def manual(model, inputs) -> list[str]:
    """Checking the default backends by hand, as a person writes it."""
    import onnxruntime as ort
    import openvino as ov
    import torch

    said = []
    # The exporters and OpenVINO cannot return Hugging Face's cache objects: a person turns the cache off.
    model.config.use_cache = False
    with torch.no_grad():
        expected = model(**inputs).logits
        compiled = torch.compile(model)
        said.append(_check("torch.compile", expected, compiled(**inputs).logits))
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "model.onnx")
            program = torch.onnx.export(model, kwargs=inputs, dynamo=True)
            program.save(path, external_data=True)
            session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
            feed = {i.name: inputs[i.name].numpy() for i in session.get_inputs()}
            said.append(_check("onnxruntime", expected, torch.from_numpy(session.run(None, feed)[0])))
            core = ov.Core()
            try:
                converted = ov.convert_model(model, example_input=inputs)
            except Exception:  # (GPT-2: "No conversion rule found for operations: aten::diff"): the ONNX file
                converted = ov.convert_model(path)
            ov_compiled = core.compile_model(converted, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
        result = ov_compiled(inputs)
        said.append(_check("openvino", expected, torch.from_numpy(result[ov_compiled.outputs[0]])))
        with torch.backends.mkldnn.flags(enabled=False):
            said.append(_check("oneDNN off", expected, model(**inputs).logits))
    return said


def _child(model_name: str, workflow: str) -> None:
    import torch

    model, inputs = build(model_name)
    params = sum(p.numel() for p in model.parameters())
    if workflow == "rlx_nb":
        import rlx_nb

        start = time.perf_counter()
        report = rlx_nb.backend_divergence(model, inputs, progress=False)
        seconds = time.perf_counter() - start
        said = report.lines()
        phases = {r.phase: [round(r.seconds, 2), round(r.peak_bytes / 1e9, 3)] for r in report.timings.itertuples()}
    else:
        start = time.perf_counter()
        said = manual(model, inputs)
        seconds = time.perf_counter() - start
        phases = {}
    print(
        json.dumps({"params": params, "seconds": seconds, "said": said, "phases": phases, "torch": torch.__version__})
    )


def _run(model_name: str, workflow: str) -> dict:
    # A fresh interpreter per case; its peak RSS from the kernel (wait4), not sampled.
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, __file__, "--child", model_name, workflow], stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        out.seek(0)
        err.seek(0)
        text, errors = out.read(), err.read()
    if os.waitstatus_to_exitcode(status) != 0:
        return {"model": model_name, "workflow": workflow, "failed": errors[-2000:]}
    row = json.loads(text.strip().splitlines()[-1])
    return {"model": model_name, "workflow": workflow, "peak_rss": usage.ru_maxrss * 1024, **row}


def _slope(rows: list[dict], workflow: str) -> tuple[float, float]:
    # Least squares of peak RSS on parameter bytes (float32): (slope, intercept in GB).
    pts = [(4 * r["params"], r["peak_rss"]) for r in rows if r["workflow"] == workflow and "peak_rss" in r]
    if len(pts) < 2:
        return float("nan"), float("nan")
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    slope = sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else float("nan")
    return slope, (my - slope * mx) / 1e9


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4.5), layout="constrained")
    ax = fig.add_subplot()
    for workflow, colour in (("rlx_nb", "#4c72b0"), ("manual", "#55a868")):
        pts = sorted(
            (4 * r["params"] / 1e9, r["peak_rss"] / 1e9) for r in rows if r["workflow"] == workflow and "peak_rss" in r
        )
        if pts:
            slope, icpt = _slope(rows, workflow)
            ax.plot(
                *zip(*pts, strict=True),
                "o-",
                color=colour,
                label=f"{workflow}: slope {slope:.2f}x model, +{icpt:.2f} GB",
            )
    xs = [4 * r["params"] / 1e9 for r in rows if "params" in r]
    if xs:
        lo, hi = min(xs), max(xs)
        ax.plot([lo, hi], [4 * lo, 4 * hi], "--", color="grey", label="4x the model (the 1.1B target)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("model size, float32 (GB)")
    ax.set_ylabel("peak RSS (GB)")
    ax.set_title("peak memory against model size, default backends, forward", fontsize=9)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", nargs=2)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--workflows", default=",".join(WORKFLOWS))
    args = parser.parse_args()
    if args.child:
        _child(*args.child)
        return
    rows = []
    for model_name in args.models.split(","):
        for workflow in args.workflows.split(","):
            print(f"{model_name} / {workflow} ...", flush=True)
            rows.append(_run(model_name, workflow))
            print("  ", {k: v for k, v in rows[-1].items() if k not in ("said", "phases")}, flush=True)
    with open(RESULTS / "real_size.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["model", "workflow", "params", "seconds", "peak_rss_gb", "failed"])
        for r in rows:
            writer.writerow([r["model"], r["workflow"], r.get("params", ""), r.get("seconds", ""),
                             r["peak_rss"] / 1e9 if "peak_rss" in r else "", r.get("failed", "")[:200]])  # fmt: skip
    _plot(rows, RESULTS / "real_size.png")
    lines = [
        "# Real model sizes: rlx_nb against checking by hand",
        "",
        f"`python bench/real_size.py`, one run, {time.strftime('%Y-%m-%d')}; each case a fresh process; "
        "default backends, forward, float32, batch 1.  Time: the call alone; peak: the process's RSS (kernel).",
        "",
        "| model | params | rlx_nb s | manual s | time ratio | rlx_nb peak GB | manual peak GB | peak ratio | rlx_nb peak / model |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    by = {(r["model"], r["workflow"]): r for r in rows}
    for model_name in dict.fromkeys(r["model"] for r in rows):
        a, m = by.get((model_name, "rlx_nb"), {}), by.get((model_name, "manual"), {})
        params = a.get("params") or m.get("params") or 0

        def cell(r, key, scale=1.0, fmt="{:.1f}"):
            return fmt.format(r[key] / scale) if key in r else "failed" if r else "-"

        ratio_t = f"{a['seconds'] / m['seconds']:.2f}x" if "seconds" in a and "seconds" in m else "-"
        ratio_m = f"{a['peak_rss'] / m['peak_rss']:.2f}x" if "peak_rss" in a and "peak_rss" in m else "-"
        per_model = f"{a['peak_rss'] / (4 * params):.2f}x" if "peak_rss" in a and params else "-"
        lines.append(
            f"| {model_name} | {params / 1e6:.0f}M | {cell(a, 'seconds')} | {cell(m, 'seconds')} | {ratio_t} | "
            f"{cell(a, 'peak_rss', 1e9, '{:.2f}')} | {cell(m, 'peak_rss', 1e9, '{:.2f}')} | {ratio_m} | {per_model} |"
        )
    for workflow in WORKFLOWS:
        slope, icpt = _slope(rows, workflow)
        lines.append(f"\nPeak RSS against float32 model size, {workflow}: slope {slope:.2f}x, intercept {icpt:.2f} GB.")
    lines += ["", "## What each run said", ""]
    for r in rows:
        lines.append(
            f"**{r['model']} / {r['workflow']}**" + (f" — FAILED: `{r['failed'][-300:]}`" if "failed" in r else "")
        )
        lines += [f"    {line}" for line in r.get("said", [])]
        if r.get("phases"):
            lines.append(
                "    phases (seconds, peak GB): " + "; ".join(f"{k} {v[0]} s {v[1]} GB" for k, v in r["phases"].items())
            )
        lines.append("")
    write_result("real_size.md", lines)


if __name__ == "__main__":
    main()
