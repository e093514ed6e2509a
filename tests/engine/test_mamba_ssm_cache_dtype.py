"""--mamba-ssm-cache-dtype (vLLM's flag): the hybrids' delta-rule state pool in bf16 (engine/state_cache.py). A bf16
pool on tiny Qwen3.5 and Ling 3 engines (chunked prefill carrying the state, n forked samples, multi-step decode,
speculative decoding's stash and rollback) gives the fp32 pool's greedy tokens with log-probs close to them; the
memory plan counts the pool at 2 bytes an element; auto (the default) follows the checkpoint's mamba_ssm_dtype; a
named dtype with a model without recurrent layers and an unknown value are refused naming the flag; the flag reaches
the engine from `areno serve` and the train rollout's config. The Triton decode step on a bf16 pool:
tests/kernels/test_delta_rule.py."""

import json

import numpy as np
import pytest
import torch
import transformers

from areno.cli import main
from areno.config import ConfigError, SamplingParams, ServeConfig, TrainConfig
from areno.engine.engine import Engine, EngineConfig
from areno.engine.kv_cache import kv_bytes_per_block, plan_num_blocks, state_bytes
from areno.engine.spec_graphs import stash_bytes
from areno.engine.state_cache import RecurrentStates
from areno.models import load_model, load_tokenizer
from areno.testing import make_tiny_checkpoint
from tests.helpers.mtp import make_echo_model

PROMPTS = ["hello world, 12 + 3 =", "tool call: {\"name\": \"add\"} and some longer text here"]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True, n=2)
# bf16 keeps 8 bits of mantissa: each state element moves by <= 2^-9 of itself per store; on these tiny models the
# greedy tokens agree and the log-probs measured within 3e-3 of the fp32 pool's (0.05: far from any flip)
MEAN_BOUND = 0.05
HAS = {"qwen3_5": hasattr(transformers, "Qwen3_5TextConfig"),
       "bailing_hybrid": hasattr(transformers, "BailingHybridConfig")}


@pytest.fixture(scope="module", params=["qwen3_5", "bailing_hybrid"])
def hybrid(request, tmp_path_factory):
    if not HAS[request.param]:
        pytest.skip(f"transformers {transformers.__version__} has no {request.param}")
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), family=request.param, seed=1)
    return load_model(path, dtype=torch.float32, device="cpu"), load_tokenizer(path)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), family="qwen3", seed=0)


def engine(model, tok, **kw):
    kw = {"block_size": 4, "max_running": 8, "max_batched_tokens": 7, **kw}
    return Engine(model, tok, EngineConfig(**kw))


def assert_close_runs(ref, out):
    """The same greedy tokens; the log-probs' mean |difference| within MEAN_BOUND."""
    assert [[c.token_ids for c in g] for g in out] == [[c.token_ids for c in g] for g in ref]
    diffs = [abs(a - b) for g1, g2 in zip(ref, out) for c1, c2 in zip(g1, g2) for a, b in zip(c1.logprobs, c2.logprobs)]
    assert np.mean(diffs) < MEAN_BOUND


@pytest.mark.parametrize("decode_steps", [1, 3])
def test_bf16_pool_follows_the_fp32_pool(hybrid, decode_steps):
    """A 7-token budget splits the longer prompt over chunks (the carried state read from the bf16 pool into the
    fp32 chunk kernel, its final state rounded back), 2 samples a prompt fork by a copy of the bf16 state."""
    model, tok = hybrid
    prompts = [tok.encode(p) for p in PROMPTS]
    assert max(map(len, prompts)) > 7
    e = engine(model, tok, mamba_ssm_cache_dtype="bfloat16", decode_steps=decode_steps)
    states = e.runner.states
    assert states.recurrent.dtype == torch.bfloat16 and states.conv.dtype == torch.float32  # conv: the model's
    out = e.generate(prompts, GREEDY)
    assert states.recurrent.abs().sum() > 0  # the layers wrote it
    ref = engine(model, tok, decode_steps=decode_steps)
    assert ref.runner.states.recurrent.dtype == torch.float32  # auto: the tiny config names no mamba_ssm_dtype
    assert_close_runs(ref.generate(prompts, GREEDY), out)
    assert sorted(e.blocks.free_state_slots) == list(range(8))


