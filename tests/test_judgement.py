"""One Judgement per (backend, output), with the clause that decided it: the oracle can be the outlier."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rlx_nb
from rlx_nb.numerics.reference import ReferenceStats
from rlx_nb.verdict.rule import judge
from rlx_nb.verdict.types import ROUNDOFF, SUSPECT, Evidence
from rlx_nb.verdict.words import Cause


def _in_float64(model, inputs):
    # A backend that computes in float64 and returns the inputs' dtype: it agrees with the fp64 reference.
    return model(*[x.double() for x in inputs]).to(inputs[0].dtype)


@pytest.fixture
def wide():
    rlx_nb.register_backend("test-in-float64", _in_float64, replace=True)
    yield "test-in-float64"
    rlx_nb.unregister_backend("test-in-float64")


def _exactly_zero_in_float64(a, b, c, d):
    # 1 / ((a * b - c) - d): a * b - c - d is exactly 0 in float64, and -2**-24 in float32, where a * b rounds.
    return 1.0 / ((a * b - c) - d)


def test_an_inf_that_fp64_also_gives_is_not_a_nan_inf_mismatch_the_oracle_is_the_outlier(wide):
    # pytorch/pytorch#150114 (linalg.cond of a singular matrix: the backend's inf is fp64's, the oracle's finite
    # 1.3e8 is the outlier).  The NaN/Inf clause compared with the oracle alone and called it SUSPECT.  Here a
    # division by a difference that is exactly 0 in float64 only, in plain IEEE arithmetic: linalg.cond's float64 SVD
    # left 9.7e16, not inf, where MKL takes its AVX-512 path, and the test failed there (#46).
    e = 2.0**-12
    args = tuple(torch.tensor([v]) for v in (1 + e, 1 + e, 1 + 2 * e, 2.0**-24))
    assert math.isinf(float(_exactly_zero_in_float64(*(x.double() for x in args))))
    assert float(_exactly_zero_in_float64(*args)) == -(2.0**24)
    report = rlx_nb.backend_divergence(_exactly_zero_in_float64, args, backends=[wide], progress=False)
    rec = report.record(wide)
    assert rec.pair.nonfinite_mismatch == 1  # against the oracle: a mismatch ...
    assert rec.verdict == ROUNDOFF and rec.cause == Cause.ORACLE_OFF  # ... against fp64: none
    assert rec.judgement.nonfinite_unexplained == 0 and rec.judgement.oracle_outliers == 1
    assert rec.reason.startswith(f"round-off, 0 of the SUSPECT line: the oracle, not {wide}, is off the fp64 reference")
    assert "the oracle itself is off the fp64 reference on out" in report.lines()[0]
    assert rec.judgement.verdict_fixed == SUSPECT  # the seed's rule still reads the oracle alone


def test_a_nan_inf_neither_the_oracle_nor_fp64_has_is_suspect():
    rlx_nb.register_backend("test-inf", lambda m, inputs: m(*inputs) / torch.tensor([1.0, 0.0, 1.0]), replace=True)
    try:
        report = rlx_nb.backend_divergence(lambda t: t * 2, torch.ones(3), backends=["test-inf"], progress=False)
    finally:
        rlx_nb.unregister_backend("test-inf")
    rec = report.record("test-inf")
    assert rec.verdict == SUSPECT and rec.cause == Cause.NONFINITE and math.isinf(rec.judgement.line)
    assert rec.judgement.nonfinite_unexplained == 1 and rec.reason.startswith("1 NaN/Inf elements")


def test_where_the_backend_equals_fp64_and_the_oracle_is_off_by_one_the_reason_says_so(wide):
    # pytorch/pytorch#145466: floor(cos(x)) in float16; the backend equals fp64, the oracle's fp16 cos rounds up
    # to 1.0 and its floor is off by 1.  It read "within 0x the fp32 round-off budget".
    x = torch.tensor(np.linspace(0.0, 0.05, 64), dtype=torch.float16)
    report = rlx_nb.backend_divergence(lambda t: torch.floor(torch.cos(t)), x, backends=[wide], progress=False)
    rec = report.record(wide)
    assert rec.verdict == ROUNDOFF and rec.cause == Cause.ORACLE_OFF
    assert rec.judgement.backend_rmse == 0 and rec.judgement.oracle_max_err == 1.0
    assert "the oracle gives 1, fp64 0" in rec.reason and "within 0x" not in rec.reason


def test_a_backend_merely_more_accurate_than_the_oracle_is_round_off_not_an_oracle_outlier(wide):
    # float64 arithmetic beats the oracle's fp32 by ~2**29 on a long sum, but the oracle is round-off there:
    # judged the other way round, its error is within the floor a float32 output's round-off sets.
    x = torch.randn(64, 4096, generator=torch.Generator().manual_seed(0))
    report = rlx_nb.backend_divergence(lambda t: t.sum(-1), x, backends=[wide], progress=False)
    rec = report.record(wide)
    assert rec.verdict == ROUNDOFF and rec.cause == Cause.WITHIN, rec.reason


_stats = st.builds(
    ReferenceStats,
    rmse=st.floats(1e-9, 1e-3),
    max_err=st.floats(1e-9, 1e-2),
    ref_rms=st.floats(0.1, 10),
    ref_max=st.floats(0.1, 100),
)


@settings(max_examples=300, deadline=None)
@given(
    errors=_stats,
    oracle=_stats,
    numel=st.integers(1, 10**6),
    dtype=st.sampled_from(["float32", "bfloat16", "float16", "tf32"]),
    nonfinite=st.sampled_from([0, 0, 0, 2]),
)
def test_every_judgement_has_a_cause_and_its_line_is_the_verdict(errors, oracle, numel, dtype, nonfinite):
    j = judge(Evidence("b", "forward", dtype, numel, errors, oracle, nonfinite_mismatch=nonfinite, max_abs=1.0))
    assert j.cause in vars(Cause).values()
    assert (j.line > 1.0) == (j.verdict == SUSPECT)  # one scale: past 1.0 is SUSPECT, whatever decided it
    if j.verdict == SUSPECT:
        assert j.cause in (Cause.WHOLE, Cause.WORST, Cause.SLICE, Cause.CONCENTRATED, Cause.NONFINITE)
    else:
        assert j.cause in (Cause.WITHIN, Cause.ORACLE_OFF, Cause.IDENTICAL, Cause.DISCRETE)
