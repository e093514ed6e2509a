"""MasterAdamW against torch.optim.AdamW (+ clip_grad_norm_), fp32 masters for bf16 params, offload cpu/disk, state
round trip, and ZeRO-1 / TP grad norm over two gloo processes."""

import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from areno.training.optimizer import MasterAdamW

SHAPES = [(7, 5), (13,), (3, 4, 6), (1,), (31, 2), (9, 9)]
HP = dict(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def make_params(dtype=torch.float32, seed=0, dtypes=None):
    g = torch.Generator().manual_seed(seed)
    dtypes = dtypes or [dtype] * len(SHAPES)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(d)) for s, d in zip(SHAPES, dtypes)]


def grads_for(step, rank=0, scale=1.0):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(s, generator=g) * scale for s in SHAPES]


def set_grads(params, grads):
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.to(p.device, p.dtype).clone()


LRS = [1e-2, 3e-2, 2e-2, 5e-3, 1e-2]
SCALES = [1.0, 5.0, 0.01, 3.0, 1.0]  # norms around 10-50 with clip 4: clipped steps and one unclipped


def run_reference(params, clip):
    opt = torch.optim.AdamW(params, lr=1.0, foreach=False, **HP)
    norms = []
    for i, lr in enumerate(LRS):
        set_grads(params, grads_for(i, scale=SCALES[i]))
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))))
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
    return norms


def run_master(params, clip, **kw):
    opt = MasterAdamW(params, **HP, **kw)
    norms = []
    for i, lr in enumerate(LRS):
        opt.zero_grad()
        set_grads(params, grads_for(i, scale=SCALES[i]))
        norms.append(opt.step(lr=lr, grad_clip=clip))
    return opt, norms


@pytest.mark.parametrize("bucket_bytes", [64, 25 * 2**20])
def test_fp32_equals_torch_adamw(bucket_bytes):
    ref, mine = make_params(), make_params()
    run_reference(ref, 0.0)
    opt, _ = run_master(mine, 0.0, bucket_bytes=bucket_bytes)
    for a, b in zip(ref, mine):
        assert torch.equal(a, b)  # same ops on the same fp32 values: bit-identical without clipping
    assert len(opt.buckets) == (6 if bucket_bytes == 64 else 1)  # a parameter larger than a bucket: its own


def test_clipping_and_norm_match_torch():
    ref, mine = make_params(), make_params()
    ref_norms = run_reference(ref, 4.0)
    _, norms = run_master(mine, 4.0, bucket_bytes=100)
    assert min(ref_norms) < 4.0 < max(ref_norms)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-6, atol=0)
    for a, b in zip(ref, mine):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_bf16_params_keep_fp32_master_and_storage():
    master = make_params()  # fp32 reference: the same math on fp32 masters, rounded to bf16 after each step
    params = [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in master]
    ptrs = [p.data_ptr() for p in params]
    ref_opt = torch.optim.AdamW(master, lr=1.0, foreach=False, **HP)
    opt = MasterAdamW(params, **HP, bucket_bytes=200)
    with torch.no_grad():
        for p, m in zip(params, master):
            m.copy_(p.float())  # masters start from the bf16 values
    for i, lr in enumerate(LRS):
        grads = grads_for(i, scale=SCALES[i])
        set_grads(params, grads)
        for m, g in zip(master, grads):
            m.grad = g.to(torch.bfloat16).float()
        ref_opt.param_groups[0]["lr"] = lr
        ref_opt.step()
        opt.step(lr=lr)
        for p, m in zip(params, master):
            assert p.dtype == torch.bfloat16
            assert torch.equal(p, m.to(torch.bfloat16))
    assert [p.data_ptr() for p in params] == ptrs  # updated in place
    sd = opt.state_dict()
    to_master = {id(p): m for p, m in zip(params, master)}
    for i, b in enumerate(opt.buckets):  # the master is fp32, not the rounded weights
        flat = torch.cat([to_master[id(p)].detach().view(-1) for p in b.params])
        assert torch.equal(sd["master"][i], flat) and not torch.equal(flat, flat.bfloat16().float())


def test_none_grad_counts_as_zero():
    a, b = make_params(), make_params()
    oa, ob = MasterAdamW(a, **HP), MasterAdamW(b, **HP)
    for i in range(3):
        grads = grads_for(i)
        set_grads(a, grads)
        set_grads(b, grads)
        a[2].grad = None
        b[2].grad = torch.zeros_like(b[2])
        assert oa.step(lr=1e-2, grad_clip=1.0) == ob.step(lr=1e-2, grad_clip=1.0)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert not torch.equal(a[2], make_params()[2])  # weight decay and momentum still move it


def test_nonfinite_grad_skips_the_step():
    params = make_params()
    opt, _ = run_master(params, 1.0)
    before = [p.detach().clone() for p in params]
    set_grads(params, grads_for(0))
    params[1].grad[3] = float("inf")
    assert opt.step(lr=1e-2, grad_clip=1.0) == float("inf")
    assert opt.num_steps == len(LRS)
    assert all(torch.equal(p, q) for p, q in zip(params, before))


