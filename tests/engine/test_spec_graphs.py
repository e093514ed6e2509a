"""Speculative decoding under CUDA graphs (``areno.engine.spec_graphs``), checked on the CPU as
``test_capture_guard`` checks the decode graphs: each steady step's verify graph is "captured" under ``capture_guard``
(any host sync fails it) and replayed under it on the static, padded buffers, and the engine gives exactly the eager
speculative engine's tokens (log-probs to float tolerance: padded rows change no real row's math, but the CPU's GEMM
may block differently), greedy and seeded temperature-1 sampling with penalties, for the hybrid Qwen3.5 and Ling
(recurrent states stepped through the K + 1 rows, rolled back eagerly), DeepSeek-V3 (MLA); with requests arriving
mid-run (prefill chunks and forks: eager steps between replays) and the gate turning speculation off and on. The
memory: the state stash allocated once at the limit batch and taken out of the KV-cache budget (never grown); the
graphs captured at start (``Engine.capture_graphs``: a run captures nothing more). One GPU test replays the real
graphs against eager speculation."""

import re

import pytest
import torch
import transformers

from areno.config import ConfigError, SamplingParams
from areno.engine import model_runner, spec_chain, spec_decode, spec_gated, spec_graphs, spec_sample
from areno.engine.decode_graphs import graph_key, graph_plan
from areno.engine.engine import Engine, EngineConfig
from areno.engine.kv_cache import kv_bytes_per_block, plan_num_blocks, state_bytes
from areno.engine.spec_chain import chain_body
from areno.engine.spec_gated import CHAIN_LENGTHS, GATED_CHAIN
from areno.engine.spec_graphs import replay_body, stash_bytes, stash_rows, verify_body, verify_buffers
from areno.engine.spec_sample import sample_body
from areno.models import load_model
from areno.testing import make_tiny_checkpoint
from areno.testing.checkpoints import FAMILIES
from areno.training.mtp import fit_draft
from tests.helpers.capture_guard import capture_guard
from tests.helpers.mtp import GATE_PROMPTS, LATE, make_echo_model

pytestmark = pytest.mark.slow


def _needs_config(family: str) -> None:
    """Skip (naming it) where this transformers lacks the family's config class (the GPU machine's 5.17 has no
    BailingHybridConfig): a tiny checkpoint is written through it."""
    name = FAMILIES[family][0]
    if not hasattr(transformers, name):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")


@pytest.fixture(scope="module", params=["qwen3_5", "deepseek_v3", "bailing_hybrid"])
def echo(request, tmp_path_factory):
    _needs_config(request.param)
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), family=request.param, seed=1)
    return make_echo_model(load_model(path, dtype=torch.float32, device="cpu"), scale=2.0, block_scale=0.5)


class _GuardedGraph:
    """``torch.cuda.CUDAGraph`` on the CPU as ``VerifyGraphs.capture`` drives it: two warm-ups, the "capture" under the
    guard; a replay reruns the body on the same static buffers under the guard, into the captured outputs."""

    def __init__(self, body):
        self.body, self.replays = body, 0
        for _ in range(2):
            body()
        with capture_guard():
            self.out = body()

    def replay(self):
        self.replays += 1
        with capture_guard():
            for dst, src in zip(self.out, self.body()):
                if dst is not None:  # a gated forward's logits (None: the runner's sampling computes them)
                    dst.copy_(src)


