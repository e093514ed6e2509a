"""Training CUDA graphs on the CPU (areno.training.graphs): the bucket grid, the padded layout, padding that leaves the
loss and gradients unchanged, the trainer's graph path (replayed by a CPU stand-in for a captured graph) against the
eager trainer over several updates, buckets and gradient modes, the sync-free optimizer step against ``step()``, and
the flag's refusal where graphs cannot apply. The GPU run of the same comparison is
tests/training/test_train_graphs_gpu.py.
"""

import copy

import pytest
import torch

from areno.kernels.logprobs import linear_logprobs
from areno.models import load_model
from areno.rl.algorithms import grpo_loss_fn, sft_loss_fn
from areno.rl.losses import sft_loss
from areno.testing import make_tiny_checkpoint
from areno.training import optimizer, optimizer_fused
from areno.training.batch import Row, pack
from areno.training.graphs import Bucket, TrainGraphs, bucket_of, bucket_up, pad_inputs, unsupported
from areno.training.loss import LossFn
from areno.training.optimizer import MasterAdamW
from areno.training.schedule import LRSchedule
from areno.training.trainer import PolicyTrainer
from tests.helpers.capture_guard import capture_guard


class CpuReplay:
    """A captured graph's stand-in: ``capture`` runs the body once (the real capture records it), ``replay`` runs
    it again on the same static buffers (grad enabled, as the captured work was recorded)."""

    def __init__(self, pool, stream):
        self.body = None

    def capture(self, body):
        self.body = body
        body()

    def replay(self):
        with torch.enable_grad():
            self.body()


def rows_of(lengths, seed, vocab=200, prompt=3):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(10, vocab, (n,), generator=g).tolist()
        lp = (-torch.rand(n - prompt, generator=g) * 3).tolist()
        out.append(Row(prompt_ids=ids[:prompt], response_ids=ids[prompt:], rollout_logprobs=lp,
                       advantage=float(torch.randn((), generator=g))))
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3", seed=0)


def test_bucket_grid_is_four_steps_per_octave():
    assert [bucket_up(n) for n in (1, 4, 5, 8, 9, 1024, 1025, 1281, 8192, 8193)] == [
        1, 4, 5, 8, 10, 1024, 1280, 1536, 8192, 10240]
    for n in range(1, 5000):
        b = bucket_up(n)
        assert n <= b <= 1.25 * n and bucket_up(b) == b
    assert bucket_up(3, floor=64) == 64


def test_pad_inputs_layout():
    p = pack(rows_of([5, 9, 3, 4], seed=0))  # 21 tokens, longest 9
    b = bucket_of(p)
    assert b == Bucket(tokens=64, seqs=10, max_seqlen=10, entropy=False)  # 4 rows + 5 padding (4 x 10 + 3) -> 10
    ids, pos, cu, tgt = pad_inputs(p, b)
    assert cu.tolist() == [0, 5, 14, 17, 21, 31, 41, 51, 61, 64, 64] and cu.dtype == torch.int32
    assert torch.equal(ids[:21], p.input_ids) and torch.equal(pos[:21], p.positions)
    assert torch.equal(tgt[:21], p.targets) and (tgt[21:] == -100).all()
    assert (ids[21:] == 0).all() and (pos[21:] == 0).all()
    with pytest.raises(ValueError, match="does not fit"):
        pad_inputs(pack(rows_of([12], seed=1)), b)  # a row longer than the bucket's max_seqlen


