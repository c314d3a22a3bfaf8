"""Localization: the result of a search -- the checks as a frame, the culprit, arrays, plots and the repro."""

from __future__ import annotations

import dataclasses
import html
from pathlib import Path
from typing import Any

import numpy as np

from rlx_nb.comparison.compare import compare
from rlx_nb.comparison.tables import localization_frame
from rlx_nb.errors import InputError, still_interrupted
from rlx_nb.localization.search import KEEP_ARRAYS_BYTES
from rlx_nb.verdict.records import OutputRecord
from rlx_nb.verdict.types import SUSPECT, VERDICT_ERROR


@dataclasses.dataclass(frozen=True)
class Found:
    """What a search found (:mod:`rlx_nb.localization.search`): the check rows, the culprit, the checks' runs."""

    rows: list[dict]
    culprit_module: str | None
    culprit_op: str | None
    preparations: int
    culprit: Any = None
    """The culprit alone (:class:`rlx_nb.localization.culprit.Culprit`), what a repro reproduces; None if none."""
    checks: dict[str, tuple[Any, str | None]] = dataclasses.field(default_factory=dict)
    """Each checked name's runs (None where they were not kept: a large module within round-off) and output."""
    full_run: str = ""
    """Why the search watched full runs instead of modules alone ("" when it did not)."""
    everywhere: bool = False
    """Every module checked is beyond round-off on its own: no one module is the culprit."""
    source: Any = None
    """The model, inputs and params searched, held weakly (:class:`rlx_nb.execution.source.WeakSource`), for the graph."""
    no_repro: str = ""
    """Why a culprit found has no standalone repro ("" where it has one, or where none was found)."""


