"""The rollout engine on tiny random checkpoints: parity with transformers, batching invariance, block accounting,
prefix sharing, preemption, stopping and continuous batching."""

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from areno.config import SamplingParams
from areno.engine.async_engine import AsyncEngine
from areno.engine.engine import Engine, EngineConfig
from areno.models import load_model, load_tokenizer
from areno.testing import make_tiny_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe", "llama", "olmo2", "olmo3", "gpt_oss", "gemma4_text"])
def family_ckpt(request, tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), family=request.param, seed=1)
    return request.param, path


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("q3"), family="qwen3", seed=2)
    model = load_model(path, dtype=torch.float32, device="cpu")
    return path, model, load_tokenizer(path)


def engine(model, tok, **kw):
    kw.setdefault("block_size", 4)
    kw.setdefault("max_running", 16)
    return Engine(model, tok, EngineConfig(**kw))


PROMPTS = ["hello world, 12 + 3 =", "the cat", "a", "tool call: {\"name\": \"add\"} and some longer text here"]


def test_greedy_matches_transformers_generate(family_ckpt):
    family, path = family_ckpt
    model = load_model(path, dtype=torch.float32, device="cpu")
    tok = load_tokenizer(path)
    prompts = [tok.encode(p) for p in PROMPTS]
    out = engine(model, tok).generate(prompts, GREEDY)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for p, group in zip(prompts, out):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(p):].tolist()
        assert group[0].token_ids == ref, family
        assert group[0].finish_reason == "length" and len(group[0].logprobs) == 10


def test_output_does_not_depend_on_the_batch(qwen3):
    _, model, tok = qwen3
    prompts = [tok.encode(p) for p in PROMPTS]
    alone = [engine(model, tok).generate([p], GREEDY)[0][0].token_ids for p in prompts]
    together = [g[0].token_ids for g in engine(model, tok, max_batched_tokens=7).generate(prompts, GREEDY)]
    assert alone == together


def test_logprobs_match_a_full_forward(qwen3):
    _, model, tok = qwen3
    p = tok.encode(PROMPTS[0])
    c = engine(model, tok).generate([p], SamplingParams(temperature=0.7, max_new_tokens=8, ignore_eos=True,
                                                         seed=3))[0][0]
    ids = torch.tensor([p + c.token_ids])
    logits = model.logits(ids)[0, len(p) - 1 : -1].double() / 0.7
    ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(c.logprobs, dtype=torch.float64), ref, atol=1e-4)


def test_blocks_return_after_finish_abort_and_preemption(qwen3):
    _, model, tok = qwen3
    # a cache so small that eight long sequences cannot all fit: the scheduler must preempt and recompute
    e = engine(model, tok, kv_cache_memory=80 * model.num_layers * 2 * 4 * model.num_kv_heads_local
               * model.head_dim * 4, max_running=8)
    assert e.blocks.num_blocks == 80
    prompts = [tok.encode(p) for p in PROMPTS] * 2
    opts = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    out = e.generate(prompts, opts)
    assert e.scheduler.num_preemptions > 0
    assert e.blocks.num_free == e.blocks.num_blocks
    ref = engine(model, tok).generate(prompts, opts)
    assert [g[0].token_ids for g in out] == [g[0].token_ids for g in ref]
    seqs = e.add_request(prompts[0], SamplingParams(max_new_tokens=30, n=3))
    e.step()
    e.step()
    e.abort(seqs)
    assert all(s.finish_reason == "abort" for s in seqs) and not e.has_work()
    assert e.blocks.num_free == e.blocks.num_blocks


def test_n_samples_share_the_prompt_blocks(qwen3):
    _, model, tok = qwen3
    prompt = tok.encode(PROMPTS[3] * 3)
    e = engine(model, tok)
    seqs = e.add_request(prompt, SamplingParams(temperature=1.0, max_new_tokens=6, n=4, seed=0))
    e.step()  # the prefill, and every sample's first token
    shared = len(prompt) // 4  # full prompt blocks, one copy for all four samples
    assert e.blocks.num_used < 4 * (shared + 1)
    assert len(set(tuple(s.block_table[:shared]) for s in seqs)) == 1
    while e.has_work():
        e.step()
    forked = [s.output_ids for s in seqs]
    assert e.blocks.num_free == e.blocks.num_blocks
    # each sample equals the same seed's sample generated without sharing
    for s in seqs:
        solo = engine(model, tok, prefix_caching=False)
        (one,) = solo.add_request(prompt, SamplingParams(temperature=1.0, max_new_tokens=6, n=1))
        one.seed = s.seed
        while solo.has_work():
            solo.step()
        assert one.output_ids == s.output_ids
    assert len(set(map(tuple, forked))) > 1


