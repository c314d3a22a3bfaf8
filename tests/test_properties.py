"""Property tests: the chunked metrics against a straightforward float64 reference, and a loader fuzz."""

from __future__ import annotations

import io
import math
import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import rlx_nb
from rlx_nb.metrics import default_tolerance, pair_stats
from tests.conftest import numpy_metrics

SPECIALS = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 1e-40, 3.4e38, -3.4e38, 1.0, -1.0]


def _reference(e: np.ndarray, a: np.ndarray) -> dict:
    e64, a64 = e.astype(np.float64).ravel(), a.astype(np.float64).ravel()
    both = np.isfinite(e64) & np.isfinite(a64)
    agree = (e64 == a64) | (np.isnan(e64) & np.isnan(a64))
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.where(both, np.abs(a64 - e64), 0.0)
    rtol, atol = default_tolerance(e.dtype.name)
    mism = int(np.count_nonzero(both & (d > atol + rtol * np.abs(np.where(both, e64, 0)))))
    bad = int(np.count_nonzero(~both & ~agree))
    ints = {np.float16: np.int16, np.float32: np.int32, np.float64: np.int64}[e.dtype.type]

    def ordered(x):
        i = x.ravel().view(ints).astype(object)
        return [int(v) if v >= 0 else int(np.iinfo(ints).min) - int(v) for v in i]

    ulps = [abs(p - q) if ok else 0 for p, q, ok in zip(ordered(a), ordered(e), both, strict=True)]
    return {
        "max_abs": d.max() if d.size else 0.0,
        "worst": int(d.argmax()) if d.size else -1,
        "mismatched": mism + bad,
        "nonfinite": bad,
        "max_ulp": max(ulps, default=0),
    }


@st.composite
def pairs(draw):
    dtype = draw(st.sampled_from([np.float16, np.float32, np.float64]))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=9))
    finfo = np.finfo(dtype)
    with np.errstate(over="ignore"):
        specials = [dtype(v) for v in SPECIALS]  # 3.4e38 becomes inf in float16: also a special
    elements = st.one_of(
        st.floats(width=finfo.bits, allow_nan=True, allow_infinity=True),
        st.sampled_from(specials),
    )
    e = draw(hnp.arrays(dtype, shape, elements=elements))
    noise = draw(hnp.arrays(dtype, shape, elements=st.sampled_from([0, 0, 1e-7, -1e-3, 1.0])))
    with np.errstate(all="ignore"):
        a = (e + noise * np.abs(e)).astype(dtype)
    swap = draw(hnp.arrays(np.bool_, shape))
    a = np.where(swap, draw(hnp.arrays(dtype, shape, elements=elements)), a)
    return e, a


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pairs())
def test_pair_stats_matches_a_float64_reference(pair):
    e, a = pair
    ref = _reference(e, a)
    with numpy_metrics():
        _check_against_reference(pair_stats(e, a), ref, e)  # the fallback without numba
    _check_against_reference(pair_stats(e, a), ref, e)  # the numba kernel for float32 pairs


def _check_against_reference(s, ref: dict, e: np.ndarray) -> None:
    assert s.mismatched == ref["mismatched"]
    assert s.nonfinite_mismatch == ref["nonfinite"]
    assert s.max_ulp == ref["max_ulp"]
    if math.isfinite(ref["max_abs"]) and ref["max_abs"] < 1e300:
        assert s.max_abs == pytest.approx(ref["max_abs"], rel=1e-6) or (
            e.dtype != np.float64 and not math.isfinite(s.max_abs)
        )
    if ref["max_abs"] > 0 and math.isfinite(s.max_abs):
        assert s.worst_index == ref["worst"]


@pytest.fixture(scope="module")
def saved_report(tmp_path_factory):
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh())
    report = rlx_nb.backend_divergence(model, torch.randn(4, 6), backends=["cpu-nomkldnn"], backward=True)
    return report.save(tmp_path_factory.mktemp("fuzz") / "r").read_bytes()


def _load_everything(data: bytes) -> None:
    report = rlx_nb.load_report(io.BytesIO(data))
    for run in [report.results.oracle, report.results.reference, *report.results.candidates.values()]:
        for leaf in run.outputs.values():
            _ = leaf.value


def test_loader_fuzz_only_raises_rlx_errors(saved_report):
    rng = random.Random(0)
    cases = [bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 400))) for _ in range(200)]
    cases += [saved_report[: rng.randint(0, len(saved_report))] for _ in range(200)]
    for _ in range(600):
        b = bytearray(saved_report)
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        cases.append(bytes(b))
    outcomes = {"ok": 0, "refused": 0}
    for data in cases:
        try:
            _load_everything(data)
            outcomes["ok"] += 1
        except rlx_nb.RlxError:
            outcomes["refused"] += 1
    assert outcomes["refused"] > 500  # most corruptions are caught; the rest are harmless flips in data
