"""``rlx_nb.invariance``: the same rows in other configurations of one computation, bit for bit first, then judged.

Each row is computed alone (the reference configuration) and in each other configuration, on the oracle (eager
float32) and on each backend asked for; every output of the row is compared bit for bit.  Where they differ, the
difference is judged on the verdict's one scale against float64 of the row alone (within round-off: a legitimate
kernel choice, the fix a batch-invariant kernel; past the line: a real bug such as a mask that leaks or a cache that
holds the wrong positions), and the model's ops are recorded in both configurations to name the first op whose inputs
are bit for bit the row's and whose output is not (:mod:`rlx_nb.configurations.ops`); on a backend, whose kernels no
op record sees, each leaf module is run alone through it instead (:mod:`rlx_nb.configurations.alone`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from typing import Any

import torch

from rlx_nb._support import switches
from rlx_nb._support.progress import bar
from rlx_nb.backends.base import ORACLE
from rlx_nb.backends.registry import get_backend
from rlx_nb.changes.ops import SEPARATOR
from rlx_nb.comparison.compare import judge_leaf
from rlx_nb.configurations import configs as cf
from rlx_nb.configurations.alone import first_module_alone
from rlx_nb.configurations.grads import float64_row_grads, row_grads
from rlx_nb.configurations.kernels import path_in_run
from rlx_nb.configurations.ops import first_parting, recorded
from rlx_nb.configurations.report import InvarianceReport
from rlx_nb.errors import BackendError, InputError, describe_error, did_you_mean, still_interrupted
from rlx_nb.execution.environment import environment
from rlx_nb.execution.results import to_leaf
from rlx_nb.numerics.device import same_bits

KINDS = ("batch", "position", "padding", "cache")


class _Through(torch.nn.Module):
    # A backend of the registry run on the model with one configuration's inputs: ``fn(module, inputs)`` where the
    # module takes the inputs positionally, whatever names the model takes them by.
    def __init__(self, model: torch.nn.Module, keys: list[str] | None) -> None:
        super().__init__()
        self.model, self.keys = model, keys

    def forward(self, *tensors: torch.Tensor) -> Any:
        if self.keys is None:
            return self.model(*tensors)
        return self.model(**dict(zip(self.keys, tensors, strict=True)))


class _OnBackend:
    # What a configuration calls as its model: the backend's run of the model on those inputs.
    def __init__(self, model: torch.nn.Module, backend: Any) -> None:
        self.model, self.backend = model, backend
        self.forward = model.forward  # (what the configurations inspect: position_ids, a cache)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        keys = list(kwargs) if kwargs else None
        tensors = tuple(kwargs.values()) if kwargs else args
        with torch.no_grad():
            return self.backend.fn(_Through(self.model, keys), tensors)


def invariance(
    model: torch.nn.Module,
    inputs: Any,
    *,
    backends: str | Iterable[str] | None = None,
    configs: Iterable[str] | None = None,
    batch_sizes: Iterable[int] = cf.BATCH_SIZES,
    pad: int = cf.PAD,
    rows: Iterable[int] | None = None,
    ops: bool = True,
    backward: bool = False,
    label: str | None = None,
    progress: bool = True,
) -> InvarianceReport:
    """Compute each row alone and in other configurations of the same computation, and compare them bit for bit,
    on the oracle and on each backend; judge each difference against float64 and name the first op that parts.

    Parameters
    ----------
    model : torch.nn.Module
        As it is (a Hugging Face model too); run in eval mode, its modes put back after.
    inputs : tensor, tuple or dict
        Batch-first: row ``i`` is slice ``i`` of every input (a dict: keyword arguments, ``input_ids`` and
        ``attention_mask`` for padding and cache configurations).  At least two rows: the others fill the batches.
    backends : list of str, optional
        Besides the oracle (``cpu``, eager float32, always): backends of the registry, each run on every
        configuration (a compiling one compiles each shape).  Cache configurations run on the oracle only.
    configs : list of str, optional
        ``batch`` (the row first in batches of ``batch_sizes``), ``position`` (last in them), ``padding`` (``pad``
        masked tokens left and right, and beside a row of padding: token inputs), ``cache`` (prefilled in two chunks
        and decoded token by token, against the whole prefill: a decoder with a cache).  Default: every one that
        applies to the model and inputs.
    rows : list of int, optional
        The rows checked (default: the first two).
    ops : bool
        Record the ops where a configuration's outputs differ, to name the first that parts.
    backward : bool
        Also each row's per-sample gradients on the oracle (outputs ``grad:<parameter>``: the gradient of the row's
        outputs against a fixed cotangent, :mod:`rlx_nb.configurations.grads`), in the batch and padding
        configurations: what a trainer computes from a rollout's rows.

    Returns
    -------
    InvarianceReport
        ``frame`` (per backend, configuration, row and output: bit for bit or not, its place on the line), ``lines()``,
        ``certificate``, ``plot()``, ``report(...)`` (a pair as a report for ``rlx_nb.explore``), ``to_html()``.

    Examples
    --------
    >>> import torch, rlx_nb
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <...>
    >>> model = torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Softmax(-1))
    >>> rep = rlx_nb.invariance(model, torch.randn(4, 16), progress=False)
    >>> rep.verdict()
    'bit for bit'
    """
    if not isinstance(model, torch.nn.Module):
        raise InputError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    given = cf.Inputs.of(inputs)
    kinds = _kinds(model, given, configs)
    sizes = _sizes(batch_sizes)
    if not isinstance(backward, bool):
        raise InputError(f"backward must be True or False; got {backward!r}")
    if isinstance(pad, bool) or not isinstance(pad, int) or pad < 1:
        raise InputError(f"pad must be a whole number of tokens >= 1; got {pad!r}")
    if given.rows < 2 and ({"batch", "position"} & set(kinds)):
        raise InputError("batch and position configurations need at least 2 rows (the other rows fill the batches); "
                         f"got {given.rows}: give more rows, or configs= without batch and position")  # fmt: skip
    chosen = _rows(rows, given.rows)
    names = _backends(backends)
    report = InvarianceReport(label or type(model).__name__, [ORACLE, *names], kinds, environment())
    start = time.perf_counter()
    # (the model itself, in eval mode for the call and put back after: a copy was its whole size again)
    modes = {m: m.training for m in model.modules()}
    with switches.exclusive():
        try:
            model.eval()
            _compare(model, given, report, _Plan(names, kinds, sizes, pad, chosen, ops, backward, progress))
        except (KeyboardInterrupt, SystemExit) as exc:  # (the configurations compared so far are kept)
            report.incomplete = f"interrupted after {len(report.pairs)} configuration(s) compared"
            exc.add_note("rlx_nb: rlx_nb.interrupted_invariance() returns the configurations compared so far")
            _KEPT["report"] = report
            raise
        finally:
            for m, training in modes.items():
                m.training = training
    report.seconds = time.perf_counter() - start
    return report


_KEPT: dict[str, Any] = {"report": None}


def interrupted_invariance() -> InvarianceReport | None:
    """The report of the last :func:`invariance` an interrupt stopped (its configurations so far), or None."""
    return _KEPT["report"]


def _kinds(model: Any, given: cf.Inputs, asked: Iterable[str] | None) -> list[str]:
    applies = {"batch", "position"} | ({"padding"} if given.tokens else set())
    applies |= {"cache"} if given.tokens and cf.has_cache(model) else set()
    if asked is None:
        return [k for k in KINDS if k in applies]
    asked = [asked] if isinstance(asked, str) else list(asked)
    for k in asked:
        if k not in KINDS:
            raise InputError(f"unknown configuration {k!r}{did_you_mean(k, KINDS)}; allowed: {', '.join(KINDS)}")
        if k == "cache" and k not in applies:
            raise InputError("cache configurations need a decoder with a cache (a model whose forward takes "
                             "past_key_values and use_cache) and token inputs (input_ids); this model has none")  # fmt: skip
        if k == "padding" and k not in applies:
            raise InputError("padding configurations need token inputs: a dict with input_ids (and attention_mask)")
    return [k for k in KINDS if k in asked]


def _sizes(batch_sizes: Iterable[int]) -> tuple[int, ...]:
    try:
        sizes = tuple(int(s) for s in batch_sizes)
    except (TypeError, ValueError):
        raise InputError(f"batch_sizes must be whole numbers >= 2; got {batch_sizes!r}") from None
    if not sizes or any(s < 2 for s in sizes):
        raise InputError(f"batch_sizes must be whole numbers >= 2 (1 is the row alone); got {list(sizes)}")
    return tuple(sorted(set(sizes)))


def _rows(rows: Iterable[int] | None, n: int) -> list[int]:
    if rows is None:
        return list(range(min(2, n)))
    chosen = sorted({int(r) for r in rows})
    bad = [r for r in chosen if not 0 <= r < n]
    if bad or not chosen:
        raise InputError(f"rows {bad or chosen} are not rows of the inputs (0 to {n - 1})")
    return chosen


def _backends(backends: Any) -> list[str]:
    if backends is None:
        return []
    names = [backends] if isinstance(backends, str) else list(backends)
    for n in names:
        try:
            get_backend(n)
        except BackendError as exc:
            raise InputError(str(exc)) from None
    return [n for n in names if n != ORACLE]


@dataclasses.dataclass
class _Plan:
    # What a call asked for, checked.
    names: list[str]
    kinds: list[str]
    sizes: tuple[int, ...]
    pad: int
    rows: list[int]
    ops: bool
    backward: bool
    progress: bool


def _compare(base: torch.nn.Module, given: cf.Inputs, report: InvarianceReport, plan_of: _Plan) -> None:
    names, kinds, sizes, pad, rows = plan_of.names, plan_of.kinds, plan_of.sizes, plan_of.pad, plan_of.rows
    ops, backward, progress = plan_of.ops, plan_of.backward, plan_of.progress
    pad_id = int(getattr(getattr(base, "config", None), "pad_token_id", None) or 0)
    reference: dict[int, dict[str, torch.Tensor]] = {}
    runners = {ORACLE: base, **{n: _OnBackend(base, get_backend(n)) for n in names}}
    plan = []
    for backend, runner in runners.items():
        for i in rows:
            made = []
            if {"batch", "position"} & set(kinds):
                made += [c for c in cf.batch_configs(given, i, sizes) if c.kind in kinds]
            if "padding" in kinds:
                made += cf.padding_configs(base, given, i, pad, pad_id)
            if "cache" in kinds and backend == ORACLE:
                made += cf.cache_configs(base, given, i)
            plan += [(backend, runner, c) for c in made]
    with bar(f"rlx_nb invariance {report.label}", total=len(plan), unit="config", enabled=progress) as shown, \
            torch.no_grad():  # fmt: skip
        alone: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
        records: dict[int, Any] = {}
        for backend, runner, config in plan:
            shown.set_postfix_str(f"{backend}: row {config.row}, {config.name}")
            key = (backend, config.row)
            try:
                grads = backward and backend == ORACLE
                if key not in alone:
                    alone[key] = _checked(cf.outputs(given.call(runner, given.row(config.row))))
                    if grads:
                        row = given.row(config.row)
                        alone[key].update(row_grads(lambda row=row: cf.outputs(given.call(base, row)), base,
                                                    alone[key], {}))  # fmt: skip
                got = config.run(runner)
                if grads and config.kind != "cache":  # (a trainer's rows: batched and padded, not decoded)
                    like = {k: v for k, v in alone[key].items() if not k.startswith("grad:")}
                    got.update(row_grads(lambda c=config: c.run(base), base, like, config.where))
            except InputError:
                raise
            except Exception as exc:
                still_interrupted(exc)
                report.failed[f"{backend}: {config.name}"] = describe_error(exc)
                shown.update()
                continue
            rows_out = _pair(alone[key], got, config)
            if any(not same for same, *_ in rows_out.values()):
                if config.row not in reference:
                    reference[config.row] = _float64(base, given, config.row)
                    if backward:
                        reference[config.row].update(_float64_grads(base, given, config.row, alone[key]))
                _judged(report, backend, config, rows_out, reference[config.row])
                if ops and not report.has_op(backend, config.name):
                    shown.set_postfix_str(f"{backend}: the ops of {config.name}")
                    if backend == ORACLE:
                        report.add_op(backend, config, _parting(base, given, config, records))
                    else:  # (its ops are its own: each leaf module run alone through it, in both configurations)
                        report.add_op(backend, config, first_module_alone(base, given, config, runner.backend))
            else:
                report.add_pair(backend, config, {k: (True, 0.0, None, None) for k in rows_out})
            shown.update()


def _checked(out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if not out:
        raise InputError("the model returned no floating tensor: there is nothing to compare per row")
    flat = [k for k, v in out.items() if v.dim() == 0 or v.shape[0] != 1]
    if flat and len(flat) == len(out):
        raise InputError(f"the model's outputs are not per row ({', '.join(flat[:3])} has no batch dimension first): "
                         "an invariance check compares each row's own outputs")  # fmt: skip
    return {k: v for k, v in out.items() if k not in flat}


def _pair(alone: dict[str, torch.Tensor], got: dict[str, torch.Tensor], config: cf.Config) -> dict[str, tuple]:
    # Per output of the row: (bit for bit, largest difference, the row alone, the row here), cut to the row.
    out = {}
    for k, a in alone.items():
        b = got.get(k)
        if b is None:
            continue
        cut = cf.aligned(b, a.shape, **config.where)
        if cut is None:
            continue
        same = same_bits(a, cut)
        diff = 0.0 if same else float((a.double() - cut.double()).abs().max())
        out[k] = (same, diff, a, cut)
    return out


def _float64(base: torch.nn.Module, given: cf.Inputs, i: int) -> dict[str, torch.Tensor]:
    # The row alone in float64, its weights cast one op at a time (no float64 copy of the model): the reference every
    # difference of the row is judged against.
    from rlx_nb.backends.eager import run_float64_streamed

    row = given.row(i)
    return cf.outputs(run_float64_streamed(_Through(base, list(row) if given.keywords else None), tuple(row.values())))


def _float64_grads(base: torch.nn.Module, given: cf.Inputs, i: int, alone: dict) -> dict[str, torch.Tensor]:
    row = {k: v.double() if v.is_floating_point() else v for k, v in given.row(i).items()}
    like = {k: v for k, v in alone.items() if not k.startswith("grad:")}
    return float64_row_grads(base, lambda m: given.call(m, row), like, cf.outputs)


def _judged(report: InvarianceReport, backend: str, config: cf.Config, rows_out: dict, ref: dict) -> None:
    judged = {}
    for k, (same, diff, a, b) in rows_out.items():
        if same:
            judged[k] = (True, 0.0, None, None)
            continue
        r = ref.get(k)
        if r is None or tuple(r.shape) != tuple(a.shape):
            judged[k] = (False, diff, None, (a, b, None))
            continue
        record = judge_leaf(to_leaf(a, copy=True), to_leaf(b, copy=True), to_leaf(r, copy=True), backend=backend,
                            output=k)  # fmt: skip
        judged[k] = (False, diff, record, (a, b, r))
    report.add_pair(backend, config, judged)


def _parting(base: torch.nn.Module, given: cf.Inputs, config: cf.Config, kept: dict[Any, Any]) -> Any:
    # (the row alone's record, and its ops' kernel paths, once a row, for every configuration compared with it)
    row = given.row(config.row)
    if config.row not in kept:
        kept.clear()  # (one row's record at a time)
        kept[config.row] = recorded(lambda m: given.call(m, row), base)
        kept["paths"] = {}
    alone, paths = kept[config.row], kept["paths"]
    # (a cache's run: its last call's ops, the earlier calls run first, unrecorded, to fill the cache)
    run = config.last(base) if config.last is not None else config.run
    where = {"window": config.window} if config.window is not None else config.where
    first: dict[str, str] = {}  # (the first op that parts, and its kernel path, taken as the run makes it)
    here = recorded(run, base, against=alone, where=where, first=first)  # (compared as it runs, nothing kept)
    parting = first_parting(alone, here)
    if parting.op is not None and SEPARATOR in parting.op:  # (an op, not a module: its kernel path in each)
        if parting.op not in paths:
            paths[parting.op] = path_in_run(lambda m: given.call(m, row), base, parting.op)
        mine = paths[parting.op]
        if first.get("op") == parting.op:
            theirs = first["path"]
        else:  # (the run's first parting op in its own order was another: the op run again where it is called)
            theirs = path_in_run(config.last(base) if config.last is not None else config.run, base, parting.op)
        if mine or theirs:
            parting.kernels = mine if mine == theirs else f"{mine or '?'} alone against {theirs or '?'} here"
    return parting


__all__ = ["KINDS", "interrupted_invariance", "invariance"]