def test_padding_leaves_loss_and_gradients_unchanged(ckpt):
    model = load_model(ckpt, dtype=torch.float32)
    p = pack(rows_of([7, 12, 4, 9], seed=2))
    t = p.input_ids.numel()
    b = bucket_of(p)
    assert b.tokens > t and b.seqs > p.num_rows

    def run(ids, pos, cu, tgt, max_seqlen):
        model.zero_grad(set_to_none=True)
        hidden = model(ids, pos, cu_seqlens=cu, max_seqlen=max_seqlen)
        lp, ent = linear_logprobs(hidden, model.lm_head_weight, tgt, return_entropy=True)
        loss = -(lp[:t] * p.mask).sum() / 13.0 - 0.01 * (ent[:t] * p.mask).sum()
        loss.backward()
        return loss.detach(), lp[:t].detach(), {n: q.grad.clone() for n, q in model.named_parameters()}

    ref = run(p.input_ids, p.positions, p.cu_seqlens, p.targets, p.max_seqlen)
    padded = run(*pad_inputs(p, b), b.max_seqlen)
    torch.testing.assert_close(padded[0], ref[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(padded[1], ref[1], rtol=1e-6, atol=1e-6)
    for name, g in ref[2].items():
        torch.testing.assert_close(padded[2][name], g, rtol=1e-5, atol=1e-6, msg=name)


def trainer_pair(ckpt, **kw):
    eager_model = load_model(ckpt, dtype=torch.float32)
    graph_model = copy.deepcopy(eager_model)
    trainers = []
    for model in (eager_model, graph_model):
        opt = MasterAdamW(list(model.parameters()), lr=1e-3, weight_decay=0.01, bucket_bytes=64 << 10,
                          states=kw.get("states", "fp32"))
        trainers.append(PolicyTrainer(model, opt, LRSchedule(1e-3), grad_clip=kw.get("grad_clip", 1.0),
                                      train_cuda_graphs="off"))
    trainers[1].graphs = TrainGraphs(graph_model, trainers[1].optimizer, grad_clip=kw.get("grad_clip", 1.0),
                                     graph_class=CpuReplay, max_graphs=kw.get("max_graphs", 8), capture_after=1)
    return trainers


class _Cfg:
    loss_agg, clip_eps_low, clip_eps_high = "token-mean", 0.2, 0.28
    kl_coef, kl_estimator, entropy_coef = 0.0, "k3", 0.01
    off_policy_correction = "tis"


def test_graph_path_matches_eager_over_updates_buckets_and_accumulation(ckpt):
    eager, graphed = trainer_pair(ckpt, grad_clip=0.5, max_graphs=3)  # clipping active on some steps
    g = graphed.graphs
    steps = [  # (row lengths, mini_bs, accumulation, entropy, activation checkpointing)
        ([12, 9, 7], 3, 1, False, False),  # "own" mode: one microbatch
        ([11, 10, 7], 3, 1, False, False),  # same bucket, new data: replayed, nothing captured
        ([30, 25], 2, 1, True, False),  # another bucket (and entropy in the loss)
        ([12, 30, 9, 7], 2, 2, False, False),  # accumulation: "acc" mode, persistent gradients; 4 > 3 entries:
        ([11, 31, 10, 6], 2, 2, False, True),  # the first one dropped. Checkpointing on: eager microbatches
        ([11, 31, 10, 6], 2, 2, False, False),  # the same acc buckets: replayed
        ([12, 8, 8], 3, 1, False, False),  # the first bucket again: captured again
    ]
    captures = []
    for i, (lengths, mini_bs, accum, entropy, checkpointing) in enumerate(steps):
        rows = rows_of(lengths, seed=10 + i)
        fn = grpo_loss_fn(_Cfg) if entropy else sft_loss_fn()
        for t in (eager, graphed):
            t.model.set_activation_checkpointing(checkpointing)
        a = eager.train(rows, fn, mini_bs, accum, entropy=entropy)
        b = graphed.train(rows, fn, mini_bs, accum, entropy=entropy)
        captures.append(g.captures)
        for k, v in a.items():
            assert b[k] == pytest.approx(v, rel=1e-4, abs=1e-6), (i, k)
        for (n, p), q in zip(eager.model.named_parameters(), graphed.model.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6, msg=f"update {i}: {n}")
    assert graphed.optimizer.num_steps == eager.optimizer.num_steps == len(steps)
    assert captures[0] == captures[1] == 4  # fwd, bwd, optimizer norm + update; the second update replayed them
    assert captures[2] == 8 and captures[3] == 8 + 2 * 2 + 2 == captures[4] == captures[5]  # acc: 2 entries + opt
    assert captures[6] == captures[5] + 4 and len(g.entries) == 3  # optimizer graphs; then "own" recaptured
    assert g.replays == 2 + 1 + 2 + 0 + 2 + 1  # every text microbatch without checkpointing went through a graph
    state_a, state_b = eager.optimizer.state_dict(), graphed.optimizer.state_dict()
    for key in ("exp_avg", "exp_avg_sq"):
        for x, y in zip(state_a[key], state_b[key]):
            torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-8)


def test_8bit_states_step_eagerly_after_graphed_microbatches(ckpt):
    """--optimizer-states 8bit: the microbatches replay their graphs ("acc" mode, persistent gradients) and the
    8-bit optimizer steps eagerly on them: the same updates as the eager trainer's."""
    eager, graphed = trainer_pair(ckpt, states="8bit")
    assert not graphed.graphs.device_optimizer
    for i, lengths in enumerate(([12, 9, 7], [11, 10, 7])):
        rows = rows_of(lengths, seed=20 + i)
        a, b = eager.train(rows, sft_loss_fn(), 3, 1), graphed.train(rows, sft_loss_fn(), 3, 1)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
        for (n, p), q in zip(eager.model.named_parameters(), graphed.model.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5, msg=f"update {i}: {n}")
    assert graphed.graphs.replays == 2 and graphed.optimizer.num_steps == 2
    assert all(b.moments8 is not None and b.moments8.codes.any() for b in graphed.optimizer.buckets)


def test_sft_takes_the_head_gradient_in_the_forward(ckpt):
    """sft_loss_fn's token weights run the head as linear_logprobs_loss, eagerly and in weighted graph buckets: the
    same stats and updates as the same loss built on linear_logprobs' output (no token weights)."""
    eager, graphed = trainer_pair(ckpt)
    plain_model = copy.deepcopy(eager.model)
    plain = PolicyTrainer(plain_model, MasterAdamW(list(plain_model.parameters()), lr=1e-3, weight_decay=0.01,
                                                   bucket_bytes=64 << 10), LRSchedule(1e-3), train_cuda_graphs="off")
    fused_fn = sft_loss_fn()

    def plain_fn(out, packed, norms):
        assert out.loss is None
        return sft_loss(out.logprobs, packed.mask, num_tokens=norms.num_tokens)

    seen = []
    for i, (lengths, mini_bs, accum) in enumerate([([12, 9, 7], 3, 1), ([11, 10, 7], 3, 1), ([12, 30, 9, 7], 2, 2)]):
        rows = rows_of(lengths, seed=40 + i)
        ref = plain.train(rows, plain_fn, mini_bs, accum)
        for t in (eager, graphed):
            got = t.train(rows, fused_fn, mini_bs, accum)
            for k, v in ref.items():
                assert got[k] == pytest.approx(v, rel=1e-4, abs=1e-6), (i, k)
            for (n, p), q in zip(plain.model.named_parameters(), t.model.parameters()):
                torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6, msg=f"update {i}: {n}")
        seen += [key[0].weighted for key in graphed.graphs.entries]
    assert graphed.graphs.replays >= 3 and seen and all(seen)


