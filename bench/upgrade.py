"""A real upgrade (#49): the zoo snapshot on this torch, diffed on another torch installed beside it.

For each model of :mod:`rlx_nb.models.zoo` and the demo MLP, CNN and transformer block (batch 2): a snapshot here
(``reference=True``: the float64 values of the old torch), its weights and inputs saved to a file, then
``rlx_nb.diff(snapshot, model, inputs, local="all")`` run by another interpreter whose torch is the newer one
(every module alone and in the whole run).  Every module past the line is listed, to be checked by hand.

    python -m venv /tmp/t214 && /tmp/t214/bin/pip install torch==2.14.1 numpy pandas numba matplotlib jinja2 \\
        tqdm transformers tabulate && /tmp/t214/bin/pip install --no-deps -e .
    python bench/upgrade.py --python /tmp/t214/bin/python [--models gpt2,vit] [--name upgrade]

Not part of CI (it needs the second torch).  Writes ``bench/results/<name>.csv`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pandas as pd
import torch

import rlx_nb

sys.path.insert(0, str(Path(__file__).parent))
from changes import DEMOS, build, counts

from rlx_nb.models import zoo

RESULTS = Path(__file__).parent / "results"
SHOWN = ["module", "change", "local_line", "propagated_line", "reason"]


def child(snapshot: str, state: str, name: str) -> None:
    model, _ = build(name)
    saved = torch.load(state)
    model.load_state_dict(saved["model"])
    d = rlx_nb.diff(snapshot, model, saved["inputs"], local="all", progress=False)
    past = d.frame[(d.frame.local_verdict == "SUSPECT") | (d.frame.propagated_verdict == "SUSPECT")]
    print(json.dumps({**counts(d), "torch": torch.__version__, "environment": d.environment,
                      "past": past[SHOWN].to_dict("records"), "culprit": d.culprit}))  # fmt: skip


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        warnings.simplefilter("ignore")
        child(*sys.argv[2:5])
        return
    p = argparse.ArgumentParser()
    p.add_argument("--python", required=True, help="the interpreter with the other torch and rlx_nb installed")
    p.add_argument("--models", default=",".join((*DEMOS, *zoo.MODELS)))
    p.add_argument("--name", default="upgrade")
    args = p.parse_args()
    warnings.simplefilter("ignore")
    rows, past = [], []
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.models.split(","):
            start = time.perf_counter()
            model, inputs = build(name)
            snap = rlx_nb.snapshot(model, inputs, Path(scratch) / name, reference=True)
            state = Path(scratch) / f"{name}.pt"
            torch.save({"model": model.state_dict(), "inputs": inputs}, state)
            done = subprocess.run([args.python, __file__, "--child", str(snap), str(state), name], capture_output=True,
                                  text=True, timeout=1800)  # fmt: skip
            if done.returncode:
                rows.append({"model": name, "error": (done.stderr.strip().splitlines() or ["?"])[-1][:300]})
            else:
                found = json.loads(done.stdout.strip().splitlines()[-1])
                past += [{"model": name, **r} for r in found.pop("past")]
                rows.append({"model": name, "from": torch.__version__, **found})
            print(f"{name}: {time.perf_counter() - start:.0f} s", rows[-1].get("past_line", rows[-1].get("error")),
                  flush=True)  # fmt: skip
    frame = pd.DataFrame(rows)
    frame.to_csv(RESULTS / f"{args.name}.csv", index=False)
    with open(RESULTS / f"{args.name}.md", "w") as f:
        f.write(f"# torch {torch.__version__} -> {frame['torch'].dropna().iloc[0] if 'torch' in frame else '?'}: "
                "the zoo diffed (bench/upgrade.py, one run)\n\n")  # fmt: skip
        cols = [c for c in ("model", "modules", "judged", "moved", "past_line", "worst_line", "culprit", "error")
                if c in frame]  # fmt: skip
        f.write(frame[cols].to_markdown(index=False, floatfmt=".3g") + "\n\n")
        envs = frame["environment"].dropna()
        if len(envs):
            f.write("Environment differences: " + "; ".join(envs.iloc[0]) + "\n\n")
        f.write("## Every module past the line\n\n")
        f.write((pd.DataFrame(past).to_markdown(index=False, floatfmt=".3g") if past else "None.") + "\n")
    print((RESULTS / f"{args.name}.md").read_text())


if __name__ == "__main__":
    main()
