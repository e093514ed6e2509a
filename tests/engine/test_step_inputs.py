"""The host helpers a step's inputs go through: block tables padded into one array, per-row lists as tensors."""

import random

import numpy as np
import pytest
import torch

from areno.engine.step_inputs import host_tensor, pad_tables


@pytest.mark.parametrize("n", [0, 1, 5, 23, 24, 57])  # below and above the scatter's threshold
@pytest.mark.parametrize("repeat", [1, 3])
def test_pad_tables_puts_each_table_in_its_rows_and_zeros_elsewhere(n, repeat):
    rng = random.Random(n * 10 + repeat)
    tables = [[rng.randrange(1, 1000) for _ in range(rng.randrange(0, 12))] for _ in range(n)]
    out = pad_tables(tables, n * repeat + 2, 12, repeat)
    assert out.dtype == np.int32 and out.shape == (n * repeat + 2, 12)
    want = np.zeros_like(out)
    for i, tb in enumerate(tables):
        for j in range(repeat):
            want[i * repeat + j, : len(tb)] = tb
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32, torch.float64])
def test_host_tensor_equals_torch_tensor(dtype):
    for values in ([], [3], [1, -1, 2**31 - 1], [[1, 2], [3, 4]], [0.5, 1.0, 1e-3]):
        if dtype in (torch.int64, torch.int32) and any(isinstance(v, float) for v in values):
            continue
        got, want = host_tensor(values, dtype), torch.tensor(values, dtype=dtype)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)


def test_host_tensor_refuses_what_the_dtype_cannot_hold():
    with pytest.raises(OverflowError):
        host_tensor([2**31], torch.int32)
