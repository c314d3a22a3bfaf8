"""Device runtimes on the real-architecture zoo: ExecuTorch, LiteRT and ONNX Runtime's levels, fp32 and int8.

fp32 (``--part fp32``): each zoo model at each batch size on ``executorch-xnnpack``, ``executorch-portable``,
``litert``, ``litert-reference`` and ``onnxruntime-noopt`` -- legitimate, so a SUSPECT is a false positive unless
it is a known runtime bug -- and, at the first batch size, every forward catalogue fault carried through
``executorch-xnnpack`` and ``litert`` (:func:`rlx_nb.backends.exported_faults.fault_through`): a fault whose error
against fp64 is past 10x the oracle's own must be caught (the real-architecture benchmark's criterion), unless it is
*inert*: its outputs equal, bit for bit, those of the runtime it went through (the model has no op the fault
changes, or the converter folded it away), so there is nothing to catch.

int8 (``--part int8``): each model PT2E-quantized for XNNPACK (:func:`rlx_nb.int8.quantize.quantize_pt2e`), judged by
:func:`rlx_nb.quantized_divergence` on ``executorch-xnnpack`` and ``executorch-portable`` (legitimate) and with
the output layer's channel 1 weight scale off by 1.5x (:func:`rlx_nb.int8.faults.channel_scale_fault`): the fault
must be caught where it is past 10x a legitimate int8 computation's error on the same output (XNNPACK's, or the
fp32 simulation's own against the exact one, at least one quantum).

    python bench/device_runtimes.py [--part fp32,int8] [--models resnet,vit] [--batches 1,16] [--resume]

Writes ``bench/results/device_runtimes.csv`` and ``.md`` after each case; ``--resume`` keeps the cases that file
already holds and runs only the others.
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
from rlx_nb.backends.exported_faults import fault_through
from rlx_nb.backends.faults import CATALOGUE, HITS
from rlx_nb.backends.registry import get_backend
from rlx_nb.execution.results import nondeterministic
from rlx_nb.int8 import faults
from rlx_nb.int8.quantize import quantize_pt2e
from rlx_nb.models import demo, zoo
from rlx_nb.verdict.types import SUSPECT, VERDICT_ERROR

sys.path.insert(0, str(Path(__file__).parent))
from int8_detection import raw_ratio as int8_ratio
from real_models import DETECTABLE, _legit_errors, _raw_ratios, _units

RESULTS = Path(__file__).parent / "results"
LEGIT = ("executorch-xnnpack", "executorch-portable", "litert", "litert-reference", "onnxruntime-noopt")
THROUGH = ("executorch-xnnpack", "litert")
_LITERT_EMPTY_MASK = (
    "LiteRT's conversion of scaled_dot_product_attention gives a query whose mask keeps no key NaN (XNNPACK) or the "
    "mean of the values (reference kernels) where PyTorch gives zeros: Mistral's padded positions whose sliding "
    "window holds only padding (tests/test_runtimes.py reproduces it on one op)"
)
_PORTABLE_QUANTIZE_INF = (
    "ExecuTorch 1.5.1's portable quantize_per_tensor turns +inf into the lowest integer where PyTorch's Q/DQ op and "
    "XNNPACK saturate it to the highest: an RMSNorm whose variance quantizes to the zero point takes rsqrt(0) = +inf "
    "(Mamba's quiet tokens at batch 1, two positions of Mistral at batch 16; tests/test_quantized.py reproduces it on one op and on a norm)"
)
KNOWN = {
    ("*", "executorch-xnnpack"): "ExecuTorch 1.5.1's XNNPACK delegate computes gelu(approximate='tanh') as the exact "
    "gelu (tests/test_runtimes.py reproduces it on one op)",
    ("mistral", "litert"): _LITERT_EMPTY_MASK,
    ("mistral", "litert-reference"): _LITERT_EMPTY_MASK,
    ("mamba", "executorch-portable"): _PORTABLE_QUANTIZE_INF,
    ("mistral", "executorch-portable"): _PORTABLE_QUANTIZE_INF,
}
"""Real bugs of a legitimate runtime the benchmark may meet: SUSPECT there is a catch (said in the row)."""


def _known(model: str, backend: str) -> str | None:
    # What a known runtime bug explains about a legitimate backend's SUSPECT on this model (None: nothing).
    return KNOWN.get((model, backend), KNOWN.get(("*", backend)))


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
        inert = fault and _same_outputs(report, backend, backend.split("+")[0])
        rows.append({
            "part": "fp32", "model": name, "batch": batch, "backend": backend, "legit": not fault,
            "verdict": worst.verdict, "line": worst.judgement.line, "suspect": any(r.verdict == SUSPECT for r in recs),
            "inert": inert, "detectable": bool(fault and not inert and ratio > DETECTABLE), "raw_ratio": ratio,
            "why": worst.reason[:160], "seconds": seconds,
        })  # fmt: skip
    return rows


def _same_outputs(report: rlx_nb.DivergenceReport, backend: str, runtime: str) -> bool:
    # Whether ``backend`` (a fault through ``runtime``) ran and left every output as ``runtime`` computed it.
    a, b = report.results.candidates.get(backend), report.results.candidates.get(runtime)
    if a is None or b is None or a.status != "ok" or b.status != "ok" or a.outputs.keys() != b.outputs.keys():
        return False
    # (the determinism check's comparison: bit for bit, NaN equal to NaN)
    return not nondeterministic(a, b, any_only=True)


def int8_rows(name: str, batch: int) -> list[dict]:
    # (a demo model -- mlp, conv, transformer -- runs at its own batch)
    model, inputs = zoo.build(name, batch=batch) if name in zoo.MODELS else getattr(demo, name)()
    try:
        converted = quantize_pt2e(model, inputs)
    except Exception as exc:
        return [{"part": "int8", "model": name, "batch": batch, "backend": "(quantize)", "legit": True,
                 "verdict": VERDICT_ERROR, "why": f"PT2E could not quantize it: {type(exc).__name__}: {exc}"[:200]}]  # fmt: skip
    fault = faults.channel_scale_fault(layer=-1, channel=1, factor=1.5)
    start = time.perf_counter()
    report = rlx_nb.quantized_divergence(
        converted, inputs, backends=["executorch-xnnpack", "executorch-portable", fault], label=name, progress=False
    )
    seconds = time.perf_counter() - start
    rows = []
    for backend in ("executorch-xnnpack", "executorch-portable", fault.name):
        row = report.record(backend)
        raw = int8_ratio(report, backend)
        rows.append({
            "part": "int8", "model": name, "batch": batch, "backend": backend, "legit": backend != fault.name,
            "verdict": row.verdict, "line": row.judgement.line, "suspect": row.verdict == SUSPECT,
            "detectable": backend == fault.name and raw > DETECTABLE, "raw_ratio": raw, "why": row.reason[:160],
            "seconds": seconds,
        })  # fmt: skip
    return rows


def _no_paths(text: object) -> object:
    # An error message names the file it was raised in: keep the package's own path, not this machine's.
    return re.sub(r"(/[^\s:]+)?/site-packages/", "", text) if isinstance(text, str) else text


def summary(df: pd.DataFrame) -> str:
    df = df.assign(why=df["why"].map(_no_paths))
    for flag in ("suspect", "detectable", "inert", "legit"):  # (an error row leaves them empty)
        if flag in df:
            df[flag] = df[flag].astype("boolean").fillna(flag == "legit").astype(bool)
    lines = ["# Device runtimes on the zoo", ""]
    for part, d in df.groupby("part"):
        legit = d[d.legit & (d.verdict != VERDICT_ERROR)]
        is_known = pd.Series([_known(m, b) is not None for m, b in zip(legit.model, legit.backend, strict=True)],
                             index=legit.index, dtype=bool)  # fmt: skip
        false = legit[legit.suspect & ~is_known]
        known = legit[legit.suspect & is_known]
        faults = d[~d.legit]
        inert = faults[faults.inert] if "inert" in faults else faults.iloc[:0]
        detectable = faults[faults.detectable]
        caught = detectable[detectable.suspect]
        errors = d[d.verdict == VERDICT_ERROR]
        lines += [
            f"## {part}",
            "",
            f"- legitimate runs judged: {len(legit)}; false SUSPECT: {len(false)}"
            + (f"; SUSPECT from a known runtime bug: {len(known)} ({', '.join(sorted(set(known.model + ' on ' + known.backend)))})"
               if len(known) else ""),
            f"- faults past {DETECTABLE:g}x (detectable): {len(detectable)}; caught: {len(caught)}"
            + (f"; missed: {', '.join(detectable[~detectable.suspect].backend + ' on ' + detectable[~detectable.suspect].model)}"
               if len(caught) < len(detectable) else ""),
            f"- inert faults (outputs bit-identical to the runtime's own run): {len(inert)}",
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
        if len(known):
            why = sorted({f"- {b}: {_known(m, b)}" for m, b in zip(known.model, known.backend, strict=True)})
            lines += ["Known runtime bugs caught:", "", *why, ""]
        if len(errors):
            lines += ["Errors:", "", errors[["model", "batch", "backend", "why"]].to_markdown(index=False), ""]
    return "\n".join(lines)


def main() -> None:
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", default="fp32,int8")
    parser.add_argument("--models", default=",".join(zoo.MODELS))
    parser.add_argument("--int8-models", default=",".join(("mlp", "conv", "transformer", *zoo.MODELS)))
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--name", default="device_runtimes")
    parser.add_argument("--resume", action="store_true", help="keep the cases the results file holds; run the rest")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    rows: list[dict] = []
    done: set[tuple] = set()
    if args.resume and (RESULTS / f"{args.name}.csv").exists():
        rows = pd.read_csv(RESULTS / f"{args.name}.csv").to_dict("records")
        done = {(r["part"], r["model"], int(r["batch"])) for r in rows}
    for part in args.part.split(","):
        names = args.models.split(",") if part == "fp32" else args.int8_models.split(",")
        for name in names:
            for i, batch in enumerate(batches):
                if name not in zoo.MODELS and i:  # a demo model has its own batch: judged once
                    continue
                if (part, name, batch) in done:
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
