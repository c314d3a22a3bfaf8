"""Each explorer interaction, timed in the kernel, next to drawing the same figures by hand in the same run.

    python bench/explorer_speed.py [--elements 4e6]

A report of the demo transformer block (a softmax fault and a legitimate backend, forward and
backward) and a second report whose output has ``--elements`` elements.  Every interaction a person
makes (open, backend, output, each metric, an element from the list, a typed index) is timed as the
explorer does it (the heatmap and histogram redrawn to PNG, the tables rebuilt); the anchor is the
same heatmap and histogram drawn to PNG by hand with ``report.plot``.  Target: under 1 s each.
Writes ``bench/results/explorer_speed.md``.
"""

from __future__ import annotations

import argparse
import time

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import torch
from _child import write_result
from IPython.core.pylabtools import print_figure

import rlx_nb
from rlx_nb.models import demo

TARGET_S = 1.0
REPEATS = 3


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _by_hand(report, backend: str, output: str) -> float:
    # The anchor: the two figures an interaction shows, drawn and encoded to PNG by hand.
    def draw():
        for ax in (report.plot.heatmap(backend, output), report.plot.histogram(output, highlight=backend)):
            print_figure(ax.figure, "png")
            plt.close(ax.figure)

    return min(_timed(draw) for _ in range(2))


class Wide(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.side = int(n**0.5)
        self.scale = torch.nn.Parameter(torch.ones(self.side))

    def forward(self, x):
        return torch.softmax(x * self.scale, dim=-1)


def _interactions(report, other_backend: str) -> dict[str, float]:
    times = {}
    t0 = time.perf_counter()
    ex = rlx_nb.explore(report, interactive=False)
    times["open"] = time.perf_counter() - t0
    times["backend"] = _timed(lambda: setattr(ex.backend_picker, "value", other_backend))
    outputs = [v for _, v in ex.output_picker.options if v != ex.output_picker.value]
    if outputs:  # the next output down the list (worst first)
        times["output"] = _timed(lambda: setattr(ex.output_picker, "value", outputs[0]))
    for _, metric in ex.metric_toggle.options:
        if metric != ex.metric_toggle.value:
            times[f"metric {metric}"] = _timed(lambda m=metric: setattr(ex.metric_toggle, "value", m))
    options = ex.element_picker.options
    if len(options) > 3:
        times["element from the list"] = _timed(lambda: setattr(ex.element_picker, "value", options[3][1]))
    index = ", ".join("0" for _ in ex.selected_index or (0,))
    times["typed index"] = _timed(lambda: setattr(ex.index_box, "value", index))
    return times


def small_report():
    """The demo transformer block, forward and backward, a softmax fault and a legitimate backend."""
    model, inputs = demo.transformer()
    return rlx_nb.backend_divergence(
        model, inputs, backends=["cpu-nomkldnn", "fault:softmax-row"], backward=True, progress=False
    )


def measure(report, other: str, repeat: int = REPEATS) -> dict:
    """Each interaction's best of ``repeat`` (a new explorer each time) and the by-hand anchor's best of 2."""
    anchor = _by_hand(report, report.worst[0], report.record(report.worst[0]).output)
    runs = [_interactions(report, other) for _ in range(repeat)]
    steps = {step: min(r[step] for r in runs) for step in runs[0]}
    return {"anchor_s": anchor, "steps": steps, "slowest_s": max(steps.values()), "ratio": max(steps.values()) / anchor}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", default="4e6")
    args = parser.parse_args()
    n = int(float(args.elements))
    rows, figures = [], []
    small = small_report()
    # Warm-up: matplotlib's fonts and the first figure, as in a session that has drawn one plot.
    _interactions(small, "cpu-nomkldnn")
    cases = [("demo transformer, forward + backward", small, "cpu-nomkldnn")]
    wide = Wide(n)
    x = torch.randn(wide.side, wide.side)
    big = rlx_nb.backend_divergence(
        wide, x, backends=["cpu-nomkldnn", "fault:softmax-row"], backward=True, progress=False
    )
    cases.append((f"softmax over {wide.side}x{wide.side} = {wide.side**2:.2g} elements", big, "cpu-nomkldnn"))
    worst = 0.0
    for name, report, other in cases:
        found = measure(report, other)
        figures.append({"report": name, **found})
        for step, took in found["steps"].items():
            worst = max(worst, took)
            rows.append(f"| {name} | {step} | {took:.3f} | {found['anchor_s']:.3f} | {took / found['anchor_s']:.2f}x |")
            print(rows[-1], flush=True)
    lines = [
        "# Explorer interactions, in the kernel",
        "",
        f"`python bench/explorer_speed.py`: one run; each interaction as the explorer does it (heatmap and "
        f"histogram redrawn to PNG, tables rebuilt), best of {REPEATS}, against drawing the same two figures to PNG "
        "by hand with `report.plot` in the same run (best of 2). Target: under 1 s each.",
        "",
        "| report | interaction | seconds | by hand (s) | ratio |",
        "|---|---|---|---|---|",
        *rows,
        "",
        f"Slowest interaction: {worst:.3f} s ({'within' if worst < TARGET_S else 'over'} the {TARGET_S:g} s target).",
    ]
    write_result("explorer_speed.md", lines, figures)


if __name__ == "__main__":
    main()
