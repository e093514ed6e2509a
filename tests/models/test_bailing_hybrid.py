"""Ling 3 (bailing_hybrid: KDA + gated MLA + sigmoid-routed MoE with a shared expert) against transformers' own
model: logits and gradients in fp32, the Hub-name round trip (MTP layers kept untouched), TP=2 on gloo, activation
checkpointing with routing counted once, the selection-bias update, and the refusal of the Ling 2.x hybrid."""

import json

import pytest
import torch
from hf_reference import (
    assert_checkpointing_keeps_loss_and_grads,
    assert_fp32_parity,
    assert_same_checkpoint,
    assert_transformers_loads_saved,
    hub_tensors,
    load_reference,
    next_token_targets,
    renamed_grads,
)

from areno.models import load_model, save_model

# the default tiny config: [KDA, MLA, KDA, MLA], dense then sparse MLPs, qk head dim 24 > v head dim 16, one MTP
# layer; the second: q_lora_rank, v head dim 32 > qk 24 (q and k padded), the softplus forget gate, no MTP
VARIANT = dict(q_lora_rank=24, v_head_dim=32, kda_safe_gate=False, num_mtp_layers=0)


def _ids(vocab, b=2, t=19, seed=0):
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def _hub_name(name: str) -> str:
    """The Hub name of a transformers parameter of Ling 3 (transformers renames them at load)."""
    name = name.replace("model.embed_tokens.", "model.word_embeddings.").replace(".self_attn.", ".attention.")
    return name.replace(".attention.o_proj.", ".attention.dense.").replace(".forget_gate.", ".")


@pytest.mark.parametrize("overrides", [{}, VARIANT], ids=["mtp", "q_lora"])
def test_logits_and_gradients_match_transformers_fp32(tiny_checkpoint, overrides):
    path = tiny_checkpoint("bailing_hybrid", **overrides)
    model, ref = load_model(path, device="cpu"), load_reference(path)
    cfg = model.config
    assert cfg.layer_types == ["linear_attention", "full_attention"] * 2 and cfg.num_experts == 8
    assert len(model.mtp_names) == (0 if overrides else 41)  # the MTP layer's tensors, held untouched
    assert_fp32_parity(model, ref, lambda ref: renamed_grads(ref, _hub_name))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_areno_hf_is_bit_identical_with_mtp_layers(tmp_path, dtype):
    from areno.testing import make_tiny_checkpoint

    src = make_tiny_checkpoint(tmp_path / "src", "bailing_hybrid", dtype=dtype)
    model = load_model(src, device="cpu")
    assert model.layers[1].mlp.gate.weight.dtype == model.layers[0].self_attn.decay.A_log.dtype == torch.float32
    out = save_model(model, tmp_path / "out")
    a = assert_same_checkpoint(src, out)
    assert any(k.startswith("model.layers.4.eh_proj") for k in a)


def test_transformers_loads_what_areno_saves(tiny_checkpoint, tmp_path):
    model = load_model(tiny_checkpoint("bailing_hybrid", **VARIANT), device="cpu")
    assert_transformers_loads_saved(model, tmp_path / "trained", load_model, save_model)


def test_checkpointing_counts_routing_once_and_bias_moves_once_per_step(tiny_checkpoint):
    path = tiny_checkpoint("bailing_hybrid")
    ids = _ids(1000, b=3, t=13, seed=4)
    model, counts0, counts1 = assert_checkpointing_keeps_loss_and_grads(path, ids)
    k, layers = model.config.num_experts_per_tok, len(model.moe_layers())
    assert counts1.shape == (layers, 8) and torch.equal(counts1, counts0)
    assert (counts1.sum(1) == ids.numel() * k).all()  # every token routed once per MoE layer, k slots
    with torch.no_grad():
        model.logits(ids)  # no grad: not counted
    assert torch.equal(model.expert_load(), counts1)

    before = torch.stack([m.gate.expert_bias.clone() for m in model.moe_layers()])
    model.update_routing_bias(1e-3)
    after = torch.stack([m.gate.expert_bias for m in model.moe_layers()])
    mean = counts1.float().mean(1, keepdim=True)
    torch.testing.assert_close(after - before, 1e-3 * torch.sign(mean - counts1.float()), rtol=0, atol=1e-7)
    assert model.expert_load().sum() == 0  # counters restart for the next step
    model.update_routing_bias(1e-3)  # nothing routed since: every load equals the mean, the bias stays
    assert torch.equal(torch.stack([m.gate.expert_bias for m in model.moe_layers()]), after)


