"""Gather every node's results on rank 0 with torch.distributed, and compare them against one oracle.

Each rank runs the model on its own live backends and serialises its results in the safe report
format (:mod:`rlx_nb.report.files`); the bytes travel as a uint8 tensor, point to point, to rank 0 —
never as pickled objects.  Rank 0 merges them (:func:`rlx_nb.report.merge.merge_results`): every backend is
named ``<node>/<backend>`` and judged against rank 0's CPU oracle and fp64 reference.  A rank whose
run fails sends its error; a rank that dies or times out becomes a ``<node>/*`` error row; the
other ranks' results are kept.

Run it under ``torchrun`` (gloo or nccl)::

    torchrun --nproc-per-node=3 my_check.py     # my_check.py calls rlx_nb.distributed.gather_report(...)
"""

from __future__ import annotations

import datetime
import io
import os
import socket
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlx_nb._support.safe import file_stem, inside, write_new
from rlx_nb.errors import InputError, still_interrupted
from rlx_nb.execution.run import run
from rlx_nb.report.files import load_results, save_results
from rlx_nb.report.merge import merge_results


def free_local_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for a torchrun master or a local server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_torchrun(script: str, nproc: int) -> list[str]:
    """The command that runs ``script`` as ``nproc`` local torchrun processes on 127.0.0.1 (a free port)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1",
        f"--master-port={free_local_port()}",
        str(script),
    ]


def node_name(rank: int) -> str:
    """``$RLX_NB_NODE`` if set, else ``node<rank>``."""
    return os.environ.get("RLX_NB_NODE") or f"node{rank}"


def _to_bytes(results) -> bytes:
    buf = io.BytesIO()
    buf.write(b"R")  # the payload's kind byte, so the tensor needs no second copy
    save_results(results, _Offset(buf))
    return buf.getbuffer()


class _Offset(io.RawIOBase):
    # A writable view of a BytesIO past its first byte: zipfile's offsets stay relative to the zip.
    def __init__(self, inner: io.BytesIO) -> None:
        self.inner = inner

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, b) -> int:
        return self.inner.write(b)

    def tell(self) -> int:
        return self.inner.tell() - 1

    def seek(self, pos: int, whence: int = 0) -> int:
        return self.inner.seek(pos + 1 if whence == 0 else pos, whence) - 1

    def flush(self) -> None:
        pass


def _payload(kind: bytes, body) -> torch.Tensor:
    if kind == b"R":  # body already starts with the kind byte
        return torch.frombuffer(body, dtype=torch.uint8)
    return torch.frombuffer(bytearray(kind + bytes(body)), dtype=torch.uint8)


def gather_report(
    model: Any,
    inputs: Any,
    *,
    backends: str | Iterable[str] | None = None,
    backward: bool = False,
    label: str | None = None,
    timeout_s: float = 600.0,
    rule: str = "budget",
):
    """Run on every rank, gather on rank 0; returns the merged report on rank 0 and None elsewhere.

    The process group is initialised from torchrun's environment (gloo unless one exists already).
    ``timeout_s`` bounds how long rank 0 waits for each other rank.
    """
    from rlx_nb.report.report import DivergenceReport

    own_group = not dist.is_initialized()
    if own_group:
        if "RANK" not in os.environ:
            raise InputError("gather_report runs under torchrun (RANK/WORLD_SIZE unset); use merge_reports for files")
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        try:
            results = run(model, inputs, backends=backends, backward=backward, label=label)
            results.environment["node"] = node_name(rank)
            results.environment["host"] = socket.gethostname()
            body = _payload(b"R", _to_bytes(results))
        except Exception as exc:  # this rank's failure travels as a message, not a crash
            still_interrupted(exc)
            body = _payload(b"E", f"{type(exc).__name__}: {exc}".encode())
            results = None
        device = _wire_device()
        if rank != 0:
            dist.send(torch.tensor([body.numel()], dtype=torch.int64, device=device), dst=0)
            dist.send(body.to(device), dst=0)
            return None
        nodes: list[tuple[str, Any]] = [(node_name(0), results if results is not None else bytes(body[1:]).decode())]
        for src in range(1, world):
            nodes.append((f"node{src}", _receive(src, timeout_s, device)))
        named = []
        for name, item in nodes:
            if isinstance(item, (bytes, bytearray, memoryview)):
                res, _ = load_results(item)
                named.append((str(res.environment.get("node", name)), res))
            else:
                named.append((name, item))
        return DivergenceReport.from_results(merge_results(named, oracle=named[0][0]), rule=rule)
    finally:
        if own_group:
            dist.destroy_process_group()


def gather_diffs(
    model: Any,
    inputs: Any,
    *,
    backend: str = "cpu",
    directory: str | os.PathLike | None = None,
    byte_budget: int | None = None,
    timeout_s: float = 600.0,
) -> dict[str, Any] | None:
    """Snapshot the model on every rank and diff each node's against node 0's, on rank 0 (#49's cluster path).

    Each rank records :func:`rlx_nb.snapshot` of ``model`` on ``inputs`` on its own ``backend`` (node 0's with the
    float64 reference, which a diff of two snapshots needs); the file's bytes travel to rank 0 as a uint8 tensor, as
    :func:`gather_report`'s do, and are written to ``directory`` (a new temporary folder by default).  Rank 0 returns ``{node: Diff}`` for every other node, each :func:`rlx_nb.diff` of node 0's
    snapshot against that node's (where the node parts from node 0, module by module, judged on round-off); a node
    whose run failed, died or timed out maps to the reason, a string.  Other ranks return None.  Node names are
    ``$RLX_NB_NODE`` or ``node<rank>`` (a name another rank gave already is told apart by its rank,
    ``"n (rank 1)"``).  The snapshot files stay in ``directory`` as ``<node>.rank<k>.rlxsnap``, to be diffed again
    or sent on.
    """
    import tempfile

    from rlx_nb.changes.diff import diff
    from rlx_nb.changes.record import snapshot

    own_group = not dist.is_initialized()
    if own_group:
        if "RANK" not in os.environ:
            raise InputError("gather_diffs runs under torchrun (RANK/WORLD_SIZE unset); diff snapshot files with "
                             "rlx_nb.diff(a, b)")  # fmt: skip
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    name = node_name(rank)
    try:
        with tempfile.TemporaryDirectory(prefix="rlx_nb_snapshot_") as scratch:
            try:
                path = snapshot(model, inputs, Path(scratch) / "node", backend=backend, reference=rank == 0,
                                byte_budget=byte_budget, label=name)  # fmt: skip
                body = _payload(b"S", name.encode() + b"\0" + path.read_bytes())
            except Exception as exc:  # (this rank's failure travels as a message, not a crash)
                still_interrupted(exc)
                body = _payload(b"E", f"{name}: {type(exc).__name__}: {exc}".encode())
        device = _wire_device()
        if rank != 0:
            dist.send(torch.tensor([body.numel()], dtype=torch.int64, device=device), dst=0)
            dist.send(body.to(device), dst=0)
            return None
        folder = Path(directory) if directory is not None else Path(tempfile.mkdtemp(prefix="rlx_nb_nodes_"))
        folder.mkdir(parents=True, exist_ok=True)
        received = [(name, memoryview(body.numpy())[1:] if body[0] == ord("S") else bytes(body[1:]).decode())]
        received += [(f"node{src}", _receive(src, timeout_s, device)) for src in range(1, world)]
        files: dict[str, Path | str] = {}
        for src, (fallback, item) in enumerate(received):
            if isinstance(item, str):
                files[_unique(fallback, src, files)] = item
                continue
            node, _, data = bytes(item).partition(b"\0")
            node = node.decode(errors="replace") or fallback
            node_label = _unique(node, src, files)
            target = inside(folder, f"{file_stem(node)}.rank{src}.rlxsnap", "a node's snapshot")
            write_new(target, data)
            files[node_label] = target
        first = next(iter(files))
        base = files[first]
        if isinstance(base, str):
            return {n: f"no diff: node 0 ({first}) has no snapshot to diff against: {base}" for n in list(files)[1:]}
        return {n: f if isinstance(f, str) else diff(base, f) for n, f in list(files.items())[1:]}
    finally:
        if own_group:
            dist.destroy_process_group()


def _unique(node: str, rank: int, taken: dict) -> str:
    # A node's name, told apart by its rank where another rank already gave it (two ranks of one node, or one
    # RLX_NB_NODE set for both): each rank's snapshot is diffed, none is dropped.
    return node if node not in taken else f"{node} (rank {rank})"


def _wire_device() -> str:
    # NCCL moves CUDA tensors only; gloo moves CPU tensors.
    return f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"


def _receive(src: int, timeout_s: float, device: str = "cpu") -> bytes | str | memoryview:
    # bytes of a saved report, or the text of an error (the rank's own, or why nothing arrived).
    size = torch.zeros(1, dtype=torch.int64, device=device)
    try:
        dist.irecv(size, src=src).wait(datetime.timedelta(seconds=timeout_s))
        body = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        dist.irecv(body, src=src).wait(datetime.timedelta(seconds=timeout_s))
        body = body.cpu()
    except Exception as exc:
        still_interrupted(exc)
        return f"no results from rank {src}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    raw = memoryview(body.numpy())
    if raw[:1] == b"E":
        return bytes(raw[1:]).decode(errors="replace")
    return raw[1:]


__all__ = ["free_local_port", "gather_diffs", "gather_report", "local_torchrun", "node_name"]
