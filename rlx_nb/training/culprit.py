"""From a local step past the line to where its error is born: the phase, then the module and op, or the parameters."""

from __future__ import annotations

import dataclasses
from typing import Any

from rlx_nb.training.backends import LossModule, resolve
from rlx_nb.training.local import phase_of, verdict_of
from rlx_nb.verdict.types import SUSPECT


@dataclasses.dataclass
class StepCulprit:
    """Where a local step's error is born: its ``phase`` (forward, buffers, backward, optimizer), and ``culprit`` --
    the module and op (``"blocks.0.attn :: F.softmax"``) where a localization found one, or the parameters whose
    update (buffers whose value) is past the line, worst first."""

    backend: str
    step: int
    phase: str
    culprit: str | None
    tensors: list[str]
    localization: Any = None
    """The :class:`rlx_nb.Localization` of the step's loss on the backend (forward, backward), or None."""
    finding: str = ""

    def __str__(self) -> str:
        return self.finding

    def repro(self, path: Any, **kwargs: Any):
        """The standalone repro of the culprit op or module, fed what it was fed at this step (from the step's own
        state): :meth:`rlx_nb.Localization.repro`.  An optimizer's update has none (its code is the user's)."""
        from rlx_nb.errors import InputError

        if self.localization is None:
            raise InputError(f"{self.backend} at step {self.step}: the error is born in the {self.phase}"
                             + (" (the optimizer's own code: no standalone repro of it is written)"
                                if self.phase == "optimizer" else "; no localization to write a repro from"))  # fmt: skip
        return self.localization.repro(path, **kwargs)


def step_culprit(report: Any, backend: str, step: int, *, local: Any, state: Any, batch: Any) -> StepCulprit:
    """:meth:`rlx_nb.training.report.TrainingReport.localize`."""
    reading = verdict_of(local, backend)
    phase = reading["phase"]
    past = sorted((r for r in local.records if r.backend == backend and r.verdict == SUSPECT and
                   phase_of(r.output) == phase), key=lambda r: -r.judgement.line)  # fmt: skip
    tensors = [r.output.split(":", 1)[-1] for r in past if r.output]
    (b,) = resolve([backend])
    where = f"{backend} at step {step}: born in the {phase}"
    if phase in ("forward", "backward") and (b.forward is not None or b.name == "cpu-nomkldnn" or
                                             b.name == "cpu-inductor"):  # fmt: skip
        from rlx_nb.localization.locate import localize

        model, _ = state.start(report.spec)
        model.train()
        module = LossModule(model, report.spec.loss, batch)
        report.spec.seeded(step)
        inputs = LossModule.inputs(batch)
        loc = None
        if phase == "backward":
            # (a forward op can be wrong by less than the loss's line -- one scalar, its errors averaged -- and past it
            # in the gradients: its module's own output says where it was born)
            loc = localize(module, inputs, backend=b.forward or b.name)
            if loc.culprit:
                phase, where = "forward", f"{backend} at step {step}: born in the forward (seen in the gradients)"
            else:
                report.spec.seeded(step)
                loc = None
        if loc is None:
            loc = localize(module, inputs, backend=b.forward or b.name, backward=phase == "backward")
        culprit = loc.culprit.replace("model.", "", 1) if loc.culprit else None
        said = f"{where}, at {culprit}" if culprit else f"{where}; {loc.finding}"
        return StepCulprit(backend, step, phase, culprit, tensors, loc, said)
    if phase == "optimizer":
        opt = type(b.make_optimizer(report.spec.optimizer, list(state.model.parameters()))).__name__
        culprit = f"{opt}.step :: {tensors[0]}" if tensors else f"{opt}.step"
        said = (f"{where}: the update of {', '.join(tensors[:4])}{' ...' if len(tensors) > 4 else ''} is past the "
                f"line while its gradients are round-off ({opt}.step)")  # fmt: skip
        return StepCulprit(backend, step, phase, culprit, tensors, None, said)
    if phase == "buffers":
        modules = sorted({t.rpartition(".")[0] for t in tensors})
        culprit = f"{modules[0]} (running statistics)" if modules else None
        said = f"{where}: the buffers {', '.join(tensors[:4])} after the forward are past the line"
        return StepCulprit(backend, step, phase, culprit, tensors, None, said)
    return StepCulprit(backend, step, phase, None, tensors, None,
                       f"{where} (no module or op: {backend} runs the whole step its own way)")  # fmt: skip


__all__ = ["StepCulprit", "step_culprit"]
