"""ARENO_WGRAD_STREAM=1: the training linears' weight gradients queued on a side stream (inline on CPU), against
the plain autograd path: the same gradients, accumulation over microbatches, the trainer's updates; the env value
checked; hooked weights keep the plain path. GPU: eager and graphed trainers with it on against it off."""

import pytest
import torch
import torch.nn.functional as F

from areno.models import load_model, wgrad_stream
from areno.models.layers import Linear
from areno.rl.algorithms import sft_loss_fn
from areno.rl.optimizer import MasterAdamW
from areno.rl.schedule import LRSchedule
from areno.rl.trainer import PolicyTrainer
from areno.testing import make_tiny_checkpoint
from tests.rl.test_train_graphs import rows_of


def test_side_linear_gradients_and_accumulation(monkeypatch):
    monkeypatch.setenv("ARENO_WGRAD_STREAM", "1")
    g = torch.Generator().manual_seed(0)
    lin = Linear(24, 40)
    torch.nn.init.normal_(lin.weight, generator=g)
    ref = lin.weight.detach().clone().requires_grad_()
    for _ in range(2):  # the second adds into the existing gradient
        x = torch.randn(3, 7, 24, generator=g, dtype=torch.float64).float().requires_grad_()
        dy = torch.randn(3, 7, 40, generator=g)
        (lin(x) * dy).sum().backward()
        x_ref = x.detach().clone().requires_grad_()
        (F.linear(x_ref, ref) * dy).sum().backward()
        wgrad_stream.join()
        torch.testing.assert_close(x.grad, x_ref.grad)
        torch.testing.assert_close(lin.weight.grad, ref.grad, rtol=1e-6, atol=1e-6)
    assert lin(x).grad_fn.name() == "SideWgradLinearBackward"


def test_plain_path_when_off_hooked_or_biased(monkeypatch):
    x = torch.randn(2, 8, requires_grad=True)
    monkeypatch.setenv("ARENO_WGRAD_STREAM", "0")
    assert Linear(8, 4)(x).grad_fn.name() != "SideWgradLinearBackward"
    monkeypatch.setenv("ARENO_WGRAD_STREAM", "1")
    hooked = Linear(8, 4)
    hooked.weight.register_hook(lambda grad: grad)  # e.g. a TP all-reduce: autograd must deliver the gradient
    assert hooked(x).grad_fn.name() != "SideWgradLinearBackward"
    assert Linear(8, 4, bias=True)(x).grad_fn.name() != "SideWgradLinearBackward"
    with torch.no_grad():
        assert Linear(8, 4)(x).grad_fn is None
    monkeypatch.setenv("ARENO_WGRAD_STREAM", "yes")
    with pytest.raises(ValueError, match="ARENO_WGRAD_STREAM must be 0 or 1"):
        Linear(8, 4)(x)


def _train(ckpt, monkeypatch, flag, device="cpu", dtype=torch.float32, graphs="off", checkpointing=False):
    monkeypatch.setenv("ARENO_WGRAD_STREAM", flag)
    model = load_model(ckpt, dtype=dtype, device=device).train()
    model.set_activation_checkpointing(checkpointing)
    opt = MasterAdamW(list(model.parameters()), lr=1e-3)
    trainer = PolicyTrainer(model, opt, LRSchedule(1e-3), grad_clip=1.0, train_cuda_graphs=graphs)
    if trainer.graphs is not None:
        trainer.graphs.capture_after = 1
    stats = [trainer.train(rows_of(lengths, seed=i), sft_loss_fn(), mini_bs, accum)
             for i, (lengths, mini_bs, accum) in enumerate([([30, 22, 18, 25], 4, 1), ([12, 33, 9, 20], 2, 2),
                                                             ([30, 22, 18, 25], 4, 1)])]
    return model, stats


@pytest.mark.parametrize("checkpointing", [False, True])  # recomputation re-runs the forward inside the backward
def test_trainer_updates_match_with_the_side_stream(tmp_path, monkeypatch, checkpointing):
    ckpt = make_tiny_checkpoint(tmp_path / "m", "qwen3", seed=0)
    queued = []
    real = wgrad_stream.queue_weight_grad
    monkeypatch.setattr(wgrad_stream, "queue_weight_grad", lambda *a: (queued.append(a[0].shape), real(*a)))
    a, sa = _train(ckpt, monkeypatch, "0", checkpointing=checkpointing)
    assert not queued
    b, sb = _train(ckpt, monkeypatch, "1", checkpointing=checkpointing)
    assert len(queued) == 4 * b.num_layers * 4  # qkv, o, gate_up, down a layer; 1 + 2 + 1 microbatch backwards
    for x, y in zip(sa, sb):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5) and y["grad_norm"] == pytest.approx(x["grad_norm"],
                                                                                                    rel=1e-4)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", ["off", "on"])
def test_gpu_side_stream_matches_the_plain_backward(tmp_path, monkeypatch, graphs):
    shape = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64)
    ckpt = make_tiny_checkpoint(tmp_path / "m", "qwen3", seed=0, **shape)
    runs = {flag: _train(ckpt, monkeypatch, flag, "cuda", torch.bfloat16, graphs) for flag in ("0", "1")}
    (a, sa), (b, sb) = runs["0"], runs["1"]
    for x, y in zip(sa, sb):  # bf16: addmm_ rounds an accumulated gradient once, autograd twice
        assert y["loss"] == pytest.approx(x["loss"], rel=2e-2) and y["grad_norm"] == pytest.approx(x["grad_norm"],
                                                                                                    rel=5e-2)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(q.float(), p.float(), rtol=0.05, atol=2e-3, msg=name)