class _KlCfg(_Cfg):
    loss_agg, kl_coef, entropy_coef = "seq-mean-token-mean", 0.05, 0.0


@pytest.mark.parametrize("case", ["token-mean", "seq-mean+kl+dual-clip", "inline-tis"])
def test_policy_loss_takes_the_head_gradient_in_the_forward(ckpt, case):
    """grpo_loss_fn's token function (policy_token_loss) runs the head as linear_logprobs_loss in eager
    microbatches: the same stats and updates as the same loss on linear_logprobs' output, with KL to a reference,
    dual clip, per-sequence means and inline truncated importance weights; graphed microbatches keep the plain head."""
    from areno.rl.algorithms import inline_proximal

    cfg = _KlCfg if case == "seq-mean+kl+dual-clip" else type("C", (_Cfg,), {"entropy_coef": 0.0})
    dual = 3.0 if case == "seq-mean+kl+dual-clip" else None
    eager, graphed = trainer_pair(ckpt)
    plain_model = copy.deepcopy(eager.model)
    plain = PolicyTrainer(plain_model, MasterAdamW(list(plain_model.parameters()), lr=1e-3, weight_decay=0.01,
                                                   bucket_bytes=64 << 10), LRSchedule(1e-3), train_cuda_graphs="off")
    seen = []

    def fused_fn():
        fn = grpo_loss_fn(cfg, dual_clip=dual)
        return inline_proximal(fn, 2.0) if case == "inline-tis" else fn

    def plain_fn():
        inner = grpo_loss_fn(cfg, dual_clip=dual)

        def fn(out, packed, norms):  # a plain callable (no token_loss): linear_logprobs and its backward
            assert out.loss is None
            return inner(out, packed, norms)
        return inline_proximal(fn, 2.0) if case == "inline-tis" else fn

    for i, (lengths, mini_bs, accum) in enumerate([([12, 9, 7], 3, 1), ([11, 10, 7, 13], 2, 2)]):
        rows = rows_of(lengths, seed=60 + i)
        if case == "seq-mean+kl+dual-clip":
            for r in rows:
                r.extras["ref"] = [lp - 0.3 for lp in r.rollout_logprobs]
        ref = plain.train(rows, plain_fn(), mini_bs, accum)
        for t in (eager, graphed):
            fn = fused_fn()
            real = fn.__call__
            if t is eager:
                def spy(out, packed, norms, real=real):
                    seen.append(out.loss is not None)
                    return real(out, packed, norms)
                fn = LossFn(spy, token_loss=fn.token_loss)
            got = t.train(rows, fn, mini_bs, accum)
            for k, v in ref.items():
                assert got[k] == pytest.approx(v, rel=1e-4, abs=1e-6), (case, i, k)
            for (n, p), q in zip(plain.model.named_parameters(), t.model.parameters()):
                torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6, msg=f"{case} update {i}: {n}")
    assert seen and all(seen)  # the eager trainer's microbatches went through linear_logprobs_loss
    assert not any(key[0].weighted for key in graphed.graphs.entries) and graphed.graphs.replays >= 2


