"""Sampling options in the engine's sampler on a tiny checkpoint: logit_bias, min_tokens masking EOS and stop ids,
repetition/presence/frequency penalties against a float64 reference loop, min-p, and multi-step decode."""

import pytest
import torch

from areno.config import SamplingParams
from areno.engine.engine import Engine, EngineConfig
from areno.models import load_model, load_tokenizer
from areno.testing import make_tiny_checkpoint
from tests.helpers.cpu_graph import CpuGraph


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("q3"), family="qwen3", seed=2)
    return load_model(path, dtype=torch.float32, device="cpu"), load_tokenizer(path)


def engine(model, tok, **kw):
    return Engine(model, tok, EngineConfig(**{"block_size": 4, "max_running": 8, **kw}))


def test_logit_bias_forces_and_forbids_tokens(qwen3):
    model, tok = qwen3
    p = tok.encode("the cat")
    free = engine(model, tok).generate([p], SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True))
    free = free[0][0].token_ids
    forced = engine(model, tok).generate([p], SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True,
                                                              seed=1, logit_bias={17: 100.0}))[0][0]
    assert forced.token_ids == [17] * 6 and max(forced.logprobs) > -1e-3  # the biased distribution's log-prob
    banned = engine(model, tok).generate([p], SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True,
                                                              logit_bias={free[0]: -100.0}))[0][0]
    assert banned.token_ids[0] != free[0] and free[0] not in banned.token_ids
    with pytest.raises(ValueError, match="logit_bias"):
        engine(model, tok).add_request(p, SamplingParams(logit_bias={10**6: 1.0}))


def test_min_tokens_masks_eos_and_stop_ids(qwen3):
    """vLLM's min_tokens: EOS and stop ids get -inf logits until min_tokens tokens are out, so none is sampled
    (or counted, or given a log-prob) before; here EOS is pushed to the top by a bias, so it comes right after."""
    model, tok = qwen3
    eos = tok.eos_token_id
    p = tok.encode("the cat")
    for decode_steps in (1, 4):
        e = engine(model, tok, decode_steps=decode_steps)
        out = e.generate([p, p], [SamplingParams(temperature=1.0, max_new_tokens=12, min_new_tokens=5, seed=3,
                                                  logit_bias={eos: 30.0}),
                                  SamplingParams(temperature=0.0, max_new_tokens=12, min_new_tokens=4, ignore_eos=True,
                                                  stop_token_ids=[21], logit_bias={21: 30.0})])  # fmt: skip
        a, b = out[0][0], out[1][0]
        assert a.token_ids[-1] == eos and len(a.token_ids) == 6 and a.finish_reason == "stop", decode_steps
        assert eos not in a.token_ids[:-1] and all(lp > -50 for lp in a.logprobs)
        assert b.token_ids[-1] == 21 and len(b.token_ids) == 5 and 21 not in b.token_ids[:-1]
        assert e.blocks.num_free == e.blocks.num_blocks


def _penalised(logits, prompt, output, rep, pres, freq):
    x = logits.double().clone()
    counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=x.numel()).double()
    seen = counts > 0
    seen[torch.tensor(prompt)] = True
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    return x - freq * counts - pres * (counts > 0).double()


def test_penalties_change_greedy_output_as_the_reference_says(qwen3):
    """Greedy decoding with penalties equals a float64 loop that penalises full-forward logits token by token;
    the returned log-probs are those of the penalised distribution (T = 1 for greedy)."""
    model, tok = qwen3
    prompts = [tok.encode(t) for t in ("the cat sat on the mat", "a b a b a b")]
    cases = [(1.3, 0.5, 0.0), (0.8, -0.5, 1.5)]
    opts = [SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True, repetition_penalty=r,
                            presence_penalty=pp, frequency_penalty=f) for r, pp, f in cases]
    plain = engine(model, tok).generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True))
    for (r, pp, f), o in zip(cases, opts):
        out = engine(model, tok, max_running=1).generate(prompts, o)  # one slot, given back and reused
        for prompt, group in zip(prompts, out):
            got = group[0]
            ids = list(prompt)
            with torch.no_grad():
                for t in range(6):
                    z = _penalised(model.logits(torch.tensor([ids]))[0, -1], prompt, ids[len(prompt):], r, pp, f)
                    assert got.token_ids[t] == int(z.argmax()), (r, pp, f, t)
                    assert abs(got.logprobs[t] - float(torch.log_softmax(z, 0)[got.token_ids[t]])) < 1e-4
                    ids.append(got.token_ids[t])
        assert any(g[0].token_ids != b[0].token_ids for g, b in zip(out, plain))  # the penalty did something


