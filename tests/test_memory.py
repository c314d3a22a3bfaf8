"""Private copies of large inputs on numpy (huge-page) memory: same values, layout and grads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import rlx_nb
from rlx_nb._memory import HUGE_COPY_BYTES, private_copy
from rlx_nb.backends.eager import to_float64

LARGE = (HUGE_COPY_BYTES // 4 // 512 + 1, 512)  # just over the threshold in float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.complex64, torch.bool])
def test_a_large_copy_is_private_aligned_and_equal(dtype):
    x = torch.randn(LARGE).to(dtype) if dtype != torch.bool else torch.rand(LARGE) > 0.5
    y = private_copy(x)
    assert y.dtype == x.dtype and y.shape == x.shape and y.stride() == x.stride()
    assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()
    assert y.data_ptr() % 64 == 0  # aligned like torch's own allocations
    first = x.view(-1)[0]
    y.view(-1)[0] = ~first if dtype == torch.bool else first + 1
    assert not torch.equal(y, x)  # the user's tensor is untouched


def test_a_cast_copy_has_the_cast_values():
    x = torch.randn(LARGE)
    y = private_copy(x, torch.float64)
    assert y.dtype == torch.float64 and torch.equal(y, x.double())


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(LARGE).t(),  # strided view: torch's clone keeps its strides
        lambda: torch.randn(8, 8),  # small: torch's own copy
        lambda: torch.randn(LARGE).conj_physical(),
    ],
)
def test_other_tensors_are_copied_by_torch_with_their_layout(make):
    x = make()
    y = private_copy(x)
    assert torch.equal(y, x) and y.stride() == x.clone().stride() and y.data_ptr() != x.data_ptr()


def test_the_reference_keeps_the_graph_of_inputs_that_need_grads():
    x = torch.randn(LARGE, requires_grad=True)
    y = to_float64(x)
    assert y.dtype == torch.float64 and y.grad_fn is not None  # differentiable: grads reach x
    z = to_float64(x.detach())
    assert z.grad_fn is None and torch.equal(z, x.detach().double())


def test_a_model_that_writes_into_a_large_input_leaves_the_users_tensor_alone():
    def model(x):
        x.mul_(2)  # in place, into the (private) input
        return x + 1

    x = torch.randn(LARGE)
    before = x.clone()
    report = rlx_nb.backend_divergence(model, x, backends=["cpu-nomkldnn"], progress=False)
    assert torch.equal(x, before)
    assert report.record("cpu-nomkldnn").verdict == "round-off"
    np.testing.assert_array_equal(report.results.oracle.outputs["out"].value, (before * 2 + 1).numpy())