def _engine(model, k, graphs, monkeypatch=None, **kw):
    kw = {"block_size": 4, "max_running": 8, "max_batched_tokens": 16, "speculative_tokens": k, **kw}
    with pytest.MonkeyPatch.context() as m:
        if graphs:  # the runner and the stash's sizing see graphs at build (as on the GPU), the buckets below
            plan = lambda max_running, eager, device: (True, [1, 2, 4, 8, 16, 32])  # noqa: E731
            m.setattr(model_runner, "graph_plan", plan)
            m.setattr(spec_decode, "graph_plan", plan)
        e = Engine(model, None, EngineConfig(**kw), eos_token_ids=[])
    if graphs:
        r = e.runner

        def capture(r, bsz, width, stash):
            buf = verify_buffers(r, bsz, width)
            graph = _GuardedGraph(lambda: verify_body(r, buf, width, stash))
            return graph, buf, graph.out

        def capture_draw(r, buf):
            graph = _GuardedGraph(lambda: (sample_body(r, buf),))
            return graph, buf, graph.out[0]

        def capture_chain(r, ex, vbuf, hidden, host, width, k):
            buf = {name: v.clone() for name, v in host.items()}
            graph = _GuardedGraph(lambda: chain_body(r, ex, vbuf, hidden, buf, width, k))
            return graph, buf, graph.out

        r.spec_exec.graphs.capture = capture

        def capture_replay(r, stash, bsz):
            buf = {"slots": torch.full((bsz,), -1, dtype=torch.int32), "counts": torch.zeros(bsz, dtype=torch.int32)}
            graph = _GuardedGraph(lambda: replay_body(r, stash, buf))
            return graph, buf, graph.out

        def capture_decode(bsz, k, width=0, rope_off=False, hidden=False):  # the gated chains' plain decode graphs
            buf = r._graph_buffers(bsz, width, rope_off)
            if hidden:
                buf["hidden"] = r._hidden_rows(k, bsz)
            graph = _GuardedGraph(lambda: r.decode_steps(buf, k))
            r.graphs[graph_key(bsz, k, width, rope_off, hidden)] = (graph, buf, graph.out)

        r._capture = capture_decode
        monkeypatch.setattr(spec_sample, "capture_draw", capture_draw)
        monkeypatch.setattr(spec_graphs, "capture_replay", capture_replay)
        monkeypatch.setattr(spec_chain, "capture_chain", capture_chain)
    return e


def _run(e, options, late_after=None, trace=None):
    """GATE_PROMPTS (each with its options), LATE joining after ``late_after`` steps; every sequence's output.
    ``trace``: gets each step's kind ("gated", "replayed" or "eager"); ``late_after`` "replayed": LATE join after the
    first replay."""
    seqs = [s for p, o in zip(GATE_PROMPTS, options) for s in e.add_request(p, o)]
    steps = 0
    while e.has_work():
        before = (e.spec.counts["spec_gated_steps"], sum(_replays(e).values())) if trace is not None else None
        e.step()  # (a real CUDAGraph counts no replays: traces are for the CPU stand-in)
        if trace is not None:
            after = (e.spec.counts["spec_gated_steps"], sum(_replays(e).values()))
            trace.append("gated" if after[0] > before[0] else "replayed" if after[1] > before[1] else "eager")
        steps += 1
        first_replay = late_after == "replayed" and trace[-1:] == ["replayed"] and trace.count("replayed") == 1
        if steps == late_after or first_replay:
            seqs += [s for p, o in zip(LATE, options) for s in e.add_request(p, o)]
    return [(s.output_ids, list(s.logprobs)) for s in seqs]


def _options(sampled: bool):
    if not sampled:
        return [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True, n=2) for n in (4, 12, 20, 30)]
    return [SamplingParams(temperature=1.0, max_new_tokens=n, ignore_eos=True, n=2, seed=i, repetition_penalty=1.3,
                           frequency_penalty=0.2, presence_penalty=0.1) for i, n in enumerate((4, 12, 20, 30))]


def _long_options():
    """Greedy, lengths such that gated chains of GATED_CHAIN steps leave a long pair decoding alone at the end."""
    return [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True, n=2) for n in (4, 12, 40, 90)]


def _assert_same(got, want):
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-5)


