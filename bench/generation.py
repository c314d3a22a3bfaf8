"""Generation: legitimate backends never SUSPECT, catalogue faults caught at the step they pass 10x, the flip
rate, and the time against the manual workflow.

The zoo's decoders (``rlx_nb.models.zoo.decoder``: GPT-2, Llama, Qwen2, Mistral with a 16-token sliding window),
random weights, an 8-token prompt, 64 new tokens, seeds 0-2, batch 1 and 4.  Each case is one
``rlx_nb.generation_divergence`` call with the legitimate backends (``cpu-nomkldnn``, ``cpu-inductor``,
``onnxruntime``, ``openvino``, ``cpu-bf16``, ``cpu-fp16``) and the catalogue's forward faults at their default
severities.

- *false SUSPECT*: a legitimate backend whose generation verdict is SUSPECT (a step's logits, or a flip that
  is no near-tie).
- *faults caught at the step*: every (fault, step) whose logits error exceeds 10x the legitimate error at that
  step (the largest of the oracle's and the sequential-sums run's error against fp64 there) must be SUSPECT
  at that step.
- *flip rate*: the share of (step, sequence) where a legitimate backend's greedy token differs from the
  oracle's; every such flip must be classed a near-tie.
- *time*: on batch 1, seed 0, warm ``generation_divergence`` calls (after a first one in a fresh process)
  against the manual workflow, warm too (:func:`manual`), :data:`REPEATS` of each alternating, the ratio of
  their medians; with the default backends and with the eager and compiled
  ones (``cpu-nomkldnn``, ``cpu-bf16``, ``cpu-inductor``), the latter also with ``check_determinism=False``
  (one oracle decode: the manual workflow checks no determinism either), and without ``cpu-nomkldnn`` (no
  candidate runs the oracle's own code, so the determinism check is a second oracle decode), that too with and
  without the check.  A case whose manual workflow takes under :data:`SHORT_S` is timed :data:`SHORT_REPEATS`
  times.

    python bench/generation.py [--models gpt2,llama,qwen2,mistral] [--seeds 0,1,2] [--batches 1,4]
    python bench/generation.py --timing-only gpt2-small   # GPT-2 at its real size (124M), time only

Writes ``bench/results/generation.md`` and ``generation.csv`` (``generation_timing_<models>.md`` for --timing-only).
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore")

import torch  # noqa: E402

import rlx_nb  # noqa: E402
from rlx_nb.backends.faults import HITS  # noqa: E402
from rlx_nb.errors import NotApplicable  # noqa: E402
from rlx_nb.models import zoo  # noqa: E402
from rlx_nb.verdict.types import SUSPECT  # noqa: E402

LEGIT = ["cpu-nomkldnn", "cpu-inductor", "onnxruntime", "openvino", "cpu-bf16", "cpu-fp16"]
FAULTS = [
    "fault:softmax-row",
    "fault:attention-scale",
    "fault:layernorm-eps",
    "fault:layernorm-unbiased",
    "fault:linear-bias-channel",
    "fault:gelu-approx",
    "fault:linear-lowp-accum",
]
STEPS = 64
OUT = Path(__file__).parent / "results"


def case(name: str, seed: int, batch: int) -> tuple[list[dict], dict]:
    model, ids = zoo.decoder(name, batch=batch, seed=seed)
    HITS.clear()
    start = time.perf_counter()
    report = rlx_nb.generation_divergence(model, ids, max_new_tokens=STEPS, backends=LEGIT + FAULTS, progress=False)
    seconds = time.perf_counter() - start
    verdicts = report.verdicts()
    steps = report.steps
    rows = []
    for backend in report.backend_names:
        mine = steps[steps.backend == backend]
        recs = {r.output: r for r in report.logits.records if r.backend == backend and r.output}
        big = caught = 0
        first_big = None
        for k in range(STEPS):
            rec = recs.get(f"step {k}")
            if rec is None:
                continue
            j = rec.judgement
            legit = max(j.oracle_max_err, j.sequential_max_err if j.sequential_max_err == j.sequential_max_err else 0.0)
            if j.backend_max_err > 10.0 * legit:
                big += 1
                caught += rec.verdict == SUSPECT
                first_big = k if first_big is None else first_big
        flips = mine[mine.flip]
        rows.append({
            "model": name, "seed": seed, "batch": batch, "backend": backend,
            "legit": backend in LEGIT, "verdict": verdicts[backend],
            "flips": len(flips), "near_ties": int((flips.flip_kind == "near-tie").sum()),
            "positions": len(mine), "fired": HITS.get(backend, 0) > 0 if backend in FAULTS else True,
            "steps_over_10x": big, "caught_at_step": caught,
            "first_over_10x": first_big,
            "first_suspect": int(mine[mine.verdict == SUSPECT].step.min()) if (mine.verdict == SUSPECT).any() else None,
            "worst_line": float(mine.line.max()),
        })  # fmt: skip
    return rows, {"model": name, "seed": seed, "batch": batch, "seconds": seconds}


def manual(model: torch.nn.Module, ids: torch.Tensor, backends: list[str]) -> float:
    """The manual workflow: greedy generation on the oracle and on each backend, then the tokens compared.

    Hugging Face ``generate`` for the eager and compiled backends; for ONNX Runtime and OpenVINO, the prefill
    and the decode step exported once (``rlx_nb.generation.export``, the same export a person writes by hand) and a
    greedy loop on each runtime.
    """
    import copy

    from rlx_nb.generation import export as decode_export
    from rlx_nb.generation.decode import Decode

    start = time.perf_counter()
    kw = {"max_new_tokens": STEPS, "min_new_tokens": STEPS, "do_sample": False}
    runs = []
    with torch.no_grad():
        ref = model.generate(ids, **kw)[:, ids.shape[1] :]
        if "cpu-nomkldnn" in backends:
            with torch.backends.mkldnn.flags(enabled=False):
                runs.append(model.generate(ids, **kw)[:, ids.shape[1] :])
        if "cpu-bf16" in backends:
            runs.append(copy.deepcopy(model).to(torch.bfloat16).generate(ids, **kw)[:, ids.shape[1] :])
        if "cpu-inductor" in backends:
            compiled = copy.deepcopy(model)
            compiled.forward = torch.compile(compiled.forward, dynamic=True)
            runs.append(compiled.generate(ids, **kw)[:, ids.shape[1] :])
        for runtime in ("onnxruntime", "openvino"):
            if runtime in backends:
                decode = Decode(model, prompt_len=ids.shape[1], steps=STEPS, free=True)
                try:
                    logits = decode_export.exported_decode(runtime)(decode, (ids,))
                except NotApplicable:  # (a sliding-window cache: no export by hand either; rlx_nb skips it too)
                    continue
                runs.append(torch.stack([logits[f"step {k}"].argmax(-1) for k in range(STEPS)], dim=1))
        decode_export.forget()
    for other in runs:
        differ = (other != ref).nonzero()
        _ = int(differ[0, 1]) if len(differ) else None  # where the text parts, as a person would print it
    return time.perf_counter() - start


TIMED = {
    "default backends": ["cpu-nomkldnn", "cpu-inductor", "onnxruntime", "openvino"],
    "eager and compiled": ["cpu-nomkldnn", "cpu-bf16", "cpu-inductor"],
    "eager and compiled, check_determinism=False": ["cpu-nomkldnn", "cpu-bf16", "cpu-inductor"],
    "compiled and bfloat16 only": ["cpu-bf16", "cpu-inductor"],
    "compiled and bfloat16 only, check_determinism=False": ["cpu-bf16", "cpu-inductor"],
}


def gpt2_small() -> tuple[torch.nn.Module, torch.Tensor]:
    """GPT-2 small at its real size (124M parameters, random weights) and an 8-token prompt."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config()).eval(), torch.randint(0, 50257, (1, zoo.PROMPT_LEN))


