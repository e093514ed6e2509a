"""Hugging Face tensor names and shapes of the tiny text families (qwen3, qwen3_moe, llama, bailing_hybrid, olmo2,
gpt_oss), in Hub layout: what ``checkpoints.random_weights`` draws and what ``qwen3_vl`` puts under its language
model."""

from __future__ import annotations


def _bailing_hybrid_layer(config: dict, p: str, full: bool, sparse: bool) -> dict:
    """Hub tensor shapes of one Ling 3 decoder layer with prefix ``p`` (``model.layers.{i}.``)."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    shapes = {p + "input_layernorm.weight": (hidden,)}
    a = p + "attention."
    if full:
        qk, rank, rope = config["qk_nope_head_dim"] + config["qk_rope_head_dim"], config["kv_lora_rank"], \
            config["qk_rope_head_dim"]
        if config.get("q_lora_rank"):
            q = config["q_lora_rank"]
            shapes.update({a + "q_a_proj.weight": (q, hidden), a + "q_a_layernorm.weight": (q,),
                           a + "q_b_proj.weight": (heads * qk, q)})
        else:
            shapes[a + "q_proj.weight"] = (heads * qk, hidden)
        shapes.update({a + "kv_a_proj_with_mqa.weight": (rank + rope, hidden), a + "kv_a_layernorm.weight": (rank,),
                       a + "kv_b_proj.weight": (heads * (config["qk_nope_head_dim"] + config["v_head_dim"]), rank),
                       a + "g_proj.weight": (heads, hidden),
                       a + "dense.weight": (hidden, heads * config["v_head_dim"])})
    else:
        hd, width = heads * config["head_dim"], config["short_conv_kernel_size"]
        for x in "qkv":
            shapes[a + f"{x}_proj.weight"] = (hd, hidden)
        for x in "qkv":
            shapes[a + f"{x}_conv1d.weight"] = (hd, 1, width)
        shapes.update({a + "f_proj.weight": (hd, hidden), a + "dt_bias": (hd,), a + "A_log": (heads,),
                       a + "b_proj.weight": (heads, hidden), a + "g_proj.weight": (hd, hidden),
                       a + "o_norm.weight": (config["head_dim"],), a + "dense.weight": (hidden, hd)})
    shapes[p + "post_attention_layernorm.weight"] = (hidden,)
    if sparse:
        experts, inter = config["num_experts"], config["moe_intermediate_size"]
        shared = inter * config.get("num_shared_experts", 1)
        shapes.update({p + "mlp.gate.weight": (experts, hidden), p + "mlp.gate.expert_bias": (experts,)})
        for e in range(experts):
            shapes[p + f"mlp.experts.{e}.gate_proj.weight"] = (inter, hidden)
            shapes[p + f"mlp.experts.{e}.up_proj.weight"] = (inter, hidden)
            shapes[p + f"mlp.experts.{e}.down_proj.weight"] = (hidden, inter)
        mlp, inter = p + "mlp.shared_experts.", shared
    else:
        mlp, inter = p + "mlp.", config["intermediate_size"]
    shapes.update({mlp + "gate_proj.weight": (inter, hidden), mlp + "up_proj.weight": (inter, hidden),
                   mlp + "down_proj.weight": (hidden, inter)})
    return shapes


def _bailing_hybrid_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    hidden, vocab, n = config["hidden_size"], config["vocab_size"], config["num_hidden_layers"]
    shapes = {"model.word_embeddings.weight": (vocab, hidden)}
    for i in range(n):
        full, sparse = config["layer_types"][i] == "full_attention", config["mlp_layer_types"][i] == "sparse"
        shapes.update(_bailing_hybrid_layer(config, f"model.layers.{i}.", full, sparse))
    for i in range(n, n + config.get("num_nextn_predict_layers", 0)):
        p = f"model.layers.{i}."
        shapes.update({p + "enorm.weight": (hidden,), p + "hnorm.weight": (hidden,),
                       p + "eh_proj.weight": (hidden, 2 * hidden)})
        shapes.update(_bailing_hybrid_layer(config, p, True, True))
        shapes[p + "final_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def _gpt_oss_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """GPT-OSS in its bf16 Hub layout: q/k/v/o with biases, sinks, a biased router, experts fused per layer."""
    hidden, vocab, heads = config["hidden_size"], config["vocab_size"], config["num_attention_heads"]
    d, kv, experts, inter = config["head_dim"], config["num_key_value_heads"], config["num_local_experts"], \
        config["intermediate_size"]
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        for name, rows in (("q_proj", heads * d), ("k_proj", kv * d), ("v_proj", kv * d)):
            shapes.update({p + f"self_attn.{name}.weight": (rows, hidden), p + f"self_attn.{name}.bias": (rows,)})
        shapes.update({p + "self_attn.o_proj.weight": (hidden, heads * d), p + "self_attn.o_proj.bias": (hidden,),
                       p + "self_attn.sinks": (heads,), p + "post_attention_layernorm.weight": (hidden,),
                       p + "mlp.router.weight": (experts, hidden), p + "mlp.router.bias": (experts,),
                       p + "mlp.experts.gate_up_proj": (experts, hidden, 2 * inter),
                       p + "mlp.experts.gate_up_proj_bias": (experts, 2 * inter),
                       p + "mlp.experts.down_proj": (experts, inter, hidden),
                       p + "mlp.experts.down_proj_bias": (experts, hidden)})
    shapes["model.norm.weight"] = (hidden,)
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def weight_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for a ``config.json`` dict of one of the tiny families, in Hub (unfused) layout."""
    if config["model_type"] == "bailing_hybrid":
        return _bailing_hybrid_shapes(config)
    if config["model_type"] == "gpt_oss":
        return _gpt_oss_shapes(config)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    qwen, olmo2 = config["model_type"] in ("qwen3", "qwen3_moe"), config["model_type"] in ("olmo2", "olmo3")
    attn_bias, mlp_bias = config.get("attention_bias", False), config.get("mlp_bias", False)
    experts = config.get("num_experts") or config.get("num_local_experts") or 0
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        if not olmo2:  # OLMo 2 norms after attention and after the MLP instead
            shapes[p + "input_layernorm.weight"] = (hidden,)
        for name, rows in (("q_proj", heads * head_dim), ("k_proj", kv_heads * head_dim),
                           ("v_proj", kv_heads * head_dim)):
            shapes[p + f"self_attn.{name}.weight"] = (rows, hidden)
            if attn_bias:
                shapes[p + f"self_attn.{name}.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, heads * head_dim)
        if attn_bias:
            shapes[p + "self_attn.o_proj.bias"] = (hidden,)
        if qwen:
            shapes[p + "self_attn.q_norm.weight"] = (head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (head_dim,)
        if olmo2:  # QK-norm over the whole projection
            shapes[p + "self_attn.q_norm.weight"] = (heads * head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (kv_heads * head_dim,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        if olmo2:
            shapes[p + "post_feedforward_layernorm.weight"] = (hidden,)
        sparse = (
            config["model_type"] == "qwen3_moe"
            and i not in (config.get("mlp_only_layers") or [])
            and experts > 0
            and (i + 1) % config.get("decoder_sparse_step", 1) == 0
        )
        if sparse:
            inter = config["moe_intermediate_size"]
            shapes[p + "mlp.gate.weight"] = (experts, hidden)
            for e in range(experts):
                shapes[p + f"mlp.experts.{e}.gate_proj.weight"] = (inter, hidden)
                shapes[p + f"mlp.experts.{e}.up_proj.weight"] = (inter, hidden)
                shapes[p + f"mlp.experts.{e}.down_proj.weight"] = (hidden, inter)
        else:
            inter = config["intermediate_size"]
            mlp = (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter)))
            for name, shape in mlp:
                shapes[p + f"mlp.{name}.weight"] = shape
                if mlp_bias:
                    shapes[p + f"mlp.{name}.bias"] = shape[:1]
    shapes["model.norm.weight"] = (hidden,)
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes
