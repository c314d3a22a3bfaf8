"""TrainingReport: what :func:`rlx_nb.training_divergence` found, per step and per backend, in frames, lines and figures."""

from __future__ import annotations

import html
import math
from pathlib import Path
from typing import Any

import pandas as pd

from rlx_nb.comparison.tables import Table
from rlx_nb.errors import InputError, did_you_mean, writing
from rlx_nb.training.trajectory import LIMIT
from rlx_nb.verdict.types import SUSPECT

STEP_COLUMNS = ["step", "backend", "loss", "oracle_loss", "loss_diff", "loss_envelope", "grad_norm", "grad_norm_diff",
                "grad_norm_envelope", "param_distance", "param_envelope", "line", "set_by"]  # fmt: skip
LOCAL_COLUMNS = ["backend", "step", "verdict", "line", "phase", "output", "reason"]


class TrainingReport:
    """Each backend's training against the oracle's: its trajectory per step (:attr:`steps`) and its local steps
    (:attr:`local`), each on the verdict's one scale (1.0 is the line).

    A backend is SUSPECT when a local step is past the line: its step computes something else than a correct step
    does, from the same state.  Its trajectory leaving the envelope alone is drift (a bug's or chaos's): where its local
    steps are round-off, the drift is chaos.
    """

    def __init__(self, label: str, spec: Any, backends: list[str], environment: dict) -> None:
        self.label, self.spec, self.backends, self.environment = label, spec, backends, environment
        self._steps: list[dict] = []
        self._local: list[dict] = []
        self.oracle_losses: list[float] = []
        self.leaving: dict[str, int] = {}
        """The first step at which each backend's trajectory left its envelope."""
        self.kept: dict[tuple[str, int], tuple[Any, Any, Any]] = {}
        """(backend, step) -> (the local step's report, the state it started from, its batch), for steps past the line."""
        self.failed: dict[str, str] = {}
        self.incomplete = ""
        self.seconds = math.nan
        self.local_seconds = 0.0
        """Of :attr:`seconds`, those the local steps took (their states kept, their runs, the bisection)."""

    # -- filled as the call runs -------------------------------------------------------------------------------------

    def add_step(self, step: int, backend: str, *, got: tuple, ref: tuple, diffs: dict, env: Any, place: float,
                 which: str) -> None:  # fmt: skip
        self._steps.append({
            "step": step, "backend": backend, "loss": got[0], "oracle_loss": ref[0], "loss_diff": diffs["loss"],
            "loss_envelope": env.loss, "grad_norm": got[1], "grad_norm_diff": diffs["grad_norm"],
            "grad_norm_envelope": env.grad_norm, "param_distance": diffs["param_distance"],
            "param_envelope": env.param_distance, "line": place, "set_by": which,
        })  # fmt: skip

    def add_local(self, backend: str, step: int, reading: dict) -> None:
        self._local.append({"backend": backend, "step": step, **reading})

    # -- frames --------------------------------------------------------------------------------------------------

    @property
    def steps(self) -> pd.DataFrame:
        """One row per (step, backend): the loss, gradient norm and parameters' distance against the oracle's, the
        envelope's (the largest round-off difference so far), and the trajectory's place on the line."""
        return Table(self._steps, columns=STEP_COLUMNS)

    @property
    def local(self) -> pd.DataFrame:
        """One row per local step judged: its verdict, place on the line, the phase its error is born in (forward,
        buffers, backward, optimizer) and the output that says so."""
        order = {b: i for i, b in enumerate(self.backends)}
        rows = sorted(self._local, key=lambda r: (order.get(r["backend"], len(order)), r["step"]))
        return Table(rows, columns=LOCAL_COLUMNS)

    @property
    def suspects(self) -> list[str]:
        """The backends with a local step past the line."""
        return [b for b in self.backends if any(r["backend"] == b and r["verdict"] == SUSPECT for r in self._local)]

    def first_suspect_step(self, backend: str) -> int | None:
        steps = [r["step"] for r in self._local if r["backend"] == backend and r["verdict"] == SUSPECT]
        return min(steps) if steps else None

    def verdict(self, backend: str) -> str:
        """``SUSPECT`` (a local step past the line), ``error``, or ``round-off``."""
        if backend in self.failed:
            return "error"
        return SUSPECT if backend in self.suspects else "round-off"

    # -- words -----------------------------------------------------------------------------------------------------

    def lines(self) -> list[str]:
        """One line per backend (what ``print`` shows, and a CI log)."""
        n = len(self.oracle_losses)
        out = []
        for b in self.backends:
            head = f"[{self.label}] {b} vs cpu over {n} step(s):"
            if b in self.failed:
                out.append(f"{head} ERROR — {self.failed[b]}")
                continue
            mine = [r for r in self._local if r["backend"] == b]
            worst_local = max(mine, key=lambda r: (r["verdict"] == SUSPECT, _n(r["line"]))) if mine else None
            traj = [r for r in self._steps if r["backend"] == b]
            worst = max(traj, key=lambda r: _n(r["line"])) if traj else None
            drift = ("trajectory within chaos" if worst is None or worst["line"] <= 1 else
                     f"trajectory leaves the envelope at step {self.leaving[b]} ({worst['line']:.3g}x the line at step "
                     f"{worst['step']}, by its {worst['set_by'].replace('_', ' ')})")  # fmt: skip
            if worst_local is not None and worst_local["verdict"] == SUSPECT:
                s = self.first_suspect_step(b)
                first = next(r for r in mine if r["step"] == s and r["verdict"] == SUSPECT)
                out.append(f"{head} SUSPECT — local step {s} is {first['line']:.3g}x the line, born in the "
                           f"{first['phase']} ({first['output']}): {first['reason']}; {drift}")  # fmt: skip
            else:
                best = f"{len(mine)} local step(s) within round-off (worst {_n(worst_local['line']):.2g} of the line)" if (
                    worst_local) else "no local step judged"  # fmt: skip
                if worst is not None and worst["line"] > 1:
                    out.append(f"{head} round-off: chaos — the {drift}, but {best}")
                else:
                    out.append(f"{head} round-off — {best}; {drift}")
        if self.incomplete:
            out.append(f"[{self.label}] INCOMPLETE: {self.incomplete}")
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def __repr__(self) -> str:
        return f"<TrainingReport {self.label!r}: {len(self.oracle_losses)} steps, suspects={self.suspects}>"

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{html.escape(b)}</td><td style='color:{'#b00020' if self.verdict(b) == SUSPECT else '#1b5e20'}'>"
            f"<b>{html.escape(self.verdict(b))}</b></td><td style='text-align:left'>{html.escape(line)}</td></tr>"
            for b, line in zip(self.backends, self.lines(), strict=False)
        )
        return f"<table><tr><th>backend</th><th>verdict</th><th>why</th></tr>{rows}</table>"

    # -- down to the op ------------------------------------------------------------------------------------------

    def local_report(self, backend: str, step: int | None = None):
        """The local step's :class:`~rlx_nb.DivergenceReport` (its outputs the loss, buffers, gradients and updated
        parameters): what ``rlx_nb.explore`` shows, down to the element.  ``step=None``: the first past the line."""
        backend, step = self._picked(backend, step)
        return self.kept[(backend, step)][0]

    def _picked(self, backend: str | None, step: int | None) -> tuple[str, int]:
        backend = backend or (self.suspects[0] if self.suspects else None)
        if backend not in self.backends:
            raise InputError(f"no backend {backend!r} in this training report{did_you_mean(backend, self.backends)}; "
                             f"it has: {', '.join(self.backends)}")  # fmt: skip
        step = self.first_suspect_step(backend) if step is None else step
        if (backend, step) not in self.kept:
            kept = ", ".join(f"{b} at step {s}" for b, s in self.kept) or "none"
            raise InputError(f"no kept local step for {backend} at step {step}: a report keeps the local steps past "
                             f"the line (keep=); kept: {kept}")  # fmt: skip
        return backend, step

    def localize(self, backend: str | None = None, step: int | None = None):
        """Where a local step's error is born: its phase, then -- forward or backward through a backend of the
        registry -- the module and op (:func:`rlx_nb.localize` of the step's loss, from the step's state), or -- the
        optimizer's update -- the parameters whose update is past the line.  Returns a
        :class:`~rlx_nb.training.culprit.StepCulprit`."""
        from rlx_nb.training.culprit import step_culprit

        backend, step = self._picked(backend, step)
        report, state, batch = self.kept[(backend, step)]
        return step_culprit(self, backend, step, local=report, state=state.resolved(), batch=batch)

    # -- figures and the page --------------------------------------------------------------------------------------

    def plot(self, backend: str | None = None, *, fig=None):
        """The loss curves with the envelope as a band, and each backend's distance from the oracle per step (log
        scale) against the line (:data:`~rlx_nb.training.trajectory.LIMIT` envelopes), its local steps marked."""
        from rlx_nb.plot.training import plot_training

        names = [backend] if backend else self.backends
        return plot_training(self.steps, self.local, names, oracle=self.oracle_losses, limit=LIMIT, fig=fig,
                             title=f"{self.label}: training against the oracle")  # fmt: skip

    def to_html(self, path: str | Path) -> Path:
        """One self-contained HTML page: the lines, the figure, the local steps and the trajectory's frame."""
        from rlx_nb.report.html import STYLE, environment_html, png_uri

        path = Path(path)
        if path.suffix.lower() not in (".html", ".htm"):
            path = path.with_name(path.name + ".html")
        fig = self.plot().figure
        image = png_uri(fig)
        import matplotlib.pyplot as plt

        plt.close(fig)
        e = html.escape
        page = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{e(self.label)}: training</title>"
                f"<style>{STYLE}</style></head><body><h1>{e(self.label)}: training against the oracle</h1>"
                f"<pre>{e(str(self))}</pre><img alt='training' src='{image}' style='max-width:100%'>"
                f"<h2>Local steps</h2><div class='wide'>{self.local.to_html(index=False)}</div>"
                f"<h2>Per step</h2><div class='wide'>{self.steps.to_html(index=False, max_rows=400)}</div>"
                f"<h2>Environment</h2>{environment_html(self.environment)}</body></html>")  # fmt: skip
        with writing(path, "the training report"):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(page, encoding="utf-8", errors="replace")
        return path


def _n(x: Any) -> float:
    return x if isinstance(x, float) and x == x else -1.0


__all__ = ["LOCAL_COLUMNS", "STEP_COLUMNS", "TrainingReport"]