@pytest.mark.parametrize("kernels", ["native", "triton"])
def test_device_step_matches_step_without_host_syncs(kernels, monkeypatch):
    monkeypatch.setenv("ARENO_KERNELS", kernels)  # the fused master update: native reference or Triton kernel
    low = torch.bfloat16 if kernels == "native" else torch.float16  # the interpreter's bf16 casts truncate

    def params(seed):
        g = torch.Generator().manual_seed(seed)
        ps = [torch.nn.Parameter(torch.randn(s, generator=g).to(d))
              for s, d in (((7, 5), low), ((13,), torch.float32), ((3, 4, 6), low))]
        return [ps[0], {"name": "tower", "params": [ps[1]]}, ps[2]], ps

    (items_a, pa), (items_b, pb) = params(0), params(0)
    ref = MasterAdamW(items_a, betas=(0.9, 0.95), weight_decay=0.1, bucket_bytes=256)
    dev = MasterAdamW(items_b, betas=(0.9, 0.95), weight_decay=0.1, bucket_bytes=256)
    lr, tower_lr, step = torch.tensor(2e-2), torch.tensor(5e-3), torch.zeros(())
    for i, scale in enumerate([1.0, 30.0, float("nan"), 0.01, 0.5]):  # plain, clipped, skipped, plain, one missing
        g = torch.Generator().manual_seed(i)
        for j, (p, q) in enumerate(zip(pa, pb)):
            p.grad = (torch.randn(p.shape, generator=g) * scale).to(p.dtype) if i < 4 or j < 2 else None
            q.grad = p.grad.clone() if p.grad is not None else None
        norm_a = ref.step(lr=2e-2, grad_clip=4.0, group_lrs={"tower": 5e-3})
        step.fill_(dev.num_steps)
        plan = dev.device_plan()  # the multi-tensor launch tables, built before a capture
        with capture_guard():
            norm = dev.device_step(lr, 4.0, step, group_lrs={"tower": tower_lr}, plan=plan)
        norm_b = float(norm)
        if norm_b == norm_b:
            dev.num_steps += 1
        dev.zero_grad()
        assert norm_b == pytest.approx(norm_a, rel=1e-6, nan_ok=True)
        assert dev.num_steps == ref.num_steps and float(step) == ref.num_steps
        for p, q in zip(pa, pb):
            torch.testing.assert_close(q, p, rtol=0, atol=1e-6 if p.dtype == torch.float32 else 0)


