"""Memory of a report over 8 backends x 20 outputs x 1e7 elements, against the outputs' own bytes.

Issue #7's target: the whole process's peak memory stays under 2x the bytes of the outputs it
holds (oracle, fp64 reference and 8 candidates; outputs are kept once, never copied per view).
After the report is built the usual views are taken (summary, per-output table, top-k elements,
an error heatmap) so a copy made by any of them would show in the peak.

Runs in a fresh process; peak is the process's maximum RSS (torch's own ~0.3 GB included).

    python bench/report_memory.py [--elements 1e7] [--outputs 20] [--backends 8]

Writes ``bench/results/report_memory.md``.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import time

from _child import run_child, write_result


def _child(n: int, n_out: int, n_backends: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import torch

    import rlx_nb
    from rlx_nb.backends.eager import run_eager

    class ManyOutputs(torch.nn.Module):
        def forward(self, x):
            return {f"o{k}": torch.nn.functional.gelu(x * (1.0 + k / n_out)) for k in range(n_out)}

    # Eight cheap real backends: the no-oneDNN eager path and eager runs registered under bench names.
    names = ["cpu-nomkldnn"] + [f"bench:eager-{k}" for k in range(n_backends - 1)]
    for name in names[1:]:
        rlx_nb.register_backend(name, run_eager, default=False, replace=True)
    x = torch.randn(n)
    t0 = time.perf_counter()
    report = rlx_nb.backend_divergence(ManyOutputs(), x, backends=names)
    t_build = time.perf_counter() - t0
    res = report.results
    held = sum(
        leaf.value.nbytes
        for run in [
            res.oracle,
            res.reference,
            *res.candidates.values(),
            *res.anchors.values(),
            *filter(None, [res.sequential]),
        ]
        for leaf in run.outputs.values()
    )
    rss_report = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    _ = report.summary, report.backends  # DataFrames, built on first use
    for name in names:
        report.elements(name, "o0", top=10)
    from matplotlib.figure import Figure

    fig = Figure()
    report.plot.heatmap(names[-1], "o19" if n_out >= 20 else "o0", ax=fig.add_subplot())
    t_views = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(
        json.dumps(
            {
                "n": n,
                "outputs": n_out,
                "backends": len(names),
                "held": held,
                "rss_report": rss_report,
                "rss": rss,
                "t_build": t_build,
                "t_views": t_views,
                "suspects": report.suspects,
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", default="1e7")
    parser.add_argument("--outputs", type=int, default=20)
    parser.add_argument("--backends", type=int, default=8)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    n = int(float(args.elements))
    if args.child:
        _child(n, args.outputs, args.backends)
        return
    r = run_child(__file__, "--elements", str(n), "--outputs", str(args.outputs), "--backends", str(args.backends))
    gb = 1 << 30
    line = (
        f"| {r['backends']} x {r['outputs']} x {r['n']:.0e} | {r['held'] / gb:.2f} GiB | {r['rss_report'] / gb:.2f} GiB "
        f"({r['rss_report'] / r['held']:.2f}x) | {r['rss'] / gb:.2f} GiB ({r['rss'] / r['held']:.2f}x) "
        f"| {r['t_build']:.1f} s | {r['t_views']:.1f} s |"
    )
    print(line)
    write_result(
        "report_memory.md",
        [
            "# Report memory vs the outputs it holds",
            "",
            f"Machine: {platform.machine()}. One run in a fresh process; peak = maximum RSS of the process.",
            "",
            "| backends x outputs x elements | outputs held (oracle, fp64 reference, candidates) "
            "| peak after backend_divergence | peak after the views (target < 2x) | build | views |",
            "|---|---|---|---|---|---|",
            line,
            "",
            "Views: `summary`, `backends`, `elements(backend, 'o0', top=10)` for every backend, one heatmap. "
            f"Suspects (expected none; all candidates are eager variants): {r['suspects'] or 'none'}.",
        ],
    )


if __name__ == "__main__":
    main()