def _replays(e, kind="verify") -> dict:
    return {key: g[0].replays for key, g in e.runner.graphs.items() if key[0] == kind}


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded-penalties"])
def test_graphed_speculation_equals_eager(echo, sampled, monkeypatch):
    """K = 3, requests arriving after 4 steps: replays of the steady steps between eager prefill/fork steps."""
    opts = _options(sampled)
    want = _run(_engine(echo, 3, graphs=False), opts, late_after=4)
    e = _engine(echo, 3, graphs=True, monkeypatch=monkeypatch)
    stash = e.runner.spec_exec.graphs.stash
    ptr = None if stash is None else stash[0].data_ptr()
    got = _run(e, opts, late_after=4)
    _assert_same(got, want)
    now = e.runner.spec_exec.graphs.stash  # batches 1 .. 8 (the limit) verified: nothing allocated, nothing grown
    assert now is stash and (now is None or now[0].data_ptr() == ptr)
    if stash is not None:  # each delta-rule layer's kept inputs: sized once for the stash's rows x (K + 1)
        rows = e.runner.spec_exec.graphs.rows * 4
        assert all(buf.shape[0] == rows for keep in stash[1] for buf in keep.bufs.values())
        assert all(keep.bufs for keep in stash[1])
    replays = _replays(e)
    assert replays and sum(replays.values()) >= 3 and all(key[2] == 4 for key in replays)  # (bucket, K + 1)
    assert len(replays) > 1  # several buckets as sequences finish
    draws = _replays(e, "spec_draw")  # the rejection sampling replayed after each verify replay
    assert sum(draws.values()) == sum(replays.values())
    assert all(key[3:] == ((16, False, False) if sampled else (0, False, False)) for key in draws)
    assert 0 < sum(_replays(e, "spec_chain").values()) <= sum(replays.values())  # the drafts after them
    if e.runner.states is not None:  # a hybrid commits each replayed verify's accepted tokens by a replay too
        assert sum(_replays(e, "replay").values()) == sum(replays.values())
    assert e.spec.stats()["spec_accept_len"] > 1.1  # drafts accepted and rejected
    assert (e.runner.states is None) == (e.runner.spec_exec.graphs.stash is None)  # hybrids: states kept per token


def test_gate_turns_speculation_off_and_on_under_graphs(echo, monkeypatch):
    """--speculative-disable-by-batch-size 3: gated (plain) steps while more than 3 decode, replays once fewer do,
    gated again when LATE join (after the first replay), replays again at the end. Gated stretches run as chains of
    GATED_CHAIN plain decode steps (graph-replayed, hidden rows kept): the drafts after them are those of a run whose
    gated steps ran one at a time."""
    opts = _long_options()
    e = _engine(echo, 2, graphs=True, monkeypatch=monkeypatch, speculative_disable_by_batch_size=3)
    trace = []
    got = _run(e, opts, late_after="replayed", trace=trace)
    plain = _engine(echo, 2, graphs=False, speculative_disable_by_batch_size=3)
    want = _run(plain, opts, late_after=trace.index("replayed") + 1)
    _assert_same(got, want)
    assert e.spec.stats() == plain.spec.stats()  # the same drafts: the deferred catch-ups read the held rows intact
    kinds = "".join(k[0] for k in trace)  # g(ated), r(eplayed), e(ager)
    assert re.search("g.*r.*g.*r", kinds), kinds  # off, on (replayed), off, on
    chains = {key: g[0].replays for key, g in e.runner.graphs.items() if key[-1] == "hidden"}
    assert chains and sum(chains.values()) >= 2 and all(key[0] > 3 and key[1] in CHAIN_LENGTHS for key in chains)
    assert e.step_counts["chained"] >= 2 * GATED_CHAIN


def test_a_gated_chain_holds_the_hidden_rows_of_its_positions(echo, monkeypatch):
    """The rows a gated chain holds for the deferred MTP catch-up (replayed graphs: copied before the next replay)
    are the target's hidden states at those positions (a packed forward over each sequence's tokens)."""
    e = _engine(echo, 2, graphs=True, monkeypatch=monkeypatch, speculative_disable_by_batch_size=3)
    for p, o in zip(GATE_PROMPTS, _long_options()):
        e.add_request(p, o)
    while e.step_counts["chained"] < 2 * GATED_CHAIN:
        e.step()
    ex, deferred = e.runner.spec_exec, e.spec.deferred.held
    assert deferred and all(n >= 2 * GATED_CHAIN for _, _, n in deferred.values())
    for sid, (seq, first, n) in deferred.items():
        held = torch.cat(ex.held[sid])
        ids = torch.tensor(seq.tokens[: first + n])
        with torch.no_grad():
            hidden = echo(ids, torch.arange(len(ids)), torch.tensor([0, len(ids)], dtype=torch.int32), len(ids))
        torch.testing.assert_close(held, hidden[first : first + n], rtol=1e-4, atol=1e-4)


