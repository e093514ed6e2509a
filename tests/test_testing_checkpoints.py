"""Tiny random HF checkpoints (areno.testing): transformers loads them offline, weights and bytes are what we wrote
and deterministic, the committed tokenizer is reproducible and lossless, the chat template renders tools."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from areno.testing import (
    CHAT_TEMPLATE,
    VOCAB_SIZE,
    load_tokenizer,
    make_tiny_checkpoint,
    tiny_config,
    train_tokenizer,
    weight_shapes,
)
from areno.testing.corpus import generate_corpus
from areno.testing.tokenizer import TOKENIZER_JSON

FAMILIES = ["qwen3", "qwen3_moe", "llama"]
ARCH = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "llama": "LlamaForCausalLM"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {f: make_tiny_checkpoint(tmp_path_factory.mktemp(f), f) for f in FAMILIES}


@pytest.fixture(scope="module")
def tok(checkpoints):
    return AutoTokenizer.from_pretrained(checkpoints["qwen3"])


def _load(path):
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, dtype="auto")
    return model.eval(), info


def _expected_model_state(file_state, model_keys):
    """Map the Hub-layout tensors of the file onto the model's own names (transformers 5 fuses MoE experts)."""
    out = dict(file_state)
    for key in model_keys:
        if key.endswith("mlp.experts.gate_up_proj") or key.endswith("mlp.experts.down_proj"):
            prefix = key.rsplit(".", 1)[0]
            n = len({k.split(".")[5] for k in file_state if k.startswith(prefix + ".")})
            parts = []
            for e in range(n):
                if key.endswith("gate_up_proj"):
                    gate, up = out.pop(f"{prefix}.{e}.gate_proj.weight"), out.pop(f"{prefix}.{e}.up_proj.weight")
                    parts.append(torch.cat([gate, up]))
                else:
                    parts.append(out.pop(f"{prefix}.{e}.down_proj.weight"))
            out[key] = torch.stack(parts)
    if "lm_head.weight" in model_keys and "lm_head.weight" not in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]  # tied
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_loads_config_model_and_tokenizer(checkpoints, family):
    path = checkpoints[family]
    cfg = AutoConfig.from_pretrained(path)
    assert cfg.model_type == family and cfg.architectures == [ARCH[family]]
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 2, 4, 2)
    assert (cfg.head_dim, cfg.vocab_size, cfg.max_position_embeddings) == (16, VOCAB_SIZE, 2048)
    assert cfg.tie_word_embeddings == (family == "qwen3")
    if family == "qwen3_moe":
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 32)
        assert cfg.norm_topk_prob is True and cfg.mlp_only_layers == [] and cfg.decoder_sparse_step == 1

    model, info = _load(path)
    assert type(model).__name__ == ARCH[family]
    assert {k: v for k, v in info.items() if v} == {}, "missing/unexpected/mismatched keys"

    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == VOCAB_SIZE
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.eos_token_id == cfg.eos_token_id and tok.pad_token_id == cfg.pad_token_id
    assert model.generation_config.eos_token_id == [cfg.eos_token_id, cfg.pad_token_id]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generate_matches_argmax_loop(checkpoints, family):
    path = checkpoints[family]
    model, _ = _load(path)
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok("What is 12 + 345? Let x = 7.", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
        new = out[0, ids.shape[1]:].tolist()
        assert len(new) >= 1
        seq = ids
        for token in new:  # the same tokens, one full forward pass per step, no KV cache
            nxt = model(seq).logits[0, -1].argmax().item()
            assert nxt == token
            seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
    if len(new) < 6:
        assert new[-1] in model.generation_config.eos_token_id
    # the random model looks at its context: changing the first prompt token changes the prediction somewhere
    other = ids.clone()
    other[0, 0] = (other[0, 0] + 1) % 900
    with torch.no_grad():
        assert not torch.equal(model(ids).logits.argmax(-1)[0, 1:], model(other).logits.argmax(-1)[0, 1:])


@pytest.mark.parametrize("family", FAMILIES)
def test_state_dict_equals_file_and_hf_save_layout(checkpoints, family, tmp_path):
    path = checkpoints[family]
    file_state = load_file(path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    assert {k: tuple(v.shape) for k, v in file_state.items()} == weight_shapes(config)
    model, _ = _load(path)
    state = model.state_dict()
    expected = _expected_model_state(file_state, state.keys())
    assert set(state) == set(expected)
    for key, value in state.items():
        assert torch.equal(value, expected[key]), key
    # transformers writes the model back under exactly the tensor names (and values) we wrote
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    assert set(saved) == set(file_state)
    assert all(torch.equal(saved[k], file_state[k]) for k in file_state)


def test_weights_are_nontrivial(checkpoints):
    state = load_file(checkpoints["qwen3"] / "model.safetensors")
    norm = state["model.layers.0.input_layernorm.weight"]
    assert not torch.equal(norm, torch.ones_like(norm)) and abs(norm.mean().item() - 1) < 0.05
    q = state["model.layers.0.self_attn.q_proj.weight"]
    assert abs(q.std().item() - 0.1) < 0.02 and abs(q.mean().item()) < 0.02
    assert "lm_head.weight" not in state  # tied, as HF saves it


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    a = make_tiny_checkpoint(tmp_path / "a", "qwen3_moe", seed=3)
    b = make_tiny_checkpoint(tmp_path / "b", "qwen3_moe", seed=3)
    c = make_tiny_checkpoint(tmp_path / "c", "qwen3_moe", seed=4)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    wa, wc = load_file(a / "model.safetensors"), load_file(c / "model.safetensors")
    assert wa.keys() == wc.keys()
    assert all(not torch.equal(wa[k], wc[k]) for k in wa)


def test_dtype_bfloat16(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "llama", dtype=torch.bfloat16)
    state = load_file(path / "model.safetensors")
    assert {v.dtype for v in state.values()} == {torch.bfloat16}
    assert json.loads((path / "config.json").read_text()).get("dtype", "bfloat16") == "bfloat16"
    model, info = _load(path)
    assert {k: v for k, v in info.items() if v} == {}
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    # the same draws as fp32, rounded
    fp32 = make_tiny_checkpoint(tmp_path / "fp32", "llama")
    ref = load_file(fp32 / "model.safetensors")
    assert all(torch.equal(state[k], ref[k].to(torch.bfloat16)) for k in state)


def test_overrides_apply(tmp_path):
    path = make_tiny_checkpoint(
        tmp_path, "qwen3", num_hidden_layers=3, hidden_size=128, vocab_size=1024, tie_word_embeddings=False,
        rope_theta=5e5,
    )
    cfg = AutoConfig.from_pretrained(path)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size, cfg.tie_word_embeddings) == (3, 128, 1024, False)
    rope = getattr(cfg, "rope_parameters", None) or {"rope_theta": cfg.rope_theta}
    assert rope["rope_theta"] == 5e5
    state = load_file(path / "model.safetensors")
    assert state["lm_head.weight"].shape == (1024, 128) and "model.layers.2.mlp.up_proj.weight" in state
    model, info = _load(path)
    assert {k: v for k, v in info.items() if v} == {}
    assert model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 1024)


