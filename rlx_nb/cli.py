"""``rlx-nb``: the command line, for CI gates and cluster nodes.

Exit codes: 0 every backend is round-off; 1 some backend is SUSPECT (with
``--baseline``: some backend got worse than in the baseline); 2 usage error or
the target cannot be loaded; 3 no SUSPECT but some requested backend did not run,
or nothing was judged (the call interrupted, every backend skipped or failed).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlx_nb._support.safe import term_text
from rlx_nb.errors import InputError, RlxError, TargetError

EXIT_OK, EXIT_SUSPECT, EXIT_USAGE, EXIT_BACKEND_FAILED = 0, 1, 2, 3
_TARGET = "path/to/file.py:factory or package.module:factory; factory() -> (model, inputs)"


def load_target(target: str) -> tuple[Any, Any]:
    """Import ``path/to/file.py:factory`` or ``package.module:factory`` and call ``factory()``.

    ``factory()`` must return ``(model, inputs)``.  Importing the target may
    register backends.
    """
    made, attr = _made(target)
    if not (isinstance(made, (tuple, list)) and len(made) == 2):
        raise TargetError(f"{attr}() must return (model, inputs); got {type(made).__name__}")
    return made[0], made[1]


TRAINING_PARTS = ("model", "batches", "loss_fn", "optimizer")


def load_training_target(target: str) -> dict[str, Any]:
    """``rlx-nb train``'s target: ``factory()`` returns a dict with ``model``, ``batches``, ``optimizer`` (a factory
    ``optimizer(params)``) and optionally ``loss_fn`` -- :func:`rlx_nb.training_divergence`'s arguments."""
    made, attr = _made(target)
    if not isinstance(made, dict) or not {"model", "batches", "optimizer"} <= set(made):
        raise TargetError(f"{attr}() must return a dict with model, batches, optimizer (and loss_fn); got "
                          + (f"a dict with {sorted(made)}" if isinstance(made, dict) else type(made).__name__))  # fmt: skip
    extra = sorted(set(made) - set(TRAINING_PARTS))
    if extra:
        raise TargetError(f"{attr}() returned unknown parts {extra}; allowed: {', '.join(TRAINING_PARTS)}")
    return made


