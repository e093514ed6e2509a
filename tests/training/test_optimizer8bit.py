"""MasterAdamW(states="8bit"): the update equals the 8-bit kernel's reference on each bucket, the state takes <= 0.3x
the bytes of fp32 moments, state_dict round trips exactly (resume is bit for bit), a mismatched resume is refused,
and ZeRO-1 over two gloo processes shards the 8-bit state."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from areno.kernels.adamw import bias_corrections
from areno.kernels.adamw8bit import adamw8bit_native, n_blocks
from areno.training.optimizer import MasterAdamW

SHAPES = [(70, 5), (130,), (3, 40, 6), (1,), (310, 2), (9, 9)]
HP = dict(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
MIXED = [torch.bfloat16, torch.float32] * 3


def make_params(dtypes=MIXED, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(d)) for s, d in zip(SHAPES, dtypes)]


def grads_for(step, rank=0):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(s, generator=g) * (1 + step) for s in SHAPES]


def set_grads(params, grads):
    for p, g in zip(params, grads):
        p.grad = g.to(p.dtype).clone()


def steps(opt, params, first, last, clip=0.0):
    for i in range(first, last):
        set_grads(params, grads_for(i))
        opt.step(lr=1e-2 * (1 + i % 3), grad_clip=clip)


def test_update_equals_the_kernel_reference_per_bucket(native_kernels):
    params = make_params()
    opt = MasterAdamW(params, **HP, states="8bit")
    assert [b.dtype for b in opt.buckets] == [torch.bfloat16, torch.float32]  # one bucket per dtype
    ref = []  # per bucket: fp32 master, codes and absmax as the reference kernel keeps them
    for b in opt.buckets:
        n = b.shard
        ref.append([torch.cat([p.detach().float().reshape(-1) for p in b.params]), torch.zeros(n, dtype=torch.uint8),
                    torch.zeros(n, dtype=torch.uint8), torch.zeros(n_blocks(n)), torch.zeros(n_blocks(n))])
    for i in range(4):
        set_grads(params, grads_for(i))
        flat = [torch.cat([p.grad.reshape(-1) for p in b.params]).float() for b in opt.buckets]
        lr = 1e-2 * (1 + i % 3)
        opt.step(lr=lr, grad_clip=0.0)
        lr_t = torch.tensor(lr)
        for (w, mq, vq, ma, va), g in zip(ref, flat):
            adamw8bit_native(w, g, mq, vq, ma, va, lr_t, *bias_corrections(lr_t, torch.tensor(i + 1.0), 0.9, 0.95),
                             torch.ones(()), torch.zeros(()), beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    for b, (w, mq, vq, ma, va) in zip(opt.buckets, ref):
        assert torch.equal(b.moments8.codes, torch.stack([mq, vq])) and torch.equal(b.moments8.absmax,
                                                                                     torch.stack([ma, va]))
        assert torch.equal(torch.cat([p.detach().reshape(-1) for p in b.params]), w.to(b.dtype))
        if b.has_master:  # the fp32 master is kept beside the bf16 parameters
            assert b.storage.dtype == torch.float32 and torch.equal(b.storage, w)
        else:
            assert b.storage.numel() == 0  # fp32 parameters are their own master: no fp32 state at all
    assert all(b.moments8.codes.any() for b in opt.buckets)


@pytest.mark.parametrize("dtype,bound", [(torch.float32, 0.3), (torch.bfloat16, 0.51)])
def test_state_bytes_are_under_a_third_of_fp32_moments(dtype, bound):
    """fp32 parameters (LoRA adapters): the state is the moments only, 2.03 / 8 bytes per element; bf16 parameters
    keep their fp32 master too (4 + 2.03 of 4 + 8 bytes)."""
    params = [torch.nn.Parameter(torch.zeros(n, dtype=dtype)) for n in (4096, 1000, 77, 65536)]
    n = sum(p.numel() for p in params)
    fp32, q8 = MasterAdamW(params, **HP), MasterAdamW(params, **HP, states="8bit")
    moments32 = 8 * n
    master = 4 * n if dtype != torch.float32 else 0
    assert fp32.state_bytes() == moments32 + master
    assert q8.state_bytes() - master <= 0.26 * moments32  # the moments alone: codes + one absmax per 256
    assert q8.state_bytes() <= bound * fp32.state_bytes()


def _clone(sd):
    return {k: ([t.clone() for t in v] if isinstance(v, list) and v and isinstance(v[0], torch.Tensor) else v)
            for k, v in sd.items()}


def test_state_dict_resume_is_exact_and_mismatches_are_refused(tmp_path):
    straight = make_params()
    o1 = MasterAdamW(straight, **HP, bucket_bytes=2000, states="8bit")
    steps(o1, straight, 0, 5, clip=4.0)
    cut = make_params()
    o2 = MasterAdamW(cut, **HP, bucket_bytes=2000, states="8bit")
    assert len(o2.buckets) > 2
    steps(o2, cut, 0, 3, clip=4.0)
    torch.save(o2.state_dict(), tmp_path / "opt.pt")
    sd = torch.load(tmp_path / "opt.pt", weights_only=True)
    assert sd["layout"]["states"] == "8bit" and sd["exp_avg"][0].dtype == torch.uint8
    resumed = make_params(seed=5)  # other weights: load_state_dict writes the masters back
    o3 = MasterAdamW(resumed, **HP, bucket_bytes=2000, states="8bit")
    o3.load_state_dict(sd)
    steps(o3, resumed, 3, 5, clip=4.0)
    assert all(torch.equal(x, y) for x, y in zip(straight, resumed))
    for b1, b3 in zip(o1.buckets, o3.buckets):
        assert torch.equal(b1.moments8.codes, b3.moments8.codes) and torch.equal(b1.storage, b3.storage)
    with pytest.raises(ValueError, match="--optimizer-states 8bit, this run has fp32"):
        MasterAdamW(make_params(), **HP, bucket_bytes=2000).load_state_dict(sd)
    fp32_sd = _clone(MasterAdamW(make_params(), **HP, bucket_bytes=2000).state_dict())
    with pytest.raises(ValueError, match="--optimizer-states fp32, this run has 8bit"):
        o3.load_state_dict(fp32_sd)


def test_8bit_refuses_offload_and_device_step():
    with pytest.raises(ValueError, match="--optimizer-states"):
        MasterAdamW(make_params(), states="8bit", offload="cpu")
    with pytest.raises(ValueError, match="--optimizer-states"):
        MasterAdamW(make_params(), states="4bit")
    opt = MasterAdamW(make_params(), states="8bit")
    with pytest.raises(RuntimeError, match="fp32 states"):
        opt.device_norm(1.0)


# ---- two gloo processes ------------------------------------------------------------------------------------
def _worker(rank, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        dp, single = make_params(), make_params()
        opt = MasterAdamW(dp, **HP, dp_group=dist.group.WORLD, states="8bit")
        one = MasterAdamW(single, **HP, states="8bit")
        start = [p.detach().float().clone() for p in single]
        for i in range(4):
            mine, other = grads_for(i, rank), grads_for(i, 1 - rank)
            set_grads(dp, mine)
            set_grads(single, [x + y for x, y in zip(mine, other)])
            opt.step(lr=1e-2, grad_clip=0.0)
            one.step(lr=1e-2, grad_clip=0.0)
        for b, b1 in zip(opt.buckets, one.buckets):  # each rank holds the 8-bit state of its half of each bucket
            assert b.moments8.codes.shape == (2, -(-b.numel // 2)) and b1.moments8.codes.shape == (2, b1.numel)
        # the shards' 256-element blocks differ from one process's, so their absmax do: equal within quantisation
        for x, y, s in zip(dp, single, start):
            moved = (y.float() - s).abs().max()
            assert (x.float() - y.float()).abs().max() <= 0.05 * moved + 1e-2 * (x.dtype == torch.bfloat16)
        dist.barrier()  # neither rank tears gloo down while the other still uses it (an abort seen under load)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two processes on gloo
def test_zero1_dp2_shards_the_8bit_state_on_gloo():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port,), nprocs=2)


# ---- H200 --------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_state_memory_on_the_qwen3_0_6b_shape():
    """The CUDA memory the optimizer's construction allocates over Qwen3-0.6B's parameter list (bf16): the 8-bit
    moments take <= 0.3x the fp32 moments' bytes (the fp32 master is the same both ways), and a step runs the Triton
    kernel (the parameters move)."""
    layer = [(6144, 1024), (1024, 3072), (4096, 1024), (1024, 2048), (1024,), (1024,), (128,), (128,)]
    params = [torch.nn.Parameter(torch.randn(s, device="cuda", dtype=torch.bfloat16) * 0.02)
              for s in [(151936, 1024)] + layer * 28 + [(1024,)]]
    n = sum(p.numel() for p in params)
    alloc = {}
    for states in ("fp32", "8bit"):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        opt = MasterAdamW(params, lr=1e-6, states=states)
        alloc[states] = torch.cuda.memory_allocated() - before - 4 * n  # less the fp32 master
        assert opt.state_bytes() - 4 * n <= alloc[states] <= 1.01 * (opt.state_bytes() - 4 * n) + 2**20 * 40
        del opt
    assert alloc["8bit"] <= 0.3 * alloc["fp32"], alloc
    opt = MasterAdamW(params, lr=1e-3, states="8bit")
    start = params[1].detach().clone()
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    assert math.isfinite(opt.step(lr=1e-3, grad_clip=1.0))
    assert not torch.equal(params[1].detach(), start)


@pytest.mark.gpu
def test_gpu_loss_curve_within_noise_of_fp32():
    """200 SFT steps of a tiny Qwen3 on fixed random rows, bf16 on CUDA: the 8-bit run's final loss (mean of the
    last 20 steps) is within the fp32 run's seed-to-seed spread (or 3% of it), and both learn."""
    import tempfile

    from areno.models import load_model
    from areno.testing import make_tiny_checkpoint

    root = make_tiny_checkpoint(tempfile.mkdtemp(), "qwen3", seed=0)

    def final_loss(states, seed):
        model = load_model(root, dtype=torch.bfloat16, device="cuda")
        opt = MasterAdamW([p for p in model.parameters() if p.requires_grad], states=states)
        data = torch.randint(0, 64, (64, 8, 33), generator=torch.Generator().manual_seed(seed)).cuda()
        losses = []
        for i in range(200):
            logits = model.logits(data[i % 64, :, :-1]).float()
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), data[i % 64, :, 1:].reshape(-1))
            loss.backward()
            opt.step(lr=1e-3, grad_clip=1.0)
            losses.append(float(loss.detach()))
        return losses[0], sum(losses[-20:]) / 20

    (first, fp32), (_, fp32_b), (_, q8) = final_loss("fp32", 0), final_loss("fp32", 1), final_loss("8bit", 0)
    assert fp32 < 0.8 * first and q8 < 0.8 * first
    assert abs(q8 - fp32) <= max(2 * abs(fp32_b - fp32), 0.03 * fp32), (q8, fp32, fp32_b)


