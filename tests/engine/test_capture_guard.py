"""Decode steps hold no operation that breaks CUDA-graph capture, checked on the CPU with ``capture_guard`` (native
kernels: on a GPU they run wherever a Triton kernel leaves a dtype or shape to them, e.g. fp32 routed experts).

The guard itself first (it flags each class of capture-breaking operation and passes sync-free code), then the
native decode paths of the kernels a decode step calls, then the body the engine captures per graph
(``ModelRunner.decode_steps`` on the static graph buffers) for qwen3, qwen3_moe, the hybrids bailing_hybrid and
qwen3_5 (value heads grouped over key heads) and olmo3 (sliding-window layers: a block table per KV-cache group in
the graph buffers): the
"graphs" are captured under the guard and their replays give the eager engine's tokens, log-probs and routes."""

import pytest
import torch

from areno.config import SamplingParams
from areno.engine.decode_graphs import graph_key
from areno.engine.engine import Engine, EngineConfig
from areno.kernels.attention.paged import store_kvcache_native
from areno.kernels.linear_attn.delta_rule import gated_delta_rule_step_native
from areno.kernels.linear_attn.short_conv import causal_conv1d_update_native
from areno.kernels.moe.fused import fused_moe_native, fused_moe_reference
from areno.models import load_model, load_tokenizer
from areno.testing import make_tiny_checkpoint
from tests.helpers.capture_guard import CaptureBreak, capture_guard

X = torch.arange(6.0)
BREAKS = {
    ".item()": lambda: X[2].item(),
    "if on a tensor": lambda: 1 if (X > 2).any() else 0,
    "0-dim tensor index": lambda: X[torch.argmax(X)],
    ".tolist()": lambda: X.tolist(),
    ".cpu()": lambda: X.cpu(),
    "nonzero": lambda: torch.nonzero(X),
    "boolean mask read": lambda: X[X > 2],
    "boolean mask write": lambda: X.clone().__setitem__(X > 2, 0.0),
    "torch.tensor": lambda: torch.tensor([1, 2]),
    "repeat_interleave": lambda: X.repeat_interleave(X.long()),
    "unique": lambda: torch.unique(X),
}


@pytest.mark.parametrize("name", list(BREAKS))
def test_guard_flags_each_capture_breaking_operation(name):
    with pytest.raises(CaptureBreak, match="would break CUDA-graph capture"):
        with torch.inference_mode(), capture_guard():
            BREAKS[name]()


def test_guard_passes_sync_free_code_and_names_the_areno_line():
    with torch.inference_mode(), capture_guard():
        i = torch.argmax(X).view(1)
        y = torch.where(X > 2, X, X.index_select(0, i)).repeat_interleave(2, output_size=12)
        y[torch.arange(3)] = 0.0
    assert y.shape == (12,) and y[:3].eq(0).all()
    ids = torch.tensor([[1, 0]], dtype=torch.int32)
    w = torch.ones(1, 2, requires_grad=True)
    with pytest.raises(CaptureBreak, match=r"capture, at areno/kernels/moe/fused\.py:\d+"):
        with capture_guard():  # with gradients, the native routed experts loop over the hit experts (a host sync)
            fused_moe_native(torch.randn(1, 8), torch.randn(2, 6, 8), torch.randn(2, 8, 3), w, ids)


