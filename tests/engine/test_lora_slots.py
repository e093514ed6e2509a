"""LoRA serving in the engine (areno.engine.lora_slots): requests for different adapters in one step equal each served
alone and PEFT's model (greedy, token for token), through the eager and the (CPU stand-in) graph paths; the prefix
cache keyed by adapter; load/unload refusals naming the adapter."""

import pytest
import torch

from areno.config import SamplingParams
from areno.engine.engine import Engine, EngineConfig
from areno.models import load_model, load_tokenizer
from areno.models.lora import LoraError
from areno.testing import make_tiny_checkpoint
from tests.helpers.cpu_graph import use_cpu_graphs
from tests.helpers.lora_adapters import make_adapter, peft_greedy

pytest.importorskip("peft")

STEPS = 8
PROMPTS = ["hello world, 12 + 3 =", "the cat sat on", "a", "tool call: {\"name\": \"add\"} and text"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_checkpoint(root / "base", family="qwen3", seed=3)
    adapters = {
        "a": make_adapter(base, root / "a", rank=4, alpha=8, targets="all-linear", seed=1),
        "b": make_adapter(base, root / "b", rank=8, alpha=8, targets=["q_proj", "v_proj", "down_proj"], seed=2),
        "c": make_adapter(base, root / "c", rank=2, alpha=4, targets=["gate_proj", "o_proj"], seed=3),
    }
    model = load_model(base, dtype=torch.float32, device="cpu")
    return base, adapters, model, load_tokenizer(base)


def engine(model, tok, adapters, names=("a", "b", "c"), **kw):
    kw.setdefault("block_size", 4)
    kw.setdefault("max_running", 16)
    kw.setdefault("max_model_len", 128)
    eng = Engine(model, tok, EngineConfig(max_loras=3, max_lora_rank=8, **kw))
    for n in names:
        eng.lora.load(n, adapters[n])
    return eng


def greedy(lora=None, n=1):
    return SamplingParams(temperature=0.0, max_new_tokens=STEPS, ignore_eos=True, lora=lora, n=n)


def close(eng):
    eng.lora.remove()  # the module-scoped model serves the next engine without these hooks


def test_mixed_batch_equals_each_alone_and_peft(setup):
    base, adapters, model, tok = setup
    prompts = [tok.encode(p) for p in PROMPTS]
    which = ["a", "b", None, "c"]
    batch = [prompts[i % len(prompts)] for i in range(len(which))]
    eng = engine(model, tok, adapters)
    seen = []
    run = eng.runner.execute
    eng.runner.execute = lambda inp: (seen.append(set(inp.lora or [-1])), run(inp))[1]
    together = eng.generate(batch, [greedy(w) for w in which])
    close(eng)
    assert any(len(s) >= 3 for s in seen)  # one step held rows of several adapters
    eng = engine(model, tok, adapters, prefix_caching=False)
    alone = [eng.generate([p], greedy(w))[0][0].token_ids for p, w in zip(batch, which)]  # one request at a time
    plain = eng.generate([batch[0]], greedy())[0][0].token_ids
    close(eng)
    assert [g[0].token_ids for g in together] == alone
    assert plain != alone[0]  # the adapter changes the answer
    for i in (0, 1):  # PEFT on transformers' model, one adapter at a time
        assert alone[i] == peft_greedy(base, adapters[which[i]], batch[i], STEPS), which[i]


def test_graph_path_gives_the_eager_tokens(setup, monkeypatch):
    """The decode graphs' inputs (the slot index a static buffer, padding rows -1) replayed on the CPU."""
    _, adapters, model, tok = setup
    prompts = [tok.encode(p) for p in PROMPTS]
    opts = [greedy(w, n=2) for w in ("a", None, "c")]
    eng = engine(model, tok, adapters)
    ref = eng.generate(prompts[:3], opts)
    close(eng)
    for k in (1, 3):
        eng = engine(model, tok, adapters, decode_steps=k)
        use_cpu_graphs(eng.runner, monkeypatch)
        got = eng.generate(prompts[:3], opts)
        close(eng)
        assert (8, k, 0) in eng.runner.graphs
        assert [[c.token_ids for c in g] for g in got] == [[c.token_ids for c in g] for g in ref]


def test_prefix_cache_is_keyed_by_adapter(setup):
    _, adapters, model, tok = setup
    prompt = tok.encode("a longer prompt that fills several cache blocks of four tokens each")
    eng = engine(model, tok, adapters)
    first = eng.generate([prompt], greedy("a"))[0][0].token_ids
    hits = eng.blocks.prefix_hits
    base = eng.generate([prompt], greedy())[0][0].token_ids
    assert eng.blocks.prefix_hits == hits  # adapter a's K/V never serve the base
    other = eng.generate([prompt], greedy("b"))[0][0].token_ids
    assert eng.blocks.prefix_hits == hits
    again = eng.generate([prompt], greedy("a"))[0][0].token_ids
    assert eng.blocks.prefix_hits > hits and again == first  # the same adapter reuses its own
    eng.lora.unload("a")
    eng.lora.load("a", adapters["c"])  # the name reloaded with other weights: a fresh key, no stale prefix
    hits = eng.blocks.prefix_hits
    eng.generate([prompt], greedy("a"))
    assert eng.blocks.prefix_hits == hits
    close(eng)
    assert len({tuple(first), tuple(base), tuple(other)}) == 3


def test_load_refusals_name_the_adapter(setup, tmp_path):
    base, adapters, model, tok = setup
    eng = Engine(model, tok, EngineConfig(block_size=4, max_running=4, max_loras=2, max_lora_rank=4))
    with pytest.raises(LoraError, match="^b: rank 8 is over --max-lora-rank 4"):
        eng.lora.load("b", adapters["b"])
    with pytest.raises(LoraError, match="^nope: .*adapter_config.json does not exist"):
        eng.lora.load("nope", tmp_path / "missing")
    other = make_tiny_checkpoint(tmp_path / "other", family="qwen3", seed=1, hidden_size=48)
    wrong = make_adapter(other, tmp_path / "wrong", rank=2, alpha=2, targets=["q_proj"], seed=4)
    with pytest.raises(LoraError, match="^wrong: .*q_proj.*another base model"):
        eng.lora.load("wrong", wrong)
    eng.lora.load("a", adapters["a"])
    with pytest.raises(LoraError, match="^a: an adapter of this name is already loaded"):
        eng.lora.load("a", adapters["c"])
    eng.lora.load("c", adapters["c"])
    with pytest.raises(LoraError, match="^a2: all 2 --max-loras slots"):
        eng.lora.load("a2", adapters["a"])
    with pytest.raises(ValueError, match="'zz' is not loaded"):
        eng.add_request(tok.encode("x"), greedy("zz"))
    with pytest.raises(ValueError, match="'zz' is not loaded"):
        eng.lora.unload("zz")
    # a slot whose adapter is unloaded stays taken while a request still runs with it
    (seq,) = eng.add_request(tok.encode("hello"), greedy("c"))
    eng.lora.unload("c")
    with pytest.raises(LoraError, match="slots"):
        eng.lora.load("c2", adapters["c"])
    while eng.has_work():
        eng.step()
    assert seq.is_finished
    eng.lora.load("c2", adapters["c"])
    eng.lora.remove()


@pytest.mark.gpu
def test_cuda_graphs_with_mixed_adapters_on_gpu(tmp_path):
    """On the GPU (Triton grouped kernel, real CUDA graphs with the slot index a static input): graphs give the eager
    tokens, and a mixed batch gives each request's tokens served alone (fp32)."""
    base = make_tiny_checkpoint(tmp_path / "base", family="qwen3", seed=3)
    adapters = {"a": make_adapter(base, tmp_path / "a", rank=4, alpha=8, targets="all-linear", seed=1),
                "b": make_adapter(base, tmp_path / "b", rank=8, alpha=8, targets=["q_proj", "down_proj"], seed=2),
                "c": make_adapter(base, tmp_path / "c", rank=2, alpha=4, targets=["o_proj"], seed=3)}
    model = load_model(base, dtype=torch.float32, device="cuda")
    tok = load_tokenizer(base)
    prompts = [tok.encode(p) for p in PROMPTS]
    which = ["a", "b", None, "c"]
    opts = [greedy(w) for w in which]
    eager = engine(model, tok, adapters, eager_decode=True)
    want = [g[0].token_ids for g in eager.generate(prompts, opts)]
    alone = [eager.generate([p], o)[0][0].token_ids for p, o in zip(prompts, opts)]
    close(eager)
    graphs = engine(model, tok, adapters)
    graphs.capture_graphs((1,))
    got = [g[0].token_ids for g in graphs.generate(prompts, opts)]
    assert graphs.runner.last_step_used_graph
    close(graphs)
    assert got == want == alone
