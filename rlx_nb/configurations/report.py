"""InvarianceReport: per backend, configuration, row and output, bit for bit or not, and where not, its place on the
line and the first op that parts; a certificate of the ops seen invariant; a map, lines and a page."""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from rlx_nb.comparison.tables import Table
from rlx_nb.errors import InputError, did_you_mean, writing
from rlx_nb.verdict.types import SUSPECT

COLUMNS = ["backend", "config", "kind", "row", "output", "bitwise", "max_abs_diff", "line", "verdict", "reason"]
BITWISE, ROUNDOFF = "bit for bit", "round-off"


class InvarianceReport:
    """What :func:`rlx_nb.invariance` found.  A pair (a backend, a configuration) is ``bit for bit`` when every row's
    every output is the row alone's, ``round-off`` when some differ within the line (a legitimate kernel choice),
    ``SUSPECT`` when some differ past it (a real bug: a mask that leaks, a cache that holds the wrong positions)."""

    def __init__(self, label: str, backends: list[str], kinds: list[str], environment: dict) -> None:
        self.label, self.backends, self.kinds, self.environment = label, backends, kinds, environment
        self._rows: list[dict] = []
        self.pairs: dict[tuple[str, str], str] = {}
        self.ops: dict[tuple[str, str], Any] = {}
        self._arrays: dict[tuple[str, str, int, str], tuple] = {}
        self.failed: dict[str, str] = {}
        self.incomplete = ""
        self.seconds = math.nan

    # -- filled as the call runs ---------------------------------------------------------------------------------

    def add_pair(self, backend: str, config: Any, judged: dict[str, tuple]) -> None:
        worst = self.pairs.get((backend, config.name), BITWISE)
        for output, (same, diff, record, arrays) in judged.items():
            verdict = BITWISE if same else (record.verdict if record is not None else "unjudged")
            line = 0.0 if same else (record.judgement.line if record is not None else math.nan)
            reason = "" if same else (record.reason if record is not None else "no float64 value of this output")
            self._rows.append({"backend": backend, "config": config.name, "kind": config.kind, "row": config.row,
                               "output": output, "bitwise": same, "max_abs_diff": diff, "line": line,
                               "verdict": verdict, "reason": reason})  # fmt: skip
            if arrays is not None:
                self._arrays[(backend, config.name, config.row, output)] = arrays
            worst = _worse(worst, verdict)
        self.pairs[(backend, config.name)] = worst

    def has_op(self, backend: str, config: str) -> bool:
        return (backend, config) in self.ops

    def add_op(self, backend: str, config: Any, parting: Any) -> None:
        self.ops[(backend, config.name)] = parting

    # -- frames and words -------------------------------------------------------------------------------------------

    @property
    def frame(self) -> pd.DataFrame:
        """One row per backend, configuration, row and output."""
        return Table(self._rows, columns=COLUMNS)

    @property
    def summary(self) -> pd.DataFrame:
        """One row per backend and configuration: its verdict, worst line, and the first op that parts."""
        rows = []
        for (backend, config), verdict in self.pairs.items():
            mine = [r for r in self._rows if r["backend"] == backend and r["config"] == config]
            lines = [r["line"] for r in mine if r["line"] == r["line"]]
            op = self.ops.get((backend, config))
            rows.append({"backend": backend, "config": config, "verdict": verdict, "line": max(lines, default=0.0),
                         "first_op": op.op if op is not None else None,
                         "op_shapes": op.shapes if op is not None else "",
                         "kernel_path": op.kernels if op is not None else "",
                         "moved_at": (op.moved or op.unaligned) if op is not None and verdict == SUSPECT else None,
                         })  # fmt: skip
        return Table(rows, columns=["backend", "config", "verdict", "line", "first_op", "op_shapes", "kernel_path",
                                    "moved_at"])  # fmt: skip

    def verdict(self, backend: str | None = None) -> str:
        """The worst over every configuration (of ``backend``; default: every backend)."""
        worst = BITWISE
        for (b, _), v in self.pairs.items():
            if backend is None or b == backend:
                worst = _worse(worst, v)
        return worst

    @property
    def suspects(self) -> list[str]:
        return [b for b in self.backends if self.verdict(b) == SUSPECT]

    def lines(self) -> list[str]:
        out = []
        for b in self.backends:
            mine = {c: v for (bb, c), v in self.pairs.items() if bb == b}
            if not mine:
                continue
            parted = [c for c, v in mine.items() if v != BITWISE]
            verdict = self.verdict(b)
            if not parted:
                out.append(f"[{self.label}] {b}: bit for bit invariant over {len(mine)} configuration(s)")
                continue
            worst = max(parted, key=lambda c: _rank(mine[c]))
            op = self.ops.get((b, worst))
            at = f"; first op that parts: {op.op} {op.shapes}".rstrip() if op is not None and op.op else ""
            if at and op.kernels:
                at += f" (kernel path: {op.kernels})"
            if not at and op is not None and op.note:
                at = f"; {op.note}"
            if op is not None and op.moved and verdict == SUSPECT:  # (where the bug is: the op that moves the row)
                at = (f"; the row is moved at {op.moved} (its output {op.jump:.2g}x further from the row alone's than "
                      f"its inputs)" + at)  # fmt: skip
            elif op is not None and op.unaligned and verdict == SUSPECT:  # (or reads other positions than the row's)
                at = (f"; the row's positions part at {op.unaligned} (its output {op.unaligned_shapes}: not the "
                      "positions the row alone computes)" + at)  # fmt: skip
            line = max((r["line"] for r in self._rows if r["backend"] == b and r["config"] == worst
                        and r["line"] == r["line"]), default=math.nan)  # fmt: skip
            said = "past the line: a bug" if verdict == SUSPECT else "within round-off: a legitimate kernel choice"
            out.append(f"[{self.label}] {b}: {verdict} — {len(parted)} of {len(mine)} configuration(s) not bit for bit "
                       f"({', '.join(parted[:4])}{' ...' if len(parted) > 4 else ''}), {said}; worst {worst} at "
                       f"{line:.3g}x the line{at}")  # fmt: skip
        if self.incomplete:
            out.append(f"[{self.label}] INCOMPLETE: {self.incomplete}")
        for what, why in self.failed.items():
            out.append(f"[{self.label}] {what}: error — {why}")
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def __repr__(self) -> str:
        return f"<InvarianceReport {self.label!r}: {self.verdict()}, {len(self.pairs)} configuration(s)>"

    def _repr_html_(self) -> str:
        return self.summary.to_html(index=False)

    # -- the certificate --------------------------------------------------------------------------------------------

    @property
    def certificate(self) -> dict[str, Any]:
        """Per backend and configuration: bit for bit or not, and (where ops were recorded) the ops seen invariant for
        the shapes tried and those not.  Data only (JSON): saved with :meth:`save_certificate`, compared across
        environments with :func:`certificate_changes`."""
        out: dict[str, Any] = {"label": self.label, "torch": self.environment.get("torch"), "pairs": {}}
        for (b, c), v in self.pairs.items():
            op = self.ops.get((b, c))
            out["pairs"][f"{b} | {c}"] = {"verdict": v, "first_op": op.op if op is not None else None,
                                          "moved_at": op.moved if op is not None else None,
                                          "kernel_path": op.kernels if op is not None else "",
                                          "invariant_ops": op.invariant if op is not None else [],
                                          "varying_ops": op.varying if op is not None else []}  # fmt: skip
        return out

    def save_certificate(self, path: str | Path) -> Path:
        path = Path(path)
        with writing(path, "the invariance certificate"):
            path.write_text(json.dumps(self.certificate, indent=1, sort_keys=True), encoding="utf-8")
        return path

    # -- down to the element ---------------------------------------------------------------------------------------

    def report(self, backend: str | None = None, config: str | None = None, row: int | None = None):
        """A pair as a :class:`~rlx_nb.DivergenceReport` (the row alone as the oracle, the row in ``config`` as the
        backend, float64 of the row alone as the reference): what ``rlx_nb.explore`` opens, down to the element.
        Default: the worst pair not bit for bit."""
        from rlx_nb.backends.base import ORACLE, REFERENCE
        from rlx_nb.comparison.compare import compare
        from rlx_nb.execution.results import OK, BackendRun, RunResults, to_leaf
        from rlx_nb.report.report import DivergenceReport

        kept = [k for k in self._arrays if (backend is None or k[0] == backend) and (config is None or k[1] == config)
                and (row is None or k[2] == row) and self._arrays[k][2] is not None]  # fmt: skip
        if not kept:
            known = sorted({c for (_, c) in self.pairs})
            raise InputError(f"no pair not bit for bit with a float64 value for backend={backend!r}, config={config!r}"
                             f"{did_you_mean(config, known) if config else ''}; the configurations: "
                             f"{', '.join(known)}")  # fmt: skip
        b, c, r, _ = max(kept, key=lambda k: _line_of(self._rows, k))
        mine = {k[3]: self._arrays[k] for k in kept if k[:3] == (b, c, r)}
        name = f"{b} · {c}"
        results = RunResults(
            label=f"{self.label} row {r}: alone against {c}",
            oracle=BackendRun(ORACLE, OK, {k: to_leaf(a, copy=True) for k, (a, _, _) in mine.items()}),
            reference=BackendRun(
                REFERENCE, OK, {k: to_leaf(x, copy=True) for k, (_, _, x) in mine.items()}, compute_dtype="float64"
            ),
            candidates={name: BackendRun(name, OK, {k: to_leaf(y, copy=True) for k, (_, y, _) in mine.items()})},
            backward=False,
            environment={"invariance": f"row {r}: alone against {c}", "backend": b},
        )
        return DivergenceReport(results, compare(results, progress=False), rule="budget", tol_rel=None)

    def tree(self, backend: str | None = None, config: str | None = None) -> str:
        """The ops of a pair on the module tree (the worst pair whose ops were recorded, by default): each marked
        bit for bit (``=``) or not (``~``), the first that parts marked ``<<``."""
        from rlx_nb.configurations.ops import tree

        key = self._tree_key(backend, config)
        if key is None:
            raise InputError(f"no pair of {backend or 'any backend'} and {config or 'any configuration'} has its ops "
                             f"recorded; recorded: {[f'{b} | {c}' for b, c in self.ops] or 'none'}")  # fmt: skip
        return f"{key[0]} | {key[1]}\n" + tree(self.ops[key])

    def _tree_key(self, backend: str | None = None, config: str | None = None) -> tuple[str, str] | None:
        # The worst pair (of ``backend`` and ``config`` where given) whose ops were recorded.
        pairs = [k for k, op in self.ops.items() if op is not None and op.order and backend in (None, k[0])
                 and config in (None, k[1])]  # fmt: skip

        def worst(k: tuple[str, str]) -> tuple[int, float]:
            lines = [r["line"] for r in self._rows if (r["backend"], r["config"]) == k and r["line"] == r["line"]]
            return _rank(self.pairs.get(k, BITWISE)), max(lines, default=0.0)

        return max(pairs, key=worst) if pairs else None

    # -- pictures and the page -------------------------------------------------------------------------------------

    def plot(self, backend: str | None = None, *, ax=None):
        """A map of rows x configurations: bit for bit, within round-off, past the line."""
        from rlx_nb.plot.invariance import plot_invariance

        return plot_invariance(self.frame, backend or self.backends[0], ax=ax, title=f"{self.label}: invariance")

    def to_html(self, path: str | Path) -> Path:
        from rlx_nb.report.html import STYLE, environment_html, png_uri

        path = Path(path)
        if path.suffix.lower() not in (".html", ".htm"):
            path = path.with_name(path.name + ".html")
        ax = self.plot()
        image = png_uri(ax.figure)
        import matplotlib.pyplot as plt

        plt.close(ax.figure)
        e = html.escape
        page = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{e(self.label)}: invariance</title>"
                f"<style>{STYLE}</style></head><body><h1>{e(self.label)}: the same rows, other configurations</h1>"
                f"<pre>{e(str(self))}</pre><img alt='invariance' src='{image}' style='max-width:100%'>"
                f"<h2>Per configuration</h2><div class='wide'>{self.summary.to_html(index=False)}</div>"
                + (f"<h2>The first op that parts, on the module tree</h2><details><summary>{e(' | '.join(self._tree_key()))}"
                   f"</summary><pre>{e(self.tree())}</pre></details>" if self._tree_key() else "") +
                f"<h2>Per output</h2><div class='wide'>{self.frame.to_html(index=False, max_rows=400)}</div>"
                f"<h2>Environment</h2>{environment_html(self.environment)}</body></html>")  # fmt: skip
        with writing(path, "the invariance report"):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(page, encoding="utf-8", errors="replace")
        return path


