"""The speculative-decoding gate (``--speculative-disable-by-batch-size``, areno.engine.spec_gate) on tiny
DeepSeek-V3 checkpoints: across gate transitions (sequences finishing at different lengths, requests added mid-run)
greedy tokens and log-probs equal the plain engine's and the gated steps are the ones the threshold implies; a gated
step samples at temperature 1 exactly what a plain step does; the MTP layer's paged K/V covers the positions gated
steps computed (a fresh prefill of the same tokens is the oracle); with a draft that predicts the target exactly every
draft after the gate lifts is accepted; ``auto`` resolves from the roofline (a number on the CPU) and follows the
accept length; bad values and the
flag without --speculative-tokens are refused naming it; preemption under the gate keeps greedy tokens."""

import asyncio
import time

import numpy as np
import pytest
import torch

from areno.config import ConfigError, SamplingParams, ServeConfig
from areno.engine import spec_gate
from areno.engine.async_engine import AsyncEngine
from areno.engine.engine import Engine, EngineConfig
from areno.engine.kv_cache import kv_bytes_per_block
from areno.engine.spec_gate import AUTO_FALLBACK, Gate, auto_gate, decode_counts, draft_flops
from areno.models import load_model
from areno.models.mtp import build_mtp_draft
from areno.platform.roofline import H100, H200, Roofline, roofline_of
from areno.testing import make_tiny_checkpoint
from tests.helpers.mtp import GATE_PROMPTS as PROMPTS
from tests.helpers.mtp import make_echo_model, run_with_arrivals

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ds"), family="deepseek_v3", seed=1)


@pytest.fixture(scope="module")
def echo(checkpoint):
    return make_echo_model(load_model(checkpoint, dtype=torch.float32, device="cpu"), scale=2.0)


def _engine(model, k, gate="auto", **kw):
    kw = {"block_size": 4, "max_running": 8, "max_batched_tokens": 64, **kw}
    return Engine(model, None, EngineConfig(speculative_tokens=k, speculative_disable_by_batch_size=gate, **kw),
                  eos_token_ids=[])


def _greedy(n):
    return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_5"])
def test_greedy_equals_plain_decoding_across_gate_transitions(echo, family, tmp_path):
    """DeepSeek-V3 (MLA, MoE) and Qwen3.5 (gated DeltaNet: recurrent states rolled back after rejections)."""
    if family != "deepseek_v3":
        path = make_tiny_checkpoint(tmp_path / family, family=family, seed=1)
        echo = make_echo_model(load_model(path, dtype=torch.float32, device="cpu"), scale=2.0)
    plain = run_with_arrivals(_engine(echo, 0))
    e = _engine(echo, 2, gate=2)
    gated = run_with_arrivals(e)
    assert [t for t, _ in gated] == [t for t, _ in plain]
    for (_, a), (_, b) in zip(gated, plain):
        np.testing.assert_allclose(a, b, atol=1e-4)
    stats = e.spec.stats()
    assert stats["spec_gated_steps"] > 0 and stats["verify_rows"] > 0 and stats["spec_accept_len"] > 1.05
    assert stats["drafted"] == stats["verify_rows"]  # drafts are made only for a step that speculates


@pytest.mark.parametrize("limit", [1, 2])
def test_the_gated_steps_are_those_the_threshold_implies(echo, limit):
    """Four sequences prefilled in one step, then decoding with no arrivals: the steps where more than N decode are
    plain, one token a sequence each, so they last until the (4 - N)-th shortest output is complete: its length - 1
    steps (its first token came from the prefill)."""
    news = [3, 6, 12, 20]
    e = _engine(echo, 2, gate=limit)
    out = e.generate(PROMPTS, [_greedy(n) for n in news])
    assert [len(g[0].token_ids) for g in out] == news
    assert e.spec.stats()["spec_gated_steps"] == sorted(news)[len(news) - limit - 1] - 1
    assert _engine(echo, 2, gate="off").spec.limit is None and _engine(echo, 2, gate=0).spec.limit is None