REPEATS = 3
"""Warm calls and manual workflows timed per case, alternating; the ratio is of their medians (this machine's
speed moves by 10-30% between minutes, so one pair swings the ratio by as much)."""
SHORT_S, SHORT_REPEATS = 2.0, 9
"""A case whose manual workflow takes less than ``SHORT_S`` seconds (a zoo decoder's eager backends: ~0.3 s) is
timed ``SHORT_REPEATS`` times: at that length one pair's ratio moves by up to 3x from minute to minute."""


def timing(name: str) -> list[dict]:
    model, ids = gpt2_small() if name == "gpt2-small" else zoo.decoder(name, batch=1, seed=0)
    rows = []
    for what, backends in TIMED.items():

        def call(b: list[str] = backends, again: bool = "check_determinism=False" not in what) -> object:
            return rlx_nb.generation_divergence(model, ids, max_new_tokens=STEPS, backends=b, progress=False,
                                                check_determinism=again)  # fmt: skip

        call()  # cold: compiles land in Inductor's caches
        manual(model, ids, backends)  # cold
        repeats = SHORT_REPEATS if manual(model, ids, backends) < SHORT_S else REPEATS
        ours, by_hand = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            call()
            ours.append(time.perf_counter() - start)
            by_hand.append(manual(model, ids, backends))
        o, m = statistics.median(ours), statistics.median(by_hand)
        rows.append({"model": name, "backends": what, "rlx_nb_s": o, "manual_s": m, "ratio": o / m,
                     "pair_ratios": [a / b for a, b in zip(ours, by_hand, strict=True)]})  # fmt: skip
        print(f"timing {name} {what}: {o:.2f} s vs {m:.2f} s", file=sys.stderr, flush=True)
    return rows