def test_native_decode_kernels_are_sync_free_and_skip_padding_rows():
    """store_kvcache, the short-conv update, the delta-rule step and the routed experts at decode size: no capture
    break, rows at slot -1 write nothing, and the experts equal the float64 oracle."""
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(4, 2, 8, generator=g), torch.randn(4, 2, 8, generator=g)
    kc, vc = torch.randn(3, 4, 2, 8, generator=g), torch.randn(3, 4, 2, 8, generator=g)
    conv, state = torch.randn(5, 6, 3, generator=g), torch.randn(5, 2, 4, 4, generator=g)
    x13, w13 = torch.randn(5, 16, generator=g), torch.randn(8, 12, 16, generator=g)
    w2 = torch.randn(8, 16, 6, generator=g)
    ids = torch.randint(0, 8, (5, 2), generator=g, dtype=torch.int32)
    tw = torch.rand(5, 2, generator=g)
    for slots in ([-1, 5, -1, 9], [-1, -1, -1, -1]):
        want_k, want_v = kc.clone(), vc.clone()
        for row, s in enumerate(slots):
            if s >= 0:
                want_k[s // 4, s % 4], want_v[s // 4, s % 4] = k[row], v[row]
        got_k, got_v, slot_mapping = kc.clone(), vc.clone(), torch.tensor(slots)
        with torch.inference_mode(), capture_guard():
            store_kvcache_native(k, v, got_k, got_v, slot_mapping)
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    idx = torch.tensor([3, -1, 1], dtype=torch.int32)
    c2, s2 = conv.clone(), state.clone()
    with torch.inference_mode(), capture_guard():
        y = causal_conv1d_update_native(torch.randn(3, 6, generator=g), c2, torch.randn(6, 4, generator=g),
                                        state_indices=idx)
        o = gated_delta_rule_step_native(*(torch.randn(3, 2, 4, generator=g) for _ in range(3)),
                                         -torch.rand(3, 2, 4, generator=g), torch.rand(3, 2, generator=g), s2,
                                         state_indices=idx)
        moe = fused_moe_native(x13, w13, w2, tw, ids)
    assert y[1].eq(0).all() and o[1].eq(0).all()
    for untouched in (0, 2, 4):  # only slots 3 and 1 moved
        assert torch.equal(c2[untouched], conv[untouched]) and torch.equal(s2[untouched], state[untouched])
    assert not torch.equal(c2[3], conv[3]) and not torch.equal(s2[1], state[1])
    want = fused_moe_reference(*(t.double() for t in (x13, w13, w2, tw)), ids)
    torch.testing.assert_close(moe.double(), want, rtol=1e-5, atol=1e-5)


# ---- the engine's graph body -----------------------------------------------------------------------------------

PROMPTS = ["hello world, 12 + 3 =", "tool call: {\"name\": \"add\"} and more", "x"]


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe", "bailing_hybrid", "olmo3", "qwen3_5"])
def family(request, tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), family=request.param, seed=2)
    return load_model(path, dtype=torch.float32, device="cpu"), load_tokenizer(path)


class _GuardedGraph:
    """``torch.cuda.CUDAGraph`` on the CPU, as ``ModelRunner._capture`` drives it: two warm-up calls of the body, then
    the "capture" (one call under the guard); a replay reruns the body on the same static buffers, under the guard."""

    def __init__(self, runner, buf, k):
        self.body = lambda: runner.decode_steps(buf, k)
        for _ in range(2):
            self.body()
        with capture_guard():
            self.out = self.body()

    def replay(self):
        with capture_guard():
            for dst, src in zip(self.out, self.body()):
                dst.copy_(src)


@pytest.mark.parametrize("k, record_routing, adjust", [(1, False, False), (2, True, True)],
                         ids=["k1", "k2-routing-penalties"])
def test_decode_graph_body_is_capturable(family, k, record_routing, adjust):
    """Greedy and sampled rows (the adjusted case adds penalties, a logit bias and min_tokens: the graphs with logit
    adjustments) padded to a bucket (slot -1 rows, state slot -1 for the hybrid), n = 2 samples forked per prompt."""
    model, tok = family
    prompts = [tok.encode(p) for p in PROMPTS]
    extra = dict(repetition_penalty=1.3, frequency_penalty=0.2, logit_bias={5: 2.0}, min_new_tokens=3) if adjust else {}
    opts = [SamplingParams(temperature=t, max_new_tokens=6, ignore_eos=True, n=2, seed=i, **extra)
            for i, t in enumerate((1.0, 0.0, 0.7))]
    cfg = dict(block_size=4, max_running=8, decode_steps=k, record_routing=record_routing)
    ref = Engine(model, tok, EngineConfig(**cfg)).generate(prompts, opts)
    eng = Engine(model, tok, EngineConfig(**cfg))
    runner = eng.runner
    runner.use_graphs, runner.graph_buckets = True, [4, 8]

    def capture(bsz, k, width=0, rope_off=False):
        buf = runner._graph_buffers(bsz, width, rope_off)
        graph = _GuardedGraph(runner, buf, k)
        runner.graphs[graph_key(bsz, k, width, rope_off)] = (graph, buf, graph.out)

    runner._capture = capture
    got = eng.generate(prompts, opts)
    assert any(key[:3] == (8, k, 16 if adjust else 0) for key in runner.graphs)  # 6 rows padded to 8
    for g1, g2 in zip(ref, got):
        for a, b in zip(g1, g2):
            assert a.token_ids == b.token_ids
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs))
            if record_routing and model.num_moe_layers:
                assert (a.routed_experts == b.routed_experts).all()
