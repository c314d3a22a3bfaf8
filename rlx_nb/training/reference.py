"""The float64 reference's optimizer update, a piece of a parameter at a time.

A local step's float64 reference is its largest run: the model, the gradients and the optimizer's state in float64,
twice float32's bytes, and the update's temporaries on top.  Where the optimizer's update is elementwise (one of
:data:`~rlx_nb.training.step.ELEMENTWISE`, in its for-loop implementation), it needs only one piece of that state at
a time: as the update comes to each parameter, the parameter's state is converted from the kept float32 state in
pieces of :data:`PIECE` elements, each piece updated by an optimizer of the same type and options over a view of
that piece, and let go.  The result is the whole update's bit for bit (every element meets the same arithmetic; a
test sets one against the other for each of the optimizers).  Any other optimizer has its whole state converted
first, as a step from a state otherwise is.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from rlx_nb.training.step import ELEMENTWISE, converted

PIECE = 1 << 20
"""The elements of a parameter updated at once (a parameter of at most this many is updated whole)."""


class PiecewiseUpdate:
    """``optimizer`` (float64, for-loop, made without state) stepping from ``saved`` (the float32 state kept, as
    :meth:`torch.optim.Optimizer.state_dict` gives it) a piece at a time; what a step needs of an optimizer
    (``param_groups``, ``zero_grad``, ``step``).  The optimizer keeps no state after its step (the step is the last)."""

    def __init__(self, optimizer: torch.optim.Optimizer, saved: dict) -> None:
        if type(optimizer) not in ELEMENTWISE:
            raise TypeError(f"{type(optimizer).__name__}'s update is not elementwise")
        self.optimizer, self.saved = optimizer, saved

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self) -> None:
        groups = self.saved["param_groups"]
        for group, kept in zip(self.optimizer.param_groups, groups, strict=True):
            options = {k: v for k, v in group.items() if k not in ("params", "param_names")}
            for p, index in zip(group["params"], kept["params"], strict=True):
                if p.grad is None:  # (as the optimizer itself skips it)
                    continue
                for piece, state in _pieces(p, self.saved["state"].get(index, {})):
                    one = type(self.optimizer)([{"params": [piece], **options}])
                    one.state[piece] = state
                    one.step()


def _pieces(p: torch.Tensor, state: dict) -> Iterator[tuple[torch.Tensor, dict]]:
    # ``p`` (with its gradient) in pieces of PIECE elements, each a leaf viewing p's own memory, with its state in
    # float64; p itself where it is small, sparse or not laid out in one block.
    grad = p.grad
    if p.numel() <= PIECE or grad.is_sparse or not (p.is_contiguous() and grad.is_contiguous()):
        yield p, converted(state, torch.float64)
        return
    flat, flat_grad = p.detach().view(-1), grad.view(-1)
    for a in range(0, p.numel(), PIECE):
        b = min(a + PIECE, p.numel())
        piece = torch.nn.Parameter(flat[a:b])
        piece.grad = flat_grad[a:b]  # (a view: an update that writes into the gradient is still seen)
        own = {}
        for name, v in state.items():  # (a tensor shaped as p is per element; any other, p's own: its step count)
            if torch.is_tensor(v) and v.shape == p.shape:
                v = v.reshape(-1)[a:b]
                own[name] = v.to(torch.float64, copy=True) if v.is_floating_point() else v.clone()
            else:
                own.update(converted({name: v}, torch.float64))
        yield piece, own


__all__ = ["PIECE", "PiecewiseUpdate"]
