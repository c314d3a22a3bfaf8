"""A quick set of the ratio benchmarks, against the committed results: ``make bench-check``.

Runs, in a few minutes on 2 cores, what a change to ``rlx_nb/`` is most likely to slow down, each as a ratio to
its anchor measured in the same run:

- end to end at 1e7 and 5e7 elements (``bench/end_to_end.py``'s gelu row: the call over ``assert_close``'s
  failure, and the peak RSS at 5e7), and its two-op model (silu-scale) at 5e7 over the manual workflow;
- the metric pass at 1e7 and 5e7 (``bench/metrics_speed.py``: the full set over a bare max-abs);
- an explorer step (``bench/explorer_speed.py``'s demo report: its slowest interaction over drawing the same two
  figures by hand).

Each is compared with the figure the full benchmark committed in ``bench/results/*.json``: the check fails (exit 1)
when a ratio is more than 25% worse than committed, or misses its target.  Each line says which.  An end-to-end
size whose figures fail is measured again in another fresh process, up to :data:`TRIES` in all, and the best
process is kept; its lines say how many measured it.

    python bench/check.py
"""

from __future__ import annotations

import dataclasses
import sys
import time

import end_to_end
import explorer_speed
import metrics_speed
from _child import read_rows

WORSE = 1.25
"""A ratio this many times the committed one is a regression."""


@dataclasses.dataclass(frozen=True)
class Figure:
    """One measured figure: lower is better; ``target`` the most it may be (None: only the committed figure)."""

    name: str
    value: float
    unit: str
    committed: float | None
    target: float | None = None
    processes: int = 1
    """How many tries measured it (end to end: fresh processes; the best is kept; see :data:`TRIES`)."""

    def problems(self) -> list[str]:
        found = []
        if self.target is not None and self.value > self.target:
            found.append(f"misses its target (<= {self.target:g}{self.unit})")
        if self.committed is not None and self.value > self.committed * WORSE:
            found.append(f"{self.value / self.committed:.2f}x the committed {self.committed:.3g}{self.unit}")
        return found

    def line(self) -> str:
        committed = f"committed {self.committed:.3g}{self.unit}" if self.committed is not None else "none committed"
        target = f", target <= {self.target:g}{self.unit}" if self.target is not None else ""
        problems = self.problems()
        verdict = "FAIL: " + "; ".join(problems) if problems else "ok"
        best = f", best of {self.processes} tries" if self.processes > 1 else ""
        return f"bench-check: {self.name}: {self.value:.3g}{self.unit} ({committed}{target}{best}): {verdict}"


def _committed(rows: list[dict], **where) -> dict | None:
    # The committed row whose fields match ``where`` (sizes within 5%: a row records the elements it ran).
    for row in rows:
        if all(abs(row[k] - v) <= 0.05 * v if isinstance(v, (int, float)) else row[k] == v for k, v in where.items()):
            return row
    return None


TRIES = 3
"""End to end, a fresh process's ratio moves by up to 0.3 with where the kernel places the model's 200 MB outputs (the
model's own runs took 0.36-0.50 s at 5e7 across processes on one host, the rest of the call 0.40-0.42 s): a size whose
figures fail is measured again in another fresh process, up to this many in all, and the best process is kept.  A
regression shows in every process."""


def _best_of(measure) -> list[Figure]:
    # ``measure()``'s figures, measured again up to TRIES times in all while any fails; the try whose first figure is
    # lowest is kept, labelled with the tries it took.
    best: list[Figure] = []
    for tries in range(1, TRIES + 1):
        out = measure()
        if not best or out[0].value < best[0].value:
            best = out
        best = [dataclasses.replace(f, processes=tries) for f in best]  # (the best so far, of this many tries)
        if not any(f.problems() for f in best):
            break
    return best