def test_unsupported_on_cpu_and_the_flag_refused(ckpt, tmp_path, capsys, monkeypatch):
    model = load_model(ckpt, dtype=torch.float32)
    assert unsupported(model) == "needs a CUDA device"
    opt = MasterAdamW(list(model.parameters()))
    with pytest.raises(ValueError, match="--train-cuda-graphs on does not apply to this run: needs a CUDA device"):
        PolicyTrainer(model, opt, LRSchedule(1e-3), train_cuda_graphs="on")
    assert PolicyTrainer(model, opt, LRSchedule(1e-3)).graphs is None  # auto: eager here
    g = TrainGraphs(model, opt, graph_class=CpuReplay)  # a bucket is captured the second time it is seen
    p = pack(rows_of([9, 5], seed=3))
    assert g.bucket(p) is None and g.bucket(p) == bucket_of(p) and g.bucket(p, entropy=True) is None
    model.set_activation_checkpointing(True)
    assert g.bucket(p) is None  # recomputation runs eagerly
    from areno.cli import main

    monkeypatch.setattr("areno.models.loader.check_model_source", lambda flag, value: None)
    with pytest.raises(SystemExit) as info:
        main(["train", "--ckpt", "m", "--dataset-path", "d.jsonl", "--algo", "sft", "--train-cuda-graphs", "on"])
    assert info.value.code == 2
    assert "--train-cuda-graphs on needs --no-activation-checkpointing" in capsys.readouterr().err


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_step_runs_fused_where_it_applies(device, monkeypatch):
    """On CUDA (one rank, fp32 states, no offload) ``step()`` is ``device_step`` plus the norm's read: the same
    updates, norms, step count and consumed gradients as the bucketed eager step (``fused = False``); on the CPU the
    fused path is forced to check it there too."""
    if device == "cpu":  # the fused path on the CPU too (native and Triton-interpreted kernels)
        monkeypatch.setattr(optimizer, "fused_fp32", lambda opt: opt.fused and optimizer_fused.alone(opt))
    low = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    shapes = (((7, 5), low), ((13,), torch.float32), ((3, 4, 6), low))
    base = [torch.randn(s, generator=g).to(d) for s, d in shapes]
    pa = [torch.nn.Parameter(t.clone().to(device)) for t in base]
    pb = [torch.nn.Parameter(t.clone().to(device)) for t in base]
    ref = MasterAdamW([pa[0], {"name": "tower", "params": [pa[1]]}, pa[2]], betas=(0.9, 0.95), weight_decay=0.1,
                      bucket_bytes=256)  # fmt: skip
    ref.fused = False
    opt = MasterAdamW([pb[0], {"name": "tower", "params": [pb[1]]}, pb[2]], betas=(0.9, 0.95), weight_decay=0.1,
                      bucket_bytes=256)  # fmt: skip
    assert optimizer.fused_fp32(opt) and not optimizer.fused_fp32(ref)
    for i, scale in enumerate([1.0, 30.0, float("nan"), 0.01, 0.5]):  # plain, clipped, skipped, plain, one missing
        gi = torch.Generator().manual_seed(i)
        for j, (p, q) in enumerate(zip(pa, pb)):
            grad = (torch.randn(p.shape, generator=gi) * scale).to(device=device, dtype=p.dtype)
            p.grad, q.grad = (grad, grad.clone()) if i < 4 or j < 2 else (None, None)
        na = ref.step(lr=2e-2, grad_clip=4.0, group_lrs={"tower": 5e-3})
        nb = opt.step(lr=2e-2, grad_clip=4.0, group_lrs={"tower": 5e-3})
        assert nb == pytest.approx(na, rel=1e-5, nan_ok=True) and opt.num_steps == ref.num_steps
        assert all(q.grad is None for q in pb)
        for p, q in zip(pa, pb):  # the clip factor divided vs multiplied: a last-bit difference at most
            torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6 if p.dtype == torch.float32 else 1e-2)
