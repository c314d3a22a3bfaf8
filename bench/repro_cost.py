"""What a standalone repro costs on real models (#47): localize, shrink, attribute, write and check, against the
report itself, in one run.

Cases (each in a fresh process):

- ``efficientnet``: Hugging Face's EfficientNet (the zoo's, random weights) on ``cpu-inductor`` with its backward:
  the real Inductor bug pytorch/pytorch#198119 (avg_pool2d backward over a ceil_mode window), bisected to its
  lowering;
- ``gpt2``: Hugging Face's GPT-2 (the zoo's) on ExecuTorch XNNPACK with the catalogue's softmax-row fault carried
  through it, told apart from the converter by the portable kernels.

    python bench/repro_cost.py [--cases efficientnet,gpt2]

Writes ``bench/results/repro_cost.md``.
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

from _child import run_child, write_result

CASES = ("efficientnet", "gpt2")


def _child(case: str) -> None:

    import rlx_nb
    from rlx_nb.backends.exported_faults import fault_through
    from rlx_nb.backends.registry import get_backend
    from rlx_nb.localization import attribution
    from rlx_nb.localization import reproduce as steps
    from rlx_nb.models import zoo

    model, inputs = zoo.build(case, batch=2)
    if case == "efficientnet":
        backend, backward = "cpu-inductor", True
    else:
        backend, backward = fault_through("fault:softmax-row", get_backend("executorch-xnnpack")), False
    name = backend if isinstance(backend, str) else backend.name
    t0 = time.perf_counter()
    report = rlx_nb.backend_divergence(model, inputs, backends=[backend], backward=backward, progress=False)
    t_report = time.perf_counter() - t0
    spent: dict[str, float] = {}

    def timed(holder, attr: str) -> None:  # each step of reproduce, timed where it is looked up
        inner = getattr(holder, attr)

        def fn(*a, **k):
            s = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                spent[attr] = spent.get(attr, 0.0) + time.perf_counter() - s

        setattr(holder, attr, fn)

    timed(steps, "shrink")
    timed(steps, "run_script")
    timed(attribution, "attribute")
    t0 = time.perf_counter()
    loc = report.localize(name)
    t_localize = time.perf_counter() - t0
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        repro = loc.repro(Path(tmp), progress=False)
        lines = repro.lines
    t_repro = time.perf_counter() - t0
    print(json.dumps({
        "case": case, "backend": name, "report_s": t_report, "localize_s": t_localize, "repro_s": t_repro,
        "shrink_s": spent.get("shrink", 0.0), "attribute_s": spent.get("attribute", 0.0),
        "check_s": spent.get("run_script", 0.0), "culprit": loc.culprit, "shrunk": str(repro.shrunk),
        "attribution": repro.attribution, "reproduces": repro.reproduces, "lines": lines,
        "rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
    }))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child)
        return
    rows = []
    for case in args.cases.split(","):
        row = run_child(__file__, case)
        rows.append(row)
        print(json.dumps(row), flush=True)
    lines = [
        "# What a standalone repro costs on real models (one run each, a fresh process per case)",
        "",
        "| model | backend | the report | localize | repro (all) | of which shrink | attribute | check run | "
        "culprit | lines | reproduces | peak RSS |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['backend']} | {r['report_s']:.1f} s | {r['localize_s']:.1f} s | "
            f"{r['repro_s']:.1f} s ({r['repro_s'] / r['report_s']:.1f}x the report) | {r['shrink_s']:.1f} s | "
            f"{r['attribute_s']:.1f} s | {r['check_s']:.1f} s | `{r['culprit']}` | {r['lines']} | {r['reproduces']} | "
            f"{r['rss_gb']:.2f} GB |"
        )
    lines += ["", "What was shrunk and where each error is born:", ""]
    lines += [f"- **{r['case']}**: {r['shrunk']} {r['attribution']}" for r in rows]
    write_result("repro_cost.md", lines)


if __name__ == "__main__":
    main()
