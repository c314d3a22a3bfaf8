"""The pictures and the page of a :class:`rlx_nb.generation.divergence.GenerationReport`."""

from __future__ import annotations

from typing import Any

from rlx_nb._support.safe import plot_text
from rlx_nb.plot.style import PALETTE, SUSPECT_COLOUR, new_axes
from rlx_nb.verdict.types import DISAGREEMENT, NEAR_TIE, SUSPECT


def plot_steps(report: Any, ax: Any = None) -> Any:
    """Each backend's worst logits error per step (over the batch), on the SUSPECT-line scale (log), the
    SUSPECT line at 1, every flip marked: a hollow circle for a near-tie, a cross for a real disagreement."""
    ax = new_axes(ax, figsize=(8.0, 4.2), margins={"left": 0.09, "right": 0.72, "bottom": 0.13, "top": 0.9})
    table = report.steps
    verdicts = report.verdicts()
    colour = 0
    labelled: set[str] = set()
    for name in report.backend_names:
        mine = table[table.backend == name]
        per_step = mine.groupby("step").line.max()
        per_step = per_step[per_step == per_step]
        if per_step.empty:  # (a backend that did not run: in the legend, never dropped without a word)
            ax.plot([], [], color="0.6", ls=":", label=plot_text(f"{name} ({verdicts[name]}: no steps to plot)"))
            continue
        if verdicts[name] == SUSPECT:
            c = SUSPECT_COLOUR
        else:
            c, colour = PALETTE[colour % len(PALETTE)], colour + 1
        y = per_step.clip(lower=1e-3)
        ax.plot(per_step.index, y, color=c, marker=".", lw=1.4, label=plot_text(f"{name} ({verdicts[name]})"))
        for kind, marker, face in ((NEAR_TIE, "o", "none"), (DISAGREEMENT, "X", SUSPECT_COLOUR)):
            flips = mine[mine.flip_kind == kind].step.unique()
            if len(flips):
                label = None if kind in labelled else f"token flip: {kind}"
                labelled.add(kind)
                ax.scatter(flips, y.reindex(flips).fillna(1e-3), s=90, marker=marker, facecolors=face,
                           edgecolors=c if kind == NEAR_TIE else SUSPECT_COLOUR, linewidths=1.5, zorder=3,
                           label=label)  # fmt: skip
    ax.axhline(1.0, color="black", ls="--", lw=1.2, label="SUSPECT line")
    ax.set_yscale("log")
    ax.set_xlabel("decode step (0: the prompt's logits)")
    ax.set_ylabel("logits error (x of the SUSPECT line)")
    ax.set_title(plot_text(f"{report.label}: where generation parts ({report.n_steps} steps, teacher-forced)"),
                 fontsize=10)  # fmt: skip
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.grid(True, which="major", alpha=0.3)
    return ax
