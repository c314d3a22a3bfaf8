"""From a report's SUSPECT backend to what its maintainers need: the standalone repro, and an issue ready to file.

``report.repro(backend, path)`` localizes the backend (the report's model, held weakly) and writes the culprit's
standalone repro (:mod:`rlx_nb.localization.reproduce`); ``report.issue(backend, path)`` writes markdown around it:
a title, the environment, what diverges and by how much against float64 (float32 eager's own error for scale),
where it is born, and the repro inline.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import math
import platform
from pathlib import Path
from typing import Any

from rlx_nb._support.safe import file_stem, inside, md_code, md_fence, md_text, write_new
from rlx_nb.errors import InputError, writing
from rlx_nb.execution.environment import packages_of
from rlx_nb.verdict.types import SUSPECT

INT8_NO_REPRO = (
    "an int8 culprit is a cut of the converted graph, lowered by the runtime whole, and rlx_nb writes no standalone "
    "repro of one yet: save the report (report.save) and the converted graph (torch.export.save of "
    "torch.export.export(graph, inputs)) to share it"
)
"""Why an int8 report's culprit has no standalone repro (said before its localization runs)."""


def repro_for(report: Any, backend: str, path: str | Path, **kwargs: Any) -> Any:
    """``report.repro``: the standalone repro of ``backend``'s culprit, kept on the report (``report.repros``)."""
    record = report.record(backend)
    if record.verdict != SUSPECT:
        raise InputError(
            f"{backend} is within round-off: no repro written ({record.verdict}, {record.judgement.line:.2g}x the "
            "SUSPECT line): there is no divergence to reproduce"
        )
    if getattr(report, "int8", None) is not None:  # (said before a localization that could not end in one)
        raise InputError(f"no culprit to reproduce: {INT8_NO_REPRO}")
    localize = {k: kwargs.pop(k) for k in ("model", "inputs", "params") if k in kwargs}
    loc = report.localize(backend, **localize)
    if loc.culprit is None:
        raise InputError(f"the localization of {backend} found no one culprit ({loc.finding}), so no repro is written")
    repro = loc.repro(path, **kwargs)
    report.repros[backend] = repro
    return repro


@dataclasses.dataclass(frozen=True)
class Issue:
    """An issue written by ``report.issue``: its markdown (shown as such in a notebook) and where it is."""

    path: Path
    text: str

    def __fspath__(self) -> str:
        return str(self.path)

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return f"<Issue {str(self.path)!r}: {self.text.splitlines()[0].removeprefix('# ')}>"

    def _repr_markdown_(self) -> str:
        return self.text


_SAME_RESULT = ("progress",)
"""``report.issue`` options that cannot change what is written: a repro made with other values of them is reused."""


def issue_for(report: Any, backend: str, path: str | Path, **kwargs: Any) -> Issue:
    """``report.issue``: markdown ready to file for ``backend``'s divergence, its repro inline (written beside it)."""
    record = report.record(backend)  # (an unknown or a round-off backend is said before any folder is made)
    if record.verdict != SUSPECT:
        raise InputError(
            f"{backend} is within round-off: no issue written ({record.verdict}, {record.judgement.line:.2g}x the "
            "SUSPECT line): there is no divergence to report"
        )
    if getattr(report, "int8", None) is not None:  # (before any folder is made, or a localization is run)
        raise InputError(f"no issue written: {INT8_NO_REPRO}")
    path = Path(path)
    if path.suffix.lower() != ".md":
        path = inside(path, f"issue_{file_stem(backend)}.md", "the issue")
    with writing(path, "the issue"):
        path.parent.mkdir(parents=True, exist_ok=True)
    repro = report.repros.get(backend)
    if repro is None or not _reusable(repro, kwargs):
        repro = repro_for(report, backend, path.parent, **kwargs)
    text = issue_text(report, record, repro)
    with writing(path, "the issue"):
        write_new(path, text)
    return Issue(path, text)


def _reusable(repro: Any, kwargs: dict) -> bool:
    # The repro written earlier is the one these options would write: still on disk, the same options that change
    # what is written (shrink, attribute, check), no other model or inputs.
    asked = {k: v for k, v in kwargs.items() if k not in _SAME_RESULT}
    if any(k in asked for k in ("model", "inputs", "params")) or not repro.path.exists():
        return False
    made = dict(zip(("shrink", "attribute", "check"), repro.options or (True, True, True), strict=True))
    return all(k in made and made[k] == v for k, v in asked.items())


