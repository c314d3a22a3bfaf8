"""Generation: the step at which a backend's greedy tokens part from the oracle's, and whether that is round-off.

:func:`generation_divergence` decodes greedily on the CPU oracle (float32, the model's own cache), then
runs the fp64 reference and every backend *teacher-forced* on the oracle's tokens, each with its own cache
(:class:`rlx_nb.generation.decode.Decode`): step ``k`` of every run sees the same tokens, so each step's logits are one
output judged by the same round-off budget as a forward pass (:func:`rlx_nb.backend_divergence` runs it).
A step whose greedy token differs from the oracle's is a *flip*; it is a **near-tie** when the fp64 logits of
the two tokens lie within the step's round-off allowance of each other (twice the budget's largest error:
each logit may move by that much, in opposite directions), else a **real disagreement** (SUSPECT).  The
reasoning is in ``docs/verdict.md`` ("Generation").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch

from rlx_nb import errors
from rlx_nb._support import switches
from rlx_nb.backends.base import Backend
from rlx_nb.backends.registry import resolve_backends
from rlx_nb.errors import InputError, still_interrupted
from rlx_nb.execution import interrupted
from rlx_nb.execution.results import GENERATION_KEY, OK
from rlx_nb.execution.run import default_label
from rlx_nb.generation.decode import Decode, Step, step_name, step_of
from rlx_nb.generation.export import forget as forget_export
from rlx_nb.generation.report import GenerationReport, progress_line
from rlx_nb.report.judged import CallOptions, judged_report
from rlx_nb.report.report import DivergenceReport

MODES = ("teacher", "free")


def generation_divergence(
    model: Any,
    inputs: Any,
    *,
    max_new_tokens: int = 32,
    backends: str | Iterable[str | Backend] | None = None,
    step: Step | None = None,
    mode: str = "teacher",
    tokenizer: Any = None,
    label: str | None = None,
    progress: bool | Callable[[str], None] | None = None,
    timeout_s: float | None = 600.0,
    check_determinism: bool = True,
    memory_budget: float | None = None,
) -> GenerationReport:
    """Decode greedily on the CPU oracle and judge every backend's logits step by step.

    Parameters
    ----------
    model : torch.nn.Module or callable
        A causal language model.  A Hugging Face model is passed as it is and decodes with its own cache;
        anything else needs ``step``.  Run on private copies; the original is untouched.
    inputs : Tensor or dict
        The prompt: ``input_ids`` (``batch x length`` integers), or a dict holding ``input_ids`` (and an
        ``attention_mask`` of ones; padded prompts are not supported).
    max_new_tokens : int
        Steps to decode (the prefill's logits are step 0).
    backends : None, str or list
        As for :func:`rlx_nb.backend_divergence`: ``None`` runs every live default backend.  Eager backends
        (``cpu-nomkldnn``, ``cpu-bf16``, ``cpu-fp16``, ``fault:*``, registered ones) run the whole decode as
        they run any model; ``cpu-inductor`` compiles the step once (dynamic shapes) for every step; ONNX
        Runtime and OpenVINO run the exported prefill and decode step (:mod:`rlx_nb.generation.export`).
        A registered backend's ``fn(decode, inputs)`` gets the :class:`~rlx_nb.generation.decode.Decode` module:
        ``decode(*inputs)`` runs every step under it; a runtime with its own step sets
        ``decode.run_step = lambda input_ids, cache, mask: (logits, cache)`` first (its cache is its own).
    step : callable, optional
        ``step(model, input_ids, cache) -> (logits, cache)``: one decode step of a model without Hugging
        Face's interface.  The first call gets the prompt and ``cache=None``; ``logits`` are
        ``batch x [positions x] vocab``.
    mode : {"teacher", "free"}
        ``"teacher"`` (default): every backend is fed the oracle's tokens, so its steps stay aligned with the
        oracle's and each is judged.  ``"free"`` also lets each backend decode on its own and reports where
        its text parts from the oracle's, with both continuations (``report.free``).
    tokenizer : optional
        Anything with ``decode(list_of_ids) -> str``: tokens are also shown as text.
    label, progress, timeout_s, memory_budget
        As for :func:`rlx_nb.backend_divergence`.
    check_determinism : bool
        As for :func:`rlx_nb.backend_divergence`: the oracle's decode runs a second time (teacher-forced on its
        own tokens) and every step whose logits differ is ``nondeterministic``.  Where ``cpu-nomkldnn`` is a
        candidate and repeats the oracle's logits bit for bit, its decode is that second run; otherwise (e.g.
        ``backends=["cpu-inductor", "cpu-bf16"]``) the check costs one more decode of the oracle.  ``False``
        saves it, and the model's own nondeterminism then counts against the backends.

    Returns
    -------
    GenerationReport

    Examples
    --------
    >>> import rlx_nb
    >>> from rlx_nb.models import zoo
    >>> model, prompt = zoo.decoder("llama", batch=1)
    >>> report = rlx_nb.generation_divergence(model, prompt, max_new_tokens=4, backends=["cpu-nomkldnn"],
    ...                                       progress=False)
    >>> report.first_divergence.loc["cpu-nomkldnn", "kind"]
    'same tokens'
    """
    from rlx_nb.generation.backends import for_generation

    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if mode not in MODES:
        raise InputError(f"mode must be one of {', '.join(repr(m) for m in MODES)}; got {mode!r}")
    if step is not None and not callable(step):
        raise InputError(f"step must be a callable step(model, input_ids, cache) -> (logits, cache), got {step!r}")
    if tokenizer is not None and not callable(getattr(tokenizer, "decode", None)):
        raise InputError(f"tokenizer must have decode(list_of_ids) -> str, got {type(tokenizer).__name__}")
    ids, masked = _prompt(inputs)
    label = label or default_label(model)
    given = resolve_backends(backends)
    candidates = [for_generation(b) for b in given]

    # The oracle's run is its greedy decode (the Decode keeps its tokens); the determinism rerun, the fp64
    # reference and every backend are teacher-forced on those tokens.  The rerun is the same computation on the
    # same tokens as the greedy decode, so it is the determinism check without a decode of its own; cpu-nomkldnn's
    # teacher-forced decode is that check where it gives the greedy decode's logits bit for bit (rlx_nb.run).
    decode = Decode(model, prompt_len=ids.shape[1], steps=max_new_tokens, step=step, masked=masked, oracle_first=True)

    meta: dict[str, Any] = {
        "mode": mode,
        "prompt": ids.tolist(),
        "max_new_tokens": max_new_tokens,
        "step_function": getattr(step, "__name__", repr(step)) if step is not None else "",
    }
    before = interrupted.latest()

    options = CallOptions(backends=candidates, label=label, progress=progress, timeout_s=timeout_s,
                          check_determinism=check_determinism, memory_budget=memory_budget)  # fmt: skip

    def line(early: DivergenceReport) -> str:
        # Each backend's early line in a generation report's words, read against the oracle's tokens (held once
        # the oracle has decoded, before any backend is judged).
        tokens = decode.tokens.value
        return early.lines()[0] if tokens is None else progress_line(early, tokens)

    def judged() -> DivergenceReport:
        try:
            return judged_report(decode, (ids,), options, entry="generation_divergence", line=line)
        except (KeyboardInterrupt, SystemExit):  # what finished is kept as a generation (rlx_nb.interrupted_report)
            kept = interrupted.latest()
            if kept is not None and kept is not before and decode.tokens.value is not None:
                kept.environment[GENERATION_KEY] = {**meta, "mode": "teacher", "tokens": decode.tokens.value.tolist()}
            raise
        finally:
            forget_export()

    forward = judged()
    if decode.whole_helpers:  # (the helper runs computed every step at once: rlx_nb.generation.decode)
        apart = _paths_apart(forward)
        if apart:  # (the oracle's tokens are held: this call's oracle run is teacher-forced on them)
            decode.whole_helpers = False
            forward = judged()
        forward.results.environment["extra_runs"].append(
            f"the helper runs step by step: {apart}" if apart else "fp64 reference, sequential sums and anchors: "
            "every teacher-forced step at once (one forward over the prompt and the fed tokens, no cache), checked "
            "against the oracle's decode"
        )  # fmt: skip
    tokens = decode.tokens.value
    if tokens is None:  # (cannot happen: the oracle ran, or the call raised)
        raise RuntimeError("generation_divergence: the oracle's decode kept no tokens")
    meta["tokens"] = tokens.tolist()
    forward.results.environment[GENERATION_KEY] = meta
    if mode == "free":
        try:
            meta["free"] = free_runs(model, ids, max_new_tokens, candidates, step=step, masked=masked)
        except (KeyboardInterrupt, SystemExit) as exc:  # every teacher-forced backend had finished: keep them
            forward.results.environment["incomplete"] = "interrupted while the free-running decodes ran"
            interrupted.keep(forward.results, exc)
            raise
        finally:
            forget_export()
    if tokenizer is not None:
        texts = {"oracle": tokens.tolist(), **{name: rows for name, rows in (meta.get("free") or {}).items() if rows}}
        decoded, failed = _decoded(tokenizer, texts)
        if decoded is not None:
            meta["texts"] = decoded
        else:
            meta["tokenizer_note"] = failed
            tokenizer = None
    unstable = forward.results.environment.get("nondeterministic") or {}
    if unstable:
        first = min(unstable, key=lambda name: step_of(name) if name.startswith("step ") else -1)
        meta["oracle_note"] = (
            f"the oracle's decode is not reproducible: its teacher-forced rerun differs from its greedy decode at "
            f"{len(unstable)} step(s), from {first} on (the model's own nondeterminism, or state kept between calls)"
        )
    report = GenerationReport(forward, tokenizer=tokenizer)
    report.source = (model, ids, step, masked)
    report.backend_objects = {b.name: b for b in given}
    if tokenizer is not None:  # the words of every token a table or line names, kept for a saved report
        shown = set(tokens.reshape(-1).tolist()) | set(report.steps.backend_token[report.steps.flip].tolist())
        shown |= {t for rows in (meta.get("free") or {}).values() for r in rows for t in r}
        meta["token_texts"] = {str(i): report._text(i) for i in sorted(shown) if i >= 0}
    return report


def _decoded(tokenizer: Any, rows: dict[str, list[list[int]]]) -> tuple[dict[str, list[str]] | None, str]:
    # Every row's text through the user's tokenizer, or (None, why) where its decode() raised or returned something
    # that is not text: the report is then shown with token ids, never lost to a tokenizer's error.
    try:
        texts = {name: [tokenizer.decode(row) for row in value] for name, value in rows.items()}
    except Exception as exc:
        still_interrupted(exc)
        return (
            None,
            f"tokens shown as ids: the tokenizer's decode() raised {type(exc).__name__}: {errors.first_line(exc)}",
        )
    if not all(isinstance(t, str) for value in texts.values() for t in value):
        return None, "tokens shown as ids: the tokenizer's decode() returned something other than text"
    return texts, ""


def _prompt(inputs: Any) -> tuple[torch.Tensor, bool]:
    # (input_ids, whether an attention mask is passed along) from the user's prompt.
    masked = False
    if isinstance(inputs, Mapping):
        unknown = sorted(set(inputs) - {"input_ids", "attention_mask"})
        if "input_ids" not in inputs:
            raise InputError(f"inputs must hold 'input_ids'; got keys {sorted(inputs)}")
        if unknown:
            raise InputError(f"inputs may hold 'input_ids' and 'attention_mask' only; got also {unknown}")
        mask = inputs.get("attention_mask")
        if mask is not None:
            if not isinstance(mask, torch.Tensor) or not bool((mask == 1).all()):
                raise InputError(
                    "attention_mask must be all ones: padded prompts are not supported (decode each prompt "
                    "length as its own batch)"
                )
            masked = True
        inputs = inputs["input_ids"]
    if not isinstance(inputs, torch.Tensor) or inputs.dtype not in (torch.int64, torch.int32) or inputs.dim() != 2:
        got = f"a {inputs.dtype} tensor of shape {tuple(inputs.shape)}" if isinstance(inputs, torch.Tensor) else (
            type(inputs).__name__)  # fmt: skip
        raise InputError(f"input_ids must be an integer tensor of shape batch x length, got {got}")
    if inputs.is_meta:
        raise InputError("input_ids is on the meta device: it has a shape but no token ids to decode")
    if inputs.shape[1] < 1 or inputs.shape[0] < 1:
        raise InputError(f"input_ids must hold at least one token per row, got shape {tuple(inputs.shape)}")
    return inputs.detach().to("cpu", torch.int64), masked


APART = 2.0**-10
"""The oracle's decode and the whole-sequence fp64 reference part when a step's logits differ by more than
this share of their largest value: ~2**14 times float32's round-off, so a different computation, not rounding."""