def _end_to_end_size(n: int, old: dict | None) -> list[Figure]:
    at = "5e7" if n > 10**7 else "1e7"
    target = n > 10**7

    def measure() -> list[Figure]:
        got = end_to_end.measure("gelu", n)
        out = [Figure(f"end to end gelu {at}, backend_divergence / assert_close", got["rlx"] / got["close"], "x",
                      old and old["rlx"] / old["close"], end_to_end.TARGET_RATIO if target else None)]  # fmt: skip
        if target:
            out.append(Figure(f"end to end gelu {at}, peak RSS", got["rss_gb"], " GB", old and old["rss_gb"],
                              end_to_end.TARGET_GB))  # fmt: skip
        return out

    return _best_of(measure)


def _two_ops(old: dict | None) -> list[Figure]:
    # The two-op model at 5e7 (#62): the call against the manual workflow (model, candidate, assert_close), whose
    # fp64 reference holds two float64 temporaries; the same best-of-TRIES processes as the gelu row.
    def measure() -> list[Figure]:
        got = end_to_end.measure("silu-scale", 5 * 10**7)
        return [Figure("end to end silu-scale 5e7, backend_divergence / manual workflow", got["rlx"] / got["manual"],
                       "x", old and old["rlx"] / old["manual"], end_to_end.TARGET_MANUAL)]  # fmt: skip

    return _best_of(measure)


def end_to_end_figures() -> list[Figure]:
    rows = read_rows("end_to_end.md")
    gelu = [f for n in (10**7, 5 * 10**7) for f in _end_to_end_size(n, _committed(rows, model="gelu", n=n))]
    return gelu + _two_ops(_committed(rows, model="silu-scale", n=5 * 10**7))


def metric_figures() -> list[Figure]:
    # (the same best of TRIES measurements as end to end: at 1e7 the bare max-abs anchor took 19-50 ms from one
    # measurement to the next in one quiet process, the full pass 17-19 ms -- the ratio 0.38x-0.89x)
    rows, out = read_rows("metrics_speed.md"), []
    for n in (10**7, 5 * 10**7):
        old = _committed(rows, n=n)
        at = "5e7" if n > 10**7 else "1e7"

        def measure(n: int = n, old: dict | None = old, at: str = at) -> list[Figure]:
            got = metrics_speed.measure(n, repeat=5)
            these = [Figure(f"metric pass {at}, pair_stats / max-abs", got["pair_stats_s"] / got["max_abs_s"], "x",
                            old and old["pair_stats_s"] / old["max_abs_s"], metrics_speed.TARGET_TO_MAX_ABS)]  # fmt: skip
            if n > 10**7:  # (the other target, as a lower-is-better ratio: pair_stats / assert_close's failure)
                these.append(Figure(f"metric pass {at}, pair_stats / assert_close",
                                    got["pair_stats_s"] / got["assert_close_s"], "x",
                                    old and old["pair_stats_s"] / old["assert_close_s"],
                                    1 / metrics_speed.TARGET_OVER_ASSERT_CLOSE))  # fmt: skip
            return these

        out += _best_of(measure)
    return out


def explorer_figures() -> list[Figure]:
    report = explorer_speed.small_report()
    explorer_speed._interactions(report, "cpu-nomkldnn")  # (warm-up, as the full benchmark does)
    got = explorer_speed.measure(report, "cpu-nomkldnn")
    old = _committed(read_rows("explorer_speed.md"), report="demo transformer, forward + backward")
    return [
        Figure("explorer step (demo report), slowest / by hand", got["ratio"], "x", old and old["ratio"]),
        Figure("explorer step (demo report), slowest", got["slowest_s"], " s", None, explorer_speed.TARGET_S),
    ]


def main() -> int:
    t0 = time.perf_counter()
    figures = []
    for part in (end_to_end_figures, metric_figures, explorer_figures):
        for figure in part():
            figures.append(figure)
            print(figure.line(), flush=True)
    failed = [f for f in figures if f.problems()]
    print(f"bench-check: {len(figures) - len(failed)} of {len(figures)} ok in {time.perf_counter() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
