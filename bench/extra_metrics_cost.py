"""What the metrics other toolchains speak (cosine, PCC, SQNR, NMSE) add to the metric pass at 5e7.

A/B in the same run: ``pair_stats`` on the same float32 pair at 5e7 elements, from this tree and from
the commit before the four metrics were added (``--base``, checked out in a temporary git worktree),
in alternating fresh processes, best of ``--repeats`` calls each.  Target: at most 1.10x.

    python bench/extra_metrics_cost.py [--base COMMIT] [--repeats 5]

Writes ``bench/results/extra_metrics_cost.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _child import write_result

BASE = "2523dd6"  # the last commit without the four metrics
N = 50_000_000
ROOT = Path(__file__).resolve().parents[1]


def _child(repeats: int) -> None:
    import numpy as np

    from rlx_nb import _fused
    from rlx_nb.metrics import pair_stats

    rng = np.random.default_rng(0)
    o = rng.standard_normal(N, dtype=np.float32)
    b = o + rng.standard_normal(N, dtype=np.float32) * np.float32(1e-3)
    assert _fused.kernel() is not None, "numba is needed: this measures the fused pass"
    pair_stats(o[:100_000], b[:100_000])  # the kernel loaded
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        pair_stats(o, b)
        best = min(best, time.perf_counter() - t0)
    print(json.dumps({"seconds": best}))


def _run(tree: Path, repeats: int) -> float:
    env = dict(os.environ, PYTHONPATH=str(tree), NUMBA_CACHE_DIR=str(tree / ".numba-cache"))
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(repeats)], env=env, capture_output=True, text=True, check=False
    )
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default=BASE)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(int(args.child))
        return
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), args.base], check=True,
                       capture_output=True)  # fmt: skip
        try:
            new, old = math.inf, math.inf
            for _ in range(3):  # alternate, so both see the same machine
                old = min(old, _run(base, args.repeats))
                new = min(new, _run(ROOT, args.repeats))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)
    ratio = new / old
    print(f"pair_stats at 5e7: {old:.3f} s without, {new:.3f} s with the four metrics: {ratio:.2f}x")
    write_result(
        "extra_metrics_cost.md",
        [
            "# The metrics other toolchains speak: their cost in the metric pass",
            "",
            f"`pair_stats` on one float32 pair of {N:.0e} elements (fused numba pass), best of {args.repeats} calls "
            "in each of 3 alternating fresh processes per side.",
            "",
            "| tree | seconds |",
            "|---|---|",
            f"| `{args.base}` (without cosine, PCC, SQNR, NMSE) | {old:.3f} |",
            f"| this tree (with them) | {new:.3f} |",
            f"| ratio (target <= 1.10) | **{ratio:.2f}x** |",
        ],
    )


if __name__ == "__main__":
    main()
