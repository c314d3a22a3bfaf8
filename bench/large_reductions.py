"""Large reductions: a mean or a sum over 2**24 .. 2**28 float32 terms, where the summation order decides the error.

pytorch#154703: Inductor's C++ sum kept one accumulator per vector lane over the whole range, with no cascade; on
a mean of 2**28 floats it was 6.1e-6 off fp64 where eager is 2.5e-8 off.  rlx_nb read it round-off at 4.4e-7 of
the SUSPECT line, because its sequential-sums run (one legitimate summation order the budget measures) summed each
output in one float32 accumulator too, and that run was 0.44 off.  The run now sums at most
``reassoc.SEQUENTIAL_BLOCK`` terms per accumulator and adds the blocks pairwise, as real kernels do.

Cases: sizes x data (``rand``: uniform in [0, 1); ``absnormal``: |N(0, 1)|, whose rounding errors lean one way) x
models (``mean``: the mean of every term; ``rows``: a mean per row of 4 rows) x backends: ``cpu-nomkldnn``,
``cpu-inductor`` (legitimate) and ``fault:sum-no-cascade`` (pytorch#154703's kernel: 16 lane accumulators, no
cascade).  Rules, on the same outputs: rlx_nb's verdict now; the same verdict with the sequential run of before
(one accumulator per output: ``SEQUENTIAL_BLOCK`` set past every size), the anchor; the seed's ``max_rel > 2e-3``;
``torch.testing.assert_close`` at float32's defaults.  A fault case is *detectable* when its error against fp64 is
more than 10x the oracle's (the detection benchmark's ground truth).

    python bench/large_reductions.py [--sizes 24,26,28]

Writes bench/results/large_reductions.csv and bench/results/large_reductions.md.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

import rlx_nb
from rlx_nb.backends import sequential as reassoc
from rlx_nb.backends.known_bugs import known_bug
from rlx_nb.verdict.types import SUSPECT

RESULTS = Path(__file__).parent / "results"
BACKENDS = ["cpu-nomkldnn", "cpu-inductor", known_bug("fault:sum-no-cascade")]
NAMES = [b if isinstance(b, str) else b.name for b in BACKENDS]


class Mean(torch.nn.Module):
    def forward(self, x):
        return x.mean()


class RowMeans(torch.nn.Module):
    def forward(self, x):
        return x.reshape(4, -1).mean(1)


MODELS = {"mean": Mean, "rows": RowMeans}


def _data(kind: str, size: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(size)
    return torch.rand(size, generator=gen) if kind == "rand" else torch.randn(size, generator=gen).abs()


def _flags(report: rlx_nb.DivergenceReport, backend: str) -> dict[str, bool]:
    res = report.results
    o = res.oracle.outputs["out"].value
    b = res.candidates[backend].outputs["out"].value
    try:
        torch.testing.assert_close(torch.from_numpy(np.asarray(b)), torch.from_numpy(np.asarray(o)))
        close = False
    except AssertionError:
        close = True
    rec = report.record(backend, "out")
    return {"rlx_nb": rec.verdict == SUSPECT, "seed_max_rel": rec.judgement.verdict_fixed == SUSPECT,
            "assert_close": close}  # fmt: skip


def run_case(kind: str, exponent: int, model: str) -> list[dict]:
    x = _data(kind, 2**exponent)
    start = time.perf_counter()
    report = rlx_nb.backend_divergence(MODELS[model](), x, backends=BACKENDS, progress=False)
    seconds = time.perf_counter() - start
    block = reassoc.SEQUENTIAL_BLOCK
    reassoc.SEQUENTIAL_BLOCK = 2**62  # the run of before: one accumulator per output
    try:
        old = rlx_nb.backend_divergence(MODELS[model](), x, backends=BACKENDS, progress=False)
    finally:
        reassoc.SEQUENTIAL_BLOCK = block
    rows = []
    for backend in NAMES:
        rec, was = report.record(backend, "out"), old.record(backend, "out")
        j = rec.judgement
        rows.append({
            "size": f"2^{exponent}", "data": kind, "model": model, "backend": backend,
            "legit": not backend.startswith("fault:"),
            "oracle_rmse": j.oracle_rmse, "sequential_rmse": j.sequential_rmse, "backend_rmse": j.backend_rmse,
            "sequential_rmse_before": was.judgement.sequential_rmse,
            "raw_ratio": j.backend_rmse / j.oracle_rmse if j.oracle_rmse > 0 else float("inf"),
            "line": j.line, "line_before": was.judgement.line,
            "rlx_nb_before": was.verdict == SUSPECT,
            **_flags(report, backend), "seconds": seconds,
        })  # fmt: skip
    return rows


def _summary(df: pd.DataFrame) -> str:
    df = df.assign(detectable=~df.legit & (df.raw_ratio > 10))
    lines = [
        "| rule | false positives (legitimate) | caught (faults > 10x the oracle's error) |",
        "|---|---|---|",
    ]
    legit, det = df[df.legit], df[df.detectable]
    for rule in ("rlx_nb", "rlx_nb_before", "seed_max_rel", "assert_close"):
        lines.append(f"| {rule} | {int(legit[rule].sum())} / {len(legit)} | {int(det[rule].sum())} / {len(det)} |")
    cols = ["size", "data", "model", "backend", "raw_ratio", "line", "line_before", "rlx_nb", "sequential_rmse",
            "sequential_rmse_before"]  # fmt: skip
    table = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for _, row in df[cols].iterrows():
        table.append("| " + " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in row) + " |")
    return "\n".join(lines) + "\n\n" + "\n".join(table) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="24,26,28", help="exponents of the term counts")
    args = parser.parse_args()
    rows = []
    for exponent in (int(e) for e in args.sizes.split(",")):
        for kind in ("rand", "absnormal"):
            for model in MODELS:
                rows += run_case(kind, exponent, model)
                print(f"2^{exponent} {kind} {model}: done", flush=True)
    df = pd.DataFrame(rows)
    RESULTS.mkdir(exist_ok=True)
    df.to_csv(RESULTS / "large_reductions.csv", index=False)
    (RESULTS / "large_reductions.md").write_text(
        f"# Large reductions (bench/large_reductions.py)\n\ntorch {torch.__version__}; one run.\n\n" + _summary(df)
    )
    print(_summary(df))


if __name__ == "__main__":
    main()