def test_min_p_one_is_greedy(qwen3):
    model, tok = qwen3
    prompts = [tok.encode(t) for t in ("the cat", "hello world, 12 + 3 =")]
    greedy = engine(model, tok).generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True))
    top = engine(model, tok).generate(prompts, SamplingParams(temperature=1.5, max_new_tokens=6, ignore_eos=True,
                                                               min_p=1.0, seed=4))  # fmt: skip
    assert [g[0].token_ids for g in greedy] == [g[0].token_ids for g in top]


def test_graph_inputs_give_the_eager_tokens(qwen3, monkeypatch):
    """The CUDA-graph path's inputs (rows padded to a bucket, full-width block tables, the adjustment buffers padded
    to their width, neutral padding rows), replayed on the CPU, one step and three chained steps per graph: the
    tokens and log-probs of eager single steps, and the adjusted graphs kept apart from the plain ones."""
    model, tok = qwen3
    prompts = [tok.encode(t) for t in ("the cat", "hello world, 12 + 3 =", "x")]
    opts = [SamplingParams(temperature=1.0, max_new_tokens=7, ignore_eos=True, n=2, seed=5, frequency_penalty=1.0,
                            repetition_penalty=1.2, min_p=0.05, logit_bias={3: 2.0}),
            SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True, n=2, seed=6),
            SamplingParams(temperature=0.8, max_new_tokens=5, n=2, seed=7, presence_penalty=1.0, min_new_tokens=3)]
    ref = engine(model, tok, max_model_len=40).generate(prompts, opts)
    for k in (1, 3):
        eng = engine(model, tok, decode_steps=k, max_model_len=40)
        runner = eng.runner
        runner.use_graphs, runner.graph_buckets = True, [4, 8]

        def capture(bsz, k, width=0, runner=runner):
            buf = runner._graph_buffers(bsz, width)
            graph = CpuGraph(runner, buf, k)
            runner.graphs[(bsz, k, width)] = (graph, buf, graph.out)

        monkeypatch.setattr(runner, "_capture", capture)
        got = eng.generate(prompts, opts)
        assert {key[2] > 0 for key in runner.graphs if key[1] == k} == {True, False}, runner.graphs.keys()
        for g1, g2 in zip(ref, got):
            for a, b in zip(g1, g2):
                assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
                torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs))


@pytest.mark.gpu
def test_gpu_graphs_with_sampling_options(tmp_path):
    """On the GPU (CUDA graphs): rows with penalties, min-p, logit_bias and min_tokens beside plain rows; k = 8
    chained steps in one graph give the tokens and log-probs of k = 1 graph replays, the adjusted graphs are captured
    apart from the plain ones (which the batch uses again once only plain rows are left), and min_tokens holds."""
    path = make_tiny_checkpoint(tmp_path, family="qwen3", seed=3)
    model = load_model(path, dtype=torch.bfloat16, device="cuda")
    tok = load_tokenizer(path)
    eos = tok.eos_token_id
    prompts = [tok.encode("more text " * i) for i in range(1, 9)]
    kinds = [{}, {"frequency_penalty": 1.0, "repetition_penalty": 1.3}, {"min_p": 0.1},
             {"logit_bias": {5: 4.0, eos: 6.0}, "min_new_tokens": 10}, {"presence_penalty": -1.0}]
    opts = [SamplingParams(temperature=1.0, max_new_tokens=60 if i % 5 == 0 else 24 + 3 * i, n=2, seed=i,
                            ignore_eos=i % 5 == 0 or i == 6, **kinds[i % 5]) for i in range(len(prompts))]
    outs = []
    for k in (1, 8):
        eng = Engine(model, tok, EngineConfig(block_size=16, max_running=32, decode_steps=k))
        outs.append(eng.generate(prompts, opts))
        assert {key[2] > 0 for key in eng.runner.graphs if key[1] == k} == {True, False}, eng.runner.graphs.keys()
    for g1, g2 in zip(*outs):
        for a, b in zip(g1, g2):
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
            assert a.logprobs == b.logprobs
    assert all(eos not in c.token_ids[:10] and len(c.token_ids) > 10 for c in outs[0][3])