def test_selection_bias_steers_routing_not_weights(tiny_checkpoint):
    """A large bias on expert 0 makes every token pick it; its weight is still its unbiased sigmoid score."""
    model = load_model(tiny_checkpoint("bailing_hybrid"), device="cpu")
    moe = model.moe_layers()[0]
    x = torch.randn(5, model.config.hidden_size)
    with torch.no_grad():
        moe.gate.expert_bias.zero_()
        moe.gate.expert_bias[0] = 10.0
        weights, ids = moe.route(x)
    assert (ids == 0).any(dim=1).all()
    scores = torch.sigmoid(x @ moe.gate.weight.t())
    chosen = scores.gather(1, ids.long())
    torch.testing.assert_close(weights, 2.5 * chosen / chosen.sum(1, keepdim=True))


def test_refuses_the_ling2_hybrid(tiny_checkpoint, tmp_path):
    import shutil

    src = tiny_checkpoint("bailing_hybrid")
    old = tmp_path / "ling2"
    shutil.copytree(src, old)
    config = json.loads((old / "config.json").read_text())
    config["architectures"] = ["BailingMoeV2_5ForCausalLM"]
    (old / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="BailingMoeV2_5ForCausalLM.*not Ling 3"):
        load_model(old, device="cpu")


# (TP=2 == TP=1: tests/models/test_tp_mla.py)


def test_trainer_moves_the_bias_once_per_optimizer_step(tiny_checkpoint):
    from areno.training.batch import Row
    from areno.training.optimizer import MasterAdamW
    from areno.training.schedule import LRSchedule
    from areno.training.trainer import PolicyTrainer

    model = load_model(tiny_checkpoint("bailing_hybrid"), device="cpu").train()
    model.set_activation_checkpointing(True)
    opt = MasterAdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    trainer = PolicyTrainer(model, opt, LRSchedule(1e-3), router_bias_update_rate=1e-2)
    steps, update = [], model.update_routing_bias

    def record(rate, group=None):  # the real update, with the loads it is given
        steps.append((rate, model.expert_load().clone(), torch.stack([m.gate.expert_bias.clone()
                                                                        for m in model.moe_layers()])))
        update(rate, group)

    model.update_routing_bias = record
    rows = [Row(list(range(3 + i, 8 + i)), list(range(20, 24 + i))) for i in range(2)]

    def loss_fn(out, packed, norms):
        return -(out.logprobs * packed.mask).sum() / norms.num_tokens, {}

    stats = trainer.train(rows, loss_fn, mini_bs=1, gradient_accumulation_steps=1)
    assert stats["num_updates"] == len(steps) == 2
    k = model.config.num_experts_per_tok
    for (rate, load, _), row in zip(steps, rows):
        assert rate == 1e-2 and (load.sum(1) == len(row) * k).all()  # this step's tokens, each counted once
    final = torch.stack([m.gate.expert_bias for m in model.moe_layers()])
    moved = sum(1e-2 * torch.sign(load.float().mean(1, keepdim=True) - load.float()) for _, load, _ in steps)
    torch.testing.assert_close(final - steps[0][2], moved, rtol=0, atol=1e-6)
    assert model.expert_load().sum() == 0
    with pytest.raises(ValueError, match="no MoE selection bias"):
        PolicyTrainer(load_model(tiny_checkpoint("qwen3"), device="cpu"), opt, LRSchedule(1e-3),
                      router_bias_update_rate=1e-2)  # a dense model: has_routing_bias is False



def test_sft_run_trains_moves_the_bias_and_keeps_mtp_untouched(tiny_checkpoint, tmp_path):
    """`areno train --algo sft` on Ling 3 with the bias update on: two steps, a checkpoint transformers and areno load,
    the MTP layer's tensors bit-identical to the source, the selection bias moved by whole multiples of the rate, at
    most once per optimizer update."""
    from areno.cli import main

    src = tiny_checkpoint("bailing_hybrid")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{a}+{a}="}], "response": str(2 * a)})
                            + "\n" for a in range(8)))
    out = tmp_path / "run"
    assert main(["train", "--algo", "sft", "--ckpt", str(src), "--dataset-path", str(data), "--batch-size", "4",
                 "--mini-bs", "2", "--max-steps", "2", "--lr", "1e-3", "--save-path", str(out), "--no-tensorboard",
                 "--dtype", "float32", "--router-bias-update-rate", "0.01"]) == 0
    before, after = hub_tensors(src), hub_tensors(out / "step-2")
    assert sorted(before) == sorted(after)
    for name in before:  # MTP untouched; everything else trained (an expert no token reached keeps its weights)
        same = torch.equal(before[name], after[name])
        assert same if name.startswith("model.layers.4.") else (not same or ".mlp.experts." in name), name
    for i in (1, 2, 3):
        moved = (after[f"model.layers.{i}.mlp.gate.expert_bias"] - before[f"model.layers.{i}.mlp.gate.expert_bias"])
        steps = moved / 0.01
        # 2 run steps of 2 optimizer updates each (4 rows, --mini-bs 2): at most 4 moves of the rate
        assert (steps - steps.round()).abs().max() < 1e-3 and 1 <= steps.round().abs().max() <= 4
    ids = _ids(1000, t=9, seed=8)
    with torch.no_grad():
        want = load_model(out / "step-2", device="cpu").logits(ids)
        assert (load_reference(out / "step-2")(ids).logits - want).abs().max() <= 1e-4 * want.abs().max()

