"""Gathering 3 ranks' results (100 MB of outputs each) on rank 0, against a plain all_gather of the same bytes.

    python bench/gather_speed.py            # launches itself under torchrun with 3 local processes (gloo)

Writes bench/results/gather_speed.md.  The rlx_nb path is what gather_report does after the model
runs: serialise the rank's results in the safe format, send the bytes point to point, and read
them back on rank 0 (the arrays stay lazy until used).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

MB = 100


def _results(rank: int):
    from rlx_nb.execution.results import BackendRun, Leaf, RunResults

    n = MB * (1 << 20) // 4
    arr = np.random.default_rng(rank).standard_normal(n, dtype=np.float32)
    run = BackendRun("cpu", "ok", {"out": Leaf(arr, "float32", arr.shape)})
    return RunResults("bench", run, run, {}, False, {"node": f"node{rank}"}, {"inputs": "x"})


def _worker() -> None:
    from rlx_nb.distributed import _payload, _receive, _to_bytes
    from rlx_nb.report.files import load_results

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = _results(rank)
    ours, plain = [], []
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        body = _payload(b"R", _to_bytes(results))
        if rank:
            dist.send(torch.tensor([body.numel()], dtype=torch.int64), dst=0)
            dist.send(body, dst=0)
        else:
            for src in range(1, world):
                load_results(_receive(src, 120))
        dist.barrier()
        ours.append(time.perf_counter() - t0)
        raw = torch.from_numpy(results.oracle.outputs["out"].value.view(np.uint8))
        out = [torch.empty_like(raw) for _ in range(world)]
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_gather(out, raw)
        dist.barrier()
        plain.append(time.perf_counter() - t0)
    if rank == 0:
        a, b = statistics.median(ours), statistics.median(plain)
        line = f"| 3 | {MB} MB | {a * 1e3:.0f} ms | {b * 1e3:.0f} ms | {a / b:.2f} |"
        print(line)
        out_md = Path(__file__).parent / "results" / "gather_speed.md"
        out_md.write_text(
            "# Gathering results across ranks (torchrun, gloo, 127.0.0.1)\n\n"
            "| ranks | outputs per rank | rlx_nb gather (serialise + send + load on rank 0) "
            "| plain all_gather of the same bytes | ratio |\n|---|---|---|---|---|\n" + line + "\n"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" in os.environ:
        _worker()
    else:
        from rlx_nb.distributed import local_torchrun

        sys.exit(subprocess.call(local_torchrun(__file__, 3), env=dict(os.environ, OMP_NUM_THREADS="1")))
