"""Structured outputs in the engine (areno.engine.grammar): which token sequences a grammar lets through, the mask
the sampler sees, and the engine decoding a mixed batch (grammar rows next to free rows, multi-step asked for)."""

import json

import pytest
import torch

from areno.config import SamplingParams
from areno.config.sampling import normalize_grammar
from areno.engine.engine import Engine, EngineConfig
from areno.engine.grammar import GrammarError, Grammars, apply_token_mask, check, token_mask
from areno.models import load_model, load_tokenizer
from areno.testing import make_tiny_checkpoint

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 100},
                                           "color": {"type": "string", "enum": ["red", "green"]}},
          "required": ["n", "color"], "additionalProperties": False}
PICK = {"type": "json_schema", "schema": SCHEMA}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("grammar"), family="qwen3", seed=3)


@pytest.fixture(scope="module")
def tok(ckpt):
    return load_tokenizer(ckpt)


@pytest.fixture(scope="module")
def grammars(tok):
    return Grammars(tok, 1024, [tok.eos_token_id])  # the checkpoint's vocabulary is padded past the tokenizer's


def allowed(matcher) -> set[int]:
    bits = matcher.mask[0]
    return {t for t in range(bits.numel() * 32) if (int(bits[t // 32]) >> (t % 32)) & 1}


def walk(grammars, tok, spec, text):
    """Feed ``text``'s tokens (then EOS) to a fresh matcher: how many it took, and whether it finished."""
    m = grammars.matcher(spec)
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    for i, t in enumerate(ids):
        if t not in allowed(m):
            assert not m.accept(t)  # the mask and the matcher agree
            return i, m.finished
        assert m.accept(t)
    return len(ids), m.finished


@pytest.mark.parametrize("spec,text,ok", [
    ({"type": "json_object"}, '{"a": [1, "x"], "b": {"c": null}}', True),
    ({"type": "json_object"}, "{}", True),
    ({"type": "json_object"}, '{ "a": 1}', False),  # compact layout: no free whitespace
    ({"type": "json_object"}, "[1]", False),  # an object, not any JSON value
    (PICK, '{"n": 7, "color": "red"}', True),
    (PICK, '{"n": 700, "color": "red"}', False),  # maximum
    (PICK, '{"n": 7, "color": "blue"}', False),  # enum
    (PICK, '{"n": 7, "color": "red", "x": 1}', False),  # no properties beyond the schema's
    (PICK, '{"n": 7}', False),  # required
])
def test_language(grammars, tok, spec, text, ok):
    n, finished = walk(grammars, tok, spec, text)
    total = len(tok.encode(text, add_special_tokens=False)) + 1
    assert (n == total and finished) == ok, (n, total, finished)


def test_eos_only_when_whole(grammars, tok):
    m = grammars.matcher({"type": "json_object"})
    assert tok.eos_token_id not in allowed(m)
    for t in tok.encode("{}", add_special_tokens=False):
        assert m.accept(t)
    assert allowed(m) == {tok.eos_token_id} and not m.finished
    assert m.accept(tok.eos_token_id) and m.finished


def test_mask_on_logits(grammars, tok):
    """Rows with a matcher keep exactly their allowed tokens; rows without one are untouched."""
    ms = [grammars.matcher(PICK), None, grammars.matcher({"type": "json_object"})]
    rows, bits = token_mask(ms)
    assert rows == [0, 2] and bits.shape == (3, 32) and bool((bits[1] == -1).all())
    logits = torch.randn(3, 1024)
    free = logits[1].clone()
    apply_token_mask(logits, (rows, bits))
    for i in rows:
        assert {int(t) for t in torch.nonzero(logits[i] > -float("inf"))} == allowed(ms[i])
    assert torch.equal(logits[1], free)
    assert token_mask([None, None]) is None


def test_bad_specs():
    with pytest.raises(GrammarError, match="nonsense"):
        check({"type": "json_schema", "schema": {"type": "nonsense"}})
    with pytest.raises(GrammarError, match="minimum greater than maximum"):
        check({"type": "json_schema", "schema": {"type": "integer", "minimum": 3, "maximum": 1}})
    for spec in ({"type": "regex"}, {"type": "json_object", "schema": {}}, {"type": "json_schema"}, "json"):
        with pytest.raises(GrammarError):
            normalize_grammar(spec)
    with pytest.raises(ValueError):
        SamplingParams(grammar={"type": "json_schema", "schema": [1]})
    assert normalize_grammar({"type": "json_schema", "schema": json.dumps(SCHEMA)}) == PICK


def test_engine_mixed_batch(ckpt, tok):
    """Grammar rows give schema-valid JSON ending in EOS; a free row in the same batch decodes exactly as it does
    alone (4-step decode asked for: alone it runs multi-step; beside grammar rows, single steps, the same tokens)."""
    model = load_model(ckpt, dtype=torch.float32, device="cpu")
    engine = Engine(model, tok, EngineConfig(block_size=4, max_running=8, decode_steps=4))
    prompts = [tok.encode("the cat sat"), tok.encode("hello world")]
    free = SamplingParams(max_new_tokens=12, seed=5, ignore_eos=True)
    alone = engine.generate([prompts[1]], free)[0][0]
    guided, mixed = engine.generate(prompts, [SamplingParams(max_new_tokens=40, seed=1, n=3, grammar=PICK), free])
    assert mixed[0].token_ids == alone.token_ids
    for c in guided:
        assert c.finish_reason == "stop" and c.token_ids[-1] == tok.eos_token_id
        obj = json.loads(tok.decode(c.token_ids[:-1]))
        assert set(obj) == {"n", "color"} and 0 <= obj["n"] <= 100 and obj["color"] in ("red", "green")
        assert all(-50 < lp <= 0 for lp in c.logprobs)
    assert len(engine.grammars.cache._cache) == 1  # compiled once for three samples


@pytest.mark.gpu
def test_engine_grammar_cuda(ckpt, tok):
    """On the GPU (bf16, CUDA graphs for the free batches, xgrammar's Triton mask kernel): grammar rows beside free
    rows give schema-valid JSON; once the grammar rows finish, the free rows go back to graph replay."""
    pytest.importorskip("xgrammar", reason="needs xgrammar (the serve extra: bash scripts/install.sh)")
    model = load_model(ckpt, dtype=torch.bfloat16, device="cuda")
    engine = Engine(model, tok, EngineConfig(block_size=16, max_running=16, decode_steps=4))
    prompts = [tok.encode("the cat sat"), tok.encode("hello world " * 3)]
    opts = [SamplingParams(max_new_tokens=40, seed=1, n=6, grammar=PICK),
            SamplingParams(max_new_tokens=80, seed=2, n=2, ignore_eos=True)]
    guided, free = engine.generate(prompts, opts)
    for c in guided:
        assert c.finish_reason == "stop" and c.token_ids[-1] == tok.eos_token_id
        obj = json.loads(tok.decode(c.token_ids[:-1]))
        assert set(obj) == {"n", "color"} and 0 <= obj["n"] <= 100 and obj["color"] in ("red", "green")
    assert all(len(c.token_ids) == 80 and c.finish_reason == "length" for c in free)
    assert engine.runner.last_step_used_graph  # the last steps held only free rows
    engine.generate([prompts[0]], SamplingParams(max_new_tokens=20, seed=3, grammar={"type": "json_object"}))
    assert not engine.runner.last_step_used_graph  # a grammar row: eager


def enum_spec(values: int, tag: str) -> dict:
    return {"type": "json_schema", "schema": {"enum": [f"{tag}-{i}" for i in range(values)]}}


def test_cache_is_bounded_by_bytes_not_count(tok):
    """Issue 37, point 21: 64 cached grammars of ~77 MB each is 5 GB. The cache keeps what fits its byte budget
    (least recently used out first); a grammar larger than the whole budget is used, never kept."""
    probe = Grammars(tok, 1024, [tok.eos_token_id])
    size = probe.compile(enum_spec(200, "a")).memory_size_bytes
    g = Grammars(tok, 1024, [tok.eos_token_id], capacity_bytes=int(2.5 * size))
    for tag in "abcd":
        g.compile(enum_spec(200, tag))
        assert g.cached_bytes <= int(2.5 * size)
    assert len(g._cache) == 2 and set(g._cache) == {json.dumps(normalize_grammar(enum_spec(200, t)), sort_keys=True)
                                                   for t in "cd"}
    big = g.matcher(enum_spec(2000, "big"))  # more bytes than the budget: compiled and used, not cached
    assert not big.finished and g.cached_bytes <= int(2.5 * size) and len(g._cache) <= 2


class SlowCompiler:
    """The grammar compiler with a blocking delay before each compile: a huge schema's seconds, injected."""

    def __init__(self, inner, delay: float):
        self.inner, self.delay = inner, delay

    def compile_json_schema(self, *args, **kwargs):
        import time

        time.sleep(self.delay)
        return self.inner.compile_json_schema(*args, **kwargs)


def test_a_slow_grammar_compile_does_not_stall_other_requests(ckpt, tok):
    """Issue 37, point 21 (a normal request took 6.1 s instead of 0.07 s during a large enum's compile): a server's
    engine compiles a new grammar off its decode loop; a plain request submitted after it finishes while it
    compiles, and the grammar request then decodes to schema-valid JSON. Aborting a request that waits for its
    grammar frees it."""
    import asyncio
    import time

    from areno.engine.async_engine import AsyncEngine

    model = load_model(ckpt, dtype=torch.float32, device="cpu")
    engine = Engine(model, tok, EngineConfig(block_size=4, max_running=8))
    engine.generate([tok.encode("warm")], SamplingParams(max_new_tokens=4, grammar={"type": "json_object"}))
    engine.grammars.cache.compiler = SlowCompiler(engine.grammars.cache.compiler, delay=3.0)
    ae = AsyncEngine(engine)
    guided = SamplingParams(max_new_tokens=40, seed=1, grammar=PICK)

    async def main():
        t0 = time.perf_counter()
        slow = await ae.submit(tok.encode("the cat sat"), guided)
        dropped = await ae.submit(tok.encode("a dog"), SamplingParams(max_new_tokens=8, grammar=enum_spec(5, "x")))
        dropped.abort()
        plain = await ae.submit(tok.encode("hello"), SamplingParams(max_new_tokens=8, ignore_eos=True))
        plain_events = [ev async for ev in plain]
        plain_s = time.perf_counter() - t0
        slow_events = [ev async for ev in slow]
        dropped_events = [ev async for ev in dropped]
        return plain_s, plain_events, slow_events, dropped_events

    try:
        plain_s, plain_events, slow_events, dropped_events = asyncio.run(main())
    finally:
        ae.shutdown()
    assert plain_s < 1.5 and plain_events[-1].finish_reason == "length", plain_s  # not behind the 3 s compile
    assert slow_events[-1].finish_reason == "stop"
    ids = [ev.token_id for ev in slow_events if ev.token_id is not None]
    assert set(json.loads(tok.decode(ids[:-1]))) == {"n", "color"}
    assert [ev.finish_reason for ev in dropped_events] == ["abort"]
    assert not engine.has_work() and not engine.grammars.waiting
