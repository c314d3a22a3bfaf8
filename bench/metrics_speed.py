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
from pathlib import Path

import numpy as np
import torch

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1e6,1e7,5e7,1e8")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    rows = []
    for n in [int(float(s)) for s in args.sizes.split(",")]:
        rng = np.random.default_rng(0)
        a = rng.standard_normal(n, dtype=np.float32)
        # Round-off-sized noise everywhere plus 0.1% of elements off by 1e-3: assert_close fails.
        b = a + rng.standard_normal(n, dtype=np.float32) * np.float32(1e-7)
        b[rng.integers(0, n, n // 1000)] += np.float32(1e-3)
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        pair_stats(a, b)  # warm up
        t_max = _median_time(lambda a=a, b=b: np.max(np.abs(a - b)), args.repeat)
        t_stats = _median_time(lambda a=a, b=b: pair_stats(a, b), args.repeat)
        t_close = _median_time(lambda ta=ta, tb=tb: _assert_close_fails(ta, tb), max(1, args.repeat // 2))
        tracemalloc.start()
        pair_stats(a, b)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        rows.append((n, t_max, t_stats, t_close, peak / a.nbytes))
        print(
            f"n={n:.0e}: max|a-b| {t_max * 1e3:.1f} ms, pair_stats {t_stats * 1e3:.1f} ms "
            f"({t_stats / t_max:.2f}x), assert_close {t_close * 1e3:.0f} ms ({t_close / t_stats:.1f}x slower), "
            f"peak extra memory {peak / a.nbytes:.2f}x one output",
            flush=True,
        )
    out = Path(__file__).parent / "results" / "metrics_speed.md"
    out.parent.mkdir(exist_ok=True)
    lines = [
        "# Full metric set vs anchors (float32 pairs)",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads; "
        f"numpy {np.__version__}, torch {torch.__version__}. Medians of {args.repeat} runs, one process.",
        "",
        "| elements | np.max(np.abs(a-b)) | pair_stats (full set) | ratio to max-abs (target <= 3) "
        "| assert_close failure | assert_close / pair_stats (target >= 10) | peak extra memory / output |",
        "|---|---|---|---|---|---|---|",
    ]
    for n, t_max, t_stats, t_close, mem in rows:
        lines.append(
            f"| {n:.0e} | {t_max * 1e3:.1f} ms | {t_stats * 1e3:.1f} ms | {t_stats / t_max:.2f} "
            f"| {t_close * 1e3:.0f} ms | {t_close / t_stats:.1f} | {mem:.2f} |"
        )
    lines += [
        "",
        "The full set: max_abs and its index, max_rel (seed) and its index, mean, exact p99, "
        "mismatch count at assert_close's tolerances, max ULP distance, NaN/Inf pattern mismatches.",
    ]
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
