"""GPT-OSS: fp32 logits and every parameter gradient (sinks, biases, router, experts) against transformers with the
clamped SwiGLU active and sequences longer than the sliding window (packed varlen included), YaRN, bit-identical
save, MXFP4 dequantized as transformers does, the engine and training end to end, and the options refused at load in
one line."""

import json

import pytest
import torch
from hf_reference import check_logits_and_grads, load_reference, with_config_change
from safetensors.torch import load_file, save_file

from areno.models import load_model, save_model
from areno.models.loader import CheckpointError, TensorDict
from areno.models.mxfp4 import Mxfp4Source, dequantize_mxfp4


def _ids(b, t, seed):
    return torch.randint(0, 1000, (b, t), generator=torch.Generator().manual_seed(seed))


def test_config_windows_sinks_and_yarn(tiny_checkpoint):
    model = load_model(tiny_checkpoint("gpt_oss"), device="cpu")
    cfg = model.config
    assert [layer.self_attn.window for layer in model.layers] == [4, None]
    assert cfg.rope_scaling["rope_type"] == "yarn" and (cfg.swiglu_alpha, cfg.swiglu_limit) == (1.702, 1.0)
    assert model.is_moe and model.num_moe_layers == 2 and model.moe_top_k == 2
    assert all(layer.self_attn.sink.weight.shape == (4,) for layer in model.layers)


@pytest.mark.parametrize("limit", [1.0, 7.0])  # 1.0: both clamps bite on the tiny weights; 7.0: GPT-OSS's own
def test_logits_and_every_gradient_match_transformers(tiny_checkpoint, limit):
    path = tiny_checkpoint("gpt_oss", swiglu_limit=limit)
    model = load_model(path, device="cpu").train()
    ref = load_reference(path).train()
    got = check_logits_and_grads(model, ref, _ids(2, 13, seed=1))  # 13 tokens, window 4
    assert any(n.endswith("self_attn.sinks") for n in got)

def test_experts_on_the_grouped_gemms_match_transformers(tiny_checkpoint, monkeypatch):
    """The experts on areno's grouped GEMMs (interpreted; the rest native): logits and every gradient."""
    import areno.kernels.moe.biased as biased

    runs = []
    monkeypatch.setattr(biased, "use_triton", lambda *t, supported=True: runs.append(supported) or supported)
    test_logits_and_every_gradient_match_transformers(tiny_checkpoint, 1.0)
    assert runs and all(runs)


def test_packed_varlen_equals_per_sequence_and_sinks_and_window_matter(tiny_checkpoint):
    model = load_model(tiny_checkpoint("gpt_oss"), device="cpu")
    lens = [9, 3, 12]
    seqs = [_ids(1, n, seed=10 + i)[0] for i, n in enumerate(lens)]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lens])

    def packed():
        return model.compute_logits(model(torch.cat(seqs), positions, cu, max(lens)))

    with torch.no_grad():
        base = packed()
        single = torch.cat([model.logits(s[None])[0] for s in seqs])
        model.layers[0].self_attn.window = None
        no_window = packed()
        model.layers[0].self_attn.window = 4
        for layer in model.layers:
            layer.self_attn.sink.weight.fill_(-1e4)  # a sink that takes no mass: plain softmax
        no_sinks = packed()
    assert (base - single).abs().max() <= 1e-5 * single.abs().max()
    assert (no_window - base).abs().max() > 1e-3 * single.abs().max()
    assert (no_sinks - base).abs().max() > 1e-3 * single.abs().max()


@pytest.mark.parametrize("change, message", [
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
     "gpt_oss: quantization_config with quant_method='fp8' is not supported .* load a dequantized"),
    ({"attention_dropout": 0.1}, "gpt_oss: attention_dropout=0.1 is not supported"),
    ({"layer_types": ["sliding_attention", "chunked_attention"]}, "gpt_oss: layer_types must list 2 of"),
    ({"sliding_window": 0}, "gpt_oss: sliding_window=0 must be a positive int"),
    ({"num_experts_per_tok": 5}, r"gpt_oss: num_experts_per_tok=5 must be in \[1, num_local_experts=4\]"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}, "rope_scaling": None},
     "gpt_oss: rope_parameters .*'dynamic'.* is not supported"),
])
def test_unimplemented_options_are_refused_at_load_in_one_line(tiny_checkpoint, tmp_path, change, message):
    with pytest.raises(CheckpointError, match=message) as e:
        load_model(with_config_change(tiny_checkpoint("gpt_oss"), tmp_path / "changed", change), device="cpu")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("algo", ["sft", "dpo", "grpo", "gspo", "ppo", "grpo-replay"])