# ---- GPU (bf16, Triton kernels): python -m pytest -q tests/models/test_bailing_hybrid.py -m gpu ----------------------

LING3_FLASH_SMALL = dict(  # Ling-3.0-Flash's attention, KDA and expert shapes; 3 layers (KDA, KDA, MLA), 64 experts
    hidden_size=2560, intermediate_size=6144, num_hidden_layers=3, layer_group_size=3, first_k_dense_replace=1,
    num_attention_heads=32, num_key_value_heads=32, head_dim=128, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, num_experts=64, num_experts_per_tok=8, n_group=8, topk_group=4,
    moe_intermediate_size=768, vocab_size=32768, max_position_embeddings=8192, num_mtp_layers=0,
)  # fmt: skip


@pytest.mark.gpu
def test_bf16_parity_and_triton_gradients_on_gpu(tmp_path, monkeypatch):
    """bf16 logits: areno's error against transformers' fp32 is at most 2x transformers' own bf16 error plus 2% of the
    logit scale. Training fwd+bwd on the Triton kernels equals the native path to bf16 rounding (loss 1%, every
    gradient's cosine similarity >= 0.98), the Triton run replaying the native run's expert choices: the two paths
    round differently, and near-tie routing flips (a few % of tokens at these random weights) would move the router
    and expert gradients by more than kernel rounding. One model load serves all three runs (loading this 1.1B-parameter
    checkpoint is a large part of the test's time). Needs a transformers with bailing_hybrid (5.2x)."""
    import transformers

    from areno.models.attention_metadata import AttentionMetadata

    if not hasattr(transformers, "BailingHybridConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no bailing_hybrid")
    from areno.testing import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path, "bailing_hybrid", dtype=torch.bfloat16, **LING3_FLASH_SMALL)
    ids = torch.randint(0, 32768, (2, 300), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        ref = load_reference(path, torch.float32).cuda()
        exact = ref(ids).logits
        del ref
        ref = load_reference(path, torch.bfloat16).cuda()
        ref_logits = ref(ids).logits.float()
        del ref
        model = load_model(path, device="cuda")
        assert model.embed_tokens.weight.dtype == torch.bfloat16
        got = model.logits(ids).float()
    scale = exact.abs().max()
    ref_err, our_err = (ref_logits - exact).abs().max(), (got - exact).abs().max()
    assert our_err <= 2 * ref_err + 2e-2 * scale, (our_err, ref_err, scale)
    del exact, ref_logits, got

    model.train()
    model.set_activation_checkpointing(True)
    b, t = 2, 257
    x = ids[:, :t].reshape(-1)
    pos = torch.arange(t, device="cuda").repeat(b)
    cu = torch.arange(0, (b + 1) * t, t, dtype=torch.int32, device="cuda")
    targets = next_token_targets(ids[:, :t])
    routes = torch.full((model.num_moe_layers, b * t, model.moe_top_k), -1, dtype=torch.int32, device="cuda")
    runs = {}
    for mode in ("native", "triton"):
        monkeypatch.setenv("ARENO_KERNELS", mode)
        model.zero_grad(set_to_none=True)
        if mode == "native":  # routes chosen here, recorded
            meta = AttentionMetadata(None, True, cu, cu, t, t, routing_out=routes)
            hidden = model(x, pos, attn_metadata=meta)
        else:  # the same experts, weighted by the current router
            hidden = model(x, pos, cu, t, routed_experts=routes.permute(1, 0, 2).contiguous())
        loss = -model.token_logprobs(hidden, targets).sum() / (targets >= 0).sum()
        loss.backward()
        runs[mode] = (loss.detach().float(), {n: p.grad.float().clone() for n, p in model.named_parameters()
                                              if p.grad is not None})
    assert (routes >= 0).all()
    (loss0, grads0), (loss1, grads1) = runs["native"], runs["triton"]
    assert (loss1 - loss0).abs() <= 1e-2 * loss0.abs(), (loss0, loss1)
    assert set(grads1) == set(grads0)
    cos = {n: float(torch.nn.functional.cosine_similarity(grads1[n].flatten(), g.flatten(), dim=0))
           for n, g in grads0.items()}
    # 0.98: the MLA layer's q_proj / kv_a_proj / input norm gradients measured 0.9888-0.9898 on the H200 (the
    # shared k_rope's gradient is a bf16 sum over 32 heads' dK); every other gradient >= 0.99. The fp32 interpreter
    # tests check the same kernels against float64 exactly.
    low = {n: round(c, 4) for n, c in cos.items() if not c >= 0.98}
    assert not low, (low, min(cos.values()))