def test_prefix_cache_reuses_blocks_across_requests(qwen3):
    _, model, tok = qwen3
    e = engine(model, tok)
    prefix = tok.encode(PROMPTS[3] * 2)
    first = e.generate([prefix + tok.encode(" one")], GREEDY)[0][0]
    hits = e.blocks.prefix_hits
    second = e.generate([prefix + tok.encode(" two")], GREEDY)[0][0]
    assert e.blocks.prefix_hits - hits >= (len(prefix) // 4) * 4
    cold = engine(model, tok, prefix_caching=False).generate([prefix + tok.encode(" two")], GREEDY)[0][0]
    assert second.token_ids == cold.token_ids and first.token_ids


def test_stop_ids_and_stop_strings(qwen3):
    _, model, tok = qwen3
    p = tok.encode(PROMPTS[1])
    free = engine(model, tok).generate([p], GREEDY)[0][0]
    stop_id = free.token_ids[3]
    c = engine(model, tok).generate([p], SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=[stop_id],
                                                         ignore_eos=True))[0][0]
    assert c.finish_reason == "stop" and c.token_ids == free.token_ids[: free.token_ids.index(stop_id) + 1]
    text = tok.decode(free.token_ids, skip_special_tokens=True)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    c = engine(model, tok).generate([p], SamplingParams(temperature=0.0, max_new_tokens=10, stop=[stop],
                                                         ignore_eos=True))[0][0]
    assert c.finish_reason == "stop" and c.stop_text == stop
    assert c.text == text[: text.index(stop)]
    c = engine(model, tok).generate([p], SamplingParams(temperature=0.0, max_new_tokens=3, min_new_tokens=3,
                                                         stop_token_ids=[free.token_ids[0]], ignore_eos=True))[0][0]
    assert c.finish_reason == "length" and len(c.token_ids) == 3


def test_short_request_finishes_while_long_ones_decode(qwen3):
    _, model, tok = qwen3
    e = engine(model, tok, max_running=8)
    ae = AsyncEngine(e)

    async def main():
        long = [await ae.submit(tok.encode(p), SamplingParams(max_new_tokens=120, ignore_eos=True))
                for p in PROMPTS[:3]]
        order, started = [], asyncio.Event()

        async def drain(name, stream):
            async for ev in stream:
                started.set()
                if ev.finish_reason:
                    order.append(name)

        tasks = [asyncio.create_task(drain("long", s)) for s in long]
        await started.wait()  # the long ones are decoding now
        probe = await ae.submit(tok.encode("x"), SamplingParams(max_new_tokens=2, ignore_eos=True))
        await drain("probe", probe)
        await asyncio.gather(*tasks)
        return order

    order = asyncio.run(main())
    ae.shutdown()
    assert order[0] == "probe" and order.count("long") == 3
    assert e.blocks.num_free == e.blocks.num_blocks