def _made(target: str) -> tuple[Any, str]:
    if ":" not in target:
        raise TargetError(f"target {target!r} must be 'path/to/file.py:factory' or 'package.module:factory'")
    where, _, attr = target.rpartition(":")
    if not where or not attr.isidentifier():
        raise TargetError(f"target {target!r}: {attr!r} is not a function name")
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where)
        if not path.is_file():
            raise TargetError(f"target file {where!r} does not exist")
        spec = importlib.util.spec_from_file_location(f"rlx_nb_target_{path.stem}", path)
        if spec is None or spec.loader is None:
            raise TargetError(f"cannot import {where!r} as a Python file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            raise TargetError(f"importing {where!r} failed: {type(exc).__name__}: {exc}") from None
    else:
        try:
            module = importlib.import_module(where)
        except Exception as exc:
            raise TargetError(f"importing module {where!r} failed: {type(exc).__name__}: {exc}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise TargetError(f"{where!r} has no callable {attr!r}")
    try:
        return factory(), attr
    except Exception as exc:
        raise TargetError(f"{attr}() failed: {type(exc).__name__}: {exc}") from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rlx-nb",
        description="Is a backend's divergence from the CPU oracle round-off, or a kernel bug?",
    )
    sub = p.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="run TARGET's model on the backends and gate on the verdict")
    check.add_argument("target", help=_TARGET)
    _common(check)
    check.add_argument(
        "--int8",
        action="store_true",
        help="quantize the model to int8 (PT2E, XNNPACK's quantizer) and judge its int8 runtimes against its Q/DQ "
        "simulation (rlx_nb.quantized_divergence; default backends executorch-xnnpack, executorch-portable)",
    )
    check.add_argument("--save", metavar="DIR", help="also save the report to DIR/<node>.rlxnb (for rlx-nb merge)")
    check.add_argument("--node", help="node name for --save (default: this host's name)")
    check.add_argument("--html", metavar="FILE", help="also write a self-contained HTML report to FILE")
    check.add_argument(
        "--repro",
        metavar="DIR",
        help="for each SUSPECT backend, write to DIR a standalone repro of its culprit (shrunk; torch + numpy + the "
        "runtime only) and an issue ready to file (issue_<backend>.md)",
    )
    check.add_argument(
        "--baseline",
        metavar="OLD.rlxnb",
        help="compare with a report saved before (another torch/ORT/OpenVINO/driver); exit 1 only when some "
        "backend got worse beyond round-off; exit 2 when the baseline was made from another model or inputs",
    )
    check.add_argument(
        "--allow-different-model",
        action="store_true",
        help="with --baseline: compare even when the saved model or input fingerprints differ (said in the lines)",
    )
    show = sub.add_parser("show", help="print a saved report's lines; --html writes it as one HTML file")
    show.add_argument("file", help="a report saved with --save or report.save (.rlxnb)")
    show.add_argument("--html", metavar="FILE", help="write a self-contained HTML report to FILE")
    merge = sub.add_parser("merge", help="merge reports saved by several nodes; judge all against one oracle")
    merge.add_argument("files", nargs="+", help="reports saved with --save (.rlxnb)")
    merge.add_argument("--oracle", help="node whose CPU oracle and fp64 reference to use (default: the first file)")
    merge.add_argument("--label", help="label for the report lines")
    snap = sub.add_parser(
        "snapshot",
        help="record TARGET's run here, module by module (inputs, outputs, this environment; --reference adds each "
        "module's float64 value), for rlx-nb diff in another environment",
    )
    snap.add_argument("target", help=_TARGET)
    snap.add_argument("-o", "--output", required=True, metavar="FILE", help="the snapshot file to write (.rlxsnap)")
    snap.add_argument(
        "--backend",
        default="cpu",
        help="what to run on (default: the CPU oracle); a backend that compiles or exports the whole model runs "
        "each module alone, for a diff on its next version",
    )
    snap.add_argument(
        "--reference",
        action="store_true",
        help="also record each module's float64 value (one float64 forward more): needed to diff two snapshots",
    )
    snap.add_argument(
        "--ops",
        action="store_true",
        help="also record each module's own torch function calls (F.softmax, torch.matmul...): a diff names the op",
    )
    snap.add_argument("--byte-budget", type=int, metavar="BYTES", help="the most bytes of arrays to write")
    snap.add_argument("--label", help="a name for this environment (default: host and torch version)")
    dif = sub.add_parser(
        "diff",
        help="where this environment's run of TARGET parts from a snapshot's, module by module, judged on round-off "
        "(or two snapshots); exit 1 when a module's change is past the line",
    )
    dif.add_argument("snapshot", help="a snapshot written by rlx-nb snapshot (.rlxsnap)")
    dif.add_argument("target", help="path/to/file.py:factory or package.module:factory, or a second snapshot")
    dif.add_argument("--backend", help="what to run on here (default: what the snapshot ran on)")
    dif.add_argument("--all", action="store_true", help="check every module alone, not only down into those past it")
    dif.add_argument("--html", metavar="FILE", help="also write a self-contained HTML page of the diff to FILE")
    train = sub.add_parser(
        "train",
        help="train TARGET's model on the oracle and on each training backend from the same state (rlx_nb."
        "training_divergence); exit 1 when a local step is past the line (--trajectory: or a trajectory leaves its "
        "envelope)",
    )
    train.add_argument("target", help="path/to/file.py:factory or package.module:factory; factory() -> dict(model=, "
                       "batches=, optimizer=, loss_fn=)")  # fmt: skip
    train.add_argument("--steps", type=int, required=True, help="training steps")
    train.add_argument("--backends", help="comma-separated training backends (default: the built-in set but bf16)")
    train.add_argument("--local-steps", help="comma-separated steps to judge locally besides the default ones")
    train.add_argument("--trajectory", action="store_true",
                       help="also exit 1 when a trajectory leaves its envelope (drift; chaos alone can do it)")  # fmt: skip
    train.add_argument("--html", metavar="FILE", help="also write a self-contained HTML report to FILE")
    train.add_argument("--label", help="label for the report lines")
    inv = sub.add_parser(
        "invariance",
        help="compute TARGET's rows alone and in other configurations (batch sizes, positions, padding, the cache) "
        "and compare them bit for bit (rlx_nb.invariance); exit 1 when some output is not bit for bit the row "
        "alone's (--past-line: only when some difference is past the line)",
    )
    inv.add_argument("target", help=_TARGET)
    inv.add_argument("--backends", help="comma-separated backends besides the oracle")
    inv.add_argument("--configs", help="comma-separated: batch, position, padding, cache (default: those that apply)")
    inv.add_argument("--past-line", action="store_true", help="exit 1 only when a difference is past the line")
    inv.add_argument("--backward", action="store_true", help="also each row's per-sample gradients (the oracle's)")
    inv.add_argument("--certificate", metavar="FILE", help="write the certificate (JSON) to FILE")
    inv.add_argument("--html", metavar="FILE", help="also write a self-contained HTML report to FILE")
    inv.add_argument("--label", help="label for the report lines")
    sub.add_parser("backends", help="list every registered backend and whether it is live here")
    demo = sub.add_parser(
        "demo",
        help="run the embedded demo models (forward and backward) on every live backend plus the fault catalogue; "
        "exits 0 when exactly the faulty backends are SUSPECT",
    )
    _common(demo)
    return p


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backends", help="comma-separated backend names (default: every live backend)")
    p.add_argument(
        "--tol-rel", type=float, help="the fixed rule's max_rel threshold (default 2e-3, 1e-2 for gradients)"
    )
    p.add_argument("--backward", action="store_true", help="also compare gradients (demo always does)")
    p.add_argument("--label", help="label for the report lines")
    p.add_argument("--rule", choices=["budget", "fixed"], default="budget", help="the verdict in charge")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "backends":
            return _backends()
        if args.command == "demo":
            return _demo(args)
        if args.command == "merge":
            return _merge(args)
        if args.command == "show":
            return _show(args)
        if args.command == "snapshot":
            return _snapshot(args)
        if args.command == "diff":
            return _diff(args)
        if args.command == "train":
            return _train(args)
        if args.command == "invariance":
            return _invariance(args)
        return _check(args)
    except RlxError as exc:
        print(term_text(f"rlx-nb: error: {exc}"), file=sys.stderr)
        return EXIT_USAGE


