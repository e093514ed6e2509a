"""The benchmark model: a Qwen3-0.6B-shape random checkpoint (made once, cached), its tokenizer and random prompts;
larger shapes (8B dense, 30B-A3B MoE) as random models built on the device (``random_model``: no checkpoint).

No weights can be downloaded, so every end-to-end benchmark (rollout, train step, serve, GRPO step) builds the same
checkpoint with ``areno.testing.make_tiny_checkpoint`` at the BENCH.md shape (596,049,920 parameters, bf16) and
caches it under ``$ARENO_BENCH_CACHE`` (default ``~/.cache/areno-bench``, else the temp folder), so the scripts of
one batch write it once.

The tiny test tokenizer has 1,000 tokens while the model's vocab has 151,936, so the checkpoint gets instead the
synthetic word-level tokenizer that TRL's G1 baseline used (``bench/baselines/peers_liger_trl.py``): token ``i``
is the word ``t{i}``, pad ``t0`` (id 0), eos ``t1`` (id 1), unk ``t2``. Every id decodes to text (a streamed server
response sends one chunk per token) and a prompt ``"t5 t77 ..."`` encodes to exactly those ids.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import torch

from areno.platform.roofline import H200

QWEN3_06B = dict(
    hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
    head_dim=128, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=40960,
    initializer_range=0.02,  # transformers' init for Qwen3: a 28-layer net at std 0.1 amplifies bf16 rounding
)  # fmt: skip
SMOKE = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=1024, tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=4096,
)  # fmt: skip
QWEN3_8B = dict(
    hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
    head_dim=128, vocab_size=151936, tie_word_embeddings=False, rope_theta=1e6, max_position_embeddings=40960,
)  # fmt: skip
QWEN3_30B_A3B = dict(
    hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
    head_dim=128, vocab_size=151936, tie_word_embeddings=False, rope_theta=1e6, max_position_embeddings=40960,
    num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1,
    mlp_only_layers=[],
)  # fmt: skip
PAD_ID, EOS_ID, UNK_ID = 0, 1, 2
FIRST_TOKEN = 3  # random prompts draw from [3, vocab): no pad/eos/unk inside a prompt
PEAK_FLOPS = H200.flops  # H200 bf16 dense, 790 TFLOP/s (BENCH.md; areno.platform.roofline)
HBM_BYTES_PER_S = H200.bytes_per_s  # 4.3 TB/s


def cache_root() -> Path:
    if os.environ.get("ARENO_BENCH_CACHE"):
        return Path(os.environ["ARENO_BENCH_CACHE"])
    home = Path.home() / ".cache" / "areno-bench"
    try:
        home.mkdir(parents=True, exist_ok=True)
        return home
    except OSError:  # read-only home: the temp folder still serves one batch of scripts
        return Path(tempfile.gettempdir()) / "areno-bench"


def word_tokenizer(vocab_size: int):
    """TRL G1 baseline's tokenizer: word-level, ``t{i}`` -> i, whitespace split, left padding.

    One fix over the baseline: its special tokens were plain strings, which the added-token splitter matches inside
    words (``"t12345"`` -> ``t1`` + unk), so about a third of its prompt words became eos/unk pairs. Here they are
    ``single_word`` added tokens, and a prompt of 128 words is 128 tokens.
    """
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token=f"t{UNK_ID}"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    special = lambda i: AddedToken(f"t{i}", special=True, single_word=True, normalized=False)  # noqa: E731
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token=special(PAD_ID), eos_token=special(EOS_ID), unk_token=special(UNK_ID)
    )
    tok.padding_side = "left"
    return tok


def checkpoint(smoke: bool = False, *, seed: int = 0) -> Path:
    """Path of the cached benchmark checkpoint (Qwen3-0.6B shape bf16, or the tiny smoke shape fp32), made if absent.

    Written into a temporary folder and renamed into place, so a killed run never leaves a half checkpoint behind.
    """
    from areno.testing import make_tiny_checkpoint

    shape = SMOKE if smoke else QWEN3_06B
    dtype = torch.float32 if smoke else torch.bfloat16
    path = cache_root() / f"{'smoke' if smoke else 'qwen3-0.6b-std002'}-seed{seed}-wordtok2"
    if (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".tmp-", dir=path.parent))
    try:
        make_tiny_checkpoint(
            tmp, "qwen3", seed=seed, dtype=dtype, bos_token_id=PAD_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, **shape
        )
        for f in tmp.iterdir():  # replace the 1,000-token test tokenizer
            if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
                f.unlink()
        tok = word_tokenizer(shape["vocab_size"])
        tok.model_max_length = shape["max_position_embeddings"]
        tok.save_pretrained(tmp)
        gen = {"bos_token_id": PAD_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        try:
            tmp.rename(path)
        except OSError:  # another process made it meanwhile
            if not (path / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


@torch.no_grad()
def random_model(shape: dict, dtype, device, seed: int = 0, *, family: str = "qwen3", unit_norms: bool = False,
                 std: float = 0.02, attn_backend: str = "flash"):
    """An areno model with random N(0, ``std``) weights drawn on the device, built as ``load_model`` builds one but
    with no checkpoint on disk. ``shape``: a config.json dict naming its ``model_type`` (any registered adapter, read
    as is), else a ``family`` (qwen3, qwen3_moe) shape completed by transformers' config class. ``unit_norms``: norm
    scales 1 (a zero-centred norm's weight 0) and expert biases 0 (a realistic next-token distribution)."""
    from areno.models.layers import RMSNorm
    from areno.models.loader import materialize
    from areno.models.registry import get_adapter
    from areno.models.tp import apply_tp_plan

    hf = shape
    if "model_type" not in shape:
        import transformers

        family_class = {"qwen3": transformers.Qwen3Config, "qwen3_moe": transformers.Qwen3MoeConfig}[family]
        hf = family_class(**{k: v for k, v in shape.items() if k != "initializer_range"})
    adapter = get_adapter(shape.get("model_type", family))
    with torch.device("meta"):
        model = adapter.model_class(adapter.config_from_hf(hf), attn_backend=attn_backend)
    apply_tp_plan(model, None)
    materialize(model, dtype, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if unit_norms and name.endswith("norm.weight"):
            p.fill_(1.0)
        elif unit_norms and name.endswith("expert_bias"):
            p.zero_()
        else:
            p.normal_(0.0, std, generator=gen)
    for module in model.modules():
        if unit_norms and isinstance(module, RMSNorm) and hasattr(module, "scale"):  # scales by 1 + weight
            module.weight.zero_()
            module.weight.fill_(1.0 - module.scale().float().mean().item())
    model.init_buffers(device)
    if hf is shape:
        model.hf_config = shape
    return model.eval()


def shape_of(smoke: bool) -> dict:
    return SMOKE if smoke else QWEN3_06B


def num_params(shape: dict) -> int:
    """Parameters of the tied Qwen3 shape (596,049,920 at the BENCH.md shape): every matrix, norms included."""
    h, i, v, layers = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"], shape["num_hidden_layers"]
    hq, hkv, d = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    per_layer = h * (hq + 2 * hkv) * d + hq * d * h + 3 * h * i + 2 * h + 2 * d
    return layers * per_layer + h + v * h


def random_prompts(n: int, length: int | list[int], vocab_size: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of random token ids in [3, vocab) (``length``: one length, or one per prompt)."""
    rng = random.Random(seed)
    lengths = [length] * n if isinstance(length, int) else list(length)
    return [[rng.randrange(FIRST_TOKEN, vocab_size) for _ in range(m)] for m in lengths]


def prompt_text(ids: list[int]) -> str:
    """The word-level tokenizer's text of ``ids`` (it encodes back to exactly ``ids``)."""
    return " ".join(f"t{i}" for i in ids)
