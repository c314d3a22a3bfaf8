"""The kernel path an op takes, where torch says it: the ATen ops it runs (a dispatch mode; for a convolution, the
backend ATen selects for it) and the library kernels MKL and oneDNN report running (their verbose lines, e.g.
``MKL SGEMM(T,N,512,1,512)``: the product's shapes as the library took them).  Two configurations whose first parting
op took another path (another GEMM shape, oneDNN's kernel where MKL's ran) are read at a glance; where the paths read
the same, the split of the work inside the kernel is what differs.

The op is run once more, on the inputs it had, with both libraries' verbose output routed to a file (and their
previous settings, the dispatch mode and the process's output put back however the call ends); only the first op
that parts is run so.  (torch's profiler would name every nested ATen op, but its first use in a process took 2.2 s.)
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch

from rlx_nb._support.kept import modes_kept
from rlx_nb.backends.sequential import QuietDispatchMode
from rlx_nb.errors import still_interrupted

_PLUMBING = frozenset(
    "t transpose as_strided expand view reshape _unsafe_view resolve_conj resolve_neg empty empty_like empty_strided "
    "resize_ scalar_tensor to _to_copy "
    "detach alias unsqueeze squeeze permute contiguous clone copy_ _nnpack_available zeros zero_ fill_ "
    "_has_compatible_shallow_copy_type".split()
)
"""ATen ops that move or allocate, not compute: left out of a path."""
_MKL = re.compile(r"MKL_VERBOSE\s+(\w+)\(([^)]*)\)")


@contextlib.contextmanager
def _routed(fds: tuple[int, ...]) -> Iterator[list[str]]:
    # The process's own ``fds`` (stdout, stderr: where C libraries print) routed to one temporary file, put back
    # after; what was printed is in the list yielded once the block ends.
    libc = ctypes.CDLL(None)
    libc.fflush(None)
    printed: list[str] = []
    with tempfile.TemporaryFile(mode="w+b") as sink:
        saved = [os.dup(fd) for fd in fds]
        try:
            for fd in fds:
                os.dup2(sink.fileno(), fd)
            yield printed
        finally:
            libc.fflush(None)
            for fd, old in zip(fds, saved, strict=True):
                os.dup2(old, fd)
                os.close(old)
            sink.seek(0)
            printed.append(sink.read().decode("utf-8", "replace"))


def _library_lines(text: str) -> list[str]:
    found: list[str] = []
    for line in text.splitlines():
        m = _MKL.search(line)
        if m:
            found.append(f"MKL {m.group(1)}({','.join(m.group(2).split(',')[:5])})")
            continue
        if line.startswith("onednn_verbose") and ",exec," in line:
            fields = line.split(",")
            at = fields.index("exec")
            if len(fields) > at + 3:
                found.append(f"oneDNN {fields[at + 2]} {fields[at + 3]}")
    return list(dict.fromkeys(found))


class _AtenOps(QuietDispatchMode):
    # The ATen ops a call reaches torch's dispatcher with, in order (a convolution with the backend ATen selects).
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name == "convolution" and len(args) >= 9:
            try:
                chosen = torch._C._select_conv_backend(*args[:9], None)
                name = f"convolution ({str(chosen).rsplit('.', 1)[-1]})"
            except Exception as exc:
                still_interrupted(exc)
        self.ops.append(name)
        return func(*args, **(kwargs or {}))


def _verbose(fn: Callable[[], Any], *modes: Any) -> str | None:
    # ``fn()`` run with MKL's and oneDNN's verbose output routed to a file (and ``modes`` entered): what they printed,
    # or None where ``fn`` fails.
    try:
        with _routed((1, 2)) as printed, modes_kept():
            with (
                torch.backends.mkl.verbose(torch.backends.mkl.VERBOSE_ON),
                torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON),
                torch.no_grad(),
                contextlib.ExitStack() as stack,
            ):
                for mode in modes:
                    stack.enter_context(mode)
                fn()
    except Exception as exc:
        still_interrupted(exc)
        return None
    return "".join(printed)


def library_path(fn: Callable[[], Any]) -> str:
    """``fn()`` run with MKL's and oneDNN's verbose output routed (no dispatch mode: a compiled call runs its own
    code), and the library kernels they say ran; "" where they say nothing (or ``fn`` fails)."""
    printed = _verbose(fn)
    return "" if printed is None else " -> ".join(_library_lines(printed))


def kernel_path(func: Callable, args: tuple, kwargs: dict) -> str:
    """``func(*args, **kwargs)`` run once more, and the path it took (module docstring); "" where torch says nothing
    (or the op cannot run again)."""
    seen = _AtenOps()
    printed = _verbose(lambda: func(*args, **kwargs), seen)
    if printed is None:
        return ""
    path = [a for a in dict.fromkeys(seen.ops) if a not in _PLUMBING]
    return " -> ".join([*path, *_library_lines(printed)])


def path_in_run(run: Callable[[torch.nn.Module], Any], model: torch.nn.Module, name: str) -> str:
    """The kernel path of the op ``name`` (``"<module> :: F.linear"``, as :mod:`rlx_nb.configurations.ops` names
    it) in ``run(model)``: the model run once more, that op run again where it is called."""
    from rlx_nb.changes.ops import SEPARATOR, OpCalls

    found: dict[str, str] = {}

    def seen(op: Any) -> None:
        named = f"<root>{op.name}" if op.name.startswith(SEPARATOR) else op.name
        if named == name and "path" not in found:
            found["path"] = kernel_path(op.func, op.args, op.kwargs)

    recorder = OpCalls(seen)
    with recorder.attached(model), torch.no_grad():
        run(model)
    return found.get("path", "")


__all__ = ["kernel_path", "library_path", "path_in_run"]