def _paths_apart(forward: DivergenceReport) -> str:
    # Where the oracle's cached decode and the fp64 reference computed at once part ("" when they agree, or
    # when there is no reference to check): a model whose cache path computes something else.
    oracle, reference = forward.results.oracle.outputs, forward.results.reference.outputs
    if forward.results.reference.status != OK:
        return ""
    for name, leaf in oracle.items():
        ref = reference.get(name)
        if ref is None or not leaf.is_array or not ref.is_array or np.shape(ref.value) != np.shape(leaf.value):
            continue
        r = np.asarray(ref.value, dtype=np.float64)
        gap = float(np.abs(np.asarray(leaf.value, dtype=np.float64) - r).max(initial=0.0))
        if gap > APART * float(np.abs(r).max(initial=0.0)):
            return (f"the oracle's cached decode and one forward over the whole sequence part at {name} ({gap:.3g} "
                    "apart): the model's cached path computes something else than its full forward")  # fmt: skip
    return ""


def free_runs(model: Any, ids: torch.Tensor, steps: int, candidates: list[Backend], *, step: Step | None,
              masked: bool) -> dict[str, list[list[int]]]:  # fmt: skip
    """Each backend's own greedy decode (free running): its tokens, ``[]`` where it could not run."""
    from rlx_nb.execution.prepare import prepare_model

    out: dict[str, list[list[int]]] = {}
    with switches.exclusive(lambda _: None) as saved:
        for backend in candidates:
            decode = Decode(prepare_model(model, None, None), prompt_len=ids.shape[1], steps=steps, step=step,
                            free=True, masked=masked)  # fmt: skip
            try:
                with torch.no_grad():
                    logits = backend.fn(decode, (ids.clone(),))
                out[backend.name] = torch.stack(
                    [torch.as_tensor(logits[step_name(k)]).float().cpu().argmax(-1) for k in range(steps)], dim=1
                ).tolist()
            except Exception as _stop:  # its teacher-forced row says why it does not run
                still_interrupted(_stop)
                out[backend.name] = []
            finally:
                switches.restore(saved)
    return out


__all__ = ["generation_divergence"]
