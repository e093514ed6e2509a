"""MTP speculative decoding through the engine (``--speculative-tokens``) on tiny checkpoints of every MTP family:
greedy tokens and log-probs equal the plain engine's (n > 1, chunked prefill, prefix hits, the hybrids' recurrent
states rolled back), the tokens sampled at temperature 1 follow the target's own distribution (a chi-square test of
their probability integral transforms against a plain forward), and a model without MTP layers is refused.
The models echo their input token often and their MTP layer always proposes it (``tests.helpers.mtp``), so drafts
are accepted in part and rejected in part."""

import numpy as np
import pytest
import torch

from areno.config import SamplingParams
from areno.engine.engine import Engine, EngineConfig
from areno.engine.kv_cache import kv_bytes_per_block, state_bytes
from areno.engine.spec_gate import AUTO_FALLBACK
from areno.engine.spec_graphs import stash_bytes
from areno.models import load_model
from areno.testing import make_tiny_checkpoint
from tests.helpers.families import assert_routes_match_forward
from tests.helpers.mtp import make_echo_model

PROMPTS = [[5, 9, 13, 200, 7, 8, 9], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [42] * 5]
pytestmark = pytest.mark.slow

SHARED = [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 99, 98]  # a prefix hit on the second prompt


@pytest.fixture(scope="module", params=["qwen3_5", "deepseek_v3", "bailing_hybrid"])
def echo(request, tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), family=request.param, seed=1)
    model = make_echo_model(load_model(path, dtype=torch.float32, device="cpu"), scale=2.0)
    return request.param, model, _greedy(model, 0)


def _engine(model, k, **kw):
    kw = {"block_size": 4, "max_running": 8, "max_batched_tokens": 12, **kw}
    return Engine(model, None, EngineConfig(speculative_tokens=k, **kw), eos_token_ids=[])


def _greedy(model, k):
    e = _engine(model, k)
    opts = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True, n=2)
    out = e.generate(PROMPTS, opts) + e.generate([SHARED], opts)  # the second call hits the prefix cache
    return [[(c.token_ids, c.logprobs) for c in g] for g in out], e


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_equals_plain_decoding(echo, k):
    family, model, (plain, _) = echo
    spec, e = _greedy(model, k)
    assert [[t for t, _ in g] for g in spec] == [[t for t, _ in g] for g in plain]
    for g1, g2 in zip(spec, plain):
        for (_, a), (_, b) in zip(g1, g2):
            np.testing.assert_allclose(a, b, atol=1e-4)
    stats = e.spec.stats()
    assert 1.1 < stats["spec_accept_len"] < k + 1  # drafts were accepted and rejected
    assert stats["spec_accept_len"] == stats["emitted"] / stats["verify_rows"]
    limit = {"spec_limit": AUTO_FALLBACK}  # auto, on the CPU: the fixed N
    assert e.spec.take_stats() == {"spec_accept_len": stats["spec_accept_len"], "spec_gated_steps": 0, **limit}
    assert e.spec.take_stats() == {"spec_accept_len": 0.0, "spec_gated_steps": 0, **limit}  # per rollout
    if family != "deepseek_v3":  # the hybrids: rejections rolled their recurrent states back
        assert e.runner.states is not None


def test_a_copying_mtp_layer_drafts_the_last_token(echo):
    """The echo model's MTP layer copies its input token: after the prefill every greedy draft is the last token."""
    _, model, _ = echo
    e = _engine(model, 3)
    (seq,) = e.add_request(PROMPTS[0], SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True))
    e.step()
    assert e.spec.drafts[seq.seq_id].tokens == [seq.tokens[-1]] * 3


def test_routing_capture_keeps_the_accepted_tokens_routes(echo):
    """Routing replay (sparse-MoE models): every token's recorded experts are a plain forward's, the verify step's
    rejected positions dropped; n = 2 forks take their head's prompt routes."""
    family, model, _ = echo
    if not model.is_moe:
        pytest.skip(f"{family}: dense, no routes")
    e = _engine(model, 2, record_routing=True)
    opts = SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True, n=2, seed=3)
    out = e.generate(PROMPTS[:2], opts)
    assert e.spec.stats()["spec_accept_len"] > 1.0
    for group in out:
        assert_routes_match_forward(model, group)