def _train(args: argparse.Namespace) -> int:
    import rlx_nb

    parts = load_training_target(args.target)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()] if args.backends else None
    try:
        local = [int(s) for s in args.local_steps.split(",") if s.strip()] if args.local_steps else None
    except ValueError:
        raise InputError(f"--local-steps must be comma-separated step numbers; got {args.local_steps!r}") from None
    report = rlx_nb.training_divergence(parts["model"], parts["batches"], parts.get("loss_fn"),
                                        optimizer=parts["optimizer"], steps=args.steps, backends=backends,
                                        local_steps=local, label=args.label)  # fmt: skip
    print(term_text(str(report)))
    if args.html:
        print(f"wrote {report.to_html(args.html)}")
    if report.suspects or (args.trajectory and report.leaving):
        return EXIT_SUSPECT
    return EXIT_BACKEND_FAILED if report.failed else EXIT_OK


def _invariance(args: argparse.Namespace) -> int:
    import rlx_nb

    model, inputs = load_target(args.target)
    split = [b.strip() for b in args.backends.split(",") if b.strip()] if args.backends else None
    configs = [c.strip() for c in args.configs.split(",") if c.strip()] if args.configs else None
    report = rlx_nb.invariance(model, inputs, backends=split, configs=configs, backward=args.backward,
                               label=args.label)  # fmt: skip
    print(term_text(str(report)))
    if args.certificate:
        print(f"wrote {report.save_certificate(args.certificate)}")
    if args.html:
        print(f"wrote {report.to_html(args.html)}")
    verdict = report.verdict()
    if verdict == "SUSPECT" or (verdict != "bit for bit" and not args.past_line):
        return EXIT_SUSPECT
    return EXIT_BACKEND_FAILED if report.failed else EXIT_OK