def test_a_gated_step_that_cannot_chain_replays_its_forward(echo, monkeypatch):
    """A gated step of decodes that does not chain (here: chains off) replays the verify body at width 1 from a graph
    per bucket (the 9B shape ran its gated steps eagerly at 0.28x the plain engine), equal to eager."""
    monkeypatch.setattr(spec_gated, "chain_length", lambda spec, step: 0)
    opts = _long_options()
    e = _engine(echo, 2, graphs=True, monkeypatch=monkeypatch, speculative_disable_by_batch_size=3)
    got = _run(e, opts, late_after=4)
    plain = _engine(echo, 2, graphs=False, speculative_disable_by_batch_size=3)
    _assert_same(got, _run(plain, opts, late_after=4))
    assert e.spec.stats() == plain.spec.stats()
    gated = {key: n for key, n in _replays(e).items() if key[2] == 1}
    assert gated and sum(gated.values()) >= 2 and all(key[1] > 3 for key in gated)


@pytest.mark.parametrize("gate", ["off", 3])
def test_speculation_takes_its_memory_out_of_the_kv_cache_budget(echo, gate, monkeypatch):
    """The blocks planned are those of the budget less the recurrent-state slots, the stash (hybrids: K x the limit
    batch's bucket x a slot's conv states and that bucket x (K + 1) tokens' delta-rule inputs, which the buffers a
    verify allocates stay within; attention-only models: none) and, where the gate can make a step plain, the
    deferred catch-up's rows."""
    k, mem, mml = 3, 600 << 10, 128  # the budget binds, not the cap (8 full-length sequences)
    e = _engine(echo, k, graphs=True, monkeypatch=monkeypatch, kv_cache_memory=mem, max_model_len=mml,
                speculative_disable_by_batch_size=gate)
    r = e.runner
    stash = r.spec_exec.graphs.stash
    assert (stash is None) == (r.states is None)
    stashed = 0 if stash is None else stash_bytes(echo, r.spec_exec.graphs.rows, k, r.dtype)
    if stash is not None:
        assert stash[0].shape[1:3] == (k, 4 if gate == 3 else 8)  # the limit batch (3: bucket 4, off: max_running)
        _run(e, _options(False)[:2])
        kept = sum(buf.numel() * buf.element_size() for keep in stash[1] for buf in keep.bufs.values())
        assert 0 < stash[0].numel() * stash[0].element_size() + kept <= stashed
    held = (e.spec.deferred.rows + 8 * GATED_CHAIN) * echo.config.hidden_size * r.dtype.itemsize if gate == 3 else 0
    assert e.spec_budget.reserved == stashed + held
    per_block = kv_bytes_per_block(echo, 4, r.dtype, mml, extra_layers=1)
    plan = dict(block_size=4, dtype=r.dtype, device=r.device, kv_cache_memory=mem, max_running=8,
                max_model_len=mml, extra_layers=1)
    assert 0 < e.blocks.num_blocks == (mem - state_bytes(echo, 8, r.dtype) - stashed - held) // per_block < 8 * 32
    unreserved = plan_num_blocks(echo, **plan)
    assert e.blocks.num_blocks == plan_num_blocks(echo, **plan, reserved=stashed + held)
    assert (e.blocks.num_blocks < unreserved) == (stashed + held > per_block)


