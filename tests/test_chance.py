"""The chance allowances on their own: chi-square shortfalls, slice lean and allowance, isolation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rlx_nb.numerics.reference import ReferenceStats, slice_stats
from rlx_nb.verdict.chance import isolation, sample_allowance, slice_allowance, slice_lean


@pytest.mark.parametrize(
    ("dof", "p", "quantile"), [(1, 0.1, 0.01579), (2, 0.1, 0.2107), (8, 0.1, 3.4895), (100, 0.5, 99.334)]
)
def test_the_chi_square_quantiles_behind_the_sample_allowance(dof, p, quantile):
    from rlx_nb.verdict.chance import _chi2_quantile

    assert _chi2_quantile(dof, p) == pytest.approx(quantile, rel=1e-3)


def test_the_sample_allowance_shrinks_with_the_elements_and_the_runs():
    assert sample_allowance(1, 2) == pytest.approx(7.958, rel=1e-3)
    assert sample_allowance(1, 1) > sample_allowance(1, 2) > sample_allowance(8, 2) > sample_allowance(64, 2) > 1.0
    assert sample_allowance(100_000, 2) < 1.01 and sample_allowance(0) == 1.0


def test_the_sample_allowance_holds_at_its_level(rng):
    # The RMS of n Gaussian errors, the larger of two runs, falls below sigma / q in about 1 % of draws.
    for n in (1, 3, 16):
        q = sample_allowance(n, 2)
        rms = np.sqrt((rng.standard_normal((20_000, 2, n)) ** 2).mean(-1)).max(-1)
        assert abs(np.mean(rms < 1 / q) - 0.01) < 0.004


def test_lean_is_one_over_n_for_independent_errors_and_one_for_shared_ones(rng):
    r = rng.standard_normal((64, 16))
    independent = slice_stats(r + 1e-7 * rng.standard_normal(r.shape), r)
    shared = slice_stats(r + 1e-7 * rng.standard_normal((64, 1)), r)  # one error per row
    axis = independent.axes.index(0)  # slices along axis 0 are the rows (16 elements each)
    assert slice_lean([independent], axis) == pytest.approx(1 / 16, rel=0.3)
    assert slice_lean([shared], axis) == pytest.approx(1.0, rel=1e-9)


def test_slice_allowance_is_the_expected_largest_chance_mean():
    c = 2.5758  # the two-sided 1 % quantile for one slice
    assert slice_allowance(np.array([4.0]), 1)[0] == pytest.approx(c / 2, rel=1e-3)
    assert slice_allowance(np.array([10_000.0]), 1)[0] == 1.0  # never below the RMS bound
    assert slice_allowance(np.array([4.0]), 1, lean=1.0)[0] == pytest.approx(c, rel=1e-3)
    assert slice_allowance(np.array([4.0]), 100)[0] > slice_allowance(np.array([4.0]), 1)[0]  # more slices, more room


def test_isolation_is_about_one_for_noise_and_large_for_one_outlier(rng):
    e = rng.standard_normal(10_000)
    noise = ReferenceStats(float(np.sqrt(np.mean(e * e))), float(np.abs(e).max()), 1.0, 1.0)
    assert 0.7 < isolation(noise, e.size) < 1.3
    e[0] = 100.0
    spike = ReferenceStats(float(np.sqrt(np.mean(e * e))), 100.0, 1.0, 1.0)
    assert isolation(spike, e.size) > 10
    assert isolation(ReferenceStats(0.0, 0.0, 1.0, 1.0), 5) == 0.0 and not math.isnan(isolation(noise, 1))