def test_moe_dense_layers_and_llama_rope_scaling(tmp_path):
    moe = make_tiny_checkpoint(tmp_path / "moe", "qwen3_moe", num_hidden_layers=3, mlp_only_layers=[0], num_experts=4)
    state = load_file(moe / "model.safetensors")
    assert "model.layers.0.mlp.gate_proj.weight" in state and "model.layers.0.mlp.gate.weight" not in state
    assert state["model.layers.1.mlp.gate.weight"].shape == (4, 64)
    assert "model.layers.2.mlp.experts.3.down_proj.weight" in state
    _, info = _load(moe)
    assert {k: v for k, v in info.items() if v} == {}

    cfg = tiny_config("llama")
    # both spellings: rope_scaling/rope_theta (Hub, transformers 4) and, under transformers 5, rope_parameters
    assert cfg["rope_theta"] == 10000.0 and cfg["rope_scaling"]["rope_type"] == "llama3"
    assert cfg["rope_scaling"]["factor"] == 8.0 and cfg["rope_scaling"]["original_max_position_embeddings"] == 256
    loaded = AutoConfig.from_pretrained(make_tiny_checkpoint(tmp_path / "llama", "llama"))
    rope = getattr(loaded, "rope_parameters", None) or loaded.rope_scaling
    assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0 and rope["high_freq_factor"] == 4.0
    assert tiny_config("qwen3_moe")["num_experts"] == 8


