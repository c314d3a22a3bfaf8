"""Full metric set vs the anchors, on float32 pairs, in one run (ratios, not absolute times).

Anchors: bare ``np.max(np.abs(a - b))`` and ``torch.testing.assert_close``'s
failure path.  Targets: within 3x of the former, >= 10x faster than the latter
at 5e7 and 1e8 elements (issues #2 and #7).  Writes ``bench/results/metrics_speed.md``.

    python bench/metrics_speed.py [--sizes 1e6,1e7,5e7,1e8] [--repeat 5]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
import tracemalloc

import numpy as np
import torch
from _child import write_result

from rlx_nb.numerics.pairs import pair_stats


def _median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _assert_close_fails(a: torch.Tensor, b: torch.Tensor) -> None:
    try:
        torch.testing.assert_close(b, a)
    except AssertionError:
        return
    raise RuntimeError("the pair was meant to fail assert_close")


TARGET_TO_MAX_ABS = 3.0
"""pair_stats over np.max(np.abs(a - b)), at most."""
TARGET_OVER_ASSERT_CLOSE = 10.0
"""assert_close's failure over pair_stats, at least (at 5e7 and 1e8)."""


def measure(n: int, repeat: int) -> dict:
    """One size: the medians of the full metric set, of the bare max-abs and of assert_close's failure, and the
    metric pass's peak extra memory over one output's."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal(n, dtype=np.float32)
    # Round-off-sized noise everywhere plus 0.1% of elements off by 1e-3: assert_close fails.
    b = a + rng.standard_normal(n, dtype=np.float32) * np.float32(1e-7)
    b[rng.integers(0, n, n // 1000)] += np.float32(1e-3)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    pair_stats(a, b)  # warm up
    t_max = _median_time(lambda: np.max(np.abs(a - b)), repeat)
    t_stats = _median_time(lambda: pair_stats(a, b), repeat)
    t_close = _median_time(lambda: _assert_close_fails(ta, tb), max(1, repeat // 2))
    tracemalloc.start()
    pair_stats(a, b)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {"n": n, "max_abs_s": t_max, "pair_stats_s": t_stats, "assert_close_s": t_close, "memory": peak / a.nbytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1e6,1e7,5e7,1e8")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    rows = []
    for n in [int(float(s)) for s in args.sizes.split(",")]:
        row = measure(n, args.repeat)
        rows.append(row)
        t_max, t_stats, t_close = row["max_abs_s"], row["pair_stats_s"], row["assert_close_s"]
        print(
            f"n={n:.0e}: max|a-b| {t_max * 1e3:.1f} ms, pair_stats {t_stats * 1e3:.1f} ms "
            f"({t_stats / t_max:.2f}x), assert_close {t_close * 1e3:.0f} ms ({t_close / t_stats:.1f}x slower), "
            f"peak extra memory {row['memory']:.2f}x one output",
            flush=True,
        )
    lines = [
        "# Full metric set vs anchors (float32 pairs)",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads; "
        f"numpy {np.__version__}, torch {torch.__version__}. Medians of {args.repeat} runs, one process.",
        "",
        f"| elements | np.max(np.abs(a-b)) | pair_stats (full set) | ratio to max-abs (target <= {TARGET_TO_MAX_ABS:g}) "
        f"| assert_close failure | assert_close / pair_stats (target >= {TARGET_OVER_ASSERT_CLOSE:g}) "
        "| peak extra memory / output |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t_max, t_stats, t_close = r["max_abs_s"], r["pair_stats_s"], r["assert_close_s"]
        lines.append(
            f"| {r['n']:.0e} | {t_max * 1e3:.1f} ms | {t_stats * 1e3:.1f} ms | {t_stats / t_max:.2f} "
            f"| {t_close * 1e3:.0f} ms | {t_close / t_stats:.1f} | {r['memory']:.2f} |"
        )
    lines += [
        "",
        "The full set: max_abs and its index, max_rel (seed) and its index, mean, exact p99, "
        "mismatch count at assert_close's tolerances, max ULP distance, NaN/Inf pattern mismatches.",
    ]
    write_result("metrics_speed.md", lines, rows)


if __name__ == "__main__":
    main()
