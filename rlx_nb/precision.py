"""Precision sweeps: run a model under each precision switch and read the effective bits it delivers.

A very common "kernel bug" report is a precision mode switched on behind the user's back: TF32
matmuls on Ampere and later (pytorch/pytorch#58434, #61890), MPS fast math (pytorch/pytorch#84936),
OpenVINO's CPU plugin picking bfloat16 by default.  :func:`precision_sweep` runs the model once per
setting — each judged as the fp32 it claims to be — and returns a frame of effective bits,
closest format and verdict per setting, so the switch that causes the drift stands out.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from rlx_nb._support import switches
from rlx_nb.backends.base import Backend
from rlx_nb.backends.emulated import emulate
from rlx_nb.backends.registry import device_probe, get_backend
from rlx_nb.comparison.tables import precision_frame
from rlx_nb.errors import InputError
from rlx_nb.verdict.types import ROUNDOFF, SUSPECT, VERDICT_ERROR

if TYPE_CHECKING:
    import pandas


@dataclasses.dataclass(frozen=True)
class Setting:
    """One precision switch: a label, the switch in words, the backend fn that runs under it, and the format the
    switch declares (``compute_dtype``: a declared reduced precision is judged on its own budget; a switch that
    claims float32 and delivers less is SUSPECT, named for the format it behaves like)."""

    label: str
    switch: str
    fn: Callable[[Any, tuple], Any]
    device: str = "cpu"
    compute_dtype: str = "float32"


def _matmul_precision(level: str) -> contextlib.AbstractContextManager:
    return switches.flipped(float32_matmul_precision=level)


def _under(ctx: Callable[[], contextlib.AbstractContextManager], base: Callable) -> Callable:
    def fn(model: Any, inputs: tuple) -> Any:
        with ctx():
            return base(model, inputs)

    return fn


def default_settings() -> list[Setting]:
    """The switches that exist on this machine: CPU ones always, CUDA and OpenVINO ones when present."""
    eager = get_backend("cpu-nomkldnn").fn
    cpu = get_backend("cpu").fn
    settings = [
        Setting("fp32", "eager, oneDNN off", eager),
        Setting(
            "matmul precision 'high'",
            "torch.set_float32_matmul_precision('high')",
            _under(lambda: _matmul_precision("high"), cpu),
        ),
        Setting(
            "matmul precision 'medium'",
            "torch.set_float32_matmul_precision('medium')",
            _under(lambda: _matmul_precision("medium"), cpu),
        ),
        Setting(
            "tf32 (emulated)", "matmul/conv operands rounded to 10 mantissa bits", emulate(11), compute_dtype="tf32"
        ),
        Setting(
            "autocast bf16",
            "torch.autocast('cpu', torch.bfloat16)",
            get_backend("cpu-bf16").fn,
            compute_dtype="bfloat16",
        ),
        Setting(
            "autocast fp16", "torch.autocast('cpu', torch.float16)", get_backend("cpu-fp16").fn, compute_dtype="float16"
        ),
    ]
    if get_backend("cuda").live:
        settings += [
            Setting("cuda fp32", "allow_tf32 = False", get_backend("cuda").fn, "cuda"),
            Setting(
                "cuda tf32",
                "torch.backends.cuda.matmul.allow_tf32 = True",
                get_backend("cuda-tf32").fn,
                "cuda",
                compute_dtype="tf32",
            ),
            Setting(
                "cuda autocast bf16",
                "torch.autocast('cuda', torch.bfloat16)",
                get_backend("cuda-bf16").fn,
                "cuda",
                compute_dtype="bfloat16",
            ),
        ]
    if get_backend("openvino").live:
        settings += [
            Setting("openvino f32 hint", "INFERENCE_PRECISION_HINT=f32", get_backend("openvino").fn),
            Setting("openvino defaults", "the CPU plugin's own defaults", get_backend("openvino-default").fn),
        ]
    return settings


def precision_sweep(
    model: Any, inputs: Any, *, settings: Iterable[Setting] | None = None, **kwargs: Any
) -> pandas.DataFrame:
    """One row per setting: the worst output's effective bits, the closest format and the verdict.

    Every setting is judged as the format it declares (``Setting.compute_dtype``): autocast bf16 on a bf16
    budget, and a switch that claims fp32 (matmul precision, a runtime's defaults) as fp32, so a silent
    precision mode shows as SUSPECT with "behaves like bf16/tf32..." in the reason.  Keyword arguments go to
    :func:`rlx_nb.backend_divergence` (``backward=True`` sweeps gradients too).

    Examples
    --------
    >>> import torch
    >>> frame = precision_sweep(torch.nn.Linear(64, 64), torch.randn(8, 64))
    >>> frame.set_index("setting").loc["autocast bf16", "closest_format"]
    'bf16'
    """
    from rlx_nb.api import backend_divergence

    settings = list(settings) if settings is not None else default_settings()
    if not settings:
        raise InputError("precision_sweep needs at least one setting")
    # The settings run as Backend objects of their own, never registered: a user's backend can bear any name.
    names = {f"sweep:{i}": s for i, s in enumerate(settings)}
    backends = [
        Backend(
            name,
            s.fn,
            device=s.device,
            default=False,
            compute_dtype=s.compute_dtype,
            description=f"precision sweep: {s.label}",
            probe=device_probe(s.device),
        )
        for name, s in names.items()
    ]
    report = backend_divergence(model, inputs, backends=backends, **kwargs)
    rows = []
    for name, s in names.items():
        recs = [r for r in report.records if r.backend == name]
        bits = [
            r.judgement.reading.effective_bits
            for r in recs
            if r.judgement.reading.effective_bits == r.judgement.reading.effective_bits
        ]
        worst = min(
            recs,
            key=lambda r: (
                r.judgement.reading.effective_bits
                if r.judgement.reading.effective_bits == r.judgement.reading.effective_bits
                else 99
            ),
        )
        rows.append(
            {
                "setting": s.label,
                "switch": s.switch,
                "effective_bits": min(bits) if bits else float("nan"),
                "closest_format": worst.judgement.reading.closest_format,
                "verdict": VERDICT_ERROR
                if name in report.errors
                else (SUSPECT if name in report.suspects else ROUNDOFF),
                "reason": worst.reason,
            }
        )
    return precision_frame(rows)


__all__ = ["Setting", "default_settings", "precision_sweep"]
