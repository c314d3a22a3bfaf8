"""Where in a compiler or a runtime a culprit's error is born: a compiler's stage and pass, a runtime's layer.

**Inductor** (``cpu-inductor``, ``cuda-inductor``): PyTorch's own ``CompilerBisector`` runs the culprit through
``torch.compile``'s stages (Dynamo alone, AOTAutograd, its decompositions and partitioner, Inductor) and, in the
first stage that diverges, turns its subsystems off one at a time and bisects the ones applied many times (the
passes, the decompositions, the lowerings) down to one application; its oracle is rlx_nb's verdict on the culprit
(SUSPECT or not), never a tolerance.  A config switch that makes the divergence go away, checked by judging the
culprit again with it set, is given as the workaround.

**A runtime with two paths** (ExecuTorch XNNPACK / portable, LiteRT delegate / reference kernels, ONNX Runtime with
and without graph optimizations): the exported program run by torch, then the pair's other member, tell where the
error is born: the export (torch's own run of the exported program already diverges), the converter or exporter
(both members diverge), or the fast path (the delegate kernel, or the graph optimizer: only it diverges).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import shutil
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch

from rlx_nb._support import switches
from rlx_nb._support.kept import inductor_tables_kept
from rlx_nb._support.quiet import quiet
from rlx_nb.backends.base import Backend
from rlx_nb.backends.registry import get_backend
from rlx_nb.errors import still_interrupted
from rlx_nb.localization.culprit import Culprit
from rlx_nb.localization.runners import PAIRS, runtime_of
from rlx_nb.verdict.types import SUSPECT

INDUCTOR = ("cpu-inductor", "cuda-inductor")

STAGES = {
    "eager": "Dynamo's graph capture (no compiler after it)",
    "aot_eager": "AOTAutograd (no decompositions)",
    "aot_eager_decomp_partition": "AOTAutograd's decompositions and partitioner",
    "aot_eager_decomp_partition_crossref": "AOTAutograd's decompositions (cross-ref mode)",
    "inductor": "Inductor",
}
"""``torch.compile``'s stages as ``CompilerBisector`` walks them."""

SUBSYSTEMS = {
    "pre_grad_passes": "pre-grad passes",
    "pre_grad_graph": "the pre-grad graph",
    "joint_graph_passes": "joint-graph passes",
    "post_grad_passes": "post-grad passes",
    "decomposition": "decompositions",
    "lowerings": "lowerings",
    "cudagraphs": "CUDA graphs",
    "aot_eager_decomp_partition_cse": "common-subexpression elimination",
    "inductor_fallback_random": "random-op fallback",
    "inductor_emulate_precision_casts": "precision-cast emulation",
    "inductor_layout_optimization": "layout optimization",
    "inductor_comprehensive_padding": "padding",
}
"""Each subsystem the bisector can turn off, in words."""


@dataclasses.dataclass(frozen=True)
class Attribution:
    """Where a culprit's error is born inside its backend (empty fields: not known)."""

    backend: str
    stage: str = ""
    subsystem: str = ""
    names: str = ""
    """What the bisection names: the op lowered or decomposed, the pass."""
    workaround: str = ""
    layer: str = ""
    sentence: str = ""
    seconds: float = 0.0

    def __str__(self) -> str:
        return self.sentence


@switches.guarded
def attribute(culprit: Culprit, *, told: Callable[[str], None] | None = None) -> Attribution:
    """Where ``culprit``'s error is born in its backend: Inductor's stage and pass, or a runtime's layer; an
    :class:`Attribution` with only a sentence where the backend has neither."""
    told = told or (lambda _: None)
    start = time.perf_counter()
    if culprit.backend in INDUCTOR:
        found = bisect_compiler(culprit, told)
    else:
        runtime, _ = runtime_of(culprit.backend)
        found = runtime_layer(culprit, runtime, told) if runtime in PAIRS or runtime.startswith("openvino") else None
        if found is None:
            return Attribution(culprit.backend, seconds=time.perf_counter() - start)
    return dataclasses.replace(found, seconds=time.perf_counter() - start)


