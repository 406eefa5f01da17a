"""The CPU small-batch linear (services/model/cpu_kernels.py) against torch's."""

import pytest
import torch
import torch.nn.functional as F

from services.model import cpu_kernels


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ toolchain: F.linear is used")
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
def test_small_linear_matches_torch_and_is_batch_invariant(rows):
    g = torch.Generator().manual_seed(rows)
    x, w, b = (
        torch.randn(rows, 136, generator=g),
        torch.randn(72, 136, generator=g),
        torch.randn(72, generator=g),
    )
    for bias in (None, b):
        y = cpu_kernels.linear(x, w, bias)
        torch.testing.assert_close(y, F.linear(x, w, bias), rtol=1e-5, atol=1e-5)
        for i in range(rows):  # each row alone gives the same bits: no dependence on the batch
            assert torch.equal(cpu_kernels.linear(x[i : i + 1], w, bias), y[i : i + 1])


def test_shapes_the_kernel_does_not_take_use_torch():
    x, w = torch.randn(9, 64), torch.randn(32, 64)  # more rows than MAX_ROWS
    assert torch.equal(cpu_kernels.linear(x, w), F.linear(x, w))
    x, w = torch.randn(2, 60), torch.randn(32, 60)  # K not a multiple of 8
    assert torch.equal(cpu_kernels.linear(x, w), F.linear(x, w))
    x, w = torch.randn(2, 64, dtype=torch.float64), torch.randn(32, 64, dtype=torch.float64)
    assert torch.equal(cpu_kernels.linear(x, w), F.linear(x, w))
