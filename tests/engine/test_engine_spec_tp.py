"""MTP speculative decoding under tensor parallelism: a TP=2 gloo group (rank 0 plans each step, rank 1 runs the
same target, rollback and MTP forwards on its shard of the weights and of the MTP layer) gives the TP=1 speculative
engine's greedy tokens and log-probs and the plain engine's greedy tokens, its seeded samples at temperature 1 (with
a frequency penalty) equal TP=1's, its gate switches speculation off and on again as TP=1's does, and rank 1's K/V
and MTP K/V (one of the two KV heads) are those of the TP=1 engine's. A tiny Qwen3.5
(gated DeltaNet states saved, restored and recomputed after rejections on both ranks; the draft's head the model's
vocab-sharded one) whose MTP layer agrees with it in part (``tests.helpers.mtp``; its block's random weights kept
at a third, so the MTP K/V are real). DeepSeek-V3 under TP (the MTP
layer's own embedding and head sharded by vocabulary, its MoE and MLA) runs through the real server:
``tests/serve/test_tp_serve.py``."""

import json
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers

from areno.config import SamplingParams
from areno.distributed.launch import free_port
from areno.engine import spec_gated
from areno.engine.engine import Engine, EngineConfig
from areno.models import load_model
from areno.models.saver import save_model
from areno.testing import make_tiny_checkpoint
from tests.helpers.mtp import make_echo_model, run_with_arrivals

pytestmark = pytest.mark.slow
PROMPTS = [[5, 9, 13, 200, 7, 8, 9], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [42] * 5]
# greedy (n = 2 samples of the first prompt: a fork drafts from its second step) and one seeded sampled request
OPTIONS = [SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True, n=2),
           SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True),
           SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True, seed=11, frequency_penalty=0.5)]
ARRIVALS = dict(news=(3, 5, 8, 10), late=(6, 4), after=5)  # the gate of 2: gated, speculating, gated, speculating


def _engine(model, k, gate="off"):
    return Engine(model, None, EngineConfig(block_size=4, max_running=8, max_batched_tokens=12, speculative_tokens=k,
                                            speculative_disable_by_batch_size=gate, eager_decode=True),
                  eos_token_ids=[])


def _run(model, rank=0):
    """The same calls on every rank: generate() (ungated), and the gate run driven step by step by rank 0 while
    rank 1 follows. Returns (rank 0: the results, else None; the gate run's engine)."""
    e = _engine(model, 2)
    out = e.generate(PROMPTS, OPTIONS)
    gated = _engine(model, 2, gate=2)
    if rank:
        gated.follow()
        return None, gated
    transitions = run_with_arrivals(gated, **ARRIVALS)
    gated.close()
    return {"greedy": [[(c.token_ids, c.logprobs) for c in g] for g in out[:2]], "sampled": out[2][0].token_ids,
            "accept": e.spec.stats()["spec_accept_len"], "gate": transitions, "gate_stats": gated.spec.stats()}, gated


def _caches(engine) -> dict:
    return {"kv": engine.runner.kv_cache, "mtp": engine.runner.spec_exec.mtp_cache}


def _worker(rank, path, port, out, device):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    if device == "cpu":
        os.environ["ARENO_KERNELS"] = "native"
    from areno.distributed import parallel

    parallel.init_distributed(backend="gloo" if device == "cpu" else "nccl", tp_size=2)
    device = "cpu" if device == "cpu" else f"cuda:{rank}"
    model = load_model(path, dtype=torch.float32, device=device, tp_group=parallel.get_tp_group())
    result, gated = _run(model, rank)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    else:
        torch.save(_caches(gated), f"{out}.rank1.pt")
    dist.barrier()  # neither rank tears gloo down while the other still uses it (an abort seen under load)
    dist.destroy_process_group()


def _close(a, b, atol=1e-4):
    """Same tokens, log-probs within ``atol``, for lists of (tokens, log-probs)."""
    assert [t for t, _ in a] == [t for t, _ in b]
    for (_, x), (_, y) in zip(a, b):
        np.testing.assert_allclose(x, y, atol=atol)


TWO_GPUS = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=TWO_GPUS)])
def test_tp2_speculation_equals_tp1(tmp_path, device, monkeypatch):
    """On the CPU (gloo, native kernels), and on two GPUs (NCCL, the GPU kernels; fp32 weights). Gated stretches do
    not chain under TP (``spec_gated``): nor do they in the TP=1 run compared with it."""
    if not hasattr(transformers, "Qwen3_5TextConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no qwen3_5")
    src = make_tiny_checkpoint(tmp_path / "src", family="qwen3_5", seed=1)
    model = make_echo_model(load_model(src, dtype=torch.float32, device=device), scale=2.0, block_scale=0.3)
    path = save_model(model, tmp_path / "echo")
    out = str(tmp_path / "res.json")
    mp.spawn(_worker, args=(str(path), free_port(), out, device), nprocs=2, join=True)
    tp2 = json.load(open(out))
    monkeypatch.setattr(spec_gated, "chain_length", lambda spec, step: 0)
    tp1, gated = _run(load_model(path, dtype=torch.float32, device=device))
    tol = 1e-4 if device == "cpu" else 1e-3
    plain = _engine(model, 0).generate(PROMPTS[:2], OPTIONS[:2])
    for g2, g1, gp in zip(tp2["greedy"], tp1["greedy"], plain):
        _close(g2, g1, tol)
        assert [t for t, _ in g2] == [c.token_ids for c in gp]  # speculation's greedy is the plain engine's
    assert tp2["sampled"] == tp1["sampled"]
    assert 1.1 < tp2["accept"] < 3  # drafts accepted and rejected
    assert tp2["accept"] == tp1["accept"] and tp2["gate_stats"] == tp1["gate_stats"]  # the same drafts as TP=1's
    _close(tp2["gate"], tp1["gate"], tol)
    assert tp2["gate_stats"]["spec_gated_steps"] > 0 and tp2["gate_stats"]["verify_rows"] > 0
    rank1 = torch.load(f"{out}.rank1.pt", map_location="cpu")
    for name, full in _caches(gated).items():  # [..., KV heads, head dim]: rank 1 holds the second of two heads
        assert full.shape[-2] == 2 and full.abs().max() > 0
        torch.testing.assert_close(rank1[name], full[..., 1:, :].cpu(), atol=tol, rtol=tol)