@contextlib.contextmanager
def _bisector_kept() -> Iterator[None]:
    # CompilerBisector as it was, however the bisection ends: torch puts its state back only when an object in
    # do_bisect's frame is collected, and a notebook keeps an interrupted call's traceback (and that frame) alive:
    # the bisection would stay on, its status folder set, and the object would reset a later bisection midway.
    from torch._inductor import compiler_bisector as cb

    bisector = cb.CompilerBisector
    saved = (bisector.bisection_enabled, bisector.in_process_cache, list(cb.BACKENDS["inductor"]))
    try:
        yield
    except BaseException as exc:
        traceback.clear_frames(exc.__traceback__)  # (torch's cleanup object goes now, with the frames below)
        raise
    finally:
        folder = bisector.in_process_cache
        bisector.bisection_enabled, bisector.in_process_cache = saved[0], saved[1]
        cb.BACKENDS["inductor"][:] = saved[2]
        cb.subsystem_call_counter.clear()
        if folder and folder != saved[1]:
            shutil.rmtree(folder, ignore_errors=True)


# -- Inductor ----------------------------------------------------------------------------------------------------


def _compiling(device: str) -> Backend:
    # torch.compile with its default backend: the one CompilerBisector replaces with the stage it tries.
    def fn(model: Any, inputs: tuple) -> Any:
        torch._dynamo.reset()
        if device != "cpu":
            model.to(device)
            inputs = tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in inputs)
        return torch.compile(model)(*inputs)

    return Backend(f"torch.compile ({device})", fn, device=device, on_caller=device == "cpu")


@contextlib.contextmanager
def _no_compile_caches() -> Iterator[None]:
    # Every bisection step compiles afresh: the graph caches (Inductor's FX graph cache, AOTAutograd's) are keyed on
    # the graph and the config, not on the stage the bisector turned off, so a step could reuse another's compile.
    # The C++ kernel cache stays on: a kernel's key is its whole source and compile command, what decides the binary
    # (force_disable_caches also moved it to a fresh folder, and each step compiled every kernel again with g++,
    # about 1.5 s each).
    import torch._functorch.config as functorch_config
    import torch._inductor.config as config

    with config.patch(fx_graph_cache=False, fx_graph_remote_cache=False, autotune_local_cache=False), \
            functorch_config.patch(enable_autograd_cache=False):  # fmt: skip
        yield


@switches.guarded
def bisect_compiler(culprit: Culprit, told: Callable[[str], None]) -> Attribution:
    """``CompilerBisector`` on the culprit, rlx_nb's verdict its oracle."""
    from torch._inductor.compiler_bisector import CompilerBisector

    device = "cuda" if culprit.backend.startswith("cuda") else "cpu"
    step = _compiling(device)
    tries = [0]

    def good() -> bool:
        tries[0] += 1
        told(f"bisecting torch.compile: {CompilerBisector.get_backend()} {CompilerBisector.get_subsystem() or ''}")
        return culprit.judge(backend=step).verdict != SUSPECT

    with quiet(), _no_compile_caches(), _bisector_kept(), inductor_tables_kept():
        result = CompilerBisector.do_bisect(good)
    b = culprit.backend
    if result is None:
        return Attribution(b, sentence=(
            f"The compiler bisection could not attribute it: torch.compile of the culprit alone, with its default "
            f"settings, is within round-off at every stage ({tries[0]} runs); {b}'s own compile path differs."))  # fmt: skip
    stage = STAGES.get(result.backend, result.backend)
    subsystem = SUBSYSTEMS.get(result.subsystem or "", result.subsystem or "")
    names = _named(result.debug_info or "")
    if not result.subsystem:
        sentence = (f"Born in {stage}: the first torch.compile stage that diverges ({result.backend}); none of its "
                    f"subsystems alone makes it go away ({tries[0]} bisection runs).")  # fmt: skip
        return Attribution(b, result.backend, sentence=sentence)
    workaround = _workaround(culprit, result.backend, result.subsystem, names, told)
    what = f"{subsystem}" + (f", at {names}" if names and names != result.subsystem else "")
    sentence = (
        f"Born in {stage} ({result.backend}), in its {what}: turning that off"
        + (" (bisected to this one application)" if result.bisect_number else "")
        + f" makes it round-off ({tries[0]} bisection runs)."
        + (f" Workaround, checked: {workaround}." if workaround else " No config switch alone was found to avoid it.")
    )
    return Attribution(b, result.backend, subsystem, names, workaround, sentence=sentence)


