"""From a culprit to a repro a maintainer can run: shrink it, attribute it, write it, run it once to check it.

:func:`reproduce` is what ``loc.repro(path)`` and ``report.repro(backend, path)`` call.  Shrinking and attributing
run the culprit again on the backend (compiles and exports included), so they run only when a repro is asked
for, with progress.
"""

from __future__ import annotations

import dataclasses
import html
import subprocess
import sys
from pathlib import Path

from rlx_nb._support import switches
from rlx_nb._support.progress import bar
from rlx_nb._support.safe import file_stem, inside
from rlx_nb.errors import InputError, writing
from rlx_nb.localization.culprit import Culprit, crosses
from rlx_nb.localization.shrink import Shrunk, shrink
from rlx_nb.localization.standalone import line_of, write_standalone
from rlx_nb.verdict.records import OutputRecord
from rlx_nb.verdict.types import SUSPECT

CHECK_TIMEOUT_S = 600.0
"""How long the check run of a written repro may take (a compile or an export included)."""


@dataclasses.dataclass(frozen=True)
class Repro:
    """A written standalone repro: where, what it reproduces, how it was shrunk, and what it printed when run."""

    path: Path
    backend: str
    label: str
    line: tuple[float, float]
    record: OutputRecord
    """The culprit's judged record (shrunk, where it was): its errors against float64, eager's, the line."""
    backward: bool = False
    shrunk: Shrunk | None = None
    attribution: str = ""
    ran: str = ""
    """What the script printed when it was run to check it ("" where it was not run)."""
    reproduces: bool | None = None
    """Whether that run crossed the line (exit 1); None where it was not run."""
    model: str = ""
    """The model's class name (what ``<root>`` stands for in the label)."""
    options: tuple = ()
    """The options it was made with that change what is written (:func:`reproduce`'s), to tell when it can be reused."""

    @property
    def data(self) -> Path | None:
        """The ``.npz`` beside the script holding its inputs, or None where they are written in it."""
        npz = self.path.with_suffix(".npz")
        return npz if f"{npz.name!r}" in self.text else None

    @property
    def judgement(self):
        return self.record.judgement

    @property
    def text(self) -> str:
        """The script's source."""
        return self.path.read_text()

    @property
    def lines(self) -> int:
        return len(self.text.splitlines())

    def __str__(self) -> str:
        parts = [f"standalone repro of {self.backend} on {self.label}: {self.path} ({self.lines} lines)"]
        if self.shrunk is not None:
            parts.append(str(self.shrunk))
        if self.attribution:
            parts.append(self.attribution)
        if self.reproduces is not None:
            verdict = "it reproduces the divergence" if self.reproduces else "it did NOT cross the line when run"
            parts.append(f"Run once without rlx_nb: {verdict}.\n{self.ran.rstrip()}")
        return "\n".join(parts)

    def __repr__(self) -> str:
        state = {None: "not run", True: "reproduces", False: "does not reproduce"}[self.reproduces]
        return f"<Repro {self.backend} on {self.label!r}: {self.path.name}, {self.lines} lines, {state}>"

    def _repr_html_(self) -> str:
        return f"<pre>{html.escape(str(self))}</pre>"


def script_path(path: str | Path, backend: str) -> Path:
    """The script's file: ``path`` itself when it names a ``.py`` file (any case), else ``repro_<backend>.py``
    inside it, the backend's name made a safe file name (:func:`~rlx_nb._support.safe.file_stem`) and the file
    checked to stay in the folder."""
    path = Path(path)
    if path.suffix.lower() == ".py":
        return path
    return inside(path, f"repro_{file_stem(backend)}.py", "the repro")


WITHOUT_RLX_NB = (
    "import runpy, sys; sys.modules['rlx_nb'] = None; sys.argv = sys.argv[1:]; "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)
"""How the check runs a script (``sys.argv[1]``): in an interpreter where ``import rlx_nb`` fails, as a maintainer
runs it.  (An editable install's finder comes before PYTHONPATH, so a shadow package would not hide rlx_nb; a None in
``sys.modules`` makes every import of it and of its modules raise ImportError.)"""


def run_script(script: Path) -> tuple[int, str]:
    """Run a written repro in a fresh interpreter where ``import rlx_nb`` fails (:data:`WITHOUT_RLX_NB`), its own
    directory as the working one: exit code and output."""
    try:
        script = script.resolve()  # (run from its own directory: a relative path would not be found there)
        done = subprocess.run([sys.executable, "-c", WITHOUT_RLX_NB, str(script)], capture_output=True, text=True,
                              timeout=CHECK_TIMEOUT_S, cwd=script.parent, check=False)  # fmt: skip
    except subprocess.TimeoutExpired:
        return -1, f"(the repro ran past {CHECK_TIMEOUT_S:g} s and was stopped)"
    lines = [ln for ln in done.stdout.splitlines() if ln.strip()]
    if not any(ln.startswith(("PAST the line", "within the line")) for ln in lines):  # (it crashed: say where)
        return done.returncode, "\n".join([*lines, *done.stderr.strip().splitlines()[-12:]])
    return done.returncode, "\n".join(lines)


@switches.guarded
def reproduce(
    culprit: Culprit,
    path: str | Path,
    *,
    shrink_inputs: bool = True,
    attribute: bool = True,
    check: bool = True,
    progress: bool | None = None,
) -> Repro:
    """Write the standalone repro of ``culprit`` (see :mod:`rlx_nb.localization.standalone`); see ``loc.repro``."""
    script = script_path(path, culprit.backend)
    with writing(path, "the repro"):  # (a path that cannot be written is said before anything runs)
        script.parent.mkdir(parents=True, exist_ok=True)
    shown = bar(f"rlx_nb repro {culprit.backend}", enabled=progress is not False, unit="step")
    try:
        told = shown.set_postfix_str
        told("judging the culprit alone")
        record = culprit.judge()
        if record.verdict != SUSPECT:
            raise InputError(
                f"{culprit.backend} on {culprit.label} is within round-off when run alone ({record.reason}); "
                "no repro written: there is no divergence to reproduce"
            )
        shrunk = None
        if shrink_inputs:
            shrunk = shrink(culprit, told=told, record=record)
            if shrunk.record is not None:  # (its last accepted step's verdict: the smallest case, judged once)
                culprit, record = shrunk.culprit, shrunk.record
        attribution = ""
        if attribute:
            from rlx_nb.localization.attribution import attribute as attribute_culprit

            attribution = attribute_culprit(culprit, told=told).sentence
        if not crosses(record):
            attribution += (" " if attribution else "") + (
                "(The verdict rests on part of the output; the whole output's error this repro checks is not past "
                "the line, so it may exit 0.)"
            )
        told("writing")
        with writing(path, "the repro"):
            write_standalone(script, culprit, record, shrunk=str(shrunk) if shrunk is not None else "",
                             attribution=attribution)  # fmt: skip
        code, ran = None, ""
        if check:
            told("running it without rlx_nb")
            code, ran = run_script(script)
        # (exit 1 and the script's own last line: a crash exits 1 too)
        crossed = None if code is None else code == 1 and "PAST the line" in ran
        return Repro(script, culprit.backend, culprit.label, line_of(record), record, culprit.backward, shrunk,
                     attribution, ran, crossed, culprit.root, (shrink_inputs, attribute, check))  # fmt: skip
    finally:
        shown.close()


__all__ = ["WITHOUT_RLX_NB", "Repro", "reproduce", "run_script", "script_path"]