def test_speculative_stash_and_rollback_at_the_pool_dtype(tmp_path):
    """MTP speculation (Qwen3.5, an echo model whose drafts are accepted in part) on a bf16 pool: the rollback
    replays the accepted tokens on it (rejections among them); greedy tokens stay the fp32 pool's. The stash's bytes
    out of the budget do not depend on the pool's dtype (it keeps inputs, no delta-rule state)."""
    if not HAS["qwen3_5"]:
        pytest.skip(f"transformers {transformers.__version__} has no qwen3_5")
    path = make_tiny_checkpoint(tmp_path / "q35", family="qwen3_5", seed=1)
    model = make_echo_model(load_model(path, dtype=torch.float32, device="cpu"), scale=2.0)
    prompts = [[5, 9, 13, 200, 7, 8, 9], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]]
    kw = {"speculative_tokens": 2, "max_batched_tokens": 12}
    spec = Engine(model, None, EngineConfig(block_size=4, max_running=8, mamba_ssm_cache_dtype="bfloat16", **kw),
                  eos_token_ids=[])
    out = spec.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True, n=2))
    assert 1.0 < spec.spec.stats()["spec_accept_len"] < 3  # drafts accepted and rejected: states rolled back
    plain = Engine(model, None, EngineConfig(block_size=4, max_running=8), eos_token_ids=[])
    assert_close_runs(plain.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True,
                                                             n=2)), out)
    fp32 = Engine(model, None, EngineConfig(block_size=4, max_running=8, **kw), eos_token_ids=[])
    assert spec.runner.states.recurrent.dtype == torch.bfloat16
    rows = spec.spec_budget.rows
    assert fp32.spec_budget.reserved == spec.spec_budget.reserved >= stash_bytes(model, rows, 2, torch.float32) > 0


def test_memory_plan_counts_the_pool_at_its_dtype(hybrid):
    """bytes_per_slot: the delta-rule part halves, the conv part stays; a budget's blocks grow by what that frees."""
    model, tok = hybrid
    shapes = model.recurrent_state_shapes()
    (d, w), (h, k, v), n = shapes["conv"], shapes["recurrent"], len(shapes["layers"])
    fp32 = RecurrentStates.bytes_per_slot(shapes, torch.float32)
    bf16 = RecurrentStates.bytes_per_slot(shapes, torch.float32, torch.bfloat16)
    assert fp32 == n * 4 * (d * w + h * k * v) and bf16 == n * (4 * d * w + 2 * h * k * v)
    assert state_bytes(model, 8, torch.float32, torch.bfloat16) == 8 * bf16
    per_block = kv_bytes_per_block(model, 4, torch.float32)
    budget = state_bytes(model, 8, torch.float32) + 20 * per_block
    plan = dict(block_size=4, dtype=torch.float32, device=torch.device("cpu"), kv_cache_memory=budget, max_running=8,
                max_model_len=4096)
    assert plan_num_blocks(model, **plan) == 20
    assert plan_num_blocks(model, **plan, state_dtype=torch.bfloat16) == 20 + 8 * (fp32 - bf16) // per_block
    e = engine(model, tok, kv_cache_memory=budget, max_model_len=4096, mamba_ssm_cache_dtype="bfloat16")
    assert e.blocks.num_blocks == 20 + 8 * (fp32 - bf16) // per_block


@pytest.mark.parametrize("asked, pool", [(None, torch.float32), ("float32", torch.float32),
                                         ("bfloat16", torch.bfloat16), ("float16", torch.float32)])
