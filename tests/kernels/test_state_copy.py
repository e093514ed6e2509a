"""copy_rows (a speculative rollback's state rows from the stash into the pool): the kernel (interpreted on the CPU)
against torch indexing over odd row sizes, several blocks a row, a stash viewed [L, K x rows, ...], fp32 and bf16;
nothing else of the pool changes; bad shapes are refused."""

import pytest
import torch

from areno.kernels.state_copy import copy_rows, copy_rows_native


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("row", [(3, 5, 7), (2, 40, 70)], ids=["small", "blocks"])  # 105 and 5,600 elements a row
def test_kernel_matches_indexing(row, dtype, triton_kernels):
    g = torch.Generator().manual_seed(sum(row))
    L, S, K, rows = 3, 9, 2, 5
    pool = torch.randn(L, S, *row, generator=g).to(dtype)
    stash = torch.randn(L, K, rows, *row, generator=g).to(dtype)
    slots, which = torch.tensor([7, 0, 4], dtype=torch.int32), torch.tensor([1, 0, 1])
    seq = torch.tensor([4, 0, 2])
    got, want = pool.clone(), pool.clone()
    copy_rows(got, slots, stash.flatten(1, 2), which * rows + seq)
    copy_rows_native(want, slots.long(), stash.flatten(1, 2), which * rows + seq)
    assert torch.equal(got, want)
    untouched = [1, 2, 3, 5, 6, 8]
    assert torch.equal(got[:, 7], stash[:, 1, 4]) and torch.equal(got[:, untouched], pool[:, untouched])


def test_no_rows_is_a_no_op_and_bad_shapes_are_refused(triton_kernels):
    pool = torch.zeros(2, 4, 3)
    copy_rows(pool, torch.zeros(0, dtype=torch.long), torch.ones(2, 4, 3), torch.zeros(0, dtype=torch.long))
    assert not pool.any()
    with pytest.raises(ValueError, match="copy_rows"):
        copy_rows(pool, torch.zeros(1, dtype=torch.long), torch.ones(2, 4, 5), torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match="copy_rows"):
        copy_rows(pool, torch.zeros(1, dtype=torch.long), torch.ones(2, 4, 3).half(), torch.zeros(1, dtype=torch.long))