@pytest.mark.parametrize("offload,batch", [("cpu", 1), ("disk", 1), ("disk", 3)])
def test_offload_gives_the_same_weights(tmp_path, offload, batch):
    dtypes = [torch.bfloat16, torch.float32, torch.bfloat16, torch.float32, torch.bfloat16, torch.bfloat16]
    ref, mine = make_params(dtypes=dtypes), make_params(dtypes=dtypes)
    ref_opt, ref_norms = run_master(ref, 4.0, bucket_bytes=150)
    opt, norms = run_master(mine, 4.0, bucket_bytes=150, offload=offload, offload_dir=tmp_path,
                            offload_batch_size=batch)
    assert norms == ref_norms
    for a, b in zip(ref, mine):
        assert torch.equal(a, b)
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    for key in ("master", "exp_avg", "exp_avg_sq"):
        assert all(isinstance(t, torch.Tensor) and torch.equal(t, r) for t, r in zip(sd[key], ref_sd[key]))
    if offload == "disk":
        folder = opt.offload_path
        assert folder.parent == tmp_path and str(os.getpid()) in folder.name
        assert folder.stat().st_mode & 0o777 == 0o700
        files = sorted(folder.iterdir())
        assert len(files) == -(-len(opt.buckets) // batch) and len(opt.buckets) > 3
        # the files hold the live state: fp32 (master,) exp_avg, exp_avg_sq of their buckets, in order
        assert sum(f.stat().st_size for f in files) == 4 * sum(b.state_numel for b in opt.buckets)
        opt.close()
        assert not folder.exists()
        assert list(tmp_path.iterdir()) == []


@pytest.mark.gpu
def test_gpu_offload_pinned_host_and_disk_give_the_same_weights(tmp_path):
    dtypes = [torch.bfloat16, torch.float32, torch.bfloat16, torch.float32, torch.bfloat16, torch.bfloat16]
    runs = {}
    for offload in ("none", "cpu", "disk"):
        params = [torch.nn.Parameter(p.detach().cuda()) for p in make_params(dtypes=dtypes)]
        ptrs = [p.data_ptr() for p in params]
        opt, norms = run_master(params, 4.0, bucket_bytes=150, offload=offload, offload_dir=tmp_path)
        assert [p.data_ptr() for p in params] == ptrs
        if offload == "cpu":
            assert all(b.storage.device.type == "cpu" and b.storage.is_pinned() for b in opt.buckets)
        runs[offload] = (norms, [p.detach().cpu() for p in params])
        opt.close()
    for offload in ("cpu", "disk"):
        assert runs[offload][0] == runs["none"][0]
        assert all(torch.equal(a, b) for a, b in zip(runs[offload][1], runs["none"][1]))


def test_disk_offload_folder_removed_at_interpreter_exit(tmp_path):
    code = (
        "import torch, sys\n"
        "from areno.training.optimizer import MasterAdamW\n"
        "p = torch.nn.Parameter(torch.randn(10, dtype=torch.bfloat16))\n"
        f"opt = MasterAdamW([p], offload='disk', offload_dir={str(tmp_path)!r})\n"
        "p.grad = torch.ones_like(p)\n"
        "opt.step(lr=1e-3)\n"
        "assert any(opt.offload_path.iterdir())\n"
        "print(opt.offload_path)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    folder = out.stdout.strip().splitlines()[-1]
    assert folder.startswith(str(tmp_path)) and not os.path.exists(folder)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("offload", ["none", "disk"])
def test_state_dict_resume_gives_the_same_next_update(tmp_path, offload):
    dtypes = [torch.bfloat16, torch.float32] * 3
    a = make_params(dtypes=dtypes)
    oa, _ = run_master(a, 4.0, bucket_bytes=150)
    sd = {k: ([t.clone() for t in v] if isinstance(v, list) and v and isinstance(v[0], torch.Tensor) else v)
          for k, v in oa.state_dict().items()}
    b = make_params(dtypes=dtypes, seed=5)  # different weights: load_state_dict writes the masters back
    ob = MasterAdamW(b, **HP, bucket_bytes=150, offload=offload, offload_dir=tmp_path)
    ob.load_state_dict(sd)
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and ob.num_steps == oa.num_steps
    for i in (7, 8):
        set_grads(a, grads_for(i))
        set_grads(b, grads_for(i))
        assert oa.step(lr=1e-2, grad_clip=4.0) == ob.step(lr=1e-2, grad_clip=4.0)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    with pytest.raises(ValueError, match="does not fit"):
        MasterAdamW(make_params(dtypes=dtypes), bucket_bytes=10**6).load_state_dict(sd)
    ob.close()


# ---- two gloo processes ------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, port, tmp):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        _check_zero1(rank, tmp)
        _check_tp_norm(rank)
        dist.barrier()  # neither rank tears gloo down while the other still uses it (an abort seen under load)
    finally:
        dist.destroy_process_group()


def _dp_grads(step, rank):
    # multiples of 1/16 below 8: exact in bf16, and so is the sum of two, so bf16 grads lose nothing
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randint(-100, 101, s, generator=g) / 16 for s in SHAPES]


def _check_zero1(rank, tmp):
    """dp=2: each rank holds its own gradients; the result equals one process stepping on their sum."""
    dtypes = [torch.float32] * len(SHAPES)
    for mixed in (False, True):
        if mixed:
            dtypes = [torch.bfloat16, torch.float32, torch.bfloat16, torch.bfloat16, torch.float32, torch.bfloat16]
        dp, single, ref = make_params(dtypes=dtypes), make_params(dtypes=dtypes), make_params()
        opt = MasterAdamW(dp, **HP, dp_group=dist.group.WORLD, bucket_bytes=120,
                          offload="disk" if mixed else "none", offload_dir=tmp)
        opt1 = MasterAdamW(single, **HP, bucket_bytes=120)
        ref_opt = torch.optim.AdamW(ref, lr=1.0, foreach=False, **HP)
        assert opt.dp_size == 2 and any(b.numel % 2 for b in opt.buckets)  # padding exercised
        for i, lr in enumerate(LRS):
            mine, other = _dp_grads(i, rank), _dp_grads(i, 1 - rank)
            if i == 2:  # rank 1 has no gradient for a parameter: it contributes zero
                (mine if rank == 1 else other)[3] = None
            summed = [(x if x is not None else 0) + (y if y is not None else 0) for x, y in zip(mine, other)]
            set_grads(dp, mine)
            set_grads(single, summed)
            clip = 0.0 if mixed else 4.0  # unclipped, the sharded update is bit-identical to one process
            norm, norm1 = opt.step(lr=lr, grad_clip=clip), opt1.step(lr=lr, grad_clip=clip)
            assert abs(norm - norm1) <= 1e-6 * norm1  # the shards sum their squares in another order
            if not mixed:
                set_grads(ref, summed)
                ref_norm = float(torch.nn.utils.clip_grad_norm_(ref, 4.0))
                ref_opt.param_groups[0]["lr"] = lr
                ref_opt.step()
                assert abs(norm - ref_norm) <= 1e-6 * ref_norm
        for x, y, r in zip(dp, single, ref):
            if mixed:
                assert torch.equal(x, y)
            else:
                torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)
                torch.testing.assert_close(x, r, rtol=1e-6, atol=1e-7)
        sd = opt.state_dict()  # each rank holds half of every (padded) bucket
        assert [t.numel() for t in sd["exp_avg"]] == [-(-b.numel // 2) for b in opt.buckets]
        opt.close()


def _check_tp_norm(rank):
    """tp=2: a row-sharded weight (summed over ranks) and a replicated one (counted once) give the full norm."""
    g = torch.Generator().manual_seed(7)
    full_w, full_b = torch.randn(6, 5, generator=g), torch.randn(5, generator=g)
    grad_w, grad_b = torch.randn(6, 5, generator=g), torch.randn(5, generator=g)
    w = torch.nn.Parameter(full_w[3 * rank : 3 * rank + 3].clone())
    b = torch.nn.Parameter(full_b.clone())
    b.tp_replicated = True
    w.grad, b.grad = grad_w[3 * rank : 3 * rank + 3].clone(), grad_b.clone()
    opt = MasterAdamW([w, b], **HP, tp_group=dist.group.WORLD)
    ref_w, ref_b = torch.nn.Parameter(full_w.clone()), torch.nn.Parameter(full_b.clone())
    ref_w.grad, ref_b.grad = grad_w.clone(), grad_b.clone()
    ref_norm = float(torch.nn.utils.clip_grad_norm_([ref_w, ref_b], 1.0))
    torch.optim.AdamW([ref_w, ref_b], lr=1e-2, foreach=False, **HP).step()
    norm = opt.step(lr=1e-2, grad_clip=1.0)
    assert abs(norm - ref_norm) <= 1e-6 * ref_norm, (norm, ref_norm)
    torch.testing.assert_close(w.detach(), ref_w.detach()[3 * rank : 3 * rank + 3], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(b.detach(), ref_b.detach(), rtol=1e-6, atol=1e-7)


def test_zero1_dp2_and_tp2_norm_on_gloo(tmp_path):
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=2)
    assert list(tmp_path.iterdir()) == []  # both ranks' disk-offload folders were removed by close()


def test_fused_update_equals_the_single_tensor_path():
    """The CUDA update goes through torch's fused AdamW kernel: it must match the op-for-op path (run here on CPU)."""
    from areno.training.optimizer import MasterAdamW

    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(300))
    opt = MasterAdamW([p], lr=1e-2, weight_decay=0.1)
    states = {}
    for fused in (False, True):
        torch.manual_seed(1)
        w, m, v = torch.randn(300), torch.zeros(300), torch.zeros(300)
        opt.num_steps = 0
        for _ in range(4):
            opt.num_steps += 1
            opt._adamw(w, torch.randn(300), m, v, 1e-2, fused=fused)
        states[fused] = (w, m, v)
    for a, b in zip(states[False], states[True]):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)