def test_auto_follows_the_checkpoints_mamba_ssm_dtype(tmp_path, asked, pool):
    """auto (the default) reads config.json's ``mamba_ssm_dtype`` as vLLM does (Qwen3.5's checkpoints say float32),
    fp32 where it is absent or names a dtype the pool does not take; a named value overrides it."""
    if not HAS["qwen3_5"]:
        pytest.skip(f"transformers {transformers.__version__} has no qwen3_5")
    path = make_tiny_checkpoint(tmp_path, family="qwen3_5", seed=1)
    if asked is not None:
        raw = json.loads((path / "config.json").read_text())
        (raw.get("text_config") or raw)["mamba_ssm_dtype"] = asked
        (path / "config.json").write_text(json.dumps(raw))
    model, tok = load_model(path, dtype=torch.float32, device="cpu"), load_tokenizer(path)
    assert model.config.mamba_ssm_dtype == asked
    assert engine(model, tok).runner.states.recurrent.dtype == pool
    named = engine(model, tok, mamba_ssm_cache_dtype="float32" if pool == torch.bfloat16 else "bfloat16")
    assert named.runner.states.recurrent.dtype != pool


def test_refused_for_a_model_without_recurrent_layers_and_for_other_values(qwen3):
    model, tok = load_model(qwen3, dtype=torch.float32, device="cpu"), load_tokenizer(qwen3)
    for name in ("bfloat16", "float32"):  # a named dtype would do nothing without a pool
        with pytest.raises(ConfigError, match=f"--mamba-ssm-cache-dtype {name} applies only to hybrid models"):
            engine(model, tok, mamba_ssm_cache_dtype=name)
    assert engine(model, tok).runner.states is None  # auto, the default: nothing to refuse
    with pytest.raises(ConfigError, match="--mamba-ssm-cache-dtype must be one of auto, float32, bfloat16"):
        engine(model, tok, mamba_ssm_cache_dtype="float16")
    for cls, kw in ((ServeConfig, {"model_path": "x"}), (TrainConfig, {"ckpt": "m", "algo": "grpo"})):
        with pytest.raises(ConfigError, match="--mamba-ssm-cache-dtype"):
            cls(mamba_ssm_cache_dtype="float16", **kw)


def test_cli_refusals_exit_2_naming_the_flag(qwen3, monkeypatch, capsys):
    """A value outside the choices (argparse); bfloat16 with a model that has no recurrent layers, found when the
    engine is built (`areno serve --engine-thread`: in this process)."""
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--model-path", str(qwen3), "--mamba-ssm-cache-dtype", "float16"])
    assert exc.value.code == 2 and "--mamba-ssm-cache-dtype" in capsys.readouterr().err

    def no_server(*a, **k):
        raise AssertionError("the engine was built: the flag was not refused")

    monkeypatch.setattr("areno.serve.server._make_server", no_server)
    rc = main(["serve", "--model-path", str(qwen3), "--engine-thread", "--port", "0", "--dtype", "float32",
               "--mamba-ssm-cache-dtype", "bfloat16"])
    err = capsys.readouterr().err
    assert rc == 2 and "error: --mamba-ssm-cache-dtype bfloat16 applies only to hybrid models" in err, err


def test_the_flag_reaches_the_engine_config(monkeypatch, tmp_path):
    """`areno serve` (in process and through the replicas' engine arguments) and the train rollout's engine config
    (colocated and split mode build it alike)."""
    from areno.rl.rollout.colocated import engine_config
    from areno.serve import replicas, server

    seen = []

    class Built(Exception):
        pass

    def fake_build(*args, **kwargs):
        seen.append(kwargs)
        raise Built

    monkeypatch.setattr("areno.engine.build.build_engine", fake_build)
    monkeypatch.setattr(server, "serve_tool_format", lambda config: None)
    config = ServeConfig(model_path=str(tmp_path), engine_thread=True, mamba_ssm_cache_dtype="bfloat16")
    with pytest.raises(Built):
        server.build_app(config)
    assert seen[-1]["mamba_ssm_cache_dtype"] == "bfloat16"
    monkeypatch.setattr(replicas, "ReplicaPool", lambda kwargs, n, **kw: seen.append(kwargs))
    replicas.build_pool(config, 1)
    assert seen[-1]["mamba_ssm_cache_dtype"] == "bfloat16"

    class Model:
        is_moe = False

    cfg = TrainConfig(ckpt=str(tmp_path), algo="grpo", mamba_ssm_cache_dtype="bfloat16")
    econf, _ = engine_config(cfg, Model(), None)
    assert econf.mamba_ssm_cache_dtype == "bfloat16"
