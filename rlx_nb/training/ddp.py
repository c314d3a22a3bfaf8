"""DistributedDataParallel as a training backend: the step run by local ranks, each batch split between them.

The ``ddp`` backend runs each step on :data:`WORLD` local processes (forked from this one when its first step runs,
each with its own ``torch.distributed`` gloo group, as ``torchrun --nproc-per-node 2`` would set them up): every rank
wraps the model in ``DistributedDataParallel``, takes its share of the batch (the first dimension of every tensor,
split evenly), runs the forward and backward (DDP averages the gradients across the ranks: the batch's sums in
another order than one process's) and the optimizer's step; the step's loss is the ranks' mean.  The ranks hold no
state of their own between steps: each command carries the state the step starts from (the parameters, buffers and
optimizer state, serialised as tensors and read back as data only, ``weights_only``), and rank 0 returns the state
after it, so the same ranks run a trajectory's steps and any local step.

Against one process, DDP is round-off only where splitting the batch changes no value: a model whose forward draws
random numbers (dropout: each rank draws its own for its share) or computes statistics over the batch (BatchNorm:
each rank's over its share; SyncBatchNorm, which would make it the one-process step, needs a GPU) trains another
step, and the backend says so rather than judge it.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import multiprocessing
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch

from rlx_nb.errors import BackendError, InputError

WORLD = 2
"""The local ranks the ``ddp`` backend runs a step on."""
TIMEOUT_S = 300.0
"""How long a rank may take to answer one step before the backend gives up on it."""


def _to_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


def share(batch: Any, rank: int, world: int) -> Any:
    """Rank ``rank``'s share of ``batch``: every tensor's rows ``rank`` of ``world`` even parts (other leaves whole)."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            return batch
        rows = batch.shape[0]
        if rows % world:
            raise InputError(
                f"ddp splits each batch's first dimension evenly between its {world} ranks; a tensor of shape "
                f"{tuple(batch.shape)} has {rows} rows: give batches whose first dimension is a multiple of {world}"
            )
        return batch.chunk(world)[rank]
    if isinstance(batch, dict):
        return {k: share(v, rank, world) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(share(v, rank, world) for v in batch)
    return batch


def refused(model: torch.nn.Module) -> str:
    """Why DDP's step cannot be the one-process step for ``model`` ("" where nothing stands in the way)."""
    norms = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if norms:
        name, norm = norms[0]
        return (f"module {name or '(top level)'!r} is a {type(norm).__name__}: under DDP each rank computes its statistics over "
                "its share of the batch, another step than one process's (SyncBatchNorm, which would make it the same "
                "step, needs a GPU); ddp judges models without batch statistics")  # fmt: skip
    return ""


class Ranks:
    """:data:`WORLD` local ranks, forked from this process, each running the steps it is sent (module docstring)."""

    def __init__(self, skeleton: torch.nn.Module, spec: Any, world: int = WORLD):
        why = refused(skeleton)
        if why:
            raise BackendError(f"ddp: {why}")
        self.world = world
        self.folder = tempfile.mkdtemp(prefix="rlx_nb_ddp_")
        ctx = multiprocessing.get_context("fork")  # (the ranks inherit the model, the loss and the optimizer factory)
        threads = max(1, torch.get_num_threads() // world)
        self.pipes, self.procs = [], []
        try:
            for rank in range(world):
                mine, theirs = ctx.Pipe()
                setup = _Setup(rank, world, self.folder, skeleton, spec, threads)
                proc = ctx.Process(target=_rank_main, args=(setup, theirs), daemon=True, name=f"rlx_nb ddp rank {rank}")
                proc.start()
                theirs.close()
                self.pipes.append(mine)
                self.procs.append(proc)
        except BaseException:
            self.close()
            raise

    def step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, batch: Any,
             keep: bool) -> tuple[float, float, dict[str, torch.Tensor]]:  # fmt: skip
        """One step from ``model``'s and ``optimizer``'s state on the ranks; both are left at the state after it."""
        command = _to_bytes({"step": step, "batch": batch, "model": model.state_dict(),
                             "optimizer": optimizer.state_dict(), "keep": keep})  # fmt: skip
        for pipe in self.pipes:
            pipe.send_bytes(command)
        replies = [self._reply(rank) for rank in range(self.world)]
        errors = [r["error"] for r in replies if "error" in r]
        if errors:
            raise BackendError(f"ddp: {errors[0]}")
        got = replies[0]
        model.load_state_dict(got["model"])
        from rlx_nb.training.step import restored

        restored(optimizer, got["optimizer"])
        return got["loss"], got["norm"], got["outputs"] or {}

    def _reply(self, rank: int) -> dict:
        pipe, proc = self.pipes[rank], self.procs[rank]
        waited = 0.0
        while not pipe.poll(1.0):
            waited += 1.0
            if not proc.is_alive():
                raise BackendError(f"ddp: rank {rank} ended (exit code {proc.exitcode}) before it answered")
            if waited > TIMEOUT_S:
                raise BackendError(f"ddp: rank {rank} gave no answer in {TIMEOUT_S:.0f} s")
        try:
            return _from_bytes(pipe.recv_bytes())
        except EOFError:
            raise BackendError(f"ddp: rank {rank} ended before it answered") from None

    def close(self) -> None:
        """The ranks stopped (asked, then ended) and their folder removed; safe to call twice."""
        for pipe in self.pipes:
            with contextlib.suppress(OSError, ValueError):
                pipe.send_bytes(_to_bytes(None))
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
        for pipe in self.pipes:
            pipe.close()
        self.pipes, self.procs = [], []
        shutil.rmtree(self.folder, ignore_errors=True)


_OPEN: list[dict[str, Ranks]] = []


@contextlib.contextmanager
def opened() -> Iterator[None]:
    """A call's ranks: started at the first step a ``ddp`` backend runs, stopped when the call ends (however it
    ends, Ctrl-C too)."""
    groups: dict[str, Ranks] = {}
    _OPEN.append(groups)
    try:
        yield
    finally:
        _OPEN.remove(groups)
        for ranks in groups.values():
            ranks.close()


def ranks_step(name: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, spec: Any, *, step: int, batch: Any,
               keep: bool) -> tuple[float, float, dict[str, torch.Tensor]]:  # fmt: skip
    """One step of the ``ddp`` backend ``name`` on its ranks (started here on its first step)."""
    if not _OPEN:
        raise BackendError(f"{name}: a DDP step runs inside rlx_nb.training_divergence (its ranks live for the call)")
    groups = _OPEN[-1]
    if name not in groups:
        groups[name] = Ranks(model, spec)
    return groups[name].step(model, optimizer, step, batch, keep)


@dataclasses.dataclass
class _Setup:
    # What a rank is started with (inherited by the fork, not sent).
    rank: int
    world: int
    folder: str
    skeleton: torch.nn.Module
    spec: Any
    threads: int


def _rank_main(setup: _Setup, pipe: Any) -> None:
    # A rank: its gloo group, the model wrapped in DDP once, then each step it is sent until told to stop.
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (a Ctrl-C is the caller's: it stops the ranks when it ends)
    torch.set_num_threads(setup.threads)
    store = dist.FileStore(os.path.join(setup.folder, "store"), setup.world)
    dist.init_process_group("gloo", store=store, rank=setup.rank, world_size=setup.world,
                            timeout=timedelta(seconds=TIMEOUT_S))  # fmt: skip
    model = copy.deepcopy(setup.skeleton)
    wrapped = DistributedDataParallel(model)
    try:
        while True:
            command = _from_bytes(pipe.recv_bytes())
            if command is None:
                break
            try:
                reply = _rank_step(setup, model, wrapped, command)
            except Exception as exc:
                from rlx_nb.errors import describe_error

                reply = {"error": describe_error(exc)}
            pipe.send_bytes(_to_bytes(reply if setup.rank == 0 or "error" in reply else {}))
    finally:
        dist.destroy_process_group()


def _rank_step(setup: _Setup, model: torch.nn.Module, wrapped: Any, command: dict) -> dict:
    import torch.distributed as dist

    from rlx_nb.training.step import grad_norm, restored

    rank, world, spec = setup.rank, setup.world, setup.spec
    step, keep = command["step"], command["keep"]
    model.load_state_dict(command["model"])
    optimizer = restored(spec.optimizer(list(model.parameters())), command["optimizer"])
    spec.seeded(step)
    model.train()
    optimizer.zero_grad(set_to_none=True)
    drawn = torch.random.get_rng_state()
    loss = spec.loss(wrapped, share(command["batch"], rank, world))
    if not torch.equal(drawn, torch.random.get_rng_state()):
        raise BackendError(
            "the forward draws random numbers (dropout): each rank draws its own for its share of the batch, another "
            "step than one process's; judge ddp with them off (p=0 or those modules in eval mode)"
        )
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError("the loss must be one number (a 0-d tensor)")
    outputs: dict[str, torch.Tensor] = {}
    mean = loss.detach().reshape(()).clone()
    dist.all_reduce(mean)
    mean /= world
    if keep:
        outputs["loss"] = mean
        for name, b in model.named_buffers():
            if b.is_floating_point():
                outputs[f"buffer:{name}"] = b.detach().clone()
    loss.backward()  # (DDP averages the gradients across the ranks as they are made)
    norm = grad_norm(model)
    for name, p in model.named_parameters() if keep else ():
        if p.grad is not None:
            outputs[f"grad:{name}"] = p.grad.detach().clone()
    optimizer.step()
    for name, p in model.named_parameters() if keep else ():
        outputs[f"param:{name}"] = p.detach().clone()
    if rank:
        return {}
    return {"loss": float(mean), "norm": norm, "model": model.state_dict(),
            "optimizer": optimizer.state_dict(), "outputs": outputs if keep else None}  # fmt: skip


__all__ = ["TIMEOUT_S", "WORLD", "Ranks", "opened", "ranks_step", "refused", "share"]
