"""Property tests: the chunked metrics against a straightforward float64 reference, and a loader fuzz."""

from __future__ import annotations

import io
import json
import math
import random
import zipfile

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import rlx_nb
from rlx_nb.numerics.pairs import default_tolerance, pair_stats
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


def _use(data: bytes, views: int, tmp_path) -> None:
    # Load, then what a reader does first: the text lines, the frames, every record, every array; the
    # notebook view (views >= 1) and the HTML report (views >= 2) for a sample (they take milliseconds and
    # a second each).
    report = rlx_nb.load_report(io.BytesIO(data))
    assert report.lines() and len(report.backends) == len(report.results.candidates)
    for name in report.results.candidates:
        report.record(name)
    for run in [report.results.oracle, report.results.reference, *report.results.candidates.values()]:
        for leaf in run.outputs.values():
            _ = leaf.value
    if views >= 1:
        assert report._repr_html_() and report.summary._repr_html_() and report.summary_detail._repr_html_()
    if views >= 2:
        report.to_html(tmp_path / "fuzzed.html")


# Values a mutated field may take: other types, out-of-range numbers, markup, deep nesting.
ODD_VALUES = [
    None, True, False, 0, -1, 2**70, 1.5, -1e308, float("nan"), float("inf"), "", "abc", "nan", "<script>x</script>",
    [], [1, 2], [-3], [2**40, 2**40], ["a"], {}, {"a": 1}, [[[[[]]]]], "SUSPECT", "round-off", "float32", "grad",
]  # fmt: skip


def _paths(node) -> list:
    # Every (container, key) pair inside a JSON document (a stack, not nested generators: 10,000 documents).
    found, stack = [], [node]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            found.append((node, key))
            if isinstance(value, (dict, list)):
                stack.append(value)
    return found


def _mutate_json(meta: dict, rng: random.Random) -> dict:
    meta = json.loads(json.dumps(meta))
    spots = list(_paths(meta))
    for _ in range(rng.randint(1, 3)):
        node, key = rng.choice(spots)
        roll = rng.random()
        if roll < 0.15 and isinstance(node, dict):
            node.pop(key, None)
        elif roll < 0.25 and isinstance(node, list) and node:
            node.append(node[rng.randrange(len(node))])
        else:
            node[key] = rng.choice(ODD_VALUES)
    return meta


def _rezip(items: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in items.items():
            zf.writestr(name, data)
    return buf.getvalue()


def _mutated_files(good: bytes, n: int, rng: random.Random):
    with zipfile.ZipFile(io.BytesIO(good)) as zf:
        items = {name: zf.read(name) for name in zf.namelist()}
    meta = json.loads(items["meta.json"])
    arrays = [name for name in items if name.endswith(".npy")]
    for i in range(n):
        kind = i % 5
        if kind in (0, 1, 2):  # a field of meta.json (the CRC stays right: the loader must read the field)
            yield _rezip({**items, "meta.json": json.dumps(_mutate_json(meta, rng)).encode()})
        elif kind == 3:  # an array's header or bytes
            name = rng.choice(arrays)
            data = bytearray(items[name])
            for _ in range(rng.randint(1, 4)):
                j = rng.randrange(min(len(data), 128) if rng.random() < 0.7 else len(data))
                data[j] = rng.randrange(256)
            if rng.random() < 0.3:
                data = data[: rng.randrange(len(data))]
            yield _rezip({**items, name: bytes(data)})
        else:  # the zip itself: flipped bits, a truncation
            data = bytearray(good)
            for _ in range(rng.randint(1, 8)):
                j = rng.randrange(len(data))
                data[j] ^= 1 << rng.randrange(8)
            yield bytes(data[: rng.randrange(len(data))] if rng.random() < 0.2 else data)


FUZZ_CASES = 3_000


def test_mutated_report_files_load_only_as_report_format_errors(saved_report, tmp_path):
    """3,000 mutated files: each loads and works in every first view, or is a ReportFormatError."""
    rng = random.Random(0)
    outcomes = {"ok": 0, "refused": 0}
    for data in _mutated_files(saved_report, FUZZ_CASES, rng):
        try:
            _use(data, views=2 if outcomes["ok"] % 97 == 0 else 1 if outcomes["ok"] % 9 == 0 else 0, tmp_path=tmp_path)
            outcomes["ok"] += 1
        except rlx_nb.ReportFormatError:
            outcomes["refused"] += 1
    assert sum(outcomes.values()) == FUZZ_CASES
    assert outcomes["refused"] > FUZZ_CASES // 2, outcomes  # most mutations are caught; the rest are harmless