def test_capture_graphs_captures_every_steady_graph_at_start(echo, monkeypatch):
    """``Engine.capture_graphs`` under speculation: the verify, sampling and chain graphs of every bucket a steady
    step replays (the gate at 3: buckets 1, 2, 4; a hybrid's replay of the accepted tokens too), and the gated steps'
    forwards (width 1) and gated chains (plain decode graphs, keeping hidden rows and not) of the buckets above the
    limit up to max_running's (4, 8); a run then replays them and captures nothing more."""
    opts = _long_options()
    e = _engine(echo, 3, graphs=True, monkeypatch=monkeypatch, speculative_disable_by_batch_size=3)
    hybrid = e.runner.states is not None
    assert e.capture_graphs() == 11 + 3 * hybrid + 4 * len(CHAIN_LENGTHS)
    keys = set(e.runner.graphs)
    kinds = ("verify", "spec_draw", "spec_chain") + (("replay",) if hybrid else ())
    steady = {(kind, b) for kind in kinds for b in (1, 2, 4)}
    assert {key[:2] for key in keys if isinstance(key[0], str) and (key[-1] != 1 or key[0] != "verify")} == steady
    assert {key for key in keys if key[0] == "verify" and key[2] == 1} == {("verify", 4, 1), ("verify", 8, 1)}
    assert {key for key in keys if not isinstance(key[0], str)} == {(b, k, 0, *h) for b in (4, 8)
                                                                   for k in CHAIN_LENGTHS for h in ((), ("hidden",))}
    got = _run(e, opts, late_after=4)
    assert set(e.runner.graphs) == keys and sum(_replays(e).values()) >= 2
    _assert_same(got, _run(_engine(echo, 3, graphs=False, speculative_disable_by_batch_size=3), opts, late_after=4))


def test_verify_graphs_cover_a_batch_at_its_own_cap():
    """A steady step of every running sequence verifies B x (K + 1) rows; a graph replays it whenever those rows stay
    within VERIFY_GRAPH_ROWS = 512 (or the largest decode bucket), so a batch at --max-running-prompts is not left eager
    (host-bound: 46 ms a token at 64 rows on the H100 against 11 ms plain)."""
    for cap, k, n, graphed in [(64, 2, 50, True), (16, 2, 10, True), (8, 4, 5, True), (128, 2, 100, True),
                               (256, 2, 150, True), (256, 2, 170, False), (256, 2, 230, False), (512, 1, 250, True),
                               (512, 1, 300, False)]:  # n off the buckets: a replayed step's stash rounds up to one
        buckets = graph_plan(cap, False, torch.device("cuda"))[1]
        rows = stash_rows(n, cap, True, buckets, k + 1)
        bucket = next(b for b in buckets if b >= n)
        assert rows == (bucket if graphed else n), (cap, k, n)
    assert stash_rows(24, 64, False, graph_plan(64, False, torch.device("cuda"))[1], 3) == 24  # no graphs: rows as is


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["qwen3_5", "deepseek_v3", "bailing_hybrid"])
def test_real_graphs_equal_eager_speculation_on_the_gpu(tmp_path, family):
    """The real CUDA graphs (captured per bucket and K at start) against eager speculation: greedy equal; the run
    captures nothing more."""
    _needs_config(family)
    path = make_tiny_checkpoint(tmp_path / family, family=family, seed=1)
    model = make_echo_model(load_model(path, dtype=torch.float32, device="cuda"), scale=2.0, block_scale=0.5)
    opts = _options(False)
    out = {}
    for eager in (True, False):
        e = Engine(model, None, EngineConfig(block_size=16, max_running=8, speculative_tokens=2, eager_decode=eager),
                   eos_token_ids=[])
        assert (e.capture_graphs() > 0) == (not eager)
        keys = set(e.runner.graphs)
        out[eager] = _run(e, opts, late_after=4)
        assert set(e.runner.graphs) == keys
    assert [t for t, _ in out[False]] == [t for t, _ in out[True]]
    most = min(e.spec.gate.most, 8)  # a tiny model on a known GPU: auto speculates at every batch up to max_running
    want = {("verify", b) for b in (1, 2, 4, 8) if b <= most}  # the steady steps' buckets, captured at start
    assert {key[:2] for key in e.runner.graphs if key[0] == "verify" and key[2] > 1} == want


