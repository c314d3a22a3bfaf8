"""Device runtimes on the real-architecture zoo: ExecuTorch, LiteRT and ONNX Runtime's levels, fp32 and int8.

fp32 (``--part fp32``): each zoo model at each batch size on ``executorch-xnnpack``, ``executorch-portable``,
``litert``, ``litert-reference`` and ``onnxruntime-noopt`` -- legitimate, so a SUSPECT is a false positive unless
it is a known runtime bug -- and, at the first batch size, every forward catalogue fault carried through
``executorch-xnnpack`` and ``litert`` (:func:`rlx_nb.backends.exported_faults.fault_through`): a fault whose error
against fp64 is past 10x the oracle's own must be caught (the real-architecture benchmark's criterion).

int8 (``--part int8``): each model PT2E-quantized for XNNPACK (:func:`rlx_nb.quantized.quantize_pt2e`), judged by
:func:`rlx_nb.quantized_divergence` on ``executorch-xnnpack`` and ``executorch-portable`` (legitimate) and with
the output layer's channel 1 weight scale off by 1.5x (:func:`rlx_nb.quantized.channel_scale_fault`).

    python bench/device_runtimes.py [--part fp32,int8] [--models resnet,vit] [--batches 1,16]

Writes ``bench/results/device_runtimes.csv`` and ``.md``.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
import warnings
from pathlib import Path

import pandas as pd

import rlx_nb
from rlx_nb import quantized
from rlx_nb.backends.exported_faults import fault_through
from rlx_nb.backends.faults import CATALOGUE, HITS
from rlx_nb.backends.registry import get_backend
from rlx_nb.models import demo, zoo
from rlx_nb.verdict.types import SUSPECT, VERDICT_ERROR

sys.path.insert(0, str(Path(__file__).parent))
from real_models import DETECTABLE, _legit_errors, _raw_ratios, _units

RESULTS = Path(__file__).parent / "results"
LEGIT = ("executorch-xnnpack", "executorch-portable", "litert", "litert-reference", "onnxruntime-noopt")
THROUGH = ("executorch-xnnpack", "litert")
KNOWN = {
    "executorch-xnnpack": "ExecuTorch 1.5.1's XNNPACK delegate computes gelu(approximate='tanh') as the exact gelu "
    "(tests/test_runtimes.py reproduces it on one op)",
}
"""Real bugs of a legitimate runtime the benchmark may meet: SUSPECT there is a catch (said in the row)."""


def _forward_faults() -> list[str]:
    return [name for name, f in CATALOGUE.items() if not f.backward_only]


def fp32_rows(name: str, batch: int, with_faults: bool) -> list[dict]:
    model, inputs = zoo.build(name, batch=batch)
    faults = [fault_through(f, get_backend(r)) for r in THROUGH for f in _forward_faults()] if with_faults else []
    HITS.clear()
    start = time.perf_counter()
    report = rlx_nb.backend_divergence(model, inputs, backends=[*LEGIT, *faults], label=name, progress=False)
    seconds = time.perf_counter() - start
    units = _units(report)
    oracle, legit = _legit_errors(report, units)
    rows = []
    for backend in report.results.candidates:
        recs = [r for r in report.records if r.backend == backend]
        worst = report.record(backend)
        fault = backend not in LEGIT
        ratio = _raw_ratios(report, backend, oracle, legit)[0] if fault else float("nan")
        rows.append({
            "part": "fp32", "model": name, "batch": batch, "backend": backend, "legit": not fault,
            "verdict": worst.verdict, "line": worst.judgement.line, "suspect": any(r.verdict == SUSPECT for r in recs),
            "detectable": bool(fault and ratio > DETECTABLE), "raw_ratio": ratio,
            "why": worst.reason[:160], "seconds": seconds,
        })  # fmt: skip
    return rows


def int8_rows(name: str, batch: int) -> list[dict]:
    # (a demo model -- mlp, conv, transformer -- runs at its own batch)
    model, inputs = zoo.build(name, batch=batch) if name in zoo.MODELS else getattr(demo, name)()
    try:
        converted = quantized.quantize_pt2e(model, inputs)
    except Exception as exc:
        return [{"part": "int8", "model": name, "batch": batch, "backend": "(quantize)", "legit": True,
                 "verdict": VERDICT_ERROR, "why": f"PT2E could not quantize it: {type(exc).__name__}: {exc}"[:200]}]  # fmt: skip
    fault = quantized.channel_scale_fault(layer=-1, channel=1, factor=1.5)
    start = time.perf_counter()
    report = quantized.quantized_divergence(
        converted, inputs, backends=["executorch-xnnpack", "executorch-portable", fault], label=name, progress=False
    )
    seconds = time.perf_counter() - start
    rows = []
    legit = report.record("executorch-xnnpack")
    for backend in ("executorch-xnnpack", "executorch-portable", fault.name):
        row = report.record(backend)
        # Detectable, independently of the budget: past 10x what legitimate XNNPACK int8 leaves (RMS or largest),
        # as the fp32 benchmark's faults are past 10x the oracle's own error (a diluted channel can be inert).
        raw = max(row["rmse"] / max(legit["rmse"], 1e-30), row["max_abs"] / max(legit["max_abs"], 1e-30))
        rows.append({
            "part": "int8", "model": name, "batch": batch, "backend": backend, "legit": backend != fault.name,
            "verdict": row["verdict"], "line": row["line"], "suspect": row["verdict"] == SUSPECT,
            "detectable": backend == fault.name and raw > DETECTABLE, "raw_ratio": raw, "why": row["why"][:160],
            "seconds": seconds,
        })  # fmt: skip
    return rows


def _no_paths(text: object) -> object:
    # An error message names the file it was raised in: keep the package's own path, not this machine's.
    return re.sub(r"(/[^\s:]+)?/site-packages/", "", text) if isinstance(text, str) else text


def summary(df: pd.DataFrame) -> str:
    df = df.assign(why=df["why"].map(_no_paths))
    lines = ["# Device runtimes on the zoo", ""]
    for part, d in df.groupby("part"):
        legit = d[d.legit & (d.verdict != VERDICT_ERROR)]
        false = legit[legit.suspect & ~legit.backend.isin(KNOWN)]
        known = legit[legit.suspect & legit.backend.isin(KNOWN)]
        faults = d[~d.legit]
        detectable = faults[faults.detectable]
        caught = detectable[detectable.suspect]
        errors = d[d.verdict == VERDICT_ERROR]
        lines += [
            f"## {part}",
            "",
            f"- legitimate runs judged: {len(legit)}; false SUSPECT: {len(false)}"
            + (f"; SUSPECT from a known runtime bug: {len(known)} ({', '.join(sorted(set(known.model)))})" if len(known) else ""),
            f"- faults past {DETECTABLE:g}x (detectable): {len(detectable)}; caught: {len(caught)}"
            + (f"; missed: {', '.join(detectable[~detectable.suspect].backend + ' on ' + detectable[~detectable.suspect].model)}"
               if len(caught) < len(detectable) else ""),
            f"- error rows (a runtime could not convert or run the model): {len(errors)}",
            "",
        ]  # fmt: skip
        if len(false):
            lines += [
                "False SUSPECT:",
                "",
                false[["model", "batch", "backend", "line", "why"]].to_markdown(index=False),
                "",
            ]
        if len(errors):
            lines += ["Errors:", "", errors[["model", "batch", "backend", "why"]].to_markdown(index=False), ""]
    return "\n".join(lines)


def main() -> None:
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", default="fp32,int8")
    parser.add_argument("--models", default=",".join(zoo.MODELS))
    parser.add_argument("--int8-models", default="mlp,conv,transformer,resnet,mobilenet,vit,convnext,swin,efficientnet")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--name", default="device_runtimes")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    rows: list[dict] = []
    for part in args.part.split(","):
        names = args.models.split(",") if part == "fp32" else args.int8_models.split(",")
        for name in names:
            for i, batch in enumerate(batches):
                if name not in zoo.MODELS and i:  # a demo model has its own batch: judged once
                    continue
                try:
                    got = fp32_rows(name, batch, i == 0) if part == "fp32" else int8_rows(name, batch)
                except Exception as exc:
                    got = [{"part": part, "model": name, "batch": batch, "backend": "(all)", "legit": True,
                            "verdict": VERDICT_ERROR, "why": f"{type(exc).__name__}: {exc}"[:200]}]  # fmt: skip
                rows += got
                print(part, name, batch, " ".join(f"{r['backend']}={r['verdict']}" for r in got if r.get("suspect")
                                                  or r["verdict"] == VERDICT_ERROR), flush=True)  # fmt: skip
                df = pd.DataFrame(rows)
                df["why"] = df["why"].map(_no_paths)
                RESULTS.mkdir(exist_ok=True)
                df.to_csv(RESULTS / f"{args.name}.csv", index=False)
                (RESULTS / f"{args.name}.md").write_text(summary(df))
    print(summary(pd.DataFrame(rows)))


if __name__ == "__main__":
    main()