def test_multi_step_decode_gives_the_single_step_tokens(qwen3):
    """decode_steps=k chains k decode steps on the device: same tokens and log-probs as one step at a time (same
    noise per (seed, position)), stops honoured mid-chain (the surplus tokens dropped), every block returned; with
    the lookahead (generate() queues the next chain, its input tokens read on the device, before reading the
    current one: rows that stop meanwhile drop the queued tokens) and without it."""
    _, model, tok = qwen3
    prompts = [tok.encode(p) for p in PROMPTS]
    sampled = [SamplingParams(temperature=1.0, max_new_tokens=m, ignore_eos=True, n=3, seed=11 + i)
               for i, m in enumerate((13, 6, 1, 9))]
    ref = engine(model, tok).generate(prompts, sampled)
    # stop on a token that one sample draws at its 3rd position, another stop string, a min_new_tokens
    stop_id = ref[0][1].token_ids[2]
    stop_text = tok.decode(ref[3][0].token_ids[4:6])
    opts = [SamplingParams(temperature=1.0, max_new_tokens=13, ignore_eos=True, n=3, seed=11,
                            stop_token_ids=[stop_id]),
            sampled[1], sampled[2],
            SamplingParams(temperature=1.0, max_new_tokens=9, n=3, seed=14, stop=[stop_text], min_new_tokens=2)]
    # min_new_tokens adjusts the logits per chain on the host, so ``opts`` never looks ahead; without it a sample
    # stops on its stop id inside the first chain while the next one is already queued
    ahead = [opts[0], sampled[1], sampled[2],
             SamplingParams(temperature=1.0, max_new_tokens=9, n=3, seed=14, stop=[stop_text])]
    looked = {True: [], False: [], None: []}  # None (the default): on CUDA devices only
    for case in (sampled, opts, ahead):
        single = engine(model, tok).generate(prompts, case)
        for lookahead in (True, False, None):
            eng = engine(model, tok, decode_steps=4, lookahead=lookahead)
            chains = []
            launch = eng.runner.launch_decode_steps
            eng.runner.launch_decode_steps = lambda *a, run=launch, chains=chains, **kw: (
                chains.append((a[2], kw.get("ids_from") is not None)) or run(*a, **kw))
            multi = eng.generate(prompts, case)
            assert chains and {k for k, _ in chains} == {4}
            looked[lookahead].append(sum(queued for _, queued in chains))  # chains fed by the device's tokens
            for g1, g2 in zip(single, multi):
                for a, b in zip(g1, g2):
                    assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
                    assert a.stop_text == b.stop_text and a.text == b.text
                    torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs))
            assert eng.blocks.num_free == eng.blocks.num_blocks and not eng.has_work()
    assert looked[False] == looked[None] == [0, 0, 0]
    assert looked[True][0] > 0 and looked[True][1] == 0 and looked[True][2] > 0
    assert any(c.finish_reason == "stop" for g in single for c in g)
    # near the end of the context the chain falls back to single steps
    ctx = engine(model, tok, decode_steps=8, max_model_len=len(prompts[0]) + 5)
    out = ctx.generate([prompts[0]], SamplingParams(temperature=1.0, max_new_tokens=5, ignore_eos=True, seed=3))
    assert out[0][0].token_ids == engine(model, tok, max_model_len=len(prompts[0]) + 5).generate(
        [prompts[0]], SamplingParams(temperature=1.0, max_new_tokens=5, ignore_eos=True, seed=3))[0][0].token_ids


def test_lookahead_under_preemption_with_forks_and_a_reused_prefix(qwen3):
    """Lookahead where blocks run short (a reservation ahead fails, the scheduler preempts between chains), with
    forked samples that may stop on EOS mid-chain, and a second call that reuses the first one's cached prefixes:
    the tokens of single steps with a roomy cache, every block returned, chains queued ahead in both calls."""
    _, model, tok = qwen3
    small = 80 * model.num_layers * 2 * 4 * model.num_kv_heads_local * model.head_dim * 4  # 80 blocks of 4
    prompts = [tok.encode(p) for p in PROMPTS] * 2
    opts = [SamplingParams(temperature=1.0, max_new_tokens=30, n=2, seed=60 + i) for i in range(len(prompts))]
    ref = [[c.token_ids for c in g] for g in engine(model, tok).generate(prompts, opts)]
    e = engine(model, tok, kv_cache_memory=small, decode_steps=4, lookahead=True)  # (auto: CUDA only)
    queued = []
    launch = e.runner.launch_decode_steps
    e.runner.launch_decode_steps = lambda *a, run=launch, **kw: queued.append("ids_from" in kw) or run(*a, **kw)
    for call in range(2):
        hits, ahead = e.blocks.prefix_hits, e.step_counts["ahead"]
        out = [[c.token_ids for c in g] for g in e.generate(prompts, opts)]
        assert out == ref, call
        assert e.blocks.num_free == e.blocks.num_blocks and not e.has_work()
        assert any(queued) and not all(queued)
        assert e.step_counts["ahead"] - ahead == 4 * sum(queued)  # the steps the lookahead queued, counted
        queued.clear()
    assert e.scheduler.num_preemptions > 0 and e.blocks.prefix_hits > hits