def test_one_training_step_end_to_end(tiny_checkpoint, tmp_path, algo):
    from areno.cli import main

    ckpt = tiny_checkpoint("gpt_oss")
    rows = [{"prompt": [{"role": "user", "content": f"{a}+{a}="}], "response": str(2 * a), "answer": str(2 * a),
             "chosen": str(2 * a), "rejected": str(2 * a + 1)} for a in range(8)]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reward = tmp_path / "reward.py"
    reward.write_text("def reward_fn(record):\n    return float(len(record.completion) % 3 == 0)\n")
    out = tmp_path / "out"
    algo, replay = algo.removesuffix("-replay"), algo.endswith("-replay")
    args = ["train", "--algo", algo, "--ckpt", str(ckpt), "--dataset-path", str(data), "--batch-size", "4",
            "--mini-bs", "2", "--max-steps", "1", "--save-path", str(out), "--lr", "1e-3", "--no-tensorboard",
            "--dtype", "float32"]
    if algo in ("grpo", "gspo", "ppo"):
        args += ["--reward-fn-path", str(reward), "--n-samples", "2", "--max-new-tokens", "6"]
    if replay:  # the rollout's experts recorded by the engine and replayed by the training forward
        args += ["--routing-replay", "on"]
    assert main(args) == 0
    saved = out / "step-1"
    line = json.loads((out / "metrics" / "metrics.jsonl").read_text().splitlines()[0])
    assert (saved / "COMPLETE").exists() and line["step"] == 1 and torch.isfinite(torch.tensor(line["loss"]))
    mine, ref = load_model(saved, device="cpu"), load_reference(saved)
    ids = _ids(1, 9, seed=3)
    with torch.no_grad():
        assert (mine.logits(ids) - ref(ids).logits).abs().max() <= 1e-4 * ref(ids).logits.abs().max()