def _named(debug: str) -> str:
    # The op or pass a bisection's debug info names (``<OpOverload(op='aten.gelu', ...)>``, ``avg_pool2d_backward``).
    found = re.search(r"op='([\w.]+)'", debug)
    return found.group(1) if found else debug.strip()


def _aten(name: str) -> Any:
    # The aten op a lowered node or a decomposition names (``avg_pool2d_backward_1``, ``aten.gelu``), or None.
    bare = re.sub(r"_\d+$", "", name.removeprefix("aten."))
    return getattr(torch.ops.aten, bare, None)


def _workaround(culprit: Culprit, stage: str, subsystem: str, names: str, told: Callable[[str], None]) -> str:
    # A switch that avoids the divergence, checked by judging the culprit on its backend with it set; "" if none.
    for text, switch in _candidates(stage, subsystem, names):
        told(f"checking the workaround {text}")
        try:
            with quiet(), _no_compile_caches(), inductor_tables_kept(), switch():
                torch._dynamo.reset()
                if culprit.judge().verdict != SUSPECT:
                    return text
        except (
            Exception
        ) as _stop:  # (a switch this torch does not have, a compile that fails with it: not a workaround)
            still_interrupted(_stop)
            continue
        finally:
            torch._dynamo.reset()
    return ""


def _candidates(stage: str, subsystem: str, names: str) -> list[tuple[str, Callable[[], Any]]]:
    import torch._inductor.config as inductor_config

    out: list[tuple[str, Callable[[], Any]]] = []
    change = {
        "inductor_emulate_precision_casts": ("emulate_precision_casts", True),
        "inductor_layout_optimization": ("layout_optimization", False),
        "inductor_comprehensive_padding": ("comprehensive_padding", False),
        "inductor_fallback_random": ("fallback_random", True),
    }.get(subsystem)
    if change is not None:
        key, value = change
        out.append((f"torch._inductor.config.{key} = {value}", lambda: inductor_config.patch(**{key: value})))
    if subsystem == "aot_eager_decomp_partition_cse":
        import torch._functorch.config as functorch_config

        out.append(("torch._functorch.config.cse = False", lambda: functorch_config.patch(cse=False)))
    op = _aten(names) if names else None
    if subsystem == "lowerings" and op is not None:
        out.append((f"torch._inductor.lowering.make_fallback(torch.ops.aten.{op.__name__})", lambda: _fallback(op)))
    if subsystem == "decomposition" and op is not None:
        out.append((f"del torch._inductor.decomposition.decompositions[torch.ops.aten.{op.__name__}.default]; "
                    "torch._inductor.decomposition.fast_random_decomps.cache_clear()",
                    lambda: _undecomposed(op)))  # fmt: skip
    if names and getattr(inductor_config, names, None) is not None:  # (a pass the user's config added: off)
        out.append((f"torch._inductor.config.{names} = None", lambda: inductor_config.patch(**{names: None})))
    if subsystem in ("pre_grad_passes", "joint_graph_passes", "post_grad_passes"):
        out.append(
            ("torch._inductor.config.pattern_matcher = False", lambda: inductor_config.patch(pattern_matcher=False))
        )
    return out


@contextlib.contextmanager
def _fallback(op: Any) -> Iterator[None]:
    # Inductor calls the eager ATen kernel for ``op`` instead of lowering it (its tables put back after).
    from torch._inductor import lowering

    with inductor_tables_kept():
        lowering.make_fallback(op, warn=False)
        yield


