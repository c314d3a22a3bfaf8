"""Device-side comparison (``rlx_nb.numerics.device``) and the pipeline that keeps outputs on a device.

Run on CPU tensors here (the code is the same torch code a GPU runs; tests/test_gpu.py checks CUDA
where there is one): the torch statistics must equal the numpy ones, and a backend that compares
on its device must give the same report without any host copy of its outputs.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import rlx_nb
from rlx_nb.backends.eager import run_eager
from rlx_nb.models import demo
from rlx_nb.numerics import device as device_metrics
from rlx_nb.numerics import elements, reference
from rlx_nb.numerics import pairs as metrics


def _pair(rng, n, dtype=np.float32):
    e = rng.standard_normal(n).astype(dtype)
    a = e.copy()
    a[n // 2 :] += (rng.standard_normal(n - n // 2) * 1e-3).astype(dtype)
    e[[1, n - 3]] = np.nan
    a[[2, n - 4]] = np.inf
    e[[5, 6]] = np.nan
    a[[5, 6]] = np.nan  # agreeing NaNs
    return e, a


@pytest.mark.parametrize("n", [7, 1000, 300_001])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_torch_pair_stats_equal_the_numpy_ones(rng, monkeypatch, n, dtype):
    monkeypatch.setattr(device_metrics, "CHUNK", 65_536)  # several chunks, as a large output on a GPU
    e, a = _pair(rng, n, dtype)
    want = metrics.pair_stats(e, a)
    got = device_metrics.pair_stats(torch.from_numpy(e), torch.from_numpy(a))
    assert (got.numel, got.worst_index, got.mismatched, got.max_ulp, got.nonfinite_mismatch) == (
        want.numel,
        want.worst_index,
        want.mismatched,
        want.max_ulp,
        want.nonfinite_mismatch,
    )
    assert got.max_abs == pytest.approx(want.max_abs, rel=1e-12)
    assert got.max_rel == pytest.approx(want.max_rel, rel=1e-6)
    assert got.p99_abs == pytest.approx(want.p99_abs, rel=1e-6)
    assert got.mean_abs == pytest.approx(want.mean_abs, rel=1e-6)  # numpy sums float16 in float32
    assert got.finite == want.finite
    for name in ("cosine", "pcc", "sqnr_db", "nmse"):  # the metrics other toolchains speak, same on device
        assert getattr(got, name) == pytest.approx(getattr(want, name), rel=1e-9, abs=1e-12), name


def test_torch_p99_falls_back_when_the_sample_misses(monkeypatch):
    monkeypatch.setattr(device_metrics, "CHUNK", 65_536)
    e = np.zeros(1_000_000, np.float32)
    a = e.copy()
    a[-20_000:] = np.linspace(1, 2, 20_000, dtype=np.float32)
    got = device_metrics.pair_stats(torch.from_numpy(e), torch.from_numpy(a))
    assert got.p99_abs == np.sort(np.abs(a - e))[math.ceil(0.99 * e.size) - 1]


def test_torch_reference_stats_and_top_k(rng, monkeypatch):
    monkeypatch.setattr(device_metrics, "CHUNK", 65_536)
    e, a = _pair(rng, 200_001)
    ref = e.astype(np.float64) + rng.standard_normal(e.size) * 1e-7
    want = reference.reference_stats(a, ref)
    got = device_metrics.reference_stats(torch.from_numpy(a), torch.from_numpy(ref))
    assert got.rmse == pytest.approx(want.rmse, rel=1e-9) and got.max_err == want.max_err
    assert got.ref_rms == pytest.approx(want.ref_rms, rel=1e-9) and got.ref_max == want.ref_max
    i_want, v_want = elements.top_k(e, a, 25)
    i_got, v_got = device_metrics.top_k(torch.from_numpy(e), torch.from_numpy(a), 25)
    np.testing.assert_array_equal(i_got, i_want)
    np.testing.assert_allclose(v_got, v_want, rtol=1e-7)


def test_torch_slice_stats_equal_the_numpy_ones(rng, monkeypatch):
    monkeypatch.setattr(device_metrics, "CHUNK", 4096)  # several chunks of rows
    shape = (6, 50, 70)
    ref = rng.standard_normal(shape)
    x = (ref + rng.standard_normal(shape) * 1e-7).astype(np.float32)
    x[2, 3, 4] = np.inf
    want = reference.slice_stats(x, ref)
    got = device_metrics.slice_stats(torch.from_numpy(x).reshape(-1), torch.from_numpy(ref).reshape(-1), shape)
    assert got.axes == want.axes == (0, 1, 2)
    for name in ("sums", "squares", "counts"):
        for g, w in zip(getattr(got, name), getattr(want, name), strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-20)


def test_a_backend_that_compares_on_its_device_gives_the_same_report_without_host_copies():
    rlx_nb.register_backend("test:on-device", run_eager, default=False, replace=True, compare_on_device=True)
    rlx_nb.register_backend("test:on-host", run_eager, default=False, replace=True, compare_on_device=False)
    model, inputs = demo.transformer()
    report = rlx_nb.backend_divergence(model, inputs, backends=["test:on-device", "test:on-host"], backward=True)
    dev = report.results.candidates["test:on-device"].outputs
    assert all(leaf.on_device for leaf in dev.values() if leaf.is_array)
    assert not any(leaf.on_device for leaf in report.results.candidates["test:on-host"].outputs.values())
    by_dev = {r.output: r for r in report.records if r.backend == "test:on-device"}
    for r in (r for r in report.records if r.backend == "test:on-host"):
        d = by_dev[r.output]
        assert (d.verdict, d.pair.worst_index, d.pair.max_ulp, d.pair.mismatched) == (
            r.verdict,
            r.pair.worst_index,
            r.pair.max_ulp,
            r.pair.mismatched,
        )
        assert d.pair.max_abs == pytest.approx(r.pair.max_abs, rel=1e-12) and d.pair.p99_abs == pytest.approx(
            r.pair.p99_abs, rel=1e-6
        )
        assert d.judgement.ratio_rmse == pytest.approx(r.judgement.ratio_rmse, rel=1e-9)
        assert (
            d.judgement.slice_ratio == pytest.approx(r.judgement.slice_ratio, rel=1e-6, nan_ok=True)
            and d.judgement.slice_at == r.judgement.slice_at
        )
    worst = report.record("test:on-device").output
    top = report.elements("test:on-device", worst, top=5)
    assert dev[worst].on_device  # the top-k moved only its 5 elements
    host_top = report.elements("test:on-host", worst, top=5)
    assert top["flat_index"].tolist() == host_top["flat_index"].tolist()
    report.arrays("test:on-device", worst)  # an explicit request for the whole output
    assert not dev[worst].on_device
    assert all(leaf.value.shape == leaf.shape for leaf in dev.values() if leaf.is_array)  # 0-d stays 0-d


def test_localize_on_a_device_backend_makes_no_host_copies():
    # Sizing each module check for keep_arrays must not pull the backend's outputs to the host.
    rlx_nb.register_backend("test:on-device", run_eager, default=False, replace=True, compare_on_device=True)
    model, inputs = demo.layered(n_layers=2, fault_layer=1)
    loc = rlx_nb.localize(model, inputs, backend="fault:softmax-row", ops=False, propagated=False)
    assert loc.culprit is not None  # the fault backend on the host, for contrast
    loc = rlx_nb.localize(model, inputs, backend="test:on-device", ops=False, propagated=False)
    assert loc.culprit is None
    leaves = [
        leaf
        for results, _ in loc._checks.values()
        if results is not None
        for leaf in results.candidates["test:on-device"].outputs.values()
        if leaf.is_array
    ]
    assert leaves and all(leaf.on_device for leaf in leaves)


def test_the_gpu_check_script_runs_dry_on_the_cpu():
    # bench/gpu_check.py is what a session lent a GPU runs, once, on scarce device time: its dry run
    # on the CPU keeps it working between such sessions.
    root = Path(__file__).resolve().parent.parent
    written = root / "bench" / "results" / "gpu_check.md"  # a real device's results, which a dry run keeps
    before = written.stat().st_mtime_ns if written.exists() else None
    done = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--device", "cpu", "--elements", "2e5"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| True |" in done.stdout, done.stdout  # device and host statistics agree
    assert "output kept on the device without a host copy: True" in done.stdout, done.stdout
    assert (written.stat().st_mtime_ns if written.exists() else None) == before
