"""--rollout-dtype fp8 in RL runs: the colocated engine's FP8 copies (a MoE's expert stacks too) are quantised again
after an optimizer step (in place, the trainer's forward staying full precision); a colocated run logs the
rollout-vs-trainer mismatch and hints at --off-policy-correction tis when it is off; a colocated --tp-size 2 run
samples from each rank's FP8 shards; split mode streams the FP8 copies of a tiny MoE's projections and experts to a
rollout engine of TP 2 (about half a bf16 stream's bytes, each rollout rank taking its shard, the verified sync
comparing them byte for byte, gloo ranks); what is not built (and a TP shard off the 128-block grid) exits 2 naming
the flag."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from areno.cli import main
from areno.config import SamplingParams, TrainConfig
from areno.kernels.fp8 import quantize_weight_fp8
from areno.models import fp8_rollout, load_model, load_tokenizer
from areno.models.layers import held_fp8
from areno.rl.rollout.colocated import ColocatedRollout
from areno.rl.rollout.policy_sync import bucket_size, plan_buckets, sync_specs
from areno.testing import make_tiny_checkpoint
from areno.training.optimizer import MasterAdamW

ROOT = Path(__file__).resolve().parents[2]
WIDTHS = dict(hidden_size=128, intermediate_size=256, head_dim=32)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return _files(tmp_path_factory.mktemp("fp8r"), family="qwen3", **WIDTHS)


@pytest.fixture(scope="module")
def tp_moe_files(tmp_path_factory):
    """A tiny Qwen3-MoE whose TP=2 shards lie on the 128 x 128 block grid (heads of 128, experts' intermediate 256:
    128 a rank)."""
    return _files(tmp_path_factory.mktemp("fp8tp"), family="qwen3_moe", hidden_size=128, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=128, num_experts=4, moe_intermediate_size=256)


@pytest.fixture(scope="module")
def moe_files(tmp_path_factory):
    """A tiny Qwen3-MoE (8 experts of intermediate 32: one partial block each)."""
    return _files(tmp_path_factory.mktemp("fp8moe"), family="qwen3_moe")


def _files(root, **ckpt):
    ckpt = make_tiny_checkpoint(root / "ckpt", seed=0, **ckpt)
    (root / "data.jsonl").write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{i}+{i}="}],
                                                         "answer": str(2 * i)}) + "\n" for i in range(16)))
    (root / "reward.py").write_text("def reward_fn(record):\n    return float(len(record.completion) % 3 == 0)\n")
    return ckpt, root / "data.jsonl", root / "reward.py"


def train_argv(files, out, *extra, steps=2):
    ckpt, data, reward = files
    return ["train", "--ckpt", str(ckpt), "--dataset-path", str(data), "--reward-fn-path", str(reward),
            "--batch-size", "2", "--n-samples", "2", "--mini-bs", "2", "--max-steps", str(steps),
            "--max-new-tokens", "4", "--save-path", str(out), "--lr", "1e-2", "--no-tensorboard", "--dtype",
            "float32", "--rollout-dtype", "fp8", *extra]


def metrics(out):
    return [json.loads(x) for x in (out / "metrics" / "metrics.jsonl").read_text().splitlines()]


def _exit_code(argv) -> int:
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def _colocated(files):
    """(model, tokenizer, optimizer, colocated rollout with --rollout-dtype fp8) on the fp32 checkpoint."""
    ckpt, data, reward = files
    model = load_model(ckpt, dtype=torch.float32, device="cpu")
    tok = load_tokenizer(ckpt)
    cfg = TrainConfig(ckpt=str(ckpt), dataset_path=str(data), reward_fn_path=str(reward), rollout_dtype="fp8",
                      n_samples=2, max_new_tokens=4, max_prompt_tokens=32)
    optimizer = MasterAdamW(list(model.parameters()), lr=1e-2)
    return model, tok, optimizer, ColocatedRollout(model, tok, optimizer, cfg)


def test_colocated_copies_are_quantised_again_after_an_optimizer_step(files):
    model, tok, optimizer, rollout = _colocated(files)
    mod = fp8_rollout.fp8_modules(model)["layers.0.mlp.down_proj"]
    prompts = [tok.encode("1+2=")]
    first = rollout.generate(prompts, GREEDY)[0][0]
    held, where = mod.fp8_qweight.clone(), mod.fp8_qweight.data_ptr()
    ids = torch.tensor([prompts[0] + first.token_ids])
    plain = model.logits(ids)  # outside the rollout the trainer's forward is fp32
    with torch.no_grad(), fp8_rollout.fp8_forward(model):
        assert not torch.allclose(model.logits(ids), plain, atol=1e-4)
    plain.float().pow(2).mean().backward()
    optimizer.step(lr=1e-2)
    assert torch.equal(mod.fp8_qweight.view(torch.uint8), held.view(torch.uint8))  # nothing before the rollout
    second = rollout.generate(prompts, GREEDY)[0][0]
    assert mod.fp8_qweight.data_ptr() == where  # in place: captured CUDA graphs read the new copy
    assert not torch.equal(mod.fp8_qweight.view(torch.uint8), held.view(torch.uint8))
    assert torch.equal(mod.fp8_qweight.view(torch.uint8), quantize_weight_fp8(mod.weight).qweight.view(torch.uint8))
    with torch.no_grad(), fp8_rollout.fp8_forward(model):
        lp = torch.log_softmax(model.logits(torch.tensor([prompts[0] + second.token_ids])).double()[0], -1)
    start = len(prompts[0])
    want = lp[start - 1 : -1].gather(-1, torch.tensor(second.token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(second.logprobs, dtype=torch.float64), want, atol=1e-4)  # the new copies
    assert not any(m.fp8_on for m in fp8_rollout.fp8_modules(model).values())


def test_a_colocated_run_logs_the_mismatch_and_hints_at_tis(files, tmp_path, caplog):
    out = tmp_path / "run"
    with caplog.at_level(logging.WARNING):
        assert main(train_argv(files, out, "--tis-cap", "0")) == 0
    hints = [r.getMessage() for r in caplog.records if "--rollout-dtype fp8" in r.getMessage()]
    assert len(hints) == 1 and "--off-policy-correction tis" in hints[0]
    ms = metrics(out)
    assert len(ms) == 2 and all(m["logprob_diff"] > 1e-3 and m["mismatch_kl"] > 0 for m in ms)


OFF_GRID = "--rollout-dtype fp8 with TP 2 needs every shard on the 128 x 128 block grid of the full weight"


@pytest.mark.parametrize("extra,words", [
    (["--lora-rank", "4"], "--rollout-dtype fp8 with --lora-rank > 0 is not built yet"),
    # the tiny qwen3's heads of 32: a rank's q rows are 64 (tests/engine/test_engine_fp8_tp.py runs aligned shards)
    (["--world-size", "2", "--tp-size", "2"], OFF_GRID),
    (["--train-devices", "0", "--rollout-devices", "1,2", "--rollout-tp-size", "2"], OFF_GRID),
])
def test_what_is_not_built_exits_2_naming_the_flag(files, tmp_path, extra, words, capsys):
    assert _exit_code(train_argv(files, tmp_path / "x", *extra)) == 2
    assert words in capsys.readouterr().err
    sft = ["train", "--algo", "sft", "--ckpt", str(files[0]), "--dataset-path", str(files[1]), "--rollout-dtype", "fp8"]
    assert _exit_code(sft) == 2
    assert "--rollout-dtype does not apply to --algo sft" in capsys.readouterr().err


def test_colocated_expert_copies_follow_the_optimizer(moe_files):
    """MoE: the experts' FP8 stacks are remade in place before the first rollout after a step, and the rollout reads
    them (the trainer's forward stays full precision)."""
    model, tok, optimizer, rollout = _colocated(moe_files)
    experts = fp8_rollout.fp8_modules(model)["layers.0.mlp.experts"]
    prompts = [tok.encode("1+2=")]
    rollout.generate(prompts, GREEDY)
    held = held_fp8(experts, "w13")
    codes, where = held.qweight.clone(), held.qweight.data_ptr()
    ids = torch.tensor([prompts[0] + tok.encode(" 3")])
    model.logits(ids).float().pow(2).mean().backward()
    assert experts.w13.grad is not None and not experts.fp8_on
    optimizer.step(lr=1e-2)
    assert torch.equal(held_fp8(experts, "w13").qweight.view(torch.uint8), codes.view(torch.uint8))
    second = rollout.generate(prompts, GREEDY)[0][0]
    now = held_fp8(experts, "w13")
    assert now.qweight.data_ptr() == where and not torch.equal(now.qweight.view(torch.uint8), codes.view(torch.uint8))
    want = quantize_weight_fp8(experts.w13)
    assert torch.equal(now.qweight.view(torch.uint8), want.qweight.view(torch.uint8)) and torch.equal(now.scale,
                                                                                                      want.scale)
    with torch.no_grad(), fp8_rollout.fp8_forward(model):
        lp = torch.log_softmax(model.logits(torch.tensor([prompts[0] + second.token_ids])).double()[0], -1)
    start = len(prompts[0])
    want_lp = lp[start - 1 : -1].gather(-1, torch.tensor(second.token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(second.logprobs, dtype=torch.float64), want_lp, atol=1e-4)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="needs 2 GPUs on a CUDA host")
def test_a_colocated_tp2_run_samples_from_each_ranks_fp8_shards(tp_moe_files, tmp_path):
    """--tp-size 2 colocated (gloo ranks): each rank quantises its shards (attention, experts) again after every
    step; the rollout's log-probs differ from the fp32 trainer's by FP8's rounding only (a row-parallel FP8 GEMM not
    all-reduced, or a stale copy, would put them far apart)."""
    out = tmp_path / "colo"
    assert main(train_argv(tp_moe_files, out, "--world-size", "2", "--tp-size", "2", steps=2)) == 0
    ms = metrics(out)
    assert len(ms) == 2 and all(1e-3 < m["logprob_diff"] < 0.5 and m["mismatch_kl"] < 0.05 for m in ms), ms


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 3, reason="needs 3 GPUs on a CUDA host")
def test_split_mode_streams_the_fp8_copies_at_about_half_the_bytes(tp_moe_files, tmp_path):
    """Split mode (gloo ranks on CPU), on the MoE, one trainer and one rollout engine of TP 2 (--rollout-tp-size 2):
    the stream carries the full FP8 entries of the projections and of the expert stacks at about half the bytes of
    their bf16 tensors, each rollout rank copies its shard's codes and block scales; the verified sync gathers the
    rollout ranks' copies and compares them byte for byte with the trainer's."""
    files = tp_moe_files
    ckpt = files[0]
    bf16 = load_model(ckpt, dtype=torch.bfloat16, device="cpu")
    replaced = fp8_rollout.wire_hf_names(bf16)
    specs, fp8_specs = sync_specs(bf16, False), sync_specs(bf16, False, fp8=True)
    names = {s[0] for s in fp8_specs}
    assert {"fp8:layers.0.self_attn.o_proj.weight.q", "fp8:layers.0.mlp.experts.w13.q",
            "fp8:layers.0.mlp.experts.w2.s"} <= names  # fmt: skip
    assert {"model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.experts.3.down_proj.weight"} <= replaced

    def nbytes(specs):
        return sum(torch.Size(s).numel() * torch.empty((), dtype=d).element_size() for _, s, d in specs)

    linear = nbytes([s for s in specs if s[0] in replaced])
    assert nbytes([s for s in fp8_specs if s[0].startswith(fp8_rollout.PREFIX)]) / linear < 0.51
    print(f"bf16 stream {nbytes(specs)} bytes, fp8 {nbytes(fp8_specs)} (the tiny model's embeddings stay bf16)")
    assert not replaced & {s[0] for s in fp8_specs}
    out = tmp_path / "split"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", ARENO_VERIFY_POLICY_SYNC="1")
    proc = subprocess.run([sys.executable, "-m", "areno", *train_argv(files, out, "--train-devices", "0",
                                                                      "--rollout-devices", "1,2",
                                                                      "--rollout-tp-size", "2", steps=2)],
                          env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    synced = [m for m in metrics(out) if "policy_sync_bytes" in m]
    assert len(synced) == 1 and synced[0]["policy_sync_verified"] == 1
    fp32 = load_model(ckpt, dtype=torch.float32, device="cpu")
    want = sum(bucket_size(b) for b in plan_buckets(sync_specs(fp32, False, fp8=True), 64 * 2**20))
    assert synced[0]["policy_sync_bytes"] == want
    assert all(m["logprob_diff"] > 1e-3 for m in metrics(out))


@pytest.mark.gpu
def test_a_bf16_gpu_run_with_fp8_rollout_logs_a_small_mismatch(files, tmp_path):
    """On a GPU (Triton FP8 GEMMs, CUDA graphs): a bf16 run trains, the mismatch stays that of the tiny model."""
    out = tmp_path / "gpu"
    argv = [a if a != "float32" else "bfloat16" for a in train_argv(files, out)]
    assert main(argv) == 0
    ms = metrics(out)
    assert len(ms) == 2 and all(0 < m["logprob_diff"] < 0.5 and m["mismatch_kl"] < 0.1 for m in ms)