def _backends() -> int:
    from rlx_nb.backends.registry import backend_table

    for row in backend_table():
        live = "live" if row["live"] else "absent"
        opt = "" if row["default"] else " (opt-in)"
        why = f" — {row['reason']}" if row["reason"] else ""
        print(f"{row['backend']:24s} {live:6s} {row['compute_dtype']:9s} {row['description']}{opt}{why}")
    return EXIT_OK


def _check(args: argparse.Namespace) -> int:
    import socket

    from rlx_nb.api import backend_divergence

    node = args.node or socket.gethostname()
    if args.save:  # (said before the model runs, not after)
        _check_node(node)
        _check_writable(args.save, "--save", directory=True)
    if args.html:
        _check_writable(args.html, "--html", directory=False)
    if args.repro:
        _check_writable(args.repro, "--repro", directory=True)
    if args.int8 and (args.backward or args.rule != "budget" or args.tol_rel is not None):
        raise InputError("--int8 judges int8 runtimes on their own budget, forward only: drop --backward, --rule "
                         "and --tol-rel")  # fmt: skip
    model, inputs = load_target(args.target)
    if args.int8:
        from rlx_nb.int8.divergence import quantized_divergence

        report = quantized_divergence(model, inputs, backends=args.backends, label=args.label)
    else:
        report = backend_divergence(
            model,
            inputs,
            backends=args.backends,
            tol_rel=args.tol_rel,
            backward=args.backward,
            label=args.label,
            rule=args.rule,
        )
    for line in report.lines():
        print(term_text(line))
    if args.save:
        path = report.save(Path(args.save) / f"{node}.rlxnb")
        print(f"saved {path}")
    if args.repro:
        _repros(report, Path(args.repro), model, inputs)
    if args.html:
        print(f"wrote {report.to_html(args.html)}")
    if args.baseline:
        from rlx_nb.report.baseline import compare_reports

        moved = compare_reports(args.baseline, report, allow_different_model=args.allow_different_model)
        for line in moved.lines():
            print(term_text(line))
        return EXIT_SUSPECT if moved.any_worse else _unjudged_code([report])
    return _exit_code([report])


def _repros(report: Any, where: Path, model: Any, inputs: Any) -> None:
    # Each SUSPECT backend's repro and issue; one that cannot be written says why and the others go on.
    from rlx_nb.errors import RlxError

    for backend in report.suspects:
        try:
            report.repro(backend, where, model=model, inputs=inputs)
            path = report.issue(backend, where).path
        except RlxError as exc:
            print(term_text(f"rlx-nb: no repro for {backend}: {exc}"), file=sys.stderr)
            continue
        repro = report.repros[backend]
        state = "reproduces" if repro.reproduces else "did NOT cross the line when run"
        print(term_text(f"wrote {repro.path} ({repro.lines} lines; {state}) and {path}"))


def _check_node(node: str) -> None:
    # --node names one file in --save: never a path that leads out of it.
    if not node or node in (".", "..") or Path(node).name != node or "\\" in node or "/" in node:
        raise InputError(f"--node must be a plain name for a file in --save (no '/', '\\' or '..'), got {node!r}")


def _check_writable(where: str, option: str, *, directory: bool) -> None:
    # The first part of the path that exists must be a directory this process may write into (and, for a
    # directory option, the path itself one when it exists).
    path = Path(where)
    if directory and path.exists() and not path.is_dir():
        raise InputError(f"{option} {where!r} is a file; it must be a directory (made if missing)")
    if not directory and path.is_dir():
        raise InputError(f"{option} {where!r} is a directory; it must name a file")
    start = path if directory else path.parent
    existing = next((p for p in (start, *start.parents) if p.exists()), None)
    if existing is not None and (not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK)):
        what = "not a directory" if not existing.is_dir() else "not writable"
        raise InputError(f"{option} {where!r} cannot be written: {str(existing)!r} is {what}")