def certificate_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs between two certificates (two environments, two torch versions): each pair whose verdict or
    first op changed, and the ops invariant in one and not in the other."""
    out = []
    a, b = old.get("pairs", {}), new.get("pairs", {})
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        if x is None or y is None:
            out.append(f"{key}: only in the {'new' if x is None else 'old'} certificate")
            continue
        if x["verdict"] != y["verdict"] or x["first_op"] != y["first_op"]:
            out.append(f"{key}: {x['verdict']} ({x['first_op']}) -> {y['verdict']} ({y['first_op']})")
        lost = sorted(set(x["invariant_ops"]) & set(y["varying_ops"]))
        if lost:
            out.append(f"{key}: no longer invariant: {', '.join(lost)}")
    return out


def _rank(verdict: str) -> int:
    return {BITWISE: 0, ROUNDOFF: 1, "unjudged": 2, SUSPECT: 3}.get(verdict, 2)


def _worse(a: str, b: str) -> str:
    return a if _rank(a) >= _rank(b) else b


def _line_of(rows: list[dict], key: tuple) -> float:
    got = [r["line"] for r in rows if (r["backend"], r["config"], r["row"], r["output"]) == key]
    return float(np.nan_to_num(max(got, default=0.0)))


__all__ = ["BITWISE", "COLUMNS", "ROUNDOFF", "InvarianceReport", "certificate_changes"]
