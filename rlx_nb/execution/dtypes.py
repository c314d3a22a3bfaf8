"""The dtypes a run meets and says: the oracle computes in float32, whatever the model's weights, the inputs or torch's
default dtype are; what is cast is said (a warning, the report's environment), and an input the model then rejects is
named with its dtype."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from rlx_nb._support import switches
from rlx_nb._support.tree import flatten
from rlx_nb.execution.prepare import normalize_inputs


def float32_default(inputs: Any, during: dict[str, Any]) -> str:
    # The oracle computes in float32: under a float64 default dtype (torch.set_default_dtype), tensors a
    # forward creates would be float64 and clash with the float32 parameters.  For the rest of the run the
    # default is float32 (the user's is restored at its end, rlx_nb._support.switches) and float64 inputs are cast
    # to float32; returns what is cast ("" if nothing).
    default = torch.get_default_dtype()
    if default == torch.float32:
        return ""
    wide = _float64_inputs(inputs)
    cast = f"{', '.join(wide)} cast from float64 to float32" if wide else ""
    warnings.warn(
        f"rlx_nb: torch's default dtype is {str(default).removeprefix('torch.')}; the oracle runs the model in "
        "float32, so the run uses float32 as the default dtype (yours is restored after)"
        + (f" and {cast}" if cast else ""),
        UserWarning,
        stacklevel=4,
    )
    switches.hold(during, "default_dtype", torch.float32)
    return cast


def _float64_inputs(inputs: Any) -> list[str]:
    args, keys = normalize_inputs(inputs)
    named = dict(zip(keys or [f"input[{i}]" for i in range(len(args))], args, strict=True))
    return [n for n, t in flatten(named) if isinstance(t, torch.Tensor) and t.dtype == torch.float64]


def dtype_hint(inputs: Any) -> str:
    # What to change when the oracle fails and an input is not float32 (the parameters were cast to float32).
    args, keys = normalize_inputs(inputs)
    named = dict(zip(keys or [f"input[{i}]" for i in range(len(args))], args, strict=True))
    other = {n: str(t.dtype).removeprefix("torch.") for n, t in flatten(named)
             if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float32}  # fmt: skip
    if not other:
        return ""
    said = ", ".join(f"{n} is {d}" for n, d in other.items())
    return (
        f" — {said}, while the oracle runs the model in float32 (its parameters are cast to float32): pass float32 "
        "inputs; a reduced precision is a backend judged on its own budget (cpu-bf16, cpu-fp16, or your own)"
    )


def narrowed_weights(model: Any) -> str:
    """What a model's floating weights are cast from to float32 for the oracle ("" when they are float32): said,
    never done silently (a bfloat16 model is judged as its float32 copy computes)."""
    if not isinstance(model, torch.nn.Module):
        return ""
    found: dict[str, int] = {}
    for t in (*model.parameters(), *model.buffers()):
        if t.is_floating_point() and t.dtype != torch.float32 and not t.is_meta:
            name = str(t.dtype).removeprefix("torch.")
            found[name] = found.get(name, 0) + 1
    return ", ".join(f"{n} {name} weight(s)" for name, n in found.items()) + " cast to float32" if found else ""


def say_narrowed(model: Any) -> str:
    """:func:`narrowed_weights`, warned about where there are any (the warning points at the caller's call)."""
    narrowed = narrowed_weights(model)
    if narrowed:
        warnings.warn(f"rlx_nb: the model's {narrowed}: the oracle runs it in float32 and every backend is given that "
                      "copy; its own reduced precision is a backend judged on its own budget (cpu-bf16, cpu-fp16)",
                      UserWarning, stacklevel=4)  # fmt: skip
    return narrowed


__all__ = ["dtype_hint", "float32_default", "narrowed_weights", "say_narrowed"]