@contextlib.contextmanager
def _undecomposed(op: Any) -> Iterator[None]:
    # Inductor's decomposition table without ``op``'s overloads; its tables put back after (lowering the op itself
    # then adds it to the lowerings and the fallbacks: those go too).
    from torch._inductor import decomposition

    with inductor_tables_kept():
        for k in [k for k in decomposition.decompositions if getattr(k, "overloadpacket", None) is op]:
            del decomposition.decompositions[k]
        _table_changed()
        yield


def _table_changed() -> None:
    # The table Inductor reads is a cached copy of its decompositions (fast_random_decomps, where torch has it).
    from torch._inductor import decomposition

    cached = getattr(decomposition, "fast_random_decomps", None)
    if cached is not None and hasattr(cached, "cache_clear"):
        cached.cache_clear()


# -- runtimes ----------------------------------------------------------------------------------------------------


def _exported_in_torch() -> Backend:
    # torch.export's program of the model, run by torch itself: what every runtime here is given.
    def fn(model: Any, inputs: tuple) -> Any:
        with quiet():
            program = torch.export.export(model, inputs, strict=False)
        return program.module()(*inputs)

    return Backend("torch.export, run by torch", fn, differentiable=False)


def runtime_layer(culprit: Culprit, runtime: str, told: Callable[[str], None]) -> Attribution:
    """The layer of ``runtime`` where the culprit's error is born (see the module docstring)."""
    b = culprit.backend
    told("the exported program, run by torch")
    exported = culprit.judge(backend=_with_carried(culprit, _exported_in_torch()))
    if exported.verdict == SUSPECT:
        return Attribution(b, layer="export", sentence=(
            f"Born in the export: torch.export's program of the culprit, run by torch itself, already diverges "
            f"({exported.judgement.line:.3g}x the line), before {runtime} converts it."))  # fmt: skip
    if runtime not in PAIRS:
        return Attribution(b, layer="runtime", sentence=(
            f"Born in {runtime}: torch.export's program of the culprit, run by torch, is within round-off; "
            f"{runtime} has no second path here to tell its converter from its kernels."))  # fmt: skip
    other, fast = PAIRS[runtime]
    pair = get_backend(other)
    reason = pair.unavailable_reason()
    if reason is not None:
        return Attribution(b, layer="runtime", sentence=(
            f"Born in {runtime}, past the export (torch's own run of the exported program is round-off); "
            f"{other}, which would tell its converter from its kernels, is not available here: {reason}."))  # fmt: skip
    told(f"the pair's other path: {other}")
    theirs = culprit.judge(backend=_with_carried(culprit, pair))
    name = b.replace(runtime, other, 1)
    if theirs.verdict == SUSPECT:
        layer = "exporter" if runtime.startswith("onnxruntime") else "converter"
        return Attribution(b, layer=layer, sentence=(
            f"Born in the {layer}: torch's own run of the exported program is round-off, and {name} diverges too "
            f"({theirs.judgement.line:.3g}x the line), so both of {runtime}'s paths are given a wrong graph."))  # fmt: skip
    return Attribution(b, layer="fast path", sentence=(
        f"Born in {fast}: torch's own run of the exported program and {name} ({theirs.judgement.line:.2g}x the line) "
        f"are round-off; only {runtime} diverges."))  # fmt: skip


def _with_carried(culprit: Culprit, backend: Backend) -> Backend:
    # ``backend`` given what the culprit's backend carries into its runtime (a catalogue fault), if anything.
    carried = getattr(culprit.lent, "carries", None)
    if carried is None:
        return backend
    from rlx_nb.backends.exported_faults import Faulty

    def fn(model: Any, inputs: tuple) -> Any:
        return backend.fn(Faulty(model, carried.fn, carried.name), inputs)

    return Backend(f"{backend.name}+{carried.name.removeprefix('fault:')}", fn, differentiable=False)


__all__ = ["Attribution", "attribute", "bisect_compiler", "runtime_layer"]
