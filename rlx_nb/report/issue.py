"""From a report's SUSPECT backend to what its maintainers need: the standalone repro, and an issue ready to file.

``report.repro(backend, path)`` localizes the backend (the report's model, held weakly) and writes the culprit's
standalone repro (:mod:`rlx_nb.localization.reproduce`); ``report.issue(backend, path)`` writes markdown around it:
a title, the environment, what diverges and by how much against float64 (float32 eager's own error for scale),
where it is born, and the repro inline.
"""

from __future__ import annotations

import importlib.metadata
import platform
from pathlib import Path
from typing import Any

from rlx_nb.errors import InputError, writing
from rlx_nb.verdict.types import SUSPECT

RUNTIME_PACKAGES = {
    "onnxruntime": ("onnxruntime", "onnx"),
    "openvino": ("openvino",),
    "executorch": ("executorch", "torchao"),
    "litert": ("litert-torch", "ai-edge-litert"),
    "cuda": (),
}
"""The packages whose versions an issue names, by the backend name's first part."""


def repro_for(report: Any, backend: str, path: str | Path, **kwargs: Any) -> Any:
    """``report.repro``: the standalone repro of ``backend``'s culprit, kept on the report (``report.repros``)."""
    record = report.record(backend)
    if record.verdict != SUSPECT:
        raise InputError(
            f"{backend} is within round-off: no repro written ({record.verdict}, {record.judgement.line:.2g}x the "
            "SUSPECT line): there is no divergence to reproduce"
        )
    localize = {k: kwargs.pop(k) for k in ("model", "inputs", "params") if k in kwargs}
    loc = report.localize(backend, **localize)
    if loc.culprit is None:
        raise InputError(f"the localization of {backend} found no one culprit ({loc.finding}), so no repro is written")
    repro = loc.repro(path, **kwargs)
    report.repros[backend] = repro
    return repro


def issue_for(report: Any, backend: str, path: str | Path, **kwargs: Any) -> Path:
    """``report.issue``: markdown ready to file for ``backend``'s divergence, its repro inline (written beside it)."""
    path = Path(path)
    if path.suffix != ".md":
        path = path / f"issue_{backend.replace(':', '_').replace('+', '_')}.md"
    with writing(path, "the issue"):
        path.parent.mkdir(parents=True, exist_ok=True)
    repro = report.repros.get(backend)
    if repro is None or kwargs:
        repro = repro_for(report, backend, path.parent, **kwargs)
    record = report.record(backend)
    with writing(path, "the issue"):
        path.write_text(issue_text(report, record, repro))
    return path


def where_born(report: Any, backend: str) -> str:
    """Where ``backend``'s error is born, once a repro was written for it (``report.repro``, ``report.issue``): the
    culprit and its attribution in one line; "" before."""
    repro = getattr(report, "repros", {}).get(backend)
    if repro is None or not repro.attribution:
        return ""
    return f"{repro.label}: {repro.attribution}"


def _versions(backend: str) -> list[str]:
    family = next((k for k in RUNTIME_PACKAGES if backend.startswith(k)), None)
    out = []
    for name in RUNTIME_PACKAGES.get(family, ()):
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
    return (
        f"On `{repro.label}` alone ({'its gradient' if repro.backward else 'forward'}), {repro.backend}'s largest error "
        f"against float64 is {e.backend_max_err:.3g} and its RMS error {e.backend_rmse:.3g}; float32 eager's are "
        f"{e.oracle_max_err:.3g} and {e.oracle_rmse:.3g}{scale}. That is {j.line:.3g}x the SUSPECT line rlx_nb "
        f"measured (a largest error past {repro.line[0]:.3g} or an RMS error past {repro.line[1]:.3g} is a bug, not "
        "round-off)."
    )


def issue_text(report: Any, record: Any, repro: Any) -> str:
    """The issue's markdown (see :func:`issue_for`)."""
    env = report.results.environment
    culprit = repro.label.rpartition(" :: ")[2]
    title = (
        f"{repro.backend}: `{culprit}` diverges from float64 far past float32 round-off ({repro.judgement.line:.3g}x)"
    )
    versions = [f"torch {env.get('torch', '?')}", *_versions(repro.backend), f"Python {env.get('python', '?')}"]
    simd = ", ".join(env.get("cpu_simd") or [])
    cpu = f"{env.get('cpu', '?')} ({env.get('machine', platform.machine())}; ATen's CPU capability {env.get('aten_cpu_capability', '?')}; {simd})"
    lines = [
        f"# {title}",
        "",
        "## Environment",
        "",
        f"- {', '.join(versions)}",
        f"- CPU: {cpu}; {env.get('threads', '?')} threads; {platform.system()}",
        "",
        "## What diverges",
        "",
        f"In the whole model (`{report.label}`), output `{record.output}` on {record.backend}: {record.reason}.",
        "",
        _what(repro),
        "",
    ]
    if repro.shrunk is not None:
        lines += [str(repro.shrunk), ""]
    if repro.attribution:
        lines += ["## Where it is born", "", repro.attribution, ""]
    extra = " and the `.npz` beside it" if repro.path.with_suffix(".npz").exists() else ""
    lines += [
        "## Repro",
        "",
        f"`python {repro.path.name}`{extra}: it imports only torch and the runtime under test (numpy where an `.npz` "
        "holds the inputs), prints each error against float64, and exits 1 past the line.",
        "",
        "```python",
        repro.text.rstrip(),
        "```",
    ]
    if repro.ran:
        lines += ["", "Its output here:", "", "```", repro.ran.rstrip(), "```"]
    lines += ["", f"_Found with rlx_nb {env.get('rlx_nb', '')}._", ""]
    return "\n".join(lines)


__all__ = ["issue_for", "issue_text", "repro_for", "where_born"]