@pytest.mark.gpu
def test_multi_step_cuda_graph_matches_single_step_graphs(tmp_path):
    """On the GPU (bf16, CUDA graphs): k decode steps in one graph give the tokens and log-probs of k one-step
    graph replays, for a batch that is not a graph bucket size (padding rows) and samples that stop early."""
    path = make_tiny_checkpoint(tmp_path, family="qwen3", seed=3)
    model = load_model(path, dtype=torch.bfloat16, device="cuda")
    tok = load_tokenizer(path)
    prompts = [tok.encode(p) for p in PROMPTS] + [tok.encode("more text " * i) for i in range(1, 8)]
    opts = [SamplingParams(temperature=1.0, max_new_tokens=20 + 7 * i, n=2, seed=i, ignore_eos=i % 2 == 0)
            for i in range(len(prompts))]
    outs = []
    for k in (1, 8):
        eng = engine(model, tok, block_size=16, max_running=32, decode_steps=k)
        outs.append(eng.generate(prompts, opts))
        assert eng.runner.last_step_used_graph and any(key[1] == k for key in eng.runner.graphs)
    for g1, g2 in zip(*outs):
        for a, b in zip(g1, g2):
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
            assert a.logprobs == b.logprobs


def test_requests_arriving_during_decode_wait_one_chain_at_most(qwen3):
    """With decode_steps=k, a request that arrives while others decode is admitted by the next step; a few arrivals
    (at most a quarter of the running count) then wait while the running ones decode k tokens in one chain (so steady
    arrivals do not hold every step to one token), and every request gets the tokens of a run where it arrived alone
    (noise keyed by seed and position)."""
    _, model, tok = qwen3
    prompts = [tok.encode(p) for p in PROMPTS] * 2
    opts = [SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=40 + i) for i in range(8)]
    alone = [engine(model, tok).generate([p], o)[0][0].token_ids for p, o in zip(prompts, opts)]
    eng = engine(model, tok, decode_steps=4)
    log = []
    run = eng.runner.launch_decode_steps
    eng.runner.launch_decode_steps = lambda *a, run=run, **kw: log.append(len(eng.scheduler.waiting)) or run(*a, **kw)
    seqs = [eng.add_request(p, o)[0] for p, o in zip(prompts[:4], opts[:4])]
    eng.step(4)  # prefill
    eng.step(4)  # a chain of 4
    for p, o in zip(prompts[4:], opts[4:]):  # one arrival per step from here on
        seqs += eng.add_request(p, o)
        eng.step(4)
    while eng.has_work():
        eng.step(4)
    assert max(log) == 1  # a chain ran while a request waited
    assert eng.step_counts["chained"] == 4 * len(log) and eng.step_counts["single"] > 0
    assert [s.tokens[s.prompt_len:] for s in seqs] == alone
    assert all(s.finish_reason == "length" for s in seqs)
    assert eng.blocks.num_free == eng.blocks.num_blocks


