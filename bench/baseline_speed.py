"""A baseline comparison of two saved reports of the demo at 1e6-element outputs: target under 1 s.

Two reports of the demo transformer (``rlx_nb.models.demo.transformer``) on a batch of 32 — its output
32 x 128 x 256, about 1e6 elements — on two candidates are saved; ``rlx_nb.compare_reports(old_path, new_path)`` is timed from the files (it reads
the saved records, never the arrays), best of 5, against the time to load one report in the same run.

    python bench/baseline_speed.py

Writes ``bench/results/baseline_speed.md``.
"""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path

import torch
from _child import write_result

import rlx_nb
from rlx_nb.models import demo


def main() -> None:
    model, _ = demo.transformer()
    x = torch.randn(32, 128, 256, generator=torch.Generator().manual_seed(0))  # the output: 1,048,576 elements
    backends = ["cpu-nomkldnn", "fault:softmax-row"]
    with tempfile.TemporaryDirectory() as tmp:
        old = rlx_nb.backend_divergence(model, x, backends=backends, progress=False).save(Path(tmp) / "old")
        # (the same model and inputs: what a baseline compares, across versions of the stack)
        new = rlx_nb.backend_divergence(model, x, backends=backends, progress=False).save(Path(tmp) / "new")
        best, load = math.inf, math.inf
        for _ in range(5):
            t0 = time.perf_counter()
            moved = rlx_nb.compare_reports(old, new)
            best = min(best, time.perf_counter() - t0)
            t0 = time.perf_counter()
            rlx_nb.load_report(old)
            load = min(load, time.perf_counter() - t0)
    n = moved.frame.shape[0]
    print(f"compare_reports of two saved reports ({n} outputs of ~1e6 elements): {best:.3f} s; one load {load:.3f} s")
    write_result(
        "baseline_speed.md",
        [
            "# Baseline comparison of two saved reports of the demo transformer, 1e6-element outputs",
            "",
            "| step | seconds |",
            "|---|---|",
            f"| `compare_reports(old.rlxnb, new.rlxnb)`, {n} (backend, output) pairs (target < 1 s) | **{best:.3f}** |",
            f"| `load_report` of one of them (reads records, no arrays) | {load:.3f} |",
        ],
    )


if __name__ == "__main__":
    main()