def where_born(report: Any, backend: str) -> str:
    """Where ``backend``'s error is born, once a repro was written for it (``report.repro``, ``report.issue``): the
    culprit and its attribution in one line; "" before."""
    repro = getattr(report, "repros", {}).get(backend)
    if repro is None or not repro.attribution:
        return ""
    return f"{repro.label}: {repro.attribution}"


def _versions(backend: str) -> list[str]:
    out = []
    for name in packages_of(backend):
        try:
            out.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def _what(repro: Any) -> str:
    j = repro.judgement
    e = j.errors
    scale = ""
    if e.oracle_max_err > 0 and e.oracle_rmse > 0:
        scale = (f" ({e.backend_max_err / e.oracle_max_err:.3g}x and {e.backend_rmse / e.oracle_rmse:.3g}x float32 "
                 "eager's own)")  # fmt: skip
    bad = j.events.nonfinite_unexplained
    nonfinite = f"{bad} values are NaN or infinite where float64's are finite; past them, its " if bad else ""
    where = (f"That is {j.line:.3g}x the SUSPECT line rlx_nb measured" if math.isfinite(j.line) else
             "A NaN or an infinity where float64 has none is past the SUSPECT line at any size")  # fmt: skip
    return (
        f"On {md_code(repro.label)} alone ({'its gradient' if repro.backward else 'forward'}), "
        f"{md_text(repro.backend)}'s {nonfinite}largest error against float64 is {e.backend_max_err:.3g} and its "
        f"RMS error {e.backend_rmse:.3g}; float32 eager's are {e.oracle_max_err:.3g} and {e.oracle_rmse:.3g}{scale}. "
        f"{where} (a largest error past {repro.line[0]:.3g}, an RMS error past {repro.line[1]:.3g} or a NaN or "
        "infinity where float64 has none is a bug, not round-off)."
    )


def title(repro: Any) -> str:
    """The issue's title: the backend, the culprit as the code calls it (the model's class for ``<root>``), and
    whether its gradient or its forward diverges."""
    module, _, op = repro.label.rpartition(" :: ")
    if not module:
        module, op = op, ""
    if module == "<root>" and getattr(repro, "model", ""):
        module = repro.model
    where = f"{md_code(op)} in {md_code(module)}" if op else md_code(module)
    what = "the gradient of " if repro.backward else ""
    line = repro.judgement.line
    how = f"far past float32 round-off ({line:.3g}x)" if math.isfinite(line) else "with NaN or infinity"
    return f"{md_text(repro.backend)}: {what}{where} diverges from float64 {how}"


def issue_text(report: Any, record: Any, repro: Any) -> str:
    """The issue's markdown (see :func:`issue_for`): every name and value from outside on one line, escaped."""
    env = report.results.environment
    versions = [f"torch {env.get('torch', '?')}", *_versions(repro.backend), f"Python {env.get('python', '?')}"]
    simd = ", ".join(str(s) for s in env.get("cpu_simd") or [])
    cpu = (f"{env.get('cpu', '?')} ({env.get('machine', platform.machine())}; ATen's CPU capability "
           f"{env.get('aten_cpu_capability', '?')}; {simd})")  # fmt: skip
    lines = [
        f"# {title(repro)}",
        "",
        "## Environment",
        "",
        f"- {md_text(', '.join(versions))}",
        f"- CPU: {md_text(cpu)}; {md_text(env.get('threads', '?'))} threads; {platform.system()}",
        "",
        "## What diverges",
        "",
        f"In the whole model ({md_code(report.label)}), output {md_code(record.output)} on "
        f"{md_text(record.backend)}: {md_text(record.reason)}.",
        "",
        _what(repro),
        "",
    ]
    if repro.shrunk is not None:
        lines += [md_text(repro.shrunk), ""]
    if repro.attribution:
        lines += ["## Where it is born", "", md_text(repro.attribution), ""]
    data = repro.data
    extra = f" and {md_code(data.name)} beside it (its inputs)" if data is not None else ""
    lines += [
        "## Repro",
        "",
        f"{md_code('python ' + repro.path.name)}{extra}: it imports only torch"
        + (", numpy" if data is not None else "")
        + " and the runtime under test, prints each error against float64, and exits 1 past the line.",
        "",
        md_fence(repro.text.rstrip(), "python"),
    ]
    if repro.ran:
        lines += ["", "Its output here:", "", md_fence(repro.ran.rstrip())]
    lines += ["", f"_Found with rlx\\_nb {md_text(env.get('rlx_nb', ''))}._", ""]
    return "\n".join(lines)


__all__ = ["Issue", "issue_for", "issue_text", "repro_for", "title", "where_born"]