@pytest.mark.parametrize("lookahead", [False, True], ids=["chained", "lookahead"])
def test_a_full_batch_with_a_queue_behind_it_chains_decode_steps(qwen3, lookahead):
    """An evaluation queues thousands of samples behind a full batch: while no waiting group fits under max_running,
    the running ones decode in chains of k (and, with lookahead, the next chain is queued before the tokens are
    read), as if nothing waited; a group is admitted once its n slots are free. Every sample gets the tokens of a
    run with k = 1 (noise keyed by seed and position), lengths differing so that slots free at different steps."""
    _, model, tok = qwen3
    prompts = [tok.encode(p) for p in PROMPTS] * 2
    opts = [SamplingParams(temperature=1.0, max_new_tokens=5 + 3 * i, n=2, ignore_eos=True, seed=60 + i)
            for i in range(len(prompts))]
    plain = engine(model, tok, max_running=4).generate(prompts, opts)
    eng = engine(model, tok, max_running=4, decode_steps=4, lookahead=lookahead)
    waiting = []
    run = eng.runner.launch_decode_steps
    eng.runner.launch_decode_steps = lambda *a, run=run, **kw: waiting.append(len(eng.scheduler.waiting)) or run(
        *a, **kw)
    out = eng.generate(prompts, opts)
    assert max(waiting) >= 4  # chains ran with groups waiting that the full batch had no room for
    assert [[c.token_ids for c in g] for g in out] == [[c.token_ids for c in g] for g in plain]
    lp = lambda groups: torch.tensor([x for g in groups for c in g for x in c.logprobs])  # noqa: E731
    torch.testing.assert_close(lp(out), lp(plain), rtol=0, atol=1e-4)  # fp32 rows batched differently
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_async_engine_queues_groups_ahead_with_an_arrival_and_an_abort(qwen3):
    """AsyncEngine steps with the engine's lookahead (forced here; CUDA's default): streams decoding 4 steps a group
    get the tokens of generate() one step at a time, while a request that arrives mid-run and one aborted mid-run
    (its queued tokens dropped) leave the others untouched; groups were queued ahead and every block comes back."""
    _, model, tok = qwen3
    prompts = [tok.encode(p) for p in PROMPTS]
    opts = [SamplingParams(temperature=1.0, max_new_tokens=24 + 4 * i, ignore_eos=True, seed=70 + i)
            for i in range(4)]
    plain = [g[0].token_ids for g in engine(model, tok).generate(prompts, opts)]
    e = engine(model, tok, lookahead=True)
    queued, run = [], e.runner.launch_decode_steps
    e.runner.launch_decode_steps = lambda *a, run=run, **kw: queued.append("ids_from" in kw) or run(*a, **kw)
    ae = AsyncEngine(e, decode_steps=4)

    async def main():
        got = {i: [] for i in range(4)}

        async def read(i, stream, abort_after=None):
            async for first in stream:
                got[i] += [x.token_id for x in (first, *stream.pending()) if x.token_id is not None]
                if abort_after is not None and len(got[i]) >= abort_after:
                    stream.abort()
                    return

        tasks = [asyncio.create_task(read(i, await ae.submit(prompts[i], opts[i]), 6 if i == 1 else None))
                 for i in range(3)]
        while len(got[0]) < 8:
            await asyncio.sleep(0.005)
        tasks.append(asyncio.create_task(read(3, await ae.submit(prompts[3], opts[3]))))  # arrives mid-run
        await asyncio.gather(*tasks)
        return got

    got = asyncio.run(main())
    ae.shutdown()
    assert [got[i] for i in (0, 2, 3)] == [plain[i] for i in (0, 2, 3)]
    assert 6 <= len(got[1]) < len(plain[1]) and got[1] == plain[1][: len(got[1])]
    assert any(queued) and not e.has_work() and e.blocks.num_free == e.blocks.num_blocks


def test_final_only_stream_delivers_a_sample_once_with_the_streamed_tokens(qwen3):
    _, model, tok = qwen3
    ae = AsyncEngine(engine(model, tok), decode_steps=4)
    opts = SamplingParams(temperature=1.0, max_new_tokens=9, ignore_eos=True, seed=5, n=2)

    async def collect(final_only):
        stream = await ae.submit(tok.encode(PROMPTS[0]), opts, final_only=final_only)
        wakes, events = 0, []
        async for first in stream:
            wakes += 1
            events += [first, *stream.pending()]
        return wakes, sorted((e.index, e.token_id, e.finish_reason) for e in events)

    (w_stream, streamed), (w_final, final) = asyncio.run(collect(False)), asyncio.run(collect(True))
    ae.shutdown()
    assert final == streamed and len(final) == 2 * 9
    assert w_final <= 2 < w_stream  # one wake-up per sample at most


def test_capture_graphs_is_a_no_op_without_graphs(qwen3):
    _, model, tok = qwen3
    assert engine(model, tok).capture_graphs((1, 4)) == 0  # CPU: no CUDA graphs


