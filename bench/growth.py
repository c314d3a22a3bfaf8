"""How the cost grows: ``backend_divergence`` and ``localize`` against model depth and output size.

Depth: ``demo.layered(n_layers)`` (encoder blocks, d 64, seq 32, batch 8) with the softmax fault
confined to the last block, 2 -> 64 blocks; ``backend_divergence`` on that one candidate and
``localize`` down to the faulty op.  Size: a LayerNorm + GELU model on 1e5 -> 1e8 elements with
the GELU fault (``fault:gelu-approx``), ``localize`` down to ``F.gelu``.  (``backend_divergence``'s
growth with output size is in ``end_to_end.md``.)

Each row runs in a fresh process; peak is the process's maximum RSS (torch's own ~0.3 GB included).

    python bench/growth.py [--depths 2,4,8,16,32,64] [--sizes 1e5,1e6,1e7,1e8]

Writes ``bench/results/growth.md``.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

from _child import run_child, write_result

WIDTH = 1024


def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


def _depth(n_layers: int) -> dict:
    import rlx_nb
    from rlx_nb.models import demo

    model, inputs = demo.layered(n_layers=n_layers, fault_layer=n_layers - 1)
    small, small_in = demo.layered(n_layers=1, fault_layer=0)
    rlx_nb.localize(small, small_in, backend="fault:softmax-row")  # warm-up
    t0 = time.perf_counter()
    report = rlx_nb.backend_divergence(model, inputs, backends=["fault:softmax-row"])
    t_div = time.perf_counter() - t0
    t0 = time.perf_counter()
    loc = rlx_nb.localize(model, inputs, backend="fault:softmax-row")
    t_loc = time.perf_counter() - t0
    return {
        "what": "depth",
        "x": n_layers,
        "t_div": t_div,
        "t_loc": t_loc,
        "checks": loc.preparations,
        "culprit": loc.culprit,
        "verdict": report.record("fault:softmax-row").verdict,
        "rss": _rss_gb(),
    }


def _size(n: int) -> dict:
    import torch

    import rlx_nb

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.LayerNorm(WIDTH), torch.nn.GELU())
    rlx_nb.localize(model, torch.randn(2, WIDTH), backend="fault:gelu-approx")  # warm-up
    x = torch.randn(max(1, n // WIDTH), WIDTH)
    t0 = time.perf_counter()
    loc = rlx_nb.localize(model, x, backend="fault:gelu-approx")
    t_loc = time.perf_counter() - t0
    return {
        "what": "size",
        "x": x.numel(),
        "t_div": float("nan"),
        "t_loc": t_loc,
        "checks": loc.preparations,
        "culprit": loc.culprit,
        "verdict": "",
        "rss": _rss_gb(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", default="2,4,8,16,32,64")
    parser.add_argument("--sizes", default="1e5,1e6,1e7,1e8")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        what, x = args.child
        print(json.dumps(_depth(int(x)) if what == "depth" else _size(int(float(x)))))
        return
    jobs = [("depth", d) for d in args.depths.split(",") if d] + [("size", s) for s in args.sizes.split(",") if s]
    rows = []
    for what, x in jobs:
        row = run_child(__file__, what, x)
        rows.append(row)
        print(row, flush=True)
    lines = ["# How the cost grows", "", "One run per row, each in a fresh process.", ""]
    lines += [
        "## Depth (`demo.layered`, softmax fault in the last block)",
        "",
        "| blocks | backend_divergence | per block | its verdict | localize | per block | checks | culprit | peak RSS |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["what"] == "depth":
            lines.append(
                f"| {r['x']} | {r['t_div']:.2f} s | {r['t_div'] / r['x'] * 1e3:.0f} ms | {r['verdict']} | {r['t_loc']:.2f} s "
                f"| {r['t_loc'] / r['x'] * 1e3:.0f} ms | {r['checks']} | `{r['culprit']}` | {r['rss']:.2f} GB |"
            )
    lines += [
        "",
        "The verdict column is the whole model's: from 16 blocks on, one faulty softmax row in the last block "
        "moves the final outputs by less than the whole model's round-off budget, so the end-to-end verdict is "
        "round-off, while localize, judging each block alone on its own budget, still finds the faulty op.",
        "",
        "## Output size (LayerNorm + GELU, GELU fault), localize",
        "",
        "| elements | localize | per 1e6 elements | checks | culprit | peak RSS | peak per output size |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["what"] == "size":
            lines.append(
                f"| {r['x']:.1e} | {r['t_loc']:.2f} s | {r['t_loc'] / r['x'] * 1e9:.0f} ms | {r['checks']} "
                f"| `{r['culprit']}` | {r['rss']:.2f} GB | {r['rss'] * 1e9 / (4 * r['x']):.1f}x |"
            )
    lines += [
        "",
        "localize here runs each top-level module alone (2 checks), the culprit's ops (1 check) and three "
        "full runs (oracle, fp64, backend) for the propagated error; it keeps the SUSPECT checks' arrays "
        "(and round-off ones under 256 MB) and every module's activations of the three full runs.",
    ]
    write_result("growth.md", lines)


if __name__ == "__main__":
    main()
