"""int8 detection: planted int8 kernel bugs against legitimate int8 runtimes, on the int8 zoo.

Each model is PT2E-quantized for XNNPACK and judged by :func:`rlx_nb.quantized_divergence` on the legitimate int8
runtimes -- ``executorch-xnnpack``, ``executorch-portable`` and a correct runtime that rounds ties half up
(:func:`rlx_nb.int8.faults.half_up_runtime`) -- and on planted kernel bugs through XNNPACK
(:mod:`rlx_nb.int8.faults`): one channel's weight scale off, one weight's sign negated, one channel's bias a
few quanta off, a requantization that truncates, at the first, middle and last layer.  Each fault's size is its
error against the exact simulation over a legitimate int8 computation's (XNNPACK's, or the fp32 simulation's own,
at least one quantum of the output: ``raw_ratio``).  Targets: 0 legitimate runs SUSPECT; every fault past 10x
caught; at least half of those at 3-10x.

    python bench/int8_detection.py [--models mlp,conv,transformer,gpt2,llama,opt@1,...] [--out NAME]
    python bench/int8_detection.py --merge NAME1,NAME2       # parts run apart (in parallel), written as one
    python bench/int8_detection.py --models opt@1 --fault-runtime cpu --no-legit   # where each caught fault is
                                   # localized, fast: the faults planted in the simulation itself, nothing else run

Writes ``bench/results/int8_detection.csv``, ``_localized.csv`` (each caught fault's culprit, the module it is planted
in, and whether the culprit is in its block: ``at_layer``) and ``.md``.
"""

from __future__ import annotations

import argparse
import re
import time
import warnings
from pathlib import Path

import numpy as np
import pandas as pd

import rlx_nb
from rlx_nb.int8 import faults, locate  # (locate: loaded with the rest, before any file changes)
from rlx_nb.int8.quantize import quantize_pt2e
from rlx_nb.int8.requantization import _QUANTIZE, _module_of, _ops
from rlx_nb.models import demo, zoo
from rlx_nb.verdict.records import worst_record
from rlx_nb.verdict.types import SUSPECT, VERDICT_ERROR

RESULTS = Path(__file__).parent / "results"
LEGIT = ("executorch-xnnpack", "executorch-portable", "int8-half-up")
DETECTABLE, SMALL = 10.0, 3.0
HOW = {"": "cut alone", locate.SPLICED: "spliced"}  # (how a culprit was found, from ``Localization.full_run``)


