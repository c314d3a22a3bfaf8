"""Every forward catalogue fault carried through each exported runtime: does its standalone repro reproduce? (#47)

For each (runtime, fault) on the demo's layered transformer (the fault in block 1), the report, the localization
and ``loc.repro`` run as a user would; the repro is then run again here in a fresh interpreter where ``import
rlx_nb`` fails.  A row says whether it crossed the line there (exit 1), its length, how far it was shrunk and where
the error is born.  A fault the runtime cannot convert, or one the report does not call SUSPECT, is said so.

    python bench/repro_catalogue.py [--runtimes onnxruntime,executorch-xnnpack,litert] [--faults softmax-row,...]

Writes ``bench/results/repro_catalogue.md`` (``--name`` another name).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _child import write_result

import rlx_nb
from rlx_nb.backends.exported_faults import fault_through
from rlx_nb.backends.faults import CATALOGUE
from rlx_nb.backends.registry import get_backend
from rlx_nb.models import demo

BLOCKED = "import runpy, sys; sys.modules['rlx_nb'] = None; runpy.run_path(sys.argv[1], run_name='__main__')"
FORWARD = [name.removeprefix("fault:") for name, f in CATALOGUE.items() if "backward" not in name]


def one(runtime: str, fault: str, where: Path) -> dict:
    model, inputs = demo.layered(fault_layer=1)
    backend = fault_through(f"fault:{fault}", get_backend(runtime))
    row = {"runtime": runtime, "fault": fault}
    t0 = time.perf_counter()
    report = rlx_nb.backend_divergence(model, inputs, backends=[backend], progress=False)
    record = report.record(backend.name)
    if record.verdict != "SUSPECT":
        return {**row, "state": f"not SUSPECT ({record.verdict}: {record.reason[:80]})"}
    try:
        repro = report.repro(backend.name, where, progress=False)
    except rlx_nb.RlxError as exc:
        return {**row, "state": f"no repro: {str(exc)[:120]}"}
    seconds = time.perf_counter() - t0
    done = subprocess.run([sys.executable, "-c", BLOCKED, str(repro.path)], capture_output=True, text=True,
                          timeout=900, cwd=repro.path.parent)  # fmt: skip
    n0, n1 = repro.shrunk.elements
    return {
        **row,
        "state": "reproduces" if done.returncode == 1 and "PAST the line" in done.stdout else "does NOT reproduce",
        "lines": repro.lines,
        "shrunk": n0 / max(n1, 1),
        "culprit": repro.label,
        "born": repro.attribution.split(":")[0],
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtimes", default="onnxruntime,executorch-xnnpack,litert")
    parser.add_argument("--faults", default=",".join(FORWARD))
    parser.add_argument("--name", default="repro_catalogue", help="results file name (bench/results/NAME.md)")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for runtime in args.runtimes.split(","):
            reason = get_backend(runtime).unavailable_reason()
            for fault in args.faults.split(","):
                if reason is not None:
                    rows.append({"runtime": runtime, "fault": fault, "state": f"runtime not available: {reason}"})
                    continue
                rows.append(one(runtime, fault, Path(tmp) / f"{runtime}-{fault}"))
                print(rows[-1], flush=True)
    done = [r for r in rows if r["state"] in ("reproduces", "does NOT reproduce")]
    ok = [r for r in done if r["state"] == "reproduces"]
    lines = [
        "# Catalogue faults through exported runtimes: the standalone repro, run where rlx_nb cannot be imported",
        "",
        f"{len(ok)} of {len(done)} repros written reproduce the divergence past the line; longest "
        f"{max((r['lines'] for r in done), default=0)} lines; inputs shrunk at least "
        f"{min((r['shrunk'] for r in done), default=0):.0f}x in elements. Model: `demo.layered(fault_layer=1)`.",
        "",
        "| runtime | fault | repro | lines | shrunk | culprit | born in | report + repro |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "lines" in r:
            lines.append(f"| {r['runtime']} | {r['fault']} | {r['state']} | {r['lines']} | {r['shrunk']:.0f}x | "
                         f"`{r['culprit']}` | {r['born']} | {r['seconds']:.0f} s |")  # fmt: skip
        else:
            lines.append(f"| {r['runtime']} | {r['fault']} | {r['state']} | | | | | |")
    write_result(f"{args.name}.md", lines)


if __name__ == "__main__":
    main()