@pytest.mark.gpu
def test_async_engine_lookahead_under_cuda_graphs_matches_generate(tmp_path):
    """On the GPU (bf16, CUDA graphs, the lookahead on by default): an AsyncEngine decoding 4 steps a group, as
    agentic rollout does, gives every stream the tokens of generate() with the same groups and no lookahead (the
    requests submitted together, so both run the same batches), with groups queued ahead and every block back."""
    path = make_tiny_checkpoint(tmp_path, family="qwen3", seed=2)
    model = load_model(path, dtype=torch.bfloat16, device="cuda")
    tok = load_tokenizer(path)
    prompts = [tok.encode(p) for p in PROMPTS]
    opts = [SamplingParams(temperature=1.0, max_new_tokens=40 + 8 * i, ignore_eos=True, seed=80 + i)
            for i in range(len(prompts))]
    ref = engine(model, tok, block_size=16, decode_steps=4, lookahead=False).generate(prompts, opts)
    e = engine(model, tok, block_size=16)
    queued, run = [], e.runner.launch_decode_steps
    e.runner.launch_decode_steps = lambda *a, run=run, **kw: queued.append("ids_from" in kw) or run(*a, **kw)
    ae = AsyncEngine(e, decode_steps=4)

    async def main():
        streams = [await ae.submit(p, o, final_only=True) for p, o in zip(prompts, opts)]  # no await suspends
        out = []
        for stream in streams:
            out.append([x.token_id async for x in stream if x.token_id is not None])
        return out

    got = asyncio.run(main())
    ae.shutdown()
    assert got == [g[0].token_ids for g in ref]
    assert any(queued) and not e.has_work() and e.blocks.num_free == e.blocks.num_blocks


@pytest.mark.gpu
def test_capture_graphs_captures_every_bucket_before_the_first_request(tmp_path):
    """A server captures every decode bucket at start: later steps of any batch size replay without capturing."""
    path = make_tiny_checkpoint(tmp_path, family="qwen3", seed=2)
    model = load_model(path, dtype=torch.bfloat16, device="cuda")
    eng = engine(model, load_tokenizer(path), block_size=16, max_running=24)
    n = eng.capture_graphs((1,))
    assert n == len(eng.runner.graph_buckets) and eng.capture_graphs((1,)) == 0
    before = set(eng.runner.graphs)
    tok = load_tokenizer(path)
    eng.generate([tok.encode(p) for p in PROMPTS * 5], SamplingParams(temperature=1.0, max_new_tokens=6, seed=1))
    assert set(eng.runner.graphs) == before


def test_warm_up_runs_prefills_per_bucket_and_leaves_the_engine_as_it_was(qwen3):
    """``warm_up`` (a server's start) prefills one prompt per attention bucket plus a mixed step, then leaves no
    work, no cached prefix and the engine's seed stream untouched: later output equals a fresh engine's."""
    _, model, tok = qwen3
    prompts = [tok.encode(p) for p in PROMPTS]
    opts = SamplingParams(temperature=1.0, max_new_tokens=6)
    assert engine(model, tok).warm_up() == {"variants": 0, "prefills": 0}  # CPU: nothing compiles
    warm = engine(model, tok, max_model_len=160, max_batched_tokens=140)
    assert warm.warm_up(on_cpu=True) == {"variants": 0, "prefills": 4}  # buckets 64 and 128, two requests each
    assert not warm.has_work() and warm.blocks.num_free == warm.blocks.num_blocks
    fresh = engine(model, tok, max_model_len=160, max_batched_tokens=140)
    got = [[c.token_ids for c in g] for g in warm.generate(prompts, opts)]
    assert got == [[c.token_ids for c in g] for g in fresh.generate(prompts, opts)]


@pytest.mark.gpu
def test_nothing_compiles_while_serving_after_warm_up(tmp_path):
    """After ``capture_graphs`` and ``warm_up``, arrivals of any count during decode (eager mixed steps of every batch
    size) compile no Triton kernel: a compile in the middle of serving stalls every stream for hundreds of ms."""
    import triton

    path = make_tiny_checkpoint(tmp_path, family="qwen3", seed=2)
    tok = load_tokenizer(path)
    eng = engine(load_model(path, dtype=torch.bfloat16, device="cuda"), tok, block_size=16, max_running=48)
    eng.capture_graphs((1,))
    eng.warm_up()
    compiled = []
    hook = triton.knobs.runtime.jit_post_compile_hook
    triton.knobs.runtime.jit_post_compile_hook = lambda *a, **kw: compiled.append(str(kw.get("repr", ""))[:80])
    try:
        opts = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True)
        for wave in (1, 3, 7, 2, 11, 5, 17, 1, 13):  # arrivals while the earlier waves decode
            for i in range(wave):
                eng.add_request(tok.encode(PROMPTS[i % len(PROMPTS)] + " x" * (wave + i)), opts)
            for _ in range(3):
                eng.step()
        while eng.has_work():
            eng.step()
    finally:
        triton.knobs.runtime.jit_post_compile_hook = hook
    assert compiled == []