def _mxfp4_checkpoint(source, folder):
    """``source`` (a tiny gpt_oss) with its experts as random MXFP4 blocks/scales, as the Hub ships them."""
    folder = with_config_change(source, folder, {"quantization_config": {"quant_method": "mxfp4",
                                "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                           "model.embed_tokens", "lm_head"]}})
    weights, gen = load_file(str(folder / "model.safetensors")), torch.Generator().manual_seed(5)
    for name in [k for k in weights if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, rows_in, rows_out = weights.pop(name).shape
        weights[name + "_blocks"] = torch.randint(0, 256, (e, rows_out, rows_in // 32, 16), generator=gen,
                                                  dtype=torch.uint8)
        weights[name + "_scales"] = torch.randint(119, 125, (e, rows_out, rows_in // 32), generator=gen,
                                                  dtype=torch.uint8)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_mxfp4_checkpoint_loads_dequantized_as_transformers_does_and_saves_plain(tiny_checkpoint, tmp_path):
    import transformers

    path = _mxfp4_checkpoint(tiny_checkpoint("gpt_oss"), tmp_path / "mxfp4")
    model = load_model(path, device="cpu")
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager",
        quantization_config=transformers.Mxfp4Config(dequantize=True))
    for name, p in ref.named_parameters():  # the dequantized experts, bit for bit
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            i, proj = int(name.split(".")[2]), name.rsplit(".", 1)[1]
            assert torch.equal(getattr(model.layers[i].mlp.experts, proj), p), name
    ids = _ids(2, 11, seed=2)
    with torch.no_grad():
        got, want = model.logits(ids), ref(ids).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    saved = save_model(model, tmp_path / "plain")
    assert "quantization_config" not in json.loads((saved / "config.json").read_text())
    assert not any(k.endswith(("_blocks", "_scales")) for k in load_file(str(saved / "model.safetensors")))
    with torch.no_grad():
        again = load_reference(saved)(ids).logits
    assert (again - want).abs().max() <= 1e-5 * want.abs().max()


def test_mxfp4_values_are_e2m1_codes_times_a_power_of_two():
    blocks = torch.tensor([[[[0x21] + [0] * 15]]], dtype=torch.uint8)  # codes 1 (0.5) then 2 (1.0)
    scales = torch.tensor([[[128]]], dtype=torch.uint8)  # 2 ** 1
    out = dequantize_mxfp4(blocks, scales)
    assert out.shape == (1, 32, 1) and out[0, :3, 0].tolist() == [1.0, 2.0, 0.0]
    with pytest.raises(ValueError, match="mxfp4: blocks uint8"):
        dequantize_mxfp4(blocks.int(), scales)
    gen = torch.Generator().manual_seed(0)  # a TP rank's slice reads as that slice of the whole
    packed = {"w_blocks": torch.randint(0, 256, (3, 8, 2, 16), generator=gen, dtype=torch.uint8),
              "w_scales": torch.randint(120, 130, (3, 8, 2), generator=gen, dtype=torch.uint8), "b": torch.ones(2)}
    source = Mxfp4Source(TensorDict(packed))
    whole = dequantize_mxfp4(packed["w_blocks"], packed["w_scales"])
    assert set(source.keys()) == {"w", "b"} and source.shape("w") == (3, 64, 8) == whole.shape
    assert torch.equal(source.read("w", (slice(None), slice(None), slice(2, 6))).float(), whole[:, :, 2:6])
    assert torch.equal(source.read("w", (...,)).float(), whole) and torch.equal(source.read("b", (...,)), packed["b"])


def test_engine_greedy_equals_generate_with_n_prefix_hits_preemption_and_chunked_prefill(tiny_checkpoint):
    """Prompts longer than the window (4) so the paged path reads the window and the sinks: n=2 greedy samples,
    prefill chunked by a 7-token budget, a cache small enough to preempt, then a second round hitting the prefix
    cache; every sample equals transformers' generate."""
    from areno.config import SamplingParams
    from areno.engine.engine import Engine, EngineConfig
    from areno.engine.kv_cache import kv_bytes_per_block
    from areno.models import load_tokenizer

    path = tiny_checkpoint("gpt_oss", seed=1)
    model, tok = load_model(path, dtype=torch.float32, device="cpu"), load_tokenizer(path)
    ref = load_reference(path)
    prefix = tok.encode("tool call: {\"name\": \"add\"} and some longer text")
    prompts = [prefix + tok.encode(s) for s in (" one", " two =", " three")] + [tok.encode("a b")]
    opts = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True, n=2)
    e = Engine(model, tok, EngineConfig(block_size=4, max_running=8, max_batched_tokens=7,
                                        kv_cache_memory=14 * kv_bytes_per_block(model, 4, torch.float32)))
    first = e.generate(prompts[:2], opts)
    hits = e.blocks.prefix_hits
    second = e.generate(prompts[2:], opts)
    assert e.scheduler.num_preemptions > 0 and e.blocks.prefix_hits - hits >= 4
    for p, group in zip(prompts, first + second, strict=True):
        want = ref.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(p):].tolist()
        assert [c.token_ids for c in group] == [want, want]
    assert e.blocks.num_free == e.blocks.num_blocks



GPT_OSS_20B_CONFIG = {  # the Hub's openai/gpt-oss-20b config.json (legacy rope spelling, MXFP4 experts)
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880, "max_position_embeddings": 131072, "model_type": "gpt_oss",
    "layer_types": ["sliding_attention", "full_attention"] * 12, "num_attention_heads": 64, "num_experts_per_tok": 4,
    "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False,
    "pad_token_id": 199999, "rms_norm_eps": 1e-05, "rope_theta": 150000, "router_aux_loss_coef": 0.9,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088,
}  # fmt: skip


def test_the_hub_config_reads_as_transformers_reads_it():
    """gpt-oss-20b's config.json through transformers' config class: shapes, windows, MXFP4, and the YaRN tables
    (attention factor included) equal transformers' rotary embedding."""
    import transformers
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    from areno.kernels.rope import rope_cos_sin
    from areno.models.gpt_oss import gpt_oss_config

    hf = transformers.GptOssConfig(**{k: v for k, v in GPT_OSS_20B_CONFIG.items() if k != "model_type"})
    cfg = gpt_oss_config(hf)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (24, 64, 8, 64)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (32, 4, 2880)
    assert cfg.sliding_window == 128 and cfg.sliding_layers == list(range(0, 24, 2)) and cfg.mxfp4
    assert cfg.attention_bias and cfg.rms_norm_eps == 1e-5 and cfg.swiglu_limit == 7.0
    positions = torch.tensor([0, 1, 4095, 4096, 70000, 131071])
    cos, sin = rope_cos_sin(cfg.rotary_dim, cfg.max_position_embeddings, cfg.rope_theta, rope_scaling=cfg.rope_scaling)
    want_cos, want_sin = GptOssRotaryEmbedding(hf)(torch.zeros(1, 1, 64), positions[None])
    torch.testing.assert_close(cos[positions], want_cos[0], rtol=0, atol=2e-7)
    torch.testing.assert_close(sin[positions], want_sin[0], rtol=0, atol=2e-7)