def test_preemption_under_the_gate_keeps_greedy_tokens(echo):
    """A cache small enough to preempt (n = 2 samples of three prompts, ten blocks): the preempted sequences' held
    catch-up is dropped and recomputed with them; greedy tokens equal the plain engine's."""
    opts = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True, n=2)
    plain = [[c.token_ids for c in g] for g in _engine(echo, 0, max_running=6).generate(PROMPTS[:3], opts)]
    kw = {"gate": 2, "max_running": 6, "max_batched_tokens": 12}
    reserved = _engine(echo, 2, **kw).spec_budget.reserved  # the deferred catch-ups' rows, out of the budget
    budget = 10 * kv_bytes_per_block(echo, 4, torch.float32, extra_layers=1) + reserved
    e = _engine(echo, 2, **kw, kv_cache_memory=budget)
    assert [[c.token_ids for c in g] for g in e.generate(PROMPTS[:3], opts)] == plain
    stats = e.spec.stats()
    assert e.scheduler.num_preemptions > 0 and stats["spec_gated_steps"] > 0 and stats["verify_rows"] > 0


def test_a_gated_step_samples_what_a_plain_step_does(echo):
    """Temperature 1, seeded: every step gated (N = 1, four sequences of equal length) gives the plain engine's tokens
    token for token (the verify step's bonus draw is plain sampling's noise); so does the engine's rebuilt runner."""
    opts = [SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True, seed=40 + i) for i in range(4)]
    plain = [g[0].token_ids for g in _engine(echo, 0).generate(PROMPTS, opts)]
    e = _engine(echo, 2, gate=1)
    assert [g[0].token_ids for g in e.generate(PROMPTS, opts)] == plain
    assert e.spec.stats()["verify_rows"] == 0 and e.spec.stats()["spec_gated_steps"] == 7
    e.drop_rollout_state()  # a rebuilt runner keeps the draft and the gate
    assert [g[0].token_ids for g in e.generate(PROMPTS, opts)] == plain
    assert e.spec.limit == 1 and e.spec.stats()["spec_gated_steps"] == 7


def test_gated_chains_sample_with_penalties_as_plain_steps(echo):
    """Every step gated (N = 1, four sequences of equal length) with repetition/frequency/presence penalties, seeded
    temperature 1: the gated chains (plain multi-step decode, penalty slots per chain) give the plain engine's tokens
    and log-probs."""
    opts = [SamplingParams(temperature=1.0, max_new_tokens=21, ignore_eos=True, seed=50 + i,
                           repetition_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.1) for i in range(4)]
    plain = _engine(echo, 0).generate(PROMPTS, opts)
    e = _engine(echo, 2, gate=1)
    out = e.generate(PROMPTS, opts)
    assert [g[0].token_ids for g in out] == [g[0].token_ids for g in plain]
    for g, h in zip(out, plain):
        np.testing.assert_allclose(g[0].logprobs, h[0].logprobs, atol=1e-4)
    assert e.step_counts["chained"] > 0 and e.spec.stats()["verify_rows"] == 0