def _show(args: argparse.Namespace) -> int:
    from rlx_nb.api import load_report

    report = load_report(args.file)
    for line in report.lines():
        print(term_text(line))
    if args.html:
        print(f"wrote {report.to_html(args.html)}")
    return _exit_code([report])


def _snapshot(args: argparse.Namespace) -> int:
    from rlx_nb.changes.record import snapshot
    from rlx_nb.changes.snapshot_file import load_snapshot

    _check_writable(args.output, "--output", directory=False)
    model, inputs = load_target(args.target)
    path = snapshot(model, inputs, args.output, backend=args.backend, reference=args.reference,
                    byte_budget=args.byte_budget, label=args.label, ops=args.ops)  # fmt: skip
    print(term_text(f"wrote {path}: {load_snapshot(path)!r}"))
    return EXIT_OK


def _diff(args: argparse.Namespace) -> int:
    from rlx_nb.changes.diff import diff
    from rlx_nb.changes.result import IDENTICAL, WITHIN

    if args.html:
        _check_writable(args.html, "--html", directory=False)
    if ":" not in args.target or Path(args.target).suffix == ".rlxsnap":
        if args.backend or args.all:
            raise InputError("--backend and --all need a model (TARGET); two snapshots are compared as recorded")
        result = diff(args.snapshot, args.target)
    else:
        model, inputs = load_target(args.target)
        result = diff(args.snapshot, model, inputs, backend=args.backend, local="all" if args.all else "descend")
    for line in result.lines():
        print(term_text(line))
    if args.html:
        print(f"wrote {result.to_html(args.html)}")
    if result.past_line:
        return EXIT_SUSPECT
    if not result.frame.change.isin([WITHIN, IDENTICAL]).any():
        print("rlx-nb: judged nothing, so this cannot pass: no module was judged", file=sys.stderr)
        return EXIT_BACKEND_FAILED
    return EXIT_OK


def _merge(args: argparse.Namespace) -> int:
    from rlx_nb.report.merge import merge_reports

    report = merge_reports(args.files, oracle=args.oracle)
    if args.label:
        report.results.label = args.label
    for line in report.lines():
        print(term_text(line))
    return _exit_code([report])


def _exit_code(reports: list) -> int:
    # SUSPECT first; then a backend that did not run, or a report that judged nothing: a gate never passes on that.
    return EXIT_SUSPECT if any(r.any_suspect for r in reports) else _unjudged_code(reports)


def _unjudged_code(reports: list) -> int:
    nothing = [why for r in reports for why in [r.judged_nothing()] if why]
    for why in nothing:
        print(term_text(f"rlx-nb: judged nothing, so this cannot pass: {why}"), file=sys.stderr)
    if nothing or any(r.not_run for r in reports):
        return EXIT_BACKEND_FAILED
    return EXIT_OK


def _demo(args: argparse.Namespace) -> int:
    from rlx_nb.api import backend_divergence
    from rlx_nb.backends.registry import available_backends
    from rlx_nb.models import demo

    backends = args.backends or ",".join([b for b in available_backends() if b != "cpu"] + demo.FAULTS)
    reports = []
    for name, factory in demo.MODELS.items():
        model, inputs = factory()
        report = backend_divergence(
            model,
            inputs,
            backends=backends,
            tol_rel=args.tol_rel,
            backward=True,
            label=args.label or name,
            rule=args.rule,
        )
        for line in report.lines():
            print(term_text(line), flush=True)
        reports.append(report)
    caught = sorted({b for r in reports for b in r.suspects if b in demo.FAULTS})
    wrong = sorted({b for r in reports for b in r.suspects if b not in demo.FAULTS})
    missed = sorted(set(demo.FAULTS) & set(backends.split(",")) - set(caught))
    print(
        f"demo: faulty backends caught: {', '.join(caught) or 'none'}; "
        f"missed: {', '.join(missed) or 'none'}; legitimate backends called SUSPECT: {', '.join(wrong) or 'none'}"
    )
    return EXIT_SUSPECT if wrong or missed else EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
