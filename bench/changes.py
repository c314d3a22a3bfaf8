"""Snapshot and diff (#49) on the zoo: legitimate environment changes read as round-off, and what they cost.

For each model of :mod:`rlx_nb.models.zoo` and the demo MLP, CNN and transformer block (batch 2):

- **cost**: a snapshot (with its float64 reference, and without) against one forward of the model (the best of 3);
  its file against the model's activations (every module's first-call outputs, each distinct tensor once); a diff
  (``backend="cpu-nomkldnn"``, the default descent) against ``rlx_nb.localize`` of the same backend;
- **legitimate changes**, each diffed with ``local="all"`` (every module alone and in the whole run): in this
  process, oneDNN off (``cpu-nomkldnn``) and one thread instead of two; in a fresh process each, MKL's SSE2 path
  (``MKL_CBWR=COMPATIBLE``), oneDNN held to SSE4.1 (``ONEDNN_MAX_CPU_ISA=SSE41``) and ATen's scalar kernels
  (``ATEN_CPU_CAPABILITY=default``), the weights and inputs passed in a file.  A module past the line is a false
  alarm; ``moved`` counts the modules whose output was not bit for bit the snapshot's (the change was real).

    python bench/changes.py [--models gpt2,vit] [--name changes] [--ops]

``--ops`` writes every snapshot with ``ops=True`` (each module's own torch function calls recorded and judged too:
op-level false alarms, and what recording them costs).

Writes ``bench/results/<name>.csv`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pandas as pd
import torch

import rlx_nb
from rlx_nb.models import demo, zoo

RESULTS = Path(__file__).parent / "results"
VARIANTS = ("MKL_CBWR=COMPATIBLE", "ONEDNN_MAX_CPU_ISA=SSE41", "ATEN_CPU_CAPABILITY=default")
DEMOS = ("mlp", "conv", "transformer")
REAL_SIZE = ("gpt2-small", "vit-base")  # (bench/real_size.py's GPT-2 small, 124M, and ViT-Base/16: cost only)


def build(name: str) -> tuple[torch.nn.Module, object]:
    if name in DEMOS:
        return getattr(demo, name)()
    if name in REAL_SIZE:
        sys.path.insert(0, str(Path(__file__).parent))
        import real_size

        return real_size.build(name.removesuffix("-small"))
    return zoo.build(name, batch=2)


def call(model, inputs):
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def best_of(fn, n: int = 3) -> float:
    # The best of n warm calls (one more, first, untimed).
    fn()
    best = float("inf")
    for _ in range(n):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def forward_seconds(model, inputs) -> float:
    with torch.no_grad():
        return best_of(lambda: call(model, inputs))


def activations(model, inputs) -> int:
    # Every module's first-call floating outputs, each distinct tensor once (held until the end: a freed tensor's
    # address may be a later one's, which counted two tensors as one).
    seen, total, done, held = set(), 0, set(), []

    def hook(name):
        def h(_, __, out):
            nonlocal total
            if name in done:
                return
            done.add(name)
            for _, leaf in rlx_nb._support.tree.flatten(out):
                if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
                    key = (leaf.data_ptr(), tuple(leaf.shape), leaf.stride())
                    if key not in seen:
                        seen.add(key)
                        held.append(leaf)
                        total += leaf.numel() * leaf.element_size()

        return h

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules()]
    with torch.no_grad():
        call(model, inputs)
    for h in handles:
        h.remove()
    return total


def counts(d) -> dict:
    f = d.frame
    judged = f[f.change != "not judged"]
    reasons = f.reason.fillna("")
    return {
        "modules": len(f),
        "judged": len(judged),
        "past_line": int(((f.local_verdict == "SUSPECT") | (f.propagated_verdict == "SUSPECT")).sum()),
        "moved": int((~reasons.str.contains("bit for bit identical") & (f.change != "not judged")).sum()),
        "worst_line": float(pd.concat([f.local_line, f.propagated_line]).max()),
    }


def child(snapshot: str, state: str, name: str) -> None:
    model, _ = build(name)
    saved = torch.load(state)
    model.load_state_dict(saved["model"])
    d = rlx_nb.diff(snapshot, model, saved["inputs"], local="all", progress=False)
    print(json.dumps({**counts(d), "environment": d.environment}))


def one(name: str, scratch: Path, ops: bool = False) -> list[dict]:
    model, inputs = build(name)
    model.eval()
    rows = []
    fwd = forward_seconds(model, inputs)
    act = activations(model, inputs)
    timed = {}
    n = 1 if name in REAL_SIZE else 3
    for reference in (True, False):
        path = scratch / f"{name}-{reference}.rlxsnap"
        seconds = best_of(lambda r=reference, p=path: rlx_nb.snapshot(model, inputs, p, reference=r, ops=ops), n)
        timed[reference] = (seconds, path.stat().st_size)
    snap = scratch / f"{name}-True.rlxsnap"
    diff_s = best_of(lambda: rlx_nb.diff(snap, model, inputs, backend="cpu-nomkldnn", progress=False), n)
    localize_s = best_of(lambda: rlx_nb.localize(model, inputs, backend="cpu-nomkldnn"), n)
    cost = {
        "model": name,
        "forward_s": fwd,
        "snapshot_s": timed[True][0],
        "snapshot_x_forward": timed[True][0] / fwd,
        "snapshot_noref_x_forward": timed[False][0] / fwd,
        "activations_mb": act / 1e6,
        "disk_x_activations": timed[True][1] / act,
        "disk_noref_x_activations": timed[False][1] / act,
        "diff_x_localize": diff_s / localize_s,
    }
    if name in REAL_SIZE:
        return [{**cost, "change": "cost only"}]
    threads = torch.get_num_threads()
    legit = {"oneDNN off (cpu-nomkldnn)": dict(backend="cpu-nomkldnn"), "1 thread, not 2": dict(threads=1)}
    for change, how in legit.items():
        torch.set_num_threads(how.get("threads", threads))
        try:
            d = rlx_nb.diff(snap, model, inputs, backend=how.get("backend"), local="all", progress=False)
        finally:
            torch.set_num_threads(threads)
        rows.append({**cost, "change": change, **counts(d)})
    state = scratch / f"{name}.pt"
    torch.save({"model": model.state_dict(), "inputs": inputs}, state)
    for variant in VARIANTS:
        key, _, value = variant.partition("=")
        env = {
            k: v for k, v in os.environ.items() if k not in ("MKL_CBWR", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
        }
        done = subprocess.run([sys.executable, __file__, "--child", str(snap), str(state), name],
                              env={**env, key: value}, capture_output=True, text=True, timeout=1200)  # fmt: skip
        if done.returncode:
            rows.append({**cost, "change": variant, "error": done.stderr.strip().splitlines()[-1][:200]})
            continue
        found = json.loads(done.stdout.strip().splitlines()[-1])
        found.pop("environment")
        rows.append({**cost, "change": variant, **found})
    return rows


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        warnings.simplefilter("ignore")
        child(*sys.argv[2:5])
        return
    p = argparse.ArgumentParser()
    p.add_argument("--models", default=",".join((*DEMOS, *zoo.MODELS, *REAL_SIZE)))
    p.add_argument("--name", default=None)
    p.add_argument("--ops", action="store_true", help="snapshots with ops=True (each module's own ops too)")
    args = p.parse_args()
    args.name = args.name or ("changes_ops" if args.ops else "changes")
    warnings.simplefilter("ignore")
    torch.set_num_threads(2)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.models.split(","):
            start = time.perf_counter()
            try:
                got = one(name, Path(scratch), ops=args.ops)
            except Exception as exc:  # (one model that cannot be snapshot is a row, not the end of the run)
                got = [{"model": name, "change": "all", "error": f"{type(exc).__name__}: {exc}"[:200]}]
            rows += got
            print(f"{name}: {time.perf_counter() - start:.0f} s", *[f"{r['change']}: {r.get('past_line', r.get('error'))}"
                                                                   for r in got], flush=True)  # fmt: skip
            pd.DataFrame(rows).to_csv(RESULTS / f"{args.name}.csv", index=False)
    frame = pd.DataFrame(rows)
    cost = frame.drop_duplicates("model")
    cols = ["model", "snapshot_x_forward", "snapshot_noref_x_forward", "disk_x_activations",
            "disk_noref_x_activations", "diff_x_localize", "forward_s", "activations_mb"]  # fmt: skip
    frame = frame[frame.change != "cost only"]
    with open(RESULTS / f"{args.name}.md", "w") as f:
        title = "Snapshot and diff on the zoo (bench/changes.py" + (
            " --ops: each module's own ops too" if args.ops else ""
        )
        f.write(f"# {title})\n\n## Cost (ratios from one run)\n\n")
        f.write(cost[[c for c in cols if c in cost]].to_markdown(index=False, floatfmt=".3g") + "\n\n")
        if "past_line" in frame:  # (the real-size models alone: cost only)
            legit = frame.pivot_table(index="model", columns="change", values="past_line", aggfunc="sum")
            moved = frame.pivot_table(index="model", columns="change", values="moved", aggfunc="sum")
            f.write("## Legitimate changes: modules past the line (false alarms)\n\n")
            f.write(legit.to_markdown(floatfmt=".0f") + "\n\n")
            f.write("## Modules whose output moved (not bit for bit the snapshot's)\n\n")
            f.write(moved.to_markdown(floatfmt=".0f") + "\n\n")
            f.write(f"Modules{' and ops' if args.ops else ''} judged in all: {int(frame.judged.sum())} over {len(frame)} (model, change) runs; "
                    f"past the line: {int(frame.past_line.sum())}.\n")  # fmt: skip
    print((RESULTS / f"{args.name}.md").read_text())


if __name__ == "__main__":
    main()