def fault_set(converted, runtime: str = "executorch-xnnpack") -> dict:
    # The planted bugs, through ``runtime``: each kind at the first, middle and last weight (or requantization);
    # {fault: the module it is planted in}.
    weights = _ops(converted, "dequantize_per_channel")
    points = [q for q in _ops(converted, _QUANTIZE) if getattr(q.args[0], "op", "") != "placeholder"]
    out = {}
    for layer in sorted({0, len(weights) // 2, len(weights) - 1}):
        user = next(iter(weights[layer].users))  # (the op the weight feeds: its module)
        where = _module_of(user, user).rsplit(" (", 1)[0]
        out[faults.channel_scale_fault(layer=layer, channel=1, factor=1.25, runtime=runtime)] = where
        out[faults.weight_sign_fault(layer=layer, channel=1, runtime=runtime)] = where
        out[faults.bias_fault(layer=layer, channel=1, quanta=3.0, runtime=runtime)] = where
    for point in sorted({0, len(points) // 2, len(points) - 1}):
        out[faults.truncation_fault(point=point, runtime=runtime)] = _module_of(points[point]).rsplit(" (", 1)[0]
    return out


def layer_of(module: str) -> str:
    # The block a module is in ("model.layers.1.self_attn.q_proj": "model.layers.1"), or the module itself outside
    # the repeated blocks (lm_head, a pooler).
    found = re.match(r"(.*?\b(?:layers?|h|blocks?)\.\d+)\b", module or "")
    return found.group(1) if found else (module or "")


def raw_ratio(report, backend: str) -> float:
    # How far past a legitimate int8 computation's error the backend is on its worst output (RMS or largest, the
    # larger): against the exact simulation, over XNNPACK's error or the simulation's own, at least one quantum.
    res = report.results
    worst = float("nan")
    for name, leaf in res.oracle.outputs.items():
        run, xnn = res.candidates.get(backend), res.candidates.get("executorch-xnnpack")
        if run is None or run.status != "ok" or name not in run.outputs or xnn is None or xnn.status != "ok":
            continue
        exact = res.reference.outputs[name].value
        q = (report.int8["quanta"] or {}).get(name) or 0.0

        def err(v, exact=exact):
            d = np.asarray(v, np.float64) - exact
            d = np.where(np.isfinite(d), d, 0.0)
            return float(np.sqrt(np.mean(d * d))), float(np.abs(d).max(initial=0.0))

        b_rms, b_max = err(run.outputs[name].value)
        x_rms, x_max = err(xnn.outputs[name].value)
        o_rms, o_max = err(leaf.value)
        rms_floor = max(x_rms, o_rms, q / np.sqrt(max(exact.size, 1)), 1e-30)
        max_floor = max(x_max, o_max, q, 1e-30)
        ratio = max(b_rms / rms_floor, b_max / max_floor)
        worst = ratio if worst != worst else max(worst, ratio)
    return worst


def _from_config(family: str, batch: int):
    # A transformer built from a small config (#63: the families whose near-boundary values outnumbered the search),
    # its text without padding, seeded: OPT, GPT-2, Llama, BERT.
    import torch
    import transformers as t

    torch.manual_seed(0)
    lm = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)
    model = {
        "opt": lambda: t.OPTForCausalLM(t.OPTConfig(**lm, ffn_dim=128, word_embed_proj_dim=64)),
        "gpt2": lambda: t.GPT2LMHeadModel(
            t.GPT2Config(vocab_size=1000, n_embd=64, n_layer=2, n_head=4, n_positions=64)
        ),
        "llama": lambda: t.LlamaForCausalLM(t.LlamaConfig(**lm, intermediate_size=128, num_key_value_heads=2)),
        "bert": lambda: t.BertModel(t.BertConfig(**lm, intermediate_size=128)),
    }[family]().eval()
    ids = torch.randint(4, 1000, (batch, 16))
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


CONFIG_FAMILIES = ("opt", "gpt2", "llama", "bert")


def converted_of(name: str) -> tuple:
    # (a zoo model at batch 1, as its committed rows were measured; a demo model runs
    # at its own; "<family>@<batch>": a transformer from a small config, CONFIG_FAMILIES)
    family, _, batch = name.partition("@")
    if family in CONFIG_FAMILIES and batch:
        model, inputs = _from_config(family, int(batch))
    else:
        model, inputs = zoo.build(name, batch=1) if name in zoo.MODELS else getattr(demo, name)()
    return quantize_pt2e(model, inputs), inputs


def placed(locs: pd.DataFrame) -> pd.DataFrame:
    # Rows localized before the bench recorded where each fault is planted: the module, from the same fault set.
    if "planted_in" in locs and locs.planted_in.notna().all():
        return locs
    locs = locs.copy()
    for name in locs[locs.get("planted_in", pd.Series(index=locs.index)).isna()].model.unique():
        where = {f.name: w for f, w in fault_set(converted_of(name)[0]).items()}
        rows = locs.model == name
        locs.loc[rows, "planted_in"] = locs.loc[rows, "backend"].map(where)
        culprits = locs.loc[rows, "culprit"].fillna("").str.partition(" :: ")[0]
        locs.loc[rows, "at_layer"] = [
            bool(c) and layer_of(c) == layer_of(w) for c, w in zip(culprits, locs.loc[rows, "planted_in"], strict=True)
        ]
    locs["at_layer"] = locs.at_layer.astype(bool)
    return locs


def rows_of(name: str, fault_runtime: str = "executorch-xnnpack", legit: bool = True) -> list[dict]:
    converted, inputs = converted_of(name)
    planted = fault_set(converted, fault_runtime)
    start = time.perf_counter()
    backends = [*LEGIT[:2], faults.half_up_runtime(), *planted] if legit else [*planted]
    report = rlx_nb.quantized_divergence(converted, inputs, backends=backends, label=name, progress=False)
    seconds = time.perf_counter() - start
    rows = []
    for backend in report.results.candidates:
        recs = [r for r in report.records if r.backend == backend]
        worst = worst_record(recs)
        ratio = raw_ratio(report, backend)
        rows.append({
            "model": name, "backend": backend, "legit": backend in LEGIT, "verdict": worst.verdict,
            "line": worst.judgement.line, "raw_ratio": ratio, "suspect": worst.verdict == SUSPECT,
            "why": worst.reason[:150], "seconds": seconds,
        })  # fmt: skip
    loc_rows = []
    for backend in report.suspects:
        if backend in LEGIT:
            continue
        start = time.perf_counter()
        loc = report.localize(backend)
        where = next((w for f, w in planted.items() if f.name == backend), "")
        loc_rows.append({"model": name, "backend": backend, "culprit": loc.culprit, "planted_in": where,
                         "at_layer": bool(loc.culprit_module) and layer_of(loc.culprit_module) == layer_of(where),
                         "seconds": round(time.perf_counter() - start, 1),
                         "how": HOW.get(loc.full_run, "cut, then splice upstream")})  # fmt: skip
    return rows, loc_rows


def summary(df: pd.DataFrame, locs: pd.DataFrame) -> str:
    legit = df[df.legit & (df.verdict != VERDICT_ERROR)]
    faults_ = df[~df.legit & (df.verdict != VERDICT_ERROR)]
    big = faults_[faults_.raw_ratio > DETECTABLE]
    mid = faults_[(faults_.raw_ratio > SMALL) & (faults_.raw_ratio <= DETECTABLE)]
    miss = big[~big.suspect]
    lines = [
        "# int8 detection", "",
        *(["(the planted faults only, no legitimate runtime: no fault's size is measured; this run checks where "
           "each caught fault is localized)", ""] if not df.legit.any() else []),
        f"- legitimate runs: {len(legit)}; SUSPECT: {int(legit.suspect.sum())}",
        f"- faults past {DETECTABLE:g}x: {len(big)}; caught: {int(big.suspect.sum())}"
        + (f"; missed: {', '.join(miss.backend + ' on ' + miss.model)}" if len(miss) else ""),
        f"- faults at {SMALL:g}-{DETECTABLE:g}x: {len(mid)}; caught: {int(mid.suspect.sum())}"
        + (f" ({mid.suspect.mean():.0%})" if len(mid) else ""),
        f"- faults under {SMALL:g}x (within what a legitimate kernel's error may reach): "
        f"{int((faults_.raw_ratio <= SMALL).sum())}; caught: {int(faults_[faults_.raw_ratio <= SMALL].suspect.sum())}",
        f"- error rows: {int((df.verdict == VERDICT_ERROR).sum())}", "",
        df.assign(line=df.line.map(lambda v: f"{v:.3g}"), raw_ratio=df.raw_ratio.map(lambda v: f"{v:.3g}"))
        [["model", "backend", "legit", "verdict", "line", "raw_ratio", "why"]].to_markdown(index=False),
        "", "## Localized", "",
        f"- caught faults localized in the block they are planted in: {int(locs.at_layer.sum())} of {len(locs)}"
        if "at_layer" in locs else "", "",
        locs.to_markdown(index=False) if len(locs) else "(none)", "",
    ]  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="mlp,conv,transformer,gpt2,llama,opt@1,opt@4,gpt2@1,gpt2@4,llama@1,llama@4,"
                        "bert@1,bert@4")  # fmt: skip
    parser.add_argument("--out", default="int8_detection")
    parser.add_argument(
        "--fault-runtime",
        default="executorch-xnnpack",
        help="the runtime the faults are planted in "
        "(cpu: the simulation's own, to check the localization fast on every family)",
    )
    parser.add_argument("--no-legit", action="store_true", help="the planted faults only")  # fmt: skip
    parser.add_argument("--merge", default="", help="results of runs in parts (their --out names, comma-separated) "
                        "written as one (--out): no model runs")  # fmt: skip
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    RESULTS.mkdir(exist_ok=True)
    if args.merge:
        parts = args.merge.split(",")
        df = pd.concat([pd.read_csv(RESULTS / f"{p}.csv") for p in parts], ignore_index=True)
        located = [RESULTS / f"{p}_localized.csv" for p in parts]
        ldf = placed(
            pd.concat([pd.read_csv(f) for f in located if f.exists() and f.stat().st_size > 1], ignore_index=True)
        )
    else:
        rows, locs = [], []
        for name in args.models.split(","):
            got, loc = rows_of(name, args.fault_runtime, legit=not args.no_legit)
            rows += got
            locs += loc
            print(name, "done", flush=True)
        df, ldf = pd.DataFrame(rows), pd.DataFrame(locs)
    df.to_csv(RESULTS / f"{args.out}.csv", index=False)
    ldf.to_csv(RESULTS / f"{args.out}_localized.csv", index=False)
    text = summary(df, ldf)
    (RESULTS / f"{args.out}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