class Localization:
    """Where along the model a backend's error is born.

    Attributes
    ----------
    frame : pandas.DataFrame
        One row per module (then op) checked, in execution order.
    culprit : str or None
        ``"<module>"`` or ``"<module> :: <op>"`` of the first place whose own error is beyond
        round-off; None when everything checked is within it.
    culprit_module, culprit_op : str or None
    preparations : int
        How many times the backend prepared (ran, compiled or exported) a module or op.
    """

    def __init__(self, backend: str, backward: bool, found: Found) -> None:
        self.backend = backend
        self.backward = backward
        self.frame = localization_frame(found.rows)
        self.culprit_module = found.culprit_module
        self.culprit_op = found.culprit_op
        self.preparations = found.preparations
        self._culprit = found.culprit
        self._checks = dict(found.checks)
        self._records: dict[str, OutputRecord] = {}
        self.full_run = found.full_run
        self.everywhere = found.everywhere
        self._source = found.source
        self._no_repro = found.no_repro
        self.attribution = ""
        self.report: Any = None
        """A weak reference to the report it localizes (``report.localize``), which keeps its repro too."""
        """Where in the backend the error is born (its compiler pass, its runtime's layer), once :meth:`repro` ran."""

    @property
    def checked(self) -> list[str]:
        """The names (modules, ops) whose check ran, in the frame's order; :meth:`arrays` reads their outputs."""
        return [n for n in self.frame["name"] if n in self._checks]

    def arrays(self, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """``(oracle, backend, fp64)`` of the worst output of one checked module or op, run alone."""
        if name not in self._checks:
            raise InputError(f"{name!r} was not checked; checked: {', '.join(self._checks)}")
        results, output = self._checks[name]
        if results is None:
            raise InputError(
                f"the arrays of {name!r} were not kept: it was within round-off and its outputs take "
                f"{output / 1e6:.0f} MB (above keep_arrays='auto''s {KEEP_ARRAYS_BYTES / 1e6:.0f} MB); "
                "run localize(..., keep_arrays='all') to keep every checked module's arrays"
            )
        run = results.candidates[self.backend]
        if output is None or output not in run.outputs:
            raise InputError(f"{name!r} produced no comparable output on {self.backend}")
        ref = results.reference.outputs.get(output)
        return (results.oracle.outputs[output].value, run.outputs[output].value, ref.value if ref is not None else None)

    def plot_heatmap(self, name: str, **kwargs: Any):
        """The error heatmap of one checked module's (or op's) worst output, run alone on the backend."""
        return self.heatmap_picture(name, **kwargs).ax

    def heatmap_picture(self, name: str, **kwargs: Any):
        """:meth:`plot_heatmap`, returning the :class:`~rlx_nb.plot.charts.Heatmap` it drew: on the report heatmap's
        scale and colours (x of the SUSPECT line, where the fp64 reference ran), its worst element marked."""
        from rlx_nb.plot.accessor import record_heatmap

        o, b, r = self.arrays(name)
        kwargs.setdefault("title", f"{self.backend} · {name} (alone)")
        return record_heatmap(self._record(name), o, b, r, **kwargs)

    def _record(self, name: str) -> OutputRecord:
        # The judged record of a check's worst output, compared once.
        if name not in self._records:
            results, output = self._checks[name]
            self._records[name] = next(r for r in compare(results, progress=False) if r.output == output)
        return self._records[name]

    @property
    def errors(self):
        """The checks that failed to run (verdict ``error``), with why; not judged."""
        return self.frame[self.frame.verdict == VERDICT_ERROR].reset_index(drop=True)

    @property
    def suspects(self) -> list[str]:
        """Every module and op found beyond round-off, in execution order (modules first).

        :attr:`culprit` is the first suspect module, in execution order, none of whose children is
        suspect -- where the error is born first; later suspects may be separate bugs, or its error
        propagated (``propagated_line`` against ``local_line`` tells).
        """
        return self.frame[self.frame.verdict == SUSPECT].name.tolist()

    @property
    def finding(self) -> str:
        """What the search found, in one sentence."""
        if self.everywhere:
            n = int((self.frame.kind == "module").sum())
            return (
                f"every one of the {n} modules checked is beyond round-off on its own: {self.backend} perturbs every "
                "module it runs alone, so no one module is the culprit — look at what they all share (a precision "
                "setting, a kernel every layer calls)"
            )
        if self.culprit is None:
            return "every module within round-off"
        return f"the error is born in {self.culprit}" + (f". {self.attribution}" if self.attribution else "")

    @property
    def culprit(self) -> str | None:
        if self.culprit_module is None:
            return None
        label = self.culprit_module or "<root>"
        return f"{label} :: {self.culprit_op}" if self.culprit_op else label

    def __repr__(self) -> str:
        what = "backward" if self.backward else "forward"
        return (
            f"<Localization {self.backend} ({what}): culprit={self.culprit!r}{', everywhere' if self.everywhere else ''}, "
            f"{len(self.frame)} checks, {self.preparations} preparations>"
        )

    def _repr_html_(self) -> str:
        head = (
            f"<p><b>{html.escape(self.backend)}</b> ({'backward' if self.backward else 'forward'}): "
            f"<b>{html.escape(self.finding)}</b>; {self.preparations} backend preparations.</p>"
        )
        return head + self.frame.to_html(index=False, escape=True, float_format=lambda v: f"{v:.3g}")

    def plot(self, *, ax=None):
        """Local vs propagated error along the model's depth (see :func:`rlx_nb.plot.charts.plot_localization`)."""
        from rlx_nb.plot.charts import plot_localization

        return plot_localization(self.frame, ax=ax, title=f"{self.backend}: where the error is born",
                                 culprit=self.culprit)  # fmt: skip

    def to_model_explorer(self, path: str | Path, *, model: Any = None, inputs: Any = None, params: Any = None) -> Path:
        """Write this localization as node data for Google's Model Explorer (``ai-edge-model-explorer``): each op
        of the model's ``torch.export`` graph valued at its module's (or op's) place on the SUSPECT line, red past
        it, blue below.  ``model`` and ``inputs`` default to the ones searched (held weakly).  Returns the path
        (``.json`` appended when it has no suffix); :meth:`show_model_explorer` opens both."""
        from rlx_nb.localization import graph

        program, strip = self._exported(model, inputs, params)
        return graph.write(graph.node_data(program, self.frame, strip=strip), path)

    def show_model_explorer(self, *, model: Any = None, inputs: Any = None, params: Any = None, **kwargs: Any) -> Path:
        """Open the model's graph in Model Explorer with this localization's error on its nodes (needs the
        ``graph`` extra: ``pip install 'rlx_nb[graph]'``); ``kwargs`` go to ``model_explorer.visualize_from_config``
        (``port=``, ``no_open_in_browser=``...).  Returns the node-data file."""
        try:
            import model_explorer
        except ImportError:
            raise InputError(
                "Model Explorer is not installed: pip install 'rlx_nb[graph]' (ai-edge-model-explorer)"
            ) from None
        import tempfile

        from rlx_nb.localization import graph

        program, strip = self._exported(model, inputs, params)
        path = graph.write(graph.node_data(program, self.frame, strip=strip), Path(tempfile.mkdtemp()) / "rlx_nb.json")
        config = (
            model_explorer.config().add_model_from_pytorch(self.backend, program).add_node_data_from_path(str(path))
        )
        model_explorer.visualize_from_config(config, **kwargs)
        return path

    def _exported(self, model: Any, inputs: Any, params: Any) -> tuple[Any, str]:
        # The model searched, prepared as the search ran it, exported; and the prefix its module paths carry.
        from rlx_nb.execution.prepare import normalize_inputs, prepare_model
        from rlx_nb.localization import graph

        if model is None or inputs is None:
            held = self._source.get() if self._source is not None else None
            if held is None:
                raise InputError(
                    "this localization does not hold its model and inputs any more: pass them, "
                    "loc.to_model_explorer(path, model=model, inputs=inputs)"
                )
            model, inputs, params = held if params is None else (*held[:2], params)
        args, keys = normalize_inputs(inputs)
        base = prepare_model(model, params, keys)
        try:
            program = graph.exported(base, args)
        except Exception as exc:  # torch.export's own limits (data-dependent control flow, ...)
            still_interrupted(exc)
            raise InputError(f"torch.export could not trace the model for Model Explorer: {exc}") from None
        return program, "model." if keys is not None else ""

    def repro(
        self,
        path: str | Path,
        *,
        shrink: bool = True,
        attribute: bool = True,
        check: bool = True,
        progress: bool | None = None,
    ) -> Any:
        """Write a standalone repro of the culprit: one Python file that imports only torch, numpy and the runtime
        under test (plus an ``.npz`` beside it where the inputs do not fit inline).

        It runs the culprit (the op as the model called it, or the module as ``torch.export`` traced it) in
        float32 eager, in float64 and on the backend, prints each one's largest and RMS error against float64 and
        the backend's as a multiple of eager's, and exits 1 when the backend is past the line rlx_nb measured
        (written in the file, with how it was measured).

        Parameters
        ----------
        path : str or Path
            A ``.py`` file, or a directory (the file is then ``repro_<backend>.py`` in it).
        shrink : bool
            First cut the culprit's inputs down (halving one size at a time) to the smallest case that still
            crosses the line, each step judged by the verdict; the file says what was shrunk.
        attribute : bool
            For an Inductor backend, bisect ``torch.compile`` to the stage and pass (and a checked workaround);
            for a runtime with two paths, tell the export, the converter and the fast path apart.  In the file.
        check : bool
            Run the written file once in a fresh interpreter and keep what it printed (``Repro.reproduces``).

        Returns
        -------
        rlx_nb.localization.reproduce.Repro
            The path, what was shrunk, the attribution and the check run's output.
        """
        from rlx_nb.localization.reproduce import reproduce

        if self._culprit is None:
            raise InputError(
                "no culprit to reproduce: "
                + (
                    "nothing is beyond round-off (every module checked is within it)"
                    if self.culprit_module is None and not self.everywhere
                    else self._no_repro
                    if self._no_repro
                    else "every module is beyond round-off on its own, so no one module is the culprit"
                    if self.everywhere
                    else "the search watched full runs (the backend cannot run a module alone)"
                )
            )
        repro = reproduce(self._culprit, path, shrink_inputs=shrink, attribute=attribute, check=check,
                          progress=progress)  # fmt: skip
        self.attribution = repro.attribution
        report = self.report() if self.report is not None else None
        if report is not None:
            report.repros[self.backend] = repro
        return repro