@pytest.mark.parametrize("kernels", ["native", "triton"])
def test_chunked_step_equals_the_bucketed_step(kernels, monkeypatch):
    """Alone on a rank the 8-bit buckets live in chunks (optimizer_fused): several buckets a kernel launch, each on
    its own 256-element blocks; the step equals the bucketed one (``fused = False``) bit for bit without clipping
    (the norm is summed differently: with clipping, to rounding), over two chunks, a named group, fp32 parameters,
    missing gradients and a skipped step."""
    from areno.training import optimizer_fused

    monkeypatch.setenv("ARENO_KERNELS", kernels)
    monkeypatch.setattr(optimizer_fused, "CHUNK_ELEMENTS", 800)  # the bf16 buckets fill two chunks

    def make():
        ps = make_params([torch.bfloat16] * 4 + [torch.float32, torch.bfloat16])
        return ps, MasterAdamW([*ps[:5], {"name": "tower", "params": [ps[5]]}], **HP, states="8bit",
                               bucket_bytes=1200)  # fmt: skip

    (pa, ref), (pb, opt) = make(), make()
    ref.fused = False
    assert len(opt.chunks) >= 3 and sum(len(c.buckets) > 1 for c in opt.chunks) >= 1  # tower: a chunk of its own
    assert all(s % 256 == 0 for c in opt.chunks for s in c.starts)
    for clip in (0.0, 1.5):
        for i, scale in enumerate([1.0, 30.0, float("nan"), 0.5]):
            for params in (pa, pb):
                set_grads(params, [g * scale for g in grads_for(i)])
                if i == 3:
                    params[1].grad = None  # counts as zero
            na = ref.step(lr=1e-2, grad_clip=clip, group_lrs={"tower": 3e-3})
            nb = opt.step(lr=1e-2, grad_clip=clip, group_lrs={"tower": 3e-3})
            assert (math.isnan(na) and math.isnan(nb)) or nb == pytest.approx(na, rel=1e-6)
            assert opt.num_steps == ref.num_steps and all(p.grad is None for p in pb)
            exact = dict(rtol=0, atol=0) if clip == 0 else dict(rtol=1e-5, atol=1e-6)
            for p, q in zip(pa, pb):
                torch.testing.assert_close(q.float(), p.float(), **exact)
            for a, b in zip(ref.buckets, opt.buckets):
                if clip == 0:
                    assert torch.equal(a.moments8.codes, b.moments8.codes)
                torch.testing.assert_close(b.moments8.absmax, a.moments8.absmax, **exact)
    saved = opt.state_dict()  # the chunk's views saved and restored as the bucketed layout's
    assert saved["layout"] == ref.state_dict()["layout"]