def test_a_budget_that_holds_no_block_is_refused(echo):
    """A --kv-cache-memory budget that the state slots and speculation's reserve leave no KV block of: a ConfigError
    naming the flag and the numbers (exit 2 from the CLI), never a one-block cache that refuses every request later."""
    per_block = kv_bytes_per_block(echo, 4, torch.float32, 128, extra_layers=1)
    plan = dict(block_size=4, dtype=torch.float32, device=torch.device("cpu"), max_running=8, max_model_len=128,
                extra_layers=1)
    states = state_bytes(echo, 8, torch.float32)
    assert plan_num_blocks(echo, **plan, kv_cache_memory=states + 1000 + 3 * per_block, reserved=1000) == 3
    with pytest.raises(ConfigError, match=r"^--kv-cache-memory \(.* bytes\) holds no KV block .*raise it"):
        plan_num_blocks(echo, **plan, kv_cache_memory=states + 1000 + per_block - 1, reserved=1000)


def _trained_draft(device, tmp_path):
    """A tiny Qwen3.5 whose MTP draft was fitted to the model's own greedy continuations of four prompts (so it
    agrees with the target through its hidden states, unlike the echo draft), the prompts and continuations."""
    path = make_tiny_checkpoint(tmp_path / "qwen3_5", family="qwen3_5", seed=0)
    model = load_model(path, dtype=torch.float32, device=device)
    plain = Engine(model, None, EngineConfig(block_size=16, max_running=8, eager_decode=True), eos_token_ids=[])
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, model.config.vocab_size, (16,), generator=g).tolist() for _ in range(4)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    outs = [list(o[0].token_ids) for o in plain.generate(prompts, greedy)]
    plain.drop_rollout_state()
    fit_draft(model, [p + o for p, o in zip(prompts, outs)], 300)
    return model, prompts, outs, greedy


def _accept(e, prompts, outs, greedy) -> float:
    e.spec.take_stats()
    got = [list(o[0].token_ids) for o in e.generate(prompts, greedy)]
    assert got == outs  # greedy speculation equals plain greedy
    return e.spec.take_stats()["spec_accept_len"]


def test_a_trained_draft_keeps_its_acceptance_under_graphs(monkeypatch, tmp_path):
    """The draft reads the target's hidden rows (the echo draft does not): replayed verify and chain graphs give the
    eager engine's acceptance, well above 1 on the prompts the draft was fitted to."""
    model, prompts, outs, greedy = _trained_draft("cpu", tmp_path)
    kw = dict(block_size=16, max_running=8, max_batched_tokens=256, speculative_disable_by_batch_size="off")
    eager = _accept(_engine(model, 2, graphs=False, **kw), prompts, outs, greedy)
    e = _engine(model, 2, graphs=True, monkeypatch=monkeypatch, **kw)
    assert _accept(e, prompts, outs, greedy) == pytest.approx(eager) and sum(_replays(e).values()) > 0
    assert eager > 2.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_trained_draft_keeps_its_acceptance_under_real_graphs_on_the_gpu(tmp_path):
    """The same with the real CUDA graphs (captured at start): the Qwen3.5-9B bench's draft accepted nothing under
    graphs on the H100 while the eager smoke run accepted 3 of 3; this pins where."""
    model, prompts, outs, greedy = _trained_draft("cuda", tmp_path)
    accept = {}
    for eager in (True, False):
        e = Engine(model, None, EngineConfig(block_size=16, max_running=8, speculative_tokens=2, eager_decode=eager,
                                             speculative_disable_by_batch_size="off"), eos_token_ids=[])
        e.capture_graphs()
        accept[eager] = _accept(e, prompts, outs, greedy)
        e.drop_rollout_state()
    assert accept[True] > 2.0 and accept[False] == pytest.approx(accept[True], abs=0.05), accept