def test_bad_arguments_raise(tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):
        make_tiny_checkpoint(tmp_path, "qwen3", vocab_size=100)
    with pytest.raises(ValueError, match="unknown family"):
        make_tiny_checkpoint(tmp_path, "gpt2")
    with pytest.raises(ValueError, match="hiden_size"):
        tiny_config("llama", hiden_size=32)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        tiny_config("qwen3", num_key_value_heads=3)
    with pytest.raises(ValueError, match="dtype"):
        tiny_config("qwen3", dtype=torch.int8)


def test_committed_tokenizer_is_reproducible():
    assert generate_corpus(50) == generate_corpus(50)
    trained = json.loads(train_tokenizer().to_str())
    committed = json.loads(TOKENIZER_JSON.read_text())
    for section in ("model", "added_tokens", "normalizer", "pre_tokenizer", "decoder", "post_processor"):
        assert trained[section] == committed[section], section
    assert len(committed["model"]["vocab"]) + len(committed["added_tokens"]) == VOCAB_SIZE == 1000
    assert all(chr(c) in committed["model"]["vocab"] for c in range(ord("!"), ord("~") + 1))


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world!  12 + 345 = 357\n\tdef f(x):\n        return {\"a\": [1, 2]}",
        "emoji 🙂🚀👩‍👩‍👧 CJK 你好，世界 東京 한국어 العربية Ελληνικά",
        "combining e\u0301 vs \u00e9, zero\u200bwidth, nul\x00 bell\x07 \r\n trailing   ",
        " a , b . c ' d n't <tool_call>{\"name\": \"x\"}</tool_call> <|im_end|> <think>",
        "".join(chr(c) for c in range(0x20, 0x2000, 7)),
    ],
)
def test_utf8_round_trip(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert load_tokenizer().decode(load_tokenizer().encode(text).ids, skip_special_tokens=False) == text
    assert all(0 <= i < VOCAB_SIZE for i in ids)


def test_special_and_tool_tokens(tok):
    for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>",
              "<tool_response>", "</tool_response>"):
        ids = tok.encode(t, add_special_tokens=False)
        assert len(ids) == 1 and ids[0] >= 991, t
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi", add_special_tokens=False)  # no BOS added
    ids = tok.encode("<|im_start|>assistant\n<tool_call>\n{}\n</tool_call><|im_end|>", add_special_tokens=False)
    # chat-control tokens are special; tool/think tags are plain added tokens, kept for parsing (as in Qwen3)
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\n<tool_call>\n{}\n</tool_call>"


def test_chat_template_system_user_assistant(tok):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "two and two"},
        {"role": "user", "content": [{"type": "text", "text": "and 3+3?"}]},
    ]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\ntwo and two\n</think>\n\n4<|im_end|>\n"
        "<|im_start|>user\nand 3+3?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(messages[1:2], add_generation_prompt=False, tokenize=False) == (
        "<|im_start|>user\n2+2?<|im_end|>\n"
    )
    no_think = tok.apply_chat_template(messages[1:2], add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_chat_template_tools_and_tool_calls(tok):
    parameters = {"type": "object", "properties": {"city": {"type": "string"}}}
    tools = [{"type": "function",
              "function": {"name": "get_weather", "description": "Weather in a city", "parameters": parameters}}]
    messages = [
        {"role": "system", "content": "Be helpful."},
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
        ]},
        {"role": "tool", "tool_call_id": "1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "2", "content": "9 C"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"name": "get_weather", "arguments": {"city": "Zürich"}}]},
        {"role": "tool", "content": "12 C"},
    ]
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\nBe helpful.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(tools[0], ensure_ascii=False) + "\n</tools>" in text
    assert text.count("<|im_start|>system") == 1
    assert text.endswith(
        "<|im_start|>user\nWeather in Paris and Oslo?<|im_end|>\n"
        "<|im_start|>assistant\nChecking.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n<tool_response>\n9 C\n</tool_response><|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n12 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    # no system message: the tools block opens the conversation on its own
    alone = tok.apply_chat_template(messages[1:2], tools=tools, add_generation_prompt=True, tokenize=False)
    assert alone.startswith("<|im_start|>system\n# Tools\n") and alone.count("<|im_end|>") == 2
    # each prefix with a generation prompt is a prefix of the next assistant turn's rendering (multi-turn RL)
    for k in (2, 5):
        prompt = tok.apply_chat_template(messages[:k], tools=tools, add_generation_prompt=True, tokenize=False)
        assert tok.apply_chat_template(messages[: k + 1], tools=tools, tokenize=False).startswith(prompt)
    assert tok.chat_template == CHAT_TEMPLATE