def test_preemption_keeps_greedy_tokens(echo):
    """A cache small enough to preempt: recomputed sequences draft again from their new prefill, same tokens."""
    family, model, (plain, _) = echo
    budget = 10 * kv_bytes_per_block(model, 4, torch.float32, extra_layers=1) + state_bytes(model, 6, torch.float32)
    budget += stash_bytes(model, 6, 2, torch.float32)  # the hybrids' verify state stash: K x 6 rows
    e = _engine(model, 2, max_running=6, kv_cache_memory=budget)
    out = e.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True, n=2))
    assert e.scheduler.num_preemptions > 0
    assert [[c.token_ids for c in g] for g in out] == [[t for t, _ in g] for g in plain[: len(PROMPTS)]]
    assert len(e.spec.drafts) == 0  # none left behind by finished sequences


def _pit(probs: torch.Tensor, token: int, u: float) -> float:
    """Randomised probability integral transform of ``token`` under ``probs``: uniform on (0, 1) when the token is
    drawn from ``probs``."""
    return float(probs[:token].sum() + u * probs[token])


def test_sampled_tokens_follow_the_target_distribution(tmp_path):
    """400 samples at temperature 1 with 2 draft tokens: tokens 2 and 3 (the first ones speculation proposes and
    verifies) are transformed by the target's exact conditional CDF (a plain forward); the 800 values are uniform
    (chi-square over 10 bins, 9 dof, p > 0.001; fixed seeds, so not flaky)."""
    path = make_tiny_checkpoint(tmp_path / "q", family="deepseek_v3", seed=1)
    model = make_echo_model(load_model(path, dtype=torch.float32, device="cpu"), scale=4.0, sharpness=8.0,
                            target_sharpness=4.0)  # the target echoes ~70% at T = 1, the draft proposes it ~100%
    prompt = [5, 9, 13, 200, 7]
    e = _engine(model, 2, max_running=64, max_batched_tokens=512)
    opts = [SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True, seed=1000 + i) for i in range(400)]
    out = [g[0] for g in e.generate([prompt] * 400, opts)]
    assert e.spec.stats()["spec_accept_len"] > 1.5
    seqs = torch.tensor([prompt + c.token_ids[:3] for c in out])
    with torch.no_grad():
        probs = torch.softmax(model.logits(seqs).double(), dim=-1)
    rng = np.random.default_rng(0)
    n = len(prompt)
    values = [_pit(probs[i, n - 1 + j], int(seqs[i, n + j]), rng.random()) for i in range(len(out)) for j in (1, 2)]
    counts = np.histogram(values, bins=10, range=(0, 1))[0]
    expected = len(values) / 10
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 27.9, (chi2, counts)  # the 0.999 quantile of chi-square with 9 dof


def test_refused_for_a_model_without_mtp_layers(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "q", family="qwen3", seed=1)
    with pytest.raises(ValueError, match="--speculative-tokens needs a model with MTP layers"):
        _engine(load_model(path, dtype=torch.float32, device="cpu"), 2)


@pytest.mark.parametrize("extra,message", [
    (["--kv-cache-dtype", "fp8"], "--speculative-tokens with --kv-cache-dtype fp8 is not built"),
    ([], "--speculative-tokens needs a model with MTP (multi-token-prediction) layers"),
])
def test_serve_refuses_the_flag_with_exit_2(tmp_path, capsys, extra, message):
    """`areno serve`: the combinations not built yet, and a checkpoint without MTP layers (qwen3), exit 2 naming it."""
    from areno.cli import main

    path = make_tiny_checkpoint(tmp_path / "q", family="qwen3", seed=1)
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--model-path", str(path), "--speculative-tokens", "2", *extra])
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["qwen3_5", "deepseek_v3", "bailing_hybrid"])
def test_greedy_equals_plain_decoding_on_the_gpu(tmp_path, family):
    """The CPU test's check on the GPU's kernels (fp32 weights, eager decode for both engines)."""
    path = make_tiny_checkpoint(tmp_path / family, family=family, seed=1)
    model = make_echo_model(load_model(path, dtype=torch.float32, device="cuda"), scale=2.0)
    opts = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True, n=2)
    out = {}
    for k in (0, 2):
        e = _engine(model, k, eager_decode=True)
        out[k] = [[c.token_ids for c in g] for g in e.generate(PROMPTS, opts)]
    assert out[2] == out[0]
    assert e.spec.stats()["spec_accept_len"] > 1.1
