"""copy_rows (a speculative rollback's state rows from the stash into the pool): the kernel (interpreted on the CPU)
against torch indexing over odd row sizes, several blocks a row, a stash viewed [L, K x rows, ...], fp32 and bf16;
nothing else of the pool changes; bad shapes are refused."""

import pytest
import torch

from areno.kernels.state_copy import copy_rows, copy_rows_native
from tests.helpers.timing import cuda_ms


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_matches_indexing_at_the_9b_shape_on_the_gpu():
    """24 layers of 32 x 128 x 128 fp32 states, 64 rejecting rows of a K = 2 stash: the same pool as torch's
    indexing, in less time (printed)."""
    L, S, K, rows, row = 24, 80, 2, 64, (32, 128, 128)
    pool = torch.randn(L, S, *row, device="cuda")
    stash = torch.randn(L, K, rows, *row, device="cuda")
    slots = torch.randperm(S, device="cuda")[:rows]
    src = torch.randint(0, K, (rows,), device="cuda") * rows + torch.arange(rows, device="cuda")
    got, want = pool.clone(), pool.clone()
    copy_rows(got, slots, stash.flatten(1, 2), src)
    copy_rows_native(want, slots, stash.flatten(1, 2), src)
    assert torch.equal(got, want)
    flat = stash.flatten(1, 2)
    times = {"kernel": cuda_ms(lambda: copy_rows(got, slots, flat, src), 10),
             "indexing": cuda_ms(lambda: copy_rows_native(got, slots, flat, src), 10)}
    print(f"rollback of {rows} rows x {L} layers ({rows * L * 2 * pool[0, 0].numel() * 4 / 1e9:.1f} GB moved): kernel "
          f"{times['kernel']:.2f} ms, indexing {times['indexing']:.2f} ms")
    assert times["kernel"] < times["indexing"]


@pytest.mark.parametrize("kernels", ["triton", "native"])
@pytest.mark.parametrize("case", ["some", "none", "first"])
def test_rows_at_minus_one_are_skipped(kernels, case, monkeypatch):
    """-1 in dst_idx skips the row (a rollback copies every row's conv state that way, the rejecting ones only),
    the native path without a host sync: the pool is what copying the other rows alone gives."""
    monkeypatch.setenv("ARENO_KERNELS", kernels)
    g = torch.Generator().manual_seed(len(case))
    L, S, rows = 2, 6, 4
    pool = torch.randn(L, S, 3, 5, generator=g)
    src = torch.randn(L, rows, 3, 5, generator=g)
    dst = {"some": [3, -1, 0, -1], "none": [-1, -1, -1, -1], "first": [-1, 5, 2, 1]}[case]
    which = torch.tensor([2, 0, 3, 1])
    got = pool.clone()
    copy_rows(got, torch.tensor(dst, dtype=torch.int32), src, which)
    want = pool.clone()
    for d, s in zip(dst, which.tolist()):
        if d >= 0:
            want[:, d] = src[:, s]
    assert torch.equal(got, want)
