"""The number formats rlx_nb knows: one table of names, aliases, mantissa bits and what follows from them.

Every module that needs a format's unit round-off, its bits, its short name or the tolerance
``torch.testing.assert_close`` gives it reads this table (:data:`FORMATS`); a name may be any alias
(``"bf16"``, ``"bfloat16"``, ``"torch.bfloat16"``), :func:`get` resolves it.

Examples
--------
>>> get("bf16").name, get("bf16").bits, get("torch.float16").short
('bfloat16', 8, 'fp16')
>>> unit_roundoff("tf32") == 2.0**-11
True
>>> closest_label(10.6)
'tf32/fp16'
"""

from __future__ import annotations

import dataclasses

from rlx_nb.errors import InputError


@dataclasses.dataclass(frozen=True)
class Format:
    """One number format: ``bits`` of mantissa (the implicit one included), so unit round-off ``2**-bits``.

    ``short`` is the name people write (``bf16``); ``aliases`` every other name it goes by (torch's, numpy's,
    OpenVINO's); ``tolerance`` the ``(rtol, atol)`` that ``torch.testing.assert_close`` uses for it.
    """

    name: str
    short: str
    bits: int
    aliases: tuple[str, ...] = ()
    tolerance: tuple[float, float] | None = None

    @property
    def unit_roundoff(self) -> float:
        """Half an ulp at 1.0."""
        return 2.0**-self.bits


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("float64", "fp64", 53, ("double", "f64", "torch.float64"), (1e-7, 1e-7)),
        Format("float32", "fp32", 24, ("float", "f32", "torch.float32"), (1.3e-6, 1e-5)),
        Format("tf32", "tf32", 11, ("tensorfloat32",)),
        Format("float16", "fp16", 11, ("half", "f16", "torch.float16"), (1e-3, 1e-5)),
        Format("bfloat16", "bf16", 8, ("torch.bfloat16",), (1.6e-2, 1e-5)),
    )
}
"""The compute formats a backend may declare (``compute_dtype``), widest first."""

_BY_ALIAS = {alias: f for f in FORMATS.values() for alias in (f.name, f.short, *f.aliases)}

ANCHOR_BITS = (8, 11)
"""The precision anchors' widths (:mod:`rlx_nb.backends.emulated`): the model's matmuls at bf16's and fp16's bits."""

LABELS = ("fp32", "tf32/fp16", "bf16")
"""The formats an effective precision is read against (formats of the same width share a label)."""


def get(name: str) -> Format:
    """The format called ``name`` (any alias), or an :class:`~rlx_nb.InputError` naming the known ones."""
    try:
        return _BY_ALIAS[str(name).lower()]
    except KeyError:
        others = ", ".join(sorted(set(_BY_ALIAS) - set(FORMATS)))
        raise InputError(f"unknown number format {name!r}: one of {', '.join(FORMATS)} (or {others})") from None


def known(name: str) -> bool:
    """Whether ``name`` is a compute format's canonical name (what a backend's ``compute_dtype`` holds)."""
    return name in FORMATS


def unit_roundoff(name: str) -> float:
    """The unit round-off of ``name``; float32's for a name that is no compute format (an integer output's)."""
    f = _BY_ALIAS.get(str(name).lower())
    return (f or FORMATS["float32"]).unit_roundoff


def scale_of(name: str) -> float:
    """A format's unit round-off over float32's (1 for fp32 and wider, 2**13 for fp16/tf32, 2**16 for bf16)."""
    return max(1.0, unit_roundoff(name) / FORMATS["float32"].unit_roundoff)


def anchor_of(name: str) -> int | None:
    """The precision anchor at a reduced format's own width (``bfloat16`` -> 8, ``float16``/``tf32`` -> 11)."""
    f = _BY_ALIAS.get(str(name).lower())
    return f.bits if f is not None and f.bits in ANCHOR_BITS else None


def label_bits(label: str) -> int:
    """The width of an effective-precision label (``"tf32/fp16"`` -> 11)."""
    return get(label.split("/")[0]).bits


def closest_label(bits: float) -> str:
    """The label (:data:`LABELS`) nearest to an effective precision of ``bits``."""
    return min(LABELS, key=lambda label: abs(label_bits(label) - bits))


INT8 = "int8"
"""The compute dtype of an int8 runtime's run (:mod:`rlx_nb.int8`): no float format; its errors are in quanta."""


def short(name: str) -> str:
    """The short name people write (``float32`` -> ``fp32``); the name itself when it is no known format."""
    f = _BY_ALIAS.get(str(name).lower())
    return f.short if f is not None else name
