"""Two of the envelope's runs stepped at once, each on its own threads, where the run on another thread count would
leave cores idle.

The envelope's run on another thread count takes one fewer thread than the process runs (:mod:`.backends`): on
sixteen it costs 16/15 of a run, but where the process runs two it runs on one, and one core waits -- that run took
1.4x-1.6x a plain run's time on a 2-core host.  There, a one-ulp run of the envelope steps beside it on the other
core, on as many threads as are left: both are round-off by construction (the one-ulp run on another thread count is
still a one-ulp run, its sums split another way), and two steps on one thread each took 0.93x the time of the two on
two threads one after the other.

Each step of a pair is checked to have drawn no random numbers: the two runs seed torch's one generator with the same
seed, and a draw of one would move the other's stream (a dropout mask neither run would have drawn alone).  After the
pair, the generator must be as seeded; any draw of either run leaves it elsewhere (the last of the two seedings comes
before every draw that could have been moved).  A step that drew returns ``None``, and the envelope is trained again
with no pair (:func:`rlx_nb.training.divergence._envelope_pass`): a model with dropout pays one step for the check.

No pair where it could change what a run computes: a compiled model (Dynamo is not to be entered from two threads
at once), or a torch function or dispatch mode the caller entered (a thread starts without the caller's modes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rlx_nb._support import switches
from rlx_nb.training.trajectory import Run


def pair_of(runs: list[Run], model: torch.nn.Module) -> tuple[Run, Run] | None:
    """The envelope's run on another thread count and a one-ulp run to step beside it, where the first leaves at
    least as many threads idle as it uses; ``None`` where no pair is to be made."""
    n = torch.get_num_threads()
    alone = next((r for r in runs if r.backend is not None and r.backend.threads), None)
    other = next((r for r in reversed(runs) if r.backend is None), None)
    if alone is None or other is None or 2 * alone.backend.threads > n:
        return None
    compiled = any(isinstance(m, torch._dynamo.eval_frame.OptimizedModule) for m in model.modules())  # (itself too)
    if compiled or _modes_entered():
        return None
    return alone, other


def _modes_entered() -> bool:
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return bool(_get_current_function_mode_stack() or _get_current_dispatch_mode_stack())


def step_pair(pair: tuple[Run, Run], spec: Any, step: int, batch: Any,
              step_of: Callable[[Run, Any, int, Any], tuple[float, float]]) -> dict[str, tuple[float, float]] | None:  # fmt: skip
    """Step ``pair``'s runs at once (``step_of(run, spec, step, batch)``, each on its own thread, its threads the
    other's count); ``{run name: (loss, gradient norm)}``, or ``None`` where the step drew random numbers."""
    alone, other = pair
    spec.seeded(step)
    seeded = torch.get_rng_state()
    rest = torch.get_num_threads() - alone.backend.threads
    got: dict[str, tuple[float, float]] = {}

    def beside() -> None:
        torch.set_num_threads(rest)  # (this thread's own OpenMP count, set before its first op)
        got[other.name] = step_of(other, spec, step, batch)

    thread = switches.worker(beside, "rlx_nb:envelope")
    with switches.flipped(threads=alone.backend.threads):
        thread.start()
        try:
            got[alone.name] = step_of(alone, spec, step, batch)
        finally:
            _wait(thread)  # (on Ctrl-C too: the thread count goes back once the other run's step is done)
    if not torch.equal(torch.get_rng_state(), seeded):
        return None
    return got


def _wait(thread: Any) -> None:
    # Until the thread beside is done; a Ctrl-C while waiting waits on (its step ends in a moment; the thread count
    # the block restores must not be changed under it).  A second Ctrl-C is raised once it is done.
    interrupted = False
    while True:
        try:
            if switches.finished(thread, 0.5):
                break
        except KeyboardInterrupt:
            interrupted = True
    if interrupted:
        raise KeyboardInterrupt


__all__ = ["pair_of", "step_pair"]
