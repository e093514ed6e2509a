"""Peer baselines: the torch log-prob path and Liger-Kernel's fused linear cross-entropy (K2), one TRL GRPO step (G1).

    python bench/baselines/peers_liger_trl.py           # K2 and G1 on the GPU (G1 about 3 minutes)
    python bench/baselines/peers_liger_trl.py K2        # one of them
    python bench/baselines/peers_liger_trl.py --smoke   # CPU: tiny sizes (K2's torch path, G1 with TRL on the CPU)

Neither peer is a dependency of areno: put liger-kernel 0.8.5 and trl 1.16.0 (with datasets 5.2.0, dill 0.4.1,
multiprocess 0.70.19; pure Python wheels for Python 3.12) on PYTHONPATH, as bench/README.md says; a part whose peer
is missing prints that and goes on.

K2: 16,384 tokens, hidden 1024, vocab 151,936, bf16, forward + backward of the mean negative log-prob: torch
``hidden @ W.T`` -> fp32 ``log_softmax`` -> ``gather``, then ``LigerFusedLinearCrossEntropyLoss``; median ms and the
peak memory above the inputs. G1: TRL ``GRPOTrainer`` on a fresh Qwen3-0.6B-shape model (random bf16 weights) and
``bench/models.py``'s word-level tokenizer of 151,936 tokens: 32 prompts x 8 samples, 128 random prompt tokens, up
to 512 new tokens at temperature 1 with ``transformers`` generate (no vLLM), 8 microbatches of 32, lr 1e-6, beta 0,
no gradient checkpointing, the reward ``bench/grpo_reward.py``'s text-length parity; seconds per step for 3 steps.
``bench/logprob.py`` and ``bench/grpo_step.py`` run these peers beside areno in their own run.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench.baselines.common import run_parts  # noqa: E402
from bench.common import gpu_time_ms  # noqa: E402
from bench.models import QWEN3_06B, SMOKE, prompt_text, random_prompts, word_tokenizer  # noqa: E402


def k2(device: str, smoke: bool):
    tokens, hidden, vocab = (256, 32, 1000) if smoke else (16384, 1024, 151936)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=gen).requires_grad_()
    w = (0.02 * torch.randn(vocab, hidden, device=device, generator=gen)).to(dtype).requires_grad_()
    target = torch.randint(0, vocab, (tokens,), device=device, generator=gen)

    def torch_path():
        logp = (h @ w.T).float().log_softmax(-1).gather(1, target.unsqueeze(1))
        (-logp.mean()).backward()

    impls = [("torch", torch_path)]
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        fused = LigerFusedLinearCrossEntropyLoss()
        impls.append(("liger_flce", lambda: fused(w, h, target).backward()))
    except ImportError as e:
        print(f"K2: liger-kernel is not importable ({e}): torch path only", file=sys.stderr)
    for name, run in impls:
        yield _measure_k2(name, run, (h, w), device, {"N": tokens, "H": hidden, "V": vocab})


def _measure_k2(name, run, leaves, device, shape) -> dict:
    def step():
        run()
        for t in leaves:
            t.grad = None

    step()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if device == "cuda" else 0
    rec = {"workload": "K2", "impl": name, **shape, "ms": gpu_time_ms(step, iters=10)}
    if device == "cuda":
        rec["peak_extra_GiB"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    return rec


def g1(device: str, smoke: bool):
    try:
        import trl
        from datasets import Dataset
        from transformers import Qwen3Config, Qwen3ForCausalLM, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        print(f"G1: trl or datasets is not importable ({e}): skipped", file=sys.stderr)
        return
    shape = {k: v for k, v in (SMOKE if smoke else QWEN3_06B).items() if k != "initializer_range"}
    prompts, samples, prompt_len, new, micro = (4, 4, 8, 16, 4) if smoke else (32, 8, 128, 512, 32)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(rms_norm_eps=1e-6, eos_token_id=1, pad_token_id=0, **shape))
    model = model.to(torch.float32 if smoke else torch.bfloat16)
    texts = [prompt_text(p) for p in random_prompts(4 * prompts, prompt_len, shape["vocab_size"])]
    ends = []

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if device == "cuda":
                torch.cuda.synchronize()
            ends.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out, per_device_train_batch_size=micro, gradient_accumulation_steps=prompts * samples // micro,
            num_generations=samples, max_completion_length=new, learning_rate=1e-6, beta=0.0, temperature=1.0,
            top_k=0, use_vllm=False, gradient_checkpointing=False, max_steps=3, logging_steps=1, report_to="none",
            save_strategy="no", **(dict(use_cpu=True, bf16=False) if device == "cpu" else dict(bf16=True)),
        )  # fmt: skip
        trainer = GRPOTrainer(
            model=model, args=config, processing_class=word_tokenizer(shape["vocab_size"]),
            reward_funcs=lambda completions, **_: [float(len(c) % 2) for c in completions],
            train_dataset=Dataset.from_dict({"prompt": texts}), callbacks=[StepClock()],
        )  # fmt: skip
        start = time.perf_counter()
        trainer.train()
    step_s = [b - a for a, b in zip([start, *ends[:-1]], ends)]
    rec = {"workload": "G1", "impl": f"trl {trl.__version__}", "step_s_all": step_s,
           "step_s": sum(step_s[1:]) / max(len(step_s) - 1, 1)}  # fmt: skip
    if device == "cuda":
        rec["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    yield rec


def main(argv=None) -> None:
    run_parts(__doc__, {"K2": lambda a, device: k2(device, a.smoke), "G1": lambda a, device: g1(device, a.smoke)}, argv)


if __name__ == "__main__":
    main()
