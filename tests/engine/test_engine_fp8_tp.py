"""FP8 rollout under tensor parallelism (--rollout-dtype fp8 with TP 2, gloo ranks; models/fp8_rollout.py): on tiny
checkpoints whose shards lie on the 128 x 128 block grid (a dense Qwen3 with one replicated KV head, a Qwen3-MoE
whose experts' intermediate slices are 128 wide, a Qwen3.5 whose in_proj ends in per-head b/a rows left in the
model's dtype), each rank quantises its own shard, the shards gathered are byte for byte what TP=1 quantises from the
full weights, and the TP=2 engine's greedy tokens equal those of a TP=1 engine holding the same dequantised values
(the exact oracle: re-quantised they give the same codes and scales, so the two engines differ only in the
row-parallel all-reduce's summation order), log-probs within 1e-4. A checkpoint whose shards are off the grid is
refused before launch, naming the model dimension."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from areno.cli import main
from areno.config import ConfigError, SamplingParams
from areno.distributed.launch import free_port
from areno.engine.engine import Engine, EngineConfig
from areno.models import fp8_rollout, load_model, load_tokenizer
from areno.testing import make_tiny_checkpoint

ATTN = dict(hidden_size=128, num_attention_heads=2, head_dim=128, num_hidden_layers=2)
# qkv: q 256 rows (128 a rank), k and v one head of 128 (replicated: both ranks hold it); gate/up and down: 128 a rank
DENSE = dict(ATTN, num_key_value_heads=1, intermediate_size=256)
MOE = dict(ATTN, num_key_value_heads=2, num_experts=4, moe_intermediate_size=256)  # w13 [4, 2 x 128, 128] a rank
# Qwen3.5: the gated delta net's in_proj (q, k 128 rows a rank, v, z 256, then b and a: 2 rows each a rank, kept in
# the model's dtype) and its full-attention layers
QWEN3_5 = dict(ATTN, num_key_value_heads=2, intermediate_size=256, linear_num_key_heads=2, linear_num_value_heads=4,
               linear_key_head_dim=128, linear_value_head_dim=128)
FAMILIES = {"qwen3": DENSE, "qwen3_moe": MOE, "qwen3_5": QWEN3_5}
PROMPTS = ["hello world, 12 + 3 =", "the cat", "1 2 3 4"]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)


def _generate(model, tok, **kw):
    engine = Engine(model, tok, EngineConfig(block_size=4, max_running=8, **kw))
    return [g[0] for g in engine.generate([tok.encode(p) for p in PROMPTS], GREEDY)]


def _bytes(t):
    return t.view(torch.uint8) if t.dtype != torch.float32 else t


def _worker(rank, paths, port, root):
    """Both checkpoints on one gloo group (one spawn): rank 0 saves the tokens, log-probs and gathered copies."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      ARENO_KERNELS="native")
    from areno.distributed import parallel

    parallel.init_distributed(backend="gloo", tp_size=2)
    for family, path in paths.items():
        model = load_model(path, dtype=torch.float32, device="cpu", tp_group=parallel.get_tp_group())
        fp8_rollout.enable(model)
        out = _generate(model, load_tokenizer(path), decode_steps=3)
        copies = {k: _bytes(v).clone() for k, v in fp8_rollout.held_wire_tensors(model)}  # gathered (a collective)
        if rank == 0:
            torch.save({"tokens": [c.token_ids for c in out], "logprobs": [c.logprobs for c in out],
                        "copies": copies}, f"{root}/{family}.pt")
    dist.barrier()  # neither rank tears gloo down while the other still uses it (an abort seen under load)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    """``{family: (checkpoint, what the TP=2 engine gave)}`` for the dense and the MoE checkpoint."""
    root = tmp_path_factory.mktemp("fp8tp")
    paths = {family: make_tiny_checkpoint(root / family, family=family, seed=5, **widths)
             for family, widths in FAMILIES.items()}
    mp.spawn(_worker, args=(paths, free_port(), str(root)), nprocs=2, join=True)
    return {family: (path, torch.load(root / f"{family}.pt")) for family, path in paths.items()}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tp2_fp8_engine_equals_tp1_on_the_same_dequantised_weights(tp2, family):
    path, got = tp2[family]
    ref = load_model(path, dtype=torch.float32, device="cpu")
    full = {k: _bytes(v) for k, v in fp8_rollout.wire_tensors(ref)}  # TP=1 quantises the full weights
    assert got["copies"].keys() == full.keys() and len(full) >= 8
    assert any(".experts.w13" in k for k in full) == (family == "qwen3_moe")
    for name, t in full.items():
        assert torch.equal(got["copies"][name], t), name  # the shards' blocks are the full weight's
    fp8_rollout.enable(ref)
    modules = fp8_rollout.fp8_modules(ref)
    if family == "qwen3_5":  # b and a (4 rows each) stream and run in the model's dtype, the rest of in_proj in FP8
        in_proj = next(m for n, m in modules.items() if n.endswith("in_proj"))
        assert in_proj.fp8_rows == in_proj.weight.shape[0] - 8 and in_proj.fp8_qweight.shape[0] == in_proj.fp8_rows
        kept = {n for n in fp8_rollout.wire_hf_names(ref) if n.endswith(("in_proj_b.weight", "in_proj_a.weight"))}
        assert not kept
    for name, t in got["copies"].items():  # the oracle holds the dequantised shard values (and their copies)
        fp8_rollout.receive(ref, modules, name, t.view(torch.float8_e4m3fn) if t.dtype == torch.uint8 else t)
    fp8_rollout.quantize(ref)  # re-quantised from the dequantised weights: the same codes and scales
    assert all(torch.equal(_bytes(v), got["copies"][k]) for k, v in fp8_rollout.held_wire_tensors(ref))
    oracle = _generate(ref, load_tokenizer(path))
    assert got["tokens"] == [c.token_ids for c in oracle]
    diff = max(abs(a - b) for c, lps in zip(oracle, got["logprobs"]) for a, b in zip(c.logprobs, lps))
    print(f"{family}: TP=2 fp8 vs the TP=1 oracle, largest |dlogp| {diff:.2e}")
    assert diff < 1e-4


def test_a_shard_off_the_block_grid_is_refused_naming_the_dimension(tmp_path, capsys):
    """A tiny MoE with 8 experts of intermediate 32 (16 a rank at TP 2: refused before launch, `areno serve` exits
    2); a dense model with heads of 32 (q: 64 rows a rank)."""
    path = make_tiny_checkpoint(tmp_path / "ckpt", family="qwen3_moe", seed=0, head_dim=128, num_attention_heads=2,
                                num_key_value_heads=2)
    with pytest.raises(ConfigError, match="^--rollout-dtype fp8 with TP 2 .*moe_intermediate_size 32 / TP 2 = 16"):
        fp8_rollout.check_checkpoint(path, 2)
    fp8_rollout.check_checkpoint(path, 1)  # no TP: any width
    serve = ["serve", "--model-path", str(path), "--tp-size", "2", "--world-size", "2", "--rollout-dtype", "fp8"]
    with pytest.raises(SystemExit) as e:
        main(serve)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "experts.w13's shard of model.layers.0.mlp.experts.0.gate_proj.weight" in err
    heads = make_tiny_checkpoint(tmp_path / "heads", family="qwen3", seed=0, hidden_size=128, head_dim=32)
    with pytest.raises(ConfigError, match=r"q_proj.weight is 4 heads x head_dim 32 / TP 2 = 64 rows"):
        fp8_rollout.check_checkpoint(heads, 2)
