"""What the metrics other toolchains speak (cosine, PCC, SQNR, NMSE) add to the metric pass at 5e7.

Two A/Bs on the same float32 pair of 5e7 elements, in the same run:

- the target: this tree's fused pass with and without the five similarity sums (the kernel's
  ``sums`` switch, only this benchmark turns it off), alternating call by call in each of 3 fresh
  processes, best of ``--repeats`` each;
- for context: this tree against the commit before the four metrics (``--base``, checked out in a
  temporary git worktree), alternating fresh processes.

Target: at most 1.10x.

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


def _child(repeats: int, toggle: bool) -> None:
    import numpy as np

    from rlx_nb.numerics import fused as _fused
    from rlx_nb.numerics import pairs as metrics

    rng = np.random.default_rng(0)
    o = rng.standard_normal(N, dtype=np.float32)
    b = o + rng.standard_normal(N, dtype=np.float32) * np.float32(1e-3)
    assert _fused.kernel() is not None, "numba is needed: this measures the fused pass"
    metrics.pair_stats(o[:100_000], b[:100_000])  # the kernel loaded

    def timed(call) -> float:
        t0 = time.perf_counter()
        call()
        return time.perf_counter() - t0

    rtol, atol = metrics.default_tolerance("float32")  # pair_stats' own defaults for float32
    calls = {
        "with": lambda: metrics.pair_stats(o, b),
        "without": lambda: metrics._fused_pair_stats(o, b, rtol, atol, p99=True, sums=False),
    }
    best = {"with": math.inf, "without": math.inf}
    for _ in range(repeats):
        for name in ("with", "without") if toggle else ("with",):  # alternating, call by call
            best[name] = min(best[name], timed(calls[name]))
    print(json.dumps(best))


def _run(tree: Path, cache: Path, repeats: int, toggle: bool = False) -> dict:
    # Each tree's kernels cached apart (the two sources differ), outside the repository.
    env = dict(os.environ, PYTHONPATH=str(tree), NUMBA_CACHE_DIR=str(cache))
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(repeats), *(["--toggle"] if toggle else [])],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default=BASE)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--toggle", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(int(args.child), args.toggle)
        return
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), args.base], check=True,
                       capture_output=True)  # fmt: skip
        try:
            new, old, without = math.inf, math.inf, math.inf
            for _ in range(3):  # alternate, so both see the same machine
                old = min(old, _run(base, Path(tmp) / "numba-base", args.repeats)["with"])
                here = _run(ROOT, Path(tmp) / "numba-here", args.repeats, toggle=True)
                new, without = min(new, here["with"]), min(without, here["without"])
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)
    marginal, against_base = new / without, new / old
    print(f"pair_stats at 5e7: {without:.3f} s without the sums, {new:.3f} s with them: {marginal:.2f}x")
    print(f"against {args.base}: {old:.3f} s, this tree {new:.3f} s: {against_base:.2f}x")
    write_result(
        "extra_metrics_cost.md",
        [
            "# The metrics other toolchains speak: their cost in the metric pass",
            "",
            f"`pair_stats` on one float32 pair of {N:.0e} elements (fused numba pass, 2 threads), best of "
            f"{args.repeats} calls in each of 3 fresh processes per side.",
            "",
            "| pass | seconds |",
            "|---|---|",
            f"| this tree, the similarity sums switched off | {without:.3f} |",
            f"| this tree, with them (cosine, PCC, SQNR, NMSE) | {new:.3f} |",
            f"| **ratio (target <= 1.10)** | **{marginal:.2f}x** |",
            f"| for context: `{args.base}`, before the four metrics (and before the block views) | {old:.3f} |",
            f"| this tree against it | {against_base:.2f}x |",
        ],
    )


if __name__ == "__main__":
    main()
