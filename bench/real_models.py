"""Real-architecture benchmark: rlx_nb's verdict on Hugging Face models nobody on the project wrote.

Each case is one model of :mod:`rlx_nb.models.zoo` (BERT, DistilBERT, GPT-2, Llama, Qwen2, Mistral, Mamba, T5, Whisper, ViT,
ConvNeXt, ResNet, MobileNetV2, EfficientNet, Swin — random weights from small configs, passed as
they are with their own keyword inputs and outputs) at one batch size and seed, in one direction:

- ``forward``: ``backward=False``, every live default backend (``cpu-nomkldnn``, ``cpu-inductor``,
  ``onnxruntime``, ``openvino``), ``cpu-bf16`` and ``cpu-fp16`` on their own budgets, and every
  catalogue fault;
- ``backward``: ``backward=True``, the differentiable ones of those.  Forward-only backends
  (ONNX Runtime, OpenVINO) are judged once, in the forward direction.

Legitimate backends must be round-off everywhere (a SUSPECT is a false positive).  A fault is
*inert* on a case when it never ran or changed no output bit; otherwise *detectable* when its
error against fp64 is more than 10x the fp32 oracle's own on some output, and then it must be
caught.  Faults that changed something but stay within 10x are reported, neither caught nor missed.

    python bench/real_models.py [--models bert,vit] [--batches 1,2,4,8] [--seeds 0,1,2]
                                [--directions forward,backward] [--name real_models] [--rejudge]

Every run's results are saved under ``bench/.cache/<name>/`` (not committed); ``--rejudge`` judges
those again with the current verdict without running any model.  Writes
``bench/results/<name>.csv`` and ``.md``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import torch

import rlx_nb
from rlx_nb.backends.faults import CATALOGUE, HITS, fault_backend
from rlx_nb.backends.registry import available_backends, get_backend, register_backend
from rlx_nb.models import zoo
from rlx_nb.verdict.types import SUSPECT, VERDICT_ERROR, VERDICT_SKIPPED

HERE = Path(__file__).parent
RESULTS = HERE / "results"
CACHE = HERE / ".cache"
REDUCED = ("cpu-bf16", "cpu-fp16")
DETECTABLE = 10.0
KNOWN_BUGS = {
    ("efficientnet", "cpu-inductor", "backward"): (
        "Inductor's avg_pool2d backward divides a window that overhangs the input (ceil_mode=True) by the whole "
        "kernel area (pytorch/pytorch#198119); Hugging Face's EfficientNet pools with AvgPool2d(hidden_dim, "
        "ceil_mode=True), so every gradient upstream of the pool comes out ~1e-5 of its size"
    ),
}
"""Real differences of a legitimate backend the benchmark meets: SUSPECT there is a catch, not a false positive
(``tests/test_real_models.py`` reproduces each on a minimal model)."""


LESS_ACCURATE = ("cpu-nnpack",)
"""Legitimate backends that are less accurate than the oracle by design (NNPACK's fast convolutions from batch
16): SUSPECT there is allowed when the report reads it as uniformly less accurate, never as a kernel bug."""


def legitimate_backends() -> list[str]:
    """Every live default backend (the oracle aside), then the reduced-precision ones and the less accurate ones."""
    live = available_backends(include_optin=True)
    return [b for b in available_backends() if b != "cpu"] + list(REDUCED) + [b for b in LESS_ACCURATE if b in live]


def fault_severities() -> dict[str, tuple[str, float]]:
    """``{backend name: (fault, severity)}`` for every catalogue fault at every severity it is swept at,
    registered as ``fault:<kind>@<severity>``."""
    out = {}
    for kind, fault in CATALOGUE.items():
        for severity in fault.severities:
            b = fault_backend(kind, severity)
            register_backend(b.name, b.fn, replace=True, default=False, hookable=True, description=b.description)
            out[b.name] = (kind, severity)
    return out


FAULTS = fault_severities()


def backends_for(direction: str) -> tuple[list[str], list[str]]:
    legit = legitimate_backends()
    faults = list(FAULTS)
    if direction == "backward":
        legit = [b for b in legit if get_backend(b).differentiable]
    else:
        faults = [f for f in faults if not CATALOGUE[FAULTS[f][0]].backward_only]
    return legit, faults


def run_case(
    model_name: str, batch: int, seed: int, direction: str, path: Path
) -> tuple[rlx_nb.DivergenceReport, dict]:
    model, inputs = zoo.build(model_name, batch=batch, seed=seed)
    legit, faults = backends_for(direction)
    HITS.clear()
    start = time.perf_counter()
    report = rlx_nb.backend_divergence(
        model, inputs, backends=legit + faults, backward=direction == "backward", label=model_name, progress=False
    )
    seconds = time.perf_counter() - start
    report.save(path)
    return report, {"fired": {f: HITS[f] > 0 for f in faults}, "seconds": seconds}


def _changed(report: rlx_nb.DivergenceReport, backend: str) -> bool:
    # Whether any output differs from the oracle's in at least one bit (a fault that changes nothing is inert).
    return any(
        rec.output is not None and rec.verdict not in (VERDICT_SKIPPED, VERDICT_ERROR) and rec.pair.max_abs != 0
        for rec in report.records
        if rec.backend == backend
    )


U32 = 2.0**-24
FP32_LEGIT = ("cpu-nomkldnn", "cpu-inductor", "onnxruntime", "openvino")


def _units(report: rlx_nb.DivergenceReport) -> dict[str, tuple[float, float]]:
    # One unit round-off of each float output's fp64 reference (RMS and largest magnitude): an error below
    # that is no error, however exactly the oracle happened to compute the output.
    out = {}
    for name, leaf in report.results.reference.outputs.items():
        if leaf.is_array and leaf.value.dtype.kind == "f" and leaf.value.size:
            r = leaf.value[np.isfinite(leaf.value)]
            out[name] = (U32 * float(np.sqrt(np.mean(r * r))) if r.size else 0.0, U32 * float(np.abs(r).max(initial=0)))
    return out


def _legit_errors(report: rlx_nb.DivergenceReport, units: dict) -> tuple[dict, dict]:
    # Per output, (RMSE, max error) against fp64 of the oracle alone, and the largest of the oracle, the
    # sequential run and every legitimate fp32 backend -- each at least one unit round-off.
    oracle, legit = {}, {}
    for rec in report.records:
        if rec.output is None or rec.judgement.oracle_rmse != rec.judgement.oracle_rmse or rec.output not in units:
            continue
        u = units[rec.output]
        o = (max(rec.judgement.oracle_rmse, u[0]), max(rec.judgement.oracle_max_err, u[1]))
        oracle[rec.output] = o
        seq = [v if v == v else 0.0 for v in (rec.judgement.sequential_rmse, rec.judgement.sequential_max_err)]
        worst = legit.get(rec.output, o)
        worst = (max(worst[0], seq[0]), max(worst[1], seq[1]))
        if rec.backend in FP32_LEGIT:
            worst = (max(worst[0], rec.judgement.backend_rmse), max(worst[1], rec.judgement.backend_max_err))
        legit[rec.output] = worst
    return oracle, legit


def _raw_ratios(report: rlx_nb.DivergenceReport, backend: str, oracle: dict, legit: dict) -> tuple[float, float]:
    # The backend's error against fp64 over the oracle's own, and over the worst legitimate error, worst over
    # outputs (RMSE and max).
    worst = [0.0, 0.0]
    for rec in report.records:
        if (
            rec.backend != backend
            or rec.output not in oracle
            or rec.judgement.backend_rmse != rec.judgement.backend_rmse
        ):
            continue
        for i, ref in enumerate((oracle[rec.output], legit[rec.output])):
            for num, den in zip((rec.judgement.backend_rmse, rec.judgement.backend_max_err), ref, strict=True):
                worst[i] = max(worst[i], num / den if den > 0 else (math.inf if num > 0 else 0.0))
    return worst[0], worst[1]


def case_rows(report: rlx_nb.DivergenceReport, key: dict, fired: dict[str, bool] | None) -> list[dict]:
    rows = []
    units = _units(report)
    oracle_err, legit_err = _legit_errors(report, units)
    for backend, run in report.results.candidates.items():
        recs = [r for r in report.records if r.backend == backend]
        judged = [r for r in recs if r.verdict not in (VERDICT_SKIPPED, VERDICT_ERROR) and r.output is not None]
        worst = report.record(backend)
        fault = backend in FAULTS
        bug = KNOWN_BUGS.get((key["model"], backend, key["direction"]))
        row = {
            **key,
            "backend": backend,
            "legit": not fault,
            "known_bug": bool(bug),
            "status": run.status,
            "verdict": worst.verdict,
            "suspect": any(r.verdict == SUSPECT for r in recs),
            "less_accurate": any(r.judgement.less_accurate for r in recs)
            and all(r.judgement.less_accurate for r in recs if r.suspect),
            "flips": max((r.judgement.discrete_events for r in recs), default=0),
            "outputs": len(judged),
            "worst_output": worst.output,
            "excess": max(
                (r.judgement.excess for r in judged if r.judgement.excess == r.judgement.excess), default=math.nan
            ),
            "slice_ratio": max(
                (r.judgement.slice_ratio for r in judged if r.judgement.slice_ratio == r.judgement.slice_ratio),
                default=math.nan,
            ),
            "reason": worst.reason,
            "notes": " | ".join(run.notes),
        }
        if fault:
            ran = fired.get(backend, True) if fired is not None else True
            changed = run.status == "ok" and _changed(report, backend)
            raw, vs_legit = _raw_ratios(report, backend, oracle_err, legit_err)
            row.update(
                fault=FAULTS[backend][0],
                severity=FAULTS[backend][1],
                fired=ran,
                inert=not (ran and changed),
                raw_ratio=raw,
                ratio_vs_legit=vs_legit,
                detectable=ran and changed and raw > DETECTABLE,
                detectable_vs_legit=ran and changed and vs_legit > DETECTABLE,
            )
        rows.append(row)
    return rows


def summary(df: pd.DataFrame) -> str:
    bugs = df[df.known_bug & (df.status == "ok")]
    df = df[~df.known_bug]
    legit = df[df.legit & (df.status == "ok")]
    errors = df[df.legit & (df.status != "ok")]
    faults = df[~df.legit & (df.status == "ok")]
    det = faults[faults.detectable.astype(bool)]
    lines = [
        "| legitimate backend | cases judged | false positives (SUSPECT) | error rows | highest excess | highest slice ratio |",
        "|---|---|---|---|---|---|",
    ]
    false = legit.suspect & ~(legit.backend.isin(LESS_ACCURATE) & legit.less_accurate.astype(bool))
    for b in df[df.legit].backend.unique():
        lb, eb = legit[legit.backend == b], errors[errors.backend == b]
        named = int((lb.suspect & lb.less_accurate.astype(bool)).sum()) if b in LESS_ACCURATE else 0
        lines.append(
            f"| {b} | {len(lb)} | {int(false[legit.backend == b].sum())}"
            f"{f' (+{named} named less accurate)' if named else ''} | {len(eb)} | {lb.excess.max():.2f} | "
            f"{lb.slice_ratio.max():.2f} |"
        )
    lines.append(
        f"| **all** | **{len(legit)}** | **{int(false.sum())}** | **{len(errors)}** | "
        f"{legit.excess.max():.2f} | {legit.slice_ratio.max():.2f} |"
    )
    flipped = legit[legit.flips.astype(int) > 0]
    lines += [
        "",
        f"Discrete events: {len(flipped)} legitimate case(s) had ReLU inputs within round-off of 0 flip (up to "
        f"{int(flipped.flips.max()) if len(flipped) else 0} units); accounted for, their highest excess is "
        f"{flipped.excess.max() if len(flipped) else float('nan'):.2f}, and {int(flipped.suspect.sum())} of them are SUSPECT.",
    ]
    out = ["\n".join(lines), ""]
    for (model, backend, direction), why in KNOWN_BUGS.items():
        cases = bugs[(bugs.model == model) & (bugs.backend == backend) & (bugs.direction == direction)]
        if len(cases):
            out.append(
                f"Not counted above: {backend} on {model} ({direction}) differs for real (not round-off), SUSPECT in "
                f"{int(cases.suspect.sum())} of {len(cases)} cases: {why}."
            )
            out.append("")
    flagged = legit[false]
    out.append(f"False positives: {len(flagged)}.")
    out += [
        f"- {r.model} batch {r.batch} seed {r.seed} {r.direction}: {r.backend} on {r.worst_output}: {r.reason}"
        for r in flagged.itertuples()
    ]
    if len(errors):
        out += ["", "Error rows (a backend that could not run the model):"]
        for (b, reason), grp in errors.groupby(["backend", "reason"]):
            cases = ", ".join(sorted({f"{m}" for m in grp.model}))
            out.append(f"- {b} ({len(grp)} cases: {cases}): {reason}")
    routes = df[df.notes.fillna("").str.contains("through the ONNX export")]
    if len(routes):
        out += [
            "",
            f"OpenVINO converted through the ONNX export (its direct conversion failed) on: "
            f"{', '.join(sorted(routes.model.unique()))}.",
        ]
    out += [
        "",
        "Catalogue faults at every severity the detection benchmark sweeps (a case is one model, batch, seed,",
        "direction and severity):",
        "",
        "| fault | severities | cases | inert (never ran, or changed no bit) | changed, within 10x | caught: > 10x the "
        "oracle's error | caught: > 10x the worst legitimate error | smallest severity caught |",
        "|---|---|---|---|---|---|---|---|",
    ]
    det2 = faults[faults.detectable_vs_legit.astype(bool)]
    for f in CATALOGUE:
        ff = faults[faults.fault == f]
        if not len(ff):
            continue
        inert = ff.inert.astype(bool)
        d, d2 = ff[ff.detectable.astype(bool)], ff[ff.detectable_vs_legit.astype(bool)]
        mild = ff[~inert & ~ff.detectable.astype(bool)]
        caught = ff[ff.suspect & ~inert]
        sevs = ", ".join(f"{v:g}" for v in sorted(ff.severity.unique()))
        smallest = f"{caught.severity.min():g}" if len(caught) else "none"
        out.append(
            f"| {f} | {sevs} | {len(ff)} | {int(inert.sum())} | {len(mild)} | {int(d.suspect.sum())}/{len(d)} | "
            f"{int(d2.suspect.sum())}/{len(d2)} | {smallest} |"
        )
    out.append(
        f"| **all** | | {len(faults)} | {int(faults.inert.astype(bool).sum())} | | "
        f"**{int(det.suspect.sum())}/{len(det)}** | **{int(det2.suspect.sum())}/{len(det2)}** | |"
    )
    out += [
        "",
        "The oracle's error on one output is one draw of round-off: on outputs of few elements (a scalar loss, "
        "a 1 x 3 logits row) it can be far below what the sequential run or another legitimate backend shows, and",
        "there a fault 10x the oracle's error is within the legitimate spread. The last column counts the faults more "
        "than 10x every legitimate error measured on the output (oracle, sequential run, the fp32 backends); an "
        "error below one unit round-off of the output counts as none.",
    ]
    missed = det2[~det2.suspect]
    if len(missed):
        out += ["", "Faults > 10x every legitimate error that were missed:"]
        out += [
            f"- {r.model} batch {r.batch} seed {r.seed} {r.direction}: {r.backend} ({r.ratio_vs_legit:.3g}x the worst "
            f"legitimate error, {r.raw_ratio:.3g}x the oracle's; worst output {r.worst_output}: {r.reason})"
            for r in missed.itertuples()
        ]
    flagged_mild = faults[~faults.detectable.astype(bool) & ~faults.inert.astype(bool) & faults.suspect]
    out += [
        "",
        f"Faults within 10x of the oracle's error (not required to be caught) that were caught anyway: "
        f"{len(flagged_mild)} of {int((~faults.inert.astype(bool) & ~faults.detectable.astype(bool)).sum())}.",
    ]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(zoo.MODELS))
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--directions", default="forward,backward")
    parser.add_argument("--name", default="real_models")
    parser.add_argument("--rejudge", action="store_true", help="judge the saved runs again; run no model")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    cache = CACHE / args.name
    cache.mkdir(parents=True, exist_ok=True)
    fired_path = cache / "fired.csv"
    fired_all = pd.read_csv(fired_path) if fired_path.exists() else pd.DataFrame()
    rows, fired_rows = [], []
    start = time.time()
    for model in args.models.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            for seed in (int(s) for s in args.seeds.split(",")):
                for direction in args.directions.split(","):
                    key = {"model": model, "batch": batch, "seed": seed, "direction": direction}
                    path = cache / f"{model}-b{batch}-s{seed}-{direction}.rlxnb"
                    t0 = time.time()
                    if args.rejudge:
                        if not path.exists():
                            continue
                        report = rlx_nb.load_report(path)
                        report = rlx_nb.DivergenceReport.from_results(report.results, progress=False)
                        sel = fired_all
                        for k, v in key.items():
                            sel = sel[sel[k] == v] if len(sel) else sel
                        fired = {r.backend: bool(r.fired) for r in sel.itertuples()} if len(sel) else None
                    else:
                        report, info = run_case(model, batch, seed, direction, path)
                        fired = info["fired"]
                        fired_rows += [{**key, "backend": b, "fired": v} for b, v in fired.items()]
                    new = case_rows(report, key, fired)
                    rows += new
                    fp = [r["backend"] for r in new if r["legit"] and r["suspect"]
                          and not (r["backend"] in LESS_ACCURATE and r["less_accurate"])]  # fmt: skip
                    print(
                        f"{model} b{batch} s{seed} {direction}: {time.time() - t0:.1f}s"
                        + (f"  FALSE POSITIVE: {', '.join(fp)}" if fp else ""),
                        flush=True,
                    )
    if fired_rows:
        fresh = pd.DataFrame(fired_rows)
        if len(fired_all):
            keys = ["model", "batch", "seed", "direction", "backend"]
            fired_all = fired_all.set_index(keys)
            fired_all = pd.concat([fired_all[~fired_all.index.isin(fresh.set_index(keys).index)].reset_index(), fresh])
        else:
            fired_all = fresh
        fired_all.to_csv(fired_path, index=False)
    df = pd.DataFrame(rows)
    RESULTS.mkdir(exist_ok=True)
    df.to_csv(RESULTS / f"{args.name}.csv", index=False)
    header = (
        f"# Real-architecture benchmark\n\n{len(df)} (case, backend) verdicts; models {args.models}; batches "
        f"{args.batches}; seeds {args.seeds}; directions {args.directions}; torch {torch.__version__}, "
        f"transformers {__import__('transformers').__version__}, numpy {np.__version__}; "
        f"{time.time() - start:.0f} s on this machine{' (re-judged from saved runs)' if args.rejudge else ''}.\n\n"
    )
    text = header + summary(df) + "\n"
    (RESULTS / f"{args.name}.md").write_text(text)
    print(text)
    sys.exit(0)


if __name__ == "__main__":
    main()