def timing_row(t: dict) -> str:
    pairs = ", ".join(f"{r:.2f}" for r in t.get("pair_ratios", []))
    return (f"| {t['model']} | {t['backends']} | {t['rlx_nb_s']:.2f} | {t['manual_s']:.2f} | {t['ratio']:.2f}x "
            f"| {pairs} |")  # fmt: skip


def fresh_timing(name: str) -> list[dict]:
    """:func:`timing` of ``name`` in a fresh interpreter: no compile of an earlier case in the process."""
    import json
    import subprocess

    done = subprocess.run(
        [sys.executable, __file__, "--timing-only", name, "--json"], capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(zoo.DECODERS))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--timing-only", default="", help="time these models only (e.g. gpt2-small: 124M parameters)")
    ap.add_argument("--json", action="store_true", help="with --timing-only: print the rows as JSON, write nothing")
    args = ap.parse_args()
    if args.timing_only:
        names = args.timing_only.split(",")
        if args.json:  # (the child a fresh process runs: fresh_timing)
            import json

            print(json.dumps([row for n in names for row in timing(n)]))
            return
        times = [row for n in names for row in fresh_timing(n)]
        text = "\n".join(
            ["| decoder | backends | rlx_nb (s) | manual (s) | ratio | each pair |", "|---|---|---|---|---|---|"]
            + [timing_row(t) for t in times]
        )
        OUT.mkdir(exist_ok=True)
        (OUT / f"generation_timing_{'_'.join(names)}.md").write_text(
            f"# Generation: warm call against the manual workflow (a fresh process per model)\n\n{text}\n"
        )
        print(text)
        return
    models = args.models.split(",")
    rows, calls = [], []
    for name in models:
        for seed in map(int, args.seeds.split(",")):
            for batch in map(int, args.batches.split(",")):
                got, took = case(name, seed, batch)
                rows += got
                calls.append(took)
                print(f"{name} seed {seed} batch {batch}: {took['seconds']:.1f} s", file=sys.stderr, flush=True)
    times = [] if args.no_timing else [row for n in models for row in fresh_timing(n)]
    OUT.mkdir(exist_ok=True)
    with open(OUT / "generation.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    legit = [r for r in rows if r["legit"]]
    faults = [r for r in rows if not r["legit"]]
    false = [r for r in legit if r["verdict"] == SUSPECT]
    lines = [
        "# Generation benchmark (bench/generation.py)",
        "",
        f"{len(models)} decoders x seeds {args.seeds} x batch {args.batches} x {STEPS} new tokens: "
        f"{len(calls)} calls, {sum(c['seconds'] for c in calls):.0f} s in all.",
        "",
        "## Legitimate backends",
        "",
        f"- false SUSPECT: **{len(false)} of {len(legit)}** (backend, case) verdicts",
        "",
        "| backend | cases | flips / positions | flip rate | flips classed near-tie | worst step line |",
        "|---|---|---|---|---|---|",
    ]
    for b in LEGIT:
        mine = [r for r in legit if r["backend"] == b]
        flips, pos = sum(r["flips"] for r in mine), sum(r["positions"] for r in mine)
        ties = sum(r["near_ties"] for r in mine)
        worst = max(r["worst_line"] for r in mine)
        lines.append(
            f"| {b} | {len(mine)} | {flips} / {pos} | {flips / max(pos, 1):.2%} | {ties} / {flips} | {worst:.2g} |"
        )
    big = sum(r["steps_over_10x"] for r in faults)
    caught = sum(r["caught_at_step"] for r in faults)
    lines += [
        "",
        "## Catalogue faults (default severity)",
        "",
        f"- (fault, step) pairs whose logits error exceeds 10x the legitimate error at that step: **{caught} / {big} "
        "caught at that step**",
        "",
        "| fault | cases fired | SUSPECT | steps > 10x | caught at the step |",
        "|---|---|---|---|---|",
    ]
    for fault in FAULTS:
        mine = [r for r in faults if r["backend"] == fault]
        fired = [r for r in mine if r["fired"]]
        lines.append(
            f"| {fault} | {len(fired)} / {len(mine)} | {sum(r['verdict'] == SUSPECT for r in fired)} | "
            f"{sum(r['steps_over_10x'] for r in mine)} | {sum(r['caught_at_step'] for r in mine)} |"
        )
    if times:
        lines += [
            "",
            "## Time: a warm call against the manual workflow (batch 1, seed 0, 64 tokens)",
            "",
            "| decoder | backends | rlx_nb (s) | manual (s) | ratio | each pair |",
            "|---|---|---|---|---|---|",
        ]
        lines += [timing_row(t) for t in times]
    (OUT / "generation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