def _mtp_kv(engine, seq, n):
    """The MTP layer's cached entries of ``seq``'s positions 0..n-1 ([n, ...] per cache tensor)."""
    bs, table = engine.config.block_size, seq.block_table
    blocks = torch.tensor([table[p // bs] for p in range(n)])
    offs = torch.tensor([p % bs for p in range(n)])
    return engine.spec.mtp_cache[:, blocks, offs]


@pytest.mark.parametrize("defer_rows", [None, 2])
def test_gated_steps_keep_the_mtp_cache_whole(checkpoint, defer_rows):
    """The random MTP layer (its attention reads its own K/V): after gated steps (their catch-up deferred, run when
    the gate lifts, or every time more than 2 rows are held) and speculating ones, the MTP K/V at every computed
    position of a running sequence equals a fresh engine's after prefilling the same tokens."""
    model = load_model(checkpoint, dtype=torch.float32, device="cpu")
    e = _engine(model, 2, gate=1)
    e.spec.deferred.rows = defer_rows or e.spec.deferred.rows
    seqs = [e.add_request(p, _greedy(n))[0] for p, n in zip(PROMPTS[:3], (4, 6, 30))]
    held, blind = 0, set()
    while not seqs[1].is_finished or e.spec.counts["verify_rows"] < 3:
        e.step()
        held = max(held, sum(d[2] for d in e.spec.deferred.held.values()))
        blind |= set(e.spec.deferred.blind)
    # the two shorter ones finish while gated: only the third holds its rows (5 gated steps), the others turn blind
    assert (held <= 2 if defer_rows else held >= 4) and not e.spec.deferred.held, held  # deferred, then run
    assert seqs[1].seq_id in blind <= {seqs[0].seq_id, seqs[1].seq_id} and not e.spec.deferred.blind  # pruned
    seq = seqs[2]
    assert e.spec.counts["spec_gated_steps"] >= 4 and not seq.is_finished
    n = seq.num_computed
    fresh = _engine(model, 2, gate="off")
    (ref,) = fresh.add_request(list(seq.tokens[: n + 1]), _greedy(2))
    fresh.step()
    torch.testing.assert_close(_mtp_kv(e, seq, n), _mtp_kv(fresh, ref, n), atol=1e-4, rtol=1e-4)


def test_gated_chains_queued_ahead_keep_tokens_and_the_mtp_cache(checkpoint, echo):
    """Lookahead (generate()'s default on CUDA): a gated chain is queued before the host reads the one in flight,
    its hidden rows copied on the stream before the queued chain replays. Greedy tokens and log-probs equal the
    plain engine's across gate transitions (rows finishing, requests arriving), the gated steps are the threshold's,
    and the MTP K/V of every computed position equals a fresh prefill's once the gate has lifted."""
    def queued_launches(e):
        launch, queued = e.runner.launch_decode_steps, []
        e.runner.launch_decode_steps = lambda *a, **kw: (queued.append(kw.get("ids_from") is not None)
                                                         or launch(*a, **kw))
        return queued

    news = [20, 30, 60]
    plain = _engine(echo, 0).generate(PROMPTS[:3], [_greedy(n) for n in news])
    e = _engine(echo, 2, gate=1, lookahead=True)
    queued = queued_launches(e)
    out = e.generate(PROMPTS[:3], [_greedy(n) for n in news])
    assert [g[0].token_ids for g in out] == [g[0].token_ids for g in plain] and any(queued)
    for g, h in zip(out, plain):
        np.testing.assert_allclose(g[0].logprobs, h[0].logprobs, atol=1e-4)
    assert e.spec.stats()["spec_gated_steps"] == sorted(news)[1] - 1 and e.chains.ahead is None
    assert 0 < e.step_counts["ahead"] < e.step_counts["chained"]  # gated chains queued behind one in flight, counted
    # sampled, one row stopping on a token mid-run (while a chain is queued: the queued chain's rows map to the
    # live ones of the chain in flight); once the gate lifts speculation samples its own tokens, so the oracle is
    # the same engine without the lookahead
    opts = [SamplingParams(temperature=1.0, max_new_tokens=n + 20, ignore_eos=True, seed=60 + i)
            for i, n in enumerate(news)]
    first = _engine(echo, 0).generate(PROMPTS[:3], opts)[0][0].token_ids
    opts[0] = SamplingParams(temperature=1.0, max_new_tokens=40, ignore_eos=True, seed=60, stop_token_ids=[first[21]])
    plain = _engine(echo, 2, gate=1, lookahead=False).generate(PROMPTS[:3], opts)
    e = _engine(echo, 2, gate=1, lookahead=True)
    queued = queued_launches(e)
    out = e.generate(PROMPTS[:3], opts)
    assert [g[0].token_ids for g in out] == [g[0].token_ids for g in plain] and any(queued)
    assert out[0][0].finish_reason == "stop"
    # arrivals mid-run: steps driven one by one with the lookahead on, as generate() does
    e = _engine(echo, 2, gate=2)
    e.chains.lookahead = True
    queued = queued_launches(e)
    gated = run_with_arrivals(e, news=(3, 40, 50, 60), late=(8, 6), after=6)
    ref = run_with_arrivals(_engine(echo, 0), news=(3, 40, 50, 60), late=(8, 6), after=6)
    assert [t for t, _ in gated] == [t for t, _ in ref] and any(queued)
    # the MTP layer's K/V after queued gated chains and speculating steps (the random MTP layer reads its own K/V)
    model = load_model(checkpoint, dtype=torch.float32, device="cpu")
    e = _engine(model, 2, gate=1)
    e.chains.lookahead = True
    queued = queued_launches(e)
    seqs = [e.add_request(p, _greedy(n))[0] for p, n in zip(PROMPTS[:3], news)]
    while not seqs[1].is_finished or e.spec.counts["verify_rows"] < 3:
        e.step()
    assert any(queued) and not seqs[2].is_finished
    seq, n = seqs[2], seqs[2].num_computed
    fresh = _engine(model, 2, gate="off")
    (ref_seq,) = fresh.add_request(list(seq.tokens[: n + 1]), _greedy(2))
    fresh.step()
    torch.testing.assert_close(_mtp_kv(e, seq, n), _mtp_kv(fresh, ref_seq, n), atol=1e-4, rtol=1e-4)


def test_every_draft_after_the_gate_is_accepted_when_the_draft_is_exact(checkpoint):
    """A target that always repeats its input token and a draft that proposes it: once the batch shrinks to N, the
    next step already verifies drafts and accepts every one of them, as an ungated engine does."""
    model = make_echo_model(load_model(checkpoint, dtype=torch.float32, device="cpu"), scale=30.0)
    news = [3, 5, 16, 16]
    for gate in ("off", 2):
        e = _engine(model, 3, gate=gate)
        out = e.generate(PROMPTS, [_greedy(n) for n in news])
        assert all(set(g[0].token_ids) == {p[-1]} for g, p in zip(out, PROMPTS))  # the target echoes
        s = e.spec.stats()
        assert s["proposed"] > 0 and s["emitted"] - s["verify_rows"] == s["proposed"], (gate, s)
    assert s["spec_gated_steps"] == news[1] - 1  # plain while three or four decode, then speculating at once


def test_auto_is_the_roofline_rule(checkpoint, echo):
    """Weight bytes over FLOPs a token against the ridge (T), a draft step's FLOPs over the target's (mu): N(a) =
    T (a - K mu) / (K + 1), 0 below a = 1 + K mu; a fixed value without a roofline (the CPU)."""
    assert _engine(echo, 2).spec.limit == AUTO_FALLBACK  # auto, on the CPU
    assert roofline_of("NVIDIA H200") is H200 and roofline_of("NVIDIA H100 80GB HBM3") is H100
    assert roofline_of("NVIDIA A10G") is None and auto_gate(echo, 2, None)[0] == Gate(2, AUTO_FALLBACK)
    nbytes, flops = decode_counts(echo)
    # the oracle: fp32 parameters (4 bytes) read once; 2 FLOPs each a token, a routed expert's at top-k / experts
    params = {n: p for n, p in echo.named_parameters() if not n.startswith("mtp.")}
    if not echo.config.tie_word_embeddings:
        params.pop("embed_tokens.weight")
    share = echo.moe_top_k / echo.config.num_experts
    assert nbytes == 4 * sum(p.numel() for p in params.values())
    expected = sum(2 * p.numel() * (share if ".experts." in n else 1.0) for n, p in params.items())
    assert flops == pytest.approx(expected)
    assert flops < nbytes / 2  # an MoE: fewer FLOPs than parameters
    # a draft step: the MTP layer as the draft runs it (its own head here; no embedding: rows gathered)
    draft = build_mtp_draft(echo)
    assert draft.head is not None
    oracle = sum(2 * p.numel() * (share if "experts" in n and "shared" not in n else 1.0)
                 for n, p in draft.named_parameters() if not n.startswith("embed."))
    assert draft_flops(echo) == pytest.approx(oracle)
    for k in (1, 3):
        gate, why = auto_gate(echo, k, H200)
        t, mu = 790 / 4.3 * nbytes / flops, oracle / flops
        assert gate.tokens == pytest.approx(t) and gate.draft == pytest.approx(mu) and "H200" in why
        for a in (1.0, 1.0 + k * mu + 0.5, k + 1.0):
            n = int(t * (a - k * mu) // (k + 1)) if a >= 1 + k * mu else 0
            assert gate.at(a) == n
        assert gate.most == gate.at(k + 1) and gate.least == 0 and gate.limit() == gate.most  # the prior: K + 1
        assert gate.limit(8, 8) == gate.at((8 + 8 * (k + 1)) / 16)  # accept 1 over 8 rows, against the prior's 8
    fixed = Gate(2, 5)
    assert fixed.limit(0, 100) == fixed.most == fixed.least == 5


def _test_roofline(model, tokens: float) -> Roofline:
    """A roofline whose ridge makes T = ``tokens`` for ``model``."""
    nbytes, flops = decode_counts(model)
    return Roofline("TEST", tokens * flops / nbytes * 1e12, 1e12)


def test_auto_weighs_a_hybrids_state_traffic(tmp_path, monkeypatch):
    """A hybrid's decode row reads and writes its recurrent-state slot (sigma token-times: 2 x slot bytes x ridge /
    FLOPs a token), a verify row reads it once and the rollback's replay reads and writes it once more (3/2 sigma,
    accepted or not): N(a) is the largest batch with a plain(B) >= speculative(B) (the batches that pay are those up
    to it), the closed form without states; a prompt chunk's step weighs the same costs. The engine gives a Qwen3.5
    its slot's bytes."""
    from areno.engine.kv_cache import state_bytes

    def oracle(t, sigma, mu, k, a):
        plain = lambda b: max(t + b * sigma, b)  # noqa: E731
        spec = lambda b: max(t + b * sigma * 1.5, b * (k + 1)) + k * mu * max(t, b)  # noqa: E731
        pays = [a * plain(b) >= spec(b) for b in range(1, 4097)]
        n = max((b for b, p in enumerate(pays, 1) if p), default=0)
        assert all(pays[:n])  # a prefix
        return n

    for t, sigma, mu, k in ((184.0, 1.02, 0.115, 2), (263.0, 1.46, 0.115, 2), (60.0, 0.3, 0.05, 3), (184, 0, 0.1, 2)):
        gate = Gate(k, None, t, mu, state=sigma)
        for a in (1.0, 1.3, 1.5, 1.86, 2.2, k + 1.0):
            n = oracle(t, sigma, mu, k, a)  # 4096: it pays at every batch tried (unbounded but for the stash's cap)
            assert gate.at(a) == n if n < 4096 else gate.at(a) >= 4096, (t, sigma, a)
        closed = Gate(k, None, t, mu)
        assert [closed.at(a) for a in (1.3, 2.2)] == [int(t * (a - k * mu) // (k + 1)) for a in (1.3, 2.2)]
    gate = Gate(2, None, 184.0, 0.115, state=1.02)
    assert gate.at(3.0) > 10 * Gate(2, None, 184.0, 0.115).at(3.0)  # the state reads keep a plain step memory-bound
    for b, p, f, emitted, rows in [(64, 8128, 256, 0, 0), (4, 2000, 5, 30, 20), (20, 100, 40, 20, 20)]:
        a = (emitted + 24) / (rows + 8)
        extra = (max(184 + b * 1.02 * 1.5, 3 * b + p) + 0.23 * max(184, b)) - max(184 + b * 1.02, b + p)
        assert gate.speculates(b, p, f, emitted, rows) == (extra <= b * (a - 1) * max(184 + f * 1.02, f) / f)
    path = make_tiny_checkpoint(tmp_path / "q", family="qwen3_5", seed=1)
    model = make_echo_model(load_model(path, dtype=torch.float32, device="cpu"), scale=2.0)
    roof = _test_roofline(model, 14.0)
    monkeypatch.setattr(spec_gate, "device_roofline", lambda device: roof)
    gate = _engine(model, 2, eager_decode=True).spec.gate
    slot, (_, flops) = state_bytes(model, 1, torch.float32), decode_counts(model)
    assert slot > 0 and gate.state == pytest.approx(2 * slot * roof.ridge / flops)
    assert gate == auto_gate(model, 2, roof, slot)[0] and auto_gate(model, 2, roof)[0].state == 0


def test_auto_weighs_a_steps_prompt_tokens():
    """``Gate.speculates``: a fixed N and a step without prompt tokens compare the decoding count with N; under
    ``auto`` a step with prompt tokens speculates where the verify rows' extra token-times (max(T, B (K + 1) + P) -
    max(T, B + P) + K mu max(T, B)) are at most what the B (a - 1) extra tokens cost later (max(T, F) / F each, F the
    sequences decoding once the prompts are in)."""
    gate = Gate(2, None, 184.0, 0.115)  # the 9B bench shape on the H200: N(3) = 169
    for b in (1, 50, 169, 170, 300):
        assert gate.speculates(b) == (b <= gate.most) and Gate(2, 60).speculates(b, 5000, 256) == (b <= 60)
    assert gate.speculates(0, 8192, 256)  # nothing decodes: nothing to gate
    assert not gate.speculates(64, 8128, 256)  # a rollout's admission: 256 prompts, 64 of them decoding
    assert gate.speculates(4, 2000, 5)  # a server: a new prompt beside four streams
    assert not gate.speculates(170, 10, 170)  # above N(3): the stash and graphs hold no more
    cases = [(64, 8128, 256, 0, 0), (4, 2000, 5, 30, 20), (20, 100, 40, 20, 20), (8, 64, 8, 0, 0)]
    for b, p, f, emitted, rows in cases:
        a = (emitted + 24) / (rows + 8)
        extra = max(184, 3 * b + p) - max(184, b + p) + 2 * 0.115 * max(184, b)
        assert gate.speculates(b, p, f, emitted, rows) == (extra <= b * (a - 1) * max(184, f) / f)


def test_a_prompt_chunk_gates_a_step_under_auto(checkpoint, monkeypatch):
    """On a test roofline (T = 14): two sequences decode speculatively; eight 40-token prompts then arrive, and
    the steps that prefill them beside the two are gated (their verify rows would cost full compute for tokens
    the ten-sequence decode after them makes cheaply); greedy tokens equal the plain engine's throughout."""
    model = make_echo_model(load_model(checkpoint, dtype=torch.float32, device="cpu"), scale=30.0)
    roof = _test_roofline(model, 14.0)
    monkeypatch.setattr(spec_gate, "device_roofline", lambda device: roof)
    prompts = [[7 + i] * 40 for i in range(8)]

    def run(e):
        seqs = [e.add_request(p, _greedy(24))[0] for p in PROMPTS[:2]]
        for _ in range(3):
            e.step()
        seqs += [e.add_request(p, _greedy(6))[0] for p in prompts]
        while e.has_work():
            e.step()
        return [s.output_ids for s in seqs]

    plain = run(_engine(model, 0, max_running=16))
    e = _engine(model, 2, max_running=16)
    calls, speculates = [], e.spec.gate.speculates
    monkeypatch.setattr(e.spec.gate.__class__, "speculates", lambda g, *a: calls.append((a[:3], speculates(*a))) or
                        calls[-1][1])
    assert run(e) == plain
    mixed = [(args, ok) for args, ok in calls if args[1] and args[0]]
    assert mixed and not any(ok for _, ok in mixed)  # every step with prompt tokens and decoding rows: gated
    assert any(ok for args, ok in calls if not args[1] and args[0] == 2)  # the two alone speculate


@pytest.mark.parametrize("scale", [0.5, 30.0])
def test_auto_follows_the_accept_length(checkpoint, scale, monkeypatch):
    """``auto`` on a roofline (a test one, T = 14): N starts at the prior's (every draft accepted: above the batch),
    so the first steps speculate. A draft the target mostly rejects (echo scale 0.5, accept ~1.2) brings the running
    accept length under 1 + K mu within the run and the remaining steps are plain; a draft it mostly accepts (scale
    30) keeps every step speculating. Either way greedy tokens and log-probs equal the plain engine's; take_stats
    starts a new window (N back at the prior's)."""
    model = make_echo_model(load_model(checkpoint, dtype=torch.float32, device="cpu"), scale=scale)
    roof = _test_roofline(model, 14.0)
    monkeypatch.setattr(spec_gate, "device_roofline", lambda device: roof)
    plain = run_with_arrivals(_engine(model, 0))
    e = _engine(model, 2)
    assert e.spec.gate.most >= 6 and e.spec.limit == e.spec.gate.most  # above run_with_arrivals' largest batch
    out = run_with_arrivals(e)
    assert [t for t, _ in out] == [t for t, _ in plain]
    for (_, a), (_, b) in zip(out, plain):
        np.testing.assert_allclose(a, b, atol=1e-4)
    s = e.spec.stats()
    assert s["verify_rows"] > 0
    if scale < 1:
        assert s["spec_accept_len"] < 1.5 and s["spec_gated_steps"] > 0 and e.spec.limit == 0
    else:
        assert s["spec_accept_len"] > 2.5 and s["spec_gated_steps"] == 0 and e.spec.limit >= 6
    end = e.spec.limit
    assert e.spec.take_stats()["spec_limit"] == end  # the window's last N, for the train metrics
    assert e.spec.limit == e.spec.gate.most


@pytest.mark.parametrize("server", [True, False])
def test_a_server_reopens_the_window_when_idle(checkpoint, server, monkeypatch):
    """``areno serve``'s engine (``ServeEngine``) restarts ``auto``'s window each time it runs dry, so a window whose
    drafts fell below break-even (N = 0: nothing more verified) probes again with the next requests; agentic
    rollout's ``AsyncEngine`` keeps its window (a function of its tokens) until ``take_stats``."""
    model = make_echo_model(load_model(checkpoint, dtype=torch.float32, device="cpu"), scale=0.5)
    roof = _test_roofline(model, 14.0)
    monkeypatch.setattr(spec_gate, "device_roofline", lambda device: roof)
    if server:
        pytest.importorskip("fastapi", reason="areno serve's engine needs the serve extra")
        from areno.serve.scoring import ServeEngine
    engine = _engine(model, 2)
    taken, take = [], engine.spec.take_stats
    monkeypatch.setattr(engine.spec, "take_stats", lambda: taken.append(take()) or taken[-1])
    aengine = (ServeEngine if server else AsyncEngine)(engine)

    async def serve(n=20):
        lengths = []
        for stream in [await aengine.submit(p, _greedy(n)) for p in PROMPTS]:
            lengths.append(len([ev async for ev in stream]))
        return lengths

    try:
        assert asyncio.run(serve()) == [20] * len(PROMPTS)
        deadline = time.monotonic() + 10
        while server and not taken and time.monotonic() < deadline:
            time.sleep(0.01)  # the engine thread reopens once it finds no work
    finally:
        aengine.close()
    if server:  # one window: the request's, ended gated (N = 0); the next starts from the prior
        assert len(taken) == 1 and taken[0]["spec_limit"] == 0 and taken[0]["spec_gated_steps"] > 0
        assert engine.spec.counts["verify_rows"] == 0 and engine.spec.limit == engine.spec.gate.most
        total = engine.spec.lifetime()  # the engine's totals outlive the window (areno serve's /metrics)
        assert total["verify_rows"] > 0 and total["spec_gated_steps"] == taken[0]["spec_gated_steps"]
    else:
        assert not taken and engine.spec.counts["spec_gated_steps"] > 0 and engine.spec.limit == 0


@pytest.mark.parametrize("value,ok", [("auto", "auto"), ("off", 0), ("0", 0), ("12", 12), (5, 5), ("-1", None),
                                      ("fast", None), (True, None), (-2, None)])
def test_serve_flag_values(value, ok, tmp_path):
    kw = dict(model_path=str(tmp_path), speculative_tokens=2, eager_decode=True)
    if ok is None:
        with pytest.raises(ConfigError, match="--speculative-disable-by-batch-size takes auto, off or an integer"):
            ServeConfig(speculative_disable_by_batch_size=value, **kw)
        return
    cfg = ServeConfig(speculative_disable_by_batch_size=value, **kw)
    engine = EngineConfig(speculative_tokens=2, **{k: v for k, v in cfg.lora_engine_kwargs().items()
                                                    if k == "speculative_disable_by_batch_size"})
    assert engine.speculative_disable_by_batch_size == ok


def test_refused_without_speculative_tokens(tmp_path, capsys):
    """`areno serve` and `areno train`: the gate without --speculative-tokens exits 2 naming it."""
    from areno.cli import main

    path = make_tiny_checkpoint(tmp_path / "q", family="qwen3", seed=1)
    (tmp_path / "r.py").write_text("def reward_fn(record):\n    return 0.0\n")
    for argv in (["serve", "--model-path", str(path)],
                 ["train", "--ckpt", str(path), "--dataset-path", "d.jsonl", "--algo", "grpo", "--reward-fn-path",
                  str(tmp_path / "r.py")]):
        with pytest.raises(SystemExit) as exc:
            main([*argv, "--speculative-disable-by-batch-size", "8"])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "--speculative-disable-by-batch-size applies only with --speculative-tokens" \
            in err, err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_5", "bailing_hybrid"])
def test_gate_transitions_keep_greedy_tokens_on_the_gpu(tmp_path, family):
    """The CPU test's transitions on the GPU's kernels (fp32 weights, eager decode for both engines), and ``auto``
    resolving from the GPU's roofline (H100 / H200: a number of its own, else the fixed value)."""
    path = make_tiny_checkpoint(tmp_path / family, family=family, seed=1)
    model = make_echo_model(load_model(path, dtype=torch.float32, device="cuda"), scale=2.0)
    plain = run_with_arrivals(_engine(model, 0, eager_decode=True))
    e = _engine(model, 2, gate=2, eager_decode=True)
    assert [t for t, _ in run_with_arrivals(e)] == [t for t, _ in plain]
    assert e.spec.stats()["spec_gated_steps"] > 0 and e.spec.stats()["verify_rows"] > 0
    roof = roofline_of(torch.cuda.get_device_name())
    gate, expected = _engine(model, 2, eager_decode=True).spec.gate, auto_gate(model, 2, roof)[0]
    assert (gate.fixed, gate.tokens) == (expected.fixed, pytest.approx(expected.tokens))  # (+ a hybrid's states)
    assert (gate.state > 0) == (family != "deepseek_v3" and roof is not None)


def test_auto_is_capped_where_the_rollback_stash_would_crowd_the_cache(tmp_path, monkeypatch):
    """A hybrid (Qwen3.5: recurrent states rolled back from a stash of K slots a speculating row): where the stash at
    auto's largest N would take more than half the budget left after the state slots (T = 10^6 here), the gate stops
    at the rows that half holds; with T = 14 it is not capped."""
    from areno.engine.kv_cache import state_bytes
    from areno.engine.spec_graphs import stash_bytes

    path = make_tiny_checkpoint(tmp_path / "q", family="qwen3_5", seed=1)
    model = make_echo_model(load_model(path, dtype=torch.float32, device="cpu"), scale=2.0)
    budget = 16 * 2**20
    fits = (budget - state_bytes(model, 8, torch.float32)) // 2 // stash_bytes(model, 1, 2, torch.float32)
    for tokens, cap in ((1e6, fits), (14.0, None)):
        roof = _test_roofline(model, tokens)
        monkeypatch.setattr(spec_gate, "device_roofline", lambda device: roof)  # noqa: B023
        gate = _engine(model, 2, kv_cache_memory=budget, eager_decode=True).spec.gate
        assert gate.fixed is None and gate.cap == cap and gate.tokens == pytest.approx(tokens)
        assert gate.most == fits if cap else gate.most < fits
