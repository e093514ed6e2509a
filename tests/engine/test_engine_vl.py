"""The engine with images (Qwen3-VL, tiny random checkpoint): greedy rollout equals transformers' ``generate`` for
prompts with images batched together, with n > 1 samples forked from one prefill (the tower once per prompt),
with chunked prefill splitting an image, with a prefix-cache hit for the same (image, prompt) and none for another
image behind the same token ids; M-RoPE decode offsets through the CUDA-graph inputs and multi-step decode."""

import io

import numpy as np
import pytest
import torch

from areno.config import SamplingParams
from areno.engine.engine import Engine, EngineConfig
from areno.models import load_model
from areno.models.multimodal import MultimodalProcessor, MultimodalPrompt, data_url
from areno.testing import make_tiny_checkpoint
from tests.helpers.cpu_graph import CpuGraph

NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    """(model, processor, transformers model, prompts, path, messages): prompts 0 and 1 have the same token ids and
    other images."""
    import transformers

    path = make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_vl_engine"), "qwen3_vl", seed=3)
    model = load_model(path, device="cpu")
    proc = MultimodalProcessor.from_pretrained(path)
    ref = transformers.Qwen3VLForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32,
                                                                      attn_implementation="eager")  # fmt: skip
    messages = [
        _user(_image(32, 32, seed=1), "what is in the picture? answer in detail"),
        _user(_image(32, 32, seed=2), "what is in the picture? answer in detail"),
        _user("first", _image(24, 40, seed=3), "then", _image(16, 24, seed=4), "which is larger?"),
    ]
    prompts = [proc.encode(m) for m in messages]
    assert prompts[0].input_ids == prompts[1].input_ids and prompts[0].image_hashes != prompts[1].image_hashes
    return model, proc, ref, prompts, path, messages


def _image(h, w, seed):
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return {"type": "image_url", "image_url": {"url": data_url(buf.getvalue())}}


def _user(*parts):
    return [{"role": "user", "content": [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]}]


def _reference(ref, prompt, new=NEW) -> list[int]:
    ids = torch.tensor([prompt.input_ids])
    mm = (ids == ref.config.image_token_id).int()
    with torch.inference_mode():
        out = ref.generate(ids, pixel_values=prompt.pixel_values, image_grid_thw=prompt.image_grid_thw,
                           mm_token_type_ids=mm, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                           do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
    return out[0, ids.shape[1] :].tolist()


@pytest.fixture(scope="module")
def want(vl):
    _, _, ref, prompts, *_ = vl
    return [_reference(ref, p) for p in prompts]


def _engine(model, **kw):
    kw.setdefault("block_size", 4)
    kw.setdefault("max_running", 16)
    return Engine(model, None, EngineConfig(**kw), eos_token_ids=[])


class TowerCalls:
    """Counts the model's tower runs and the images in each (the real tower runs)."""

    def __init__(self, model, monkeypatch):
        self.images, run = [], model.encode_images

        def encode_images(pixel_values, grid):
            self.images.append(len(grid))
            return run(pixel_values, grid)

        monkeypatch.setattr(model, "encode_images", encode_images)


def test_batch_with_images_and_samples_matches_transformers(vl, want, monkeypatch):
    """Three prompts with images and a text prompt in one batch, n = 3 samples each (greedy: all equal), a token
    budget that splits an image across prefill chunks: every sample equals transformers (the text prompt: what it
    gives alone); one tower run per prompt, none per sample, and nothing left resident."""
    model, proc, _, prompts, *_ = vl
    text = proc.encode(_user("no picture here, only text"))
    assert text.pixel_values is None
    alone = _engine(model).generate([text.input_ids], GREEDY)[0][0].token_ids
    tower = TowerCalls(model, monkeypatch)
    eng = _engine(model, max_batched_tokens=13)
    opts = SamplingParams(temperature=0.0, max_new_tokens=NEW, ignore_eos=True, n=3)
    out = eng.generate([prompts[0], text, prompts[1], prompts[2]], opts)
    for group, ref in zip(out, [want[0], alone, want[1], want[2]]):
        assert [c.token_ids for c in group] == [ref] * 3
    assert sum(tower.images) == 4 and len(tower.images) <= 3  # every image once (prompts starting together share)
    assert not eng.runner.images.resident and not eng.runner.images.readers
    assert eng.blocks.num_used == 0


def test_prefix_cache_keys_include_the_image(vl, want, monkeypatch):
    """The same (image, prompt) again hits the prefix cache past its image (so the tower does not run); another
    image behind the same token ids shares only the blocks before the image and still gives its own tokens."""
    model, _, _, prompts, *_ = vl
    eng = _engine(model)
    image_start = prompts[0].input_ids.index(model.config.image_token_id)
    first = eng.generate([prompts[0]], GREEDY)[0][0]
    tower = TowerCalls(model, monkeypatch)
    again = eng.add_request(None, GREEDY, mm=prompts[0])[0]
    other = eng.add_request(None, GREEDY, mm=prompts[1])[0]
    while eng.has_work():
        eng.step()
    assert again.output_ids == first.token_ids == want[0] and other.output_ids == want[1]
    assert again.prefix_cached > eng.blocks.blocks_for(len(prompts[0].input_ids)) * 4 - 8  # all but the last block
    assert other.prefix_cached <= image_start
    assert tower.images == [1]  # only the other image


def test_preempted_image_prompts_are_recomputed(vl, want):
    """A KV cache too small for the batch: preempted image prompts come back (with the prefix cache, their image
    blocks may still be cached; without it, the tower runs again) and still give transformers' tokens."""
    model, _, _, prompts, *_ = vl
    per_block = model.num_layers * 2 * 4 * model.num_kv_heads_local * model.head_dim * 4
    opts = SamplingParams(temperature=0.0, max_new_tokens=NEW, ignore_eos=True, n=2)
    for caching in (True, False):
        eng = _engine(model, kv_cache_memory=24 * per_block, max_running=6, prefix_caching=caching)
        out = eng.generate(prompts, opts)
        assert eng.scheduler.num_preemptions > 0
        assert [[c.token_ids for c in g] for g in out] == [[w, w] for w in want]
        assert not eng.runner.images.resident and eng.blocks.num_used == 0


def test_decode_offsets_through_graph_inputs_and_multi_step(vl, want, monkeypatch):
    """The CUDA-graph path's inputs (padded bucket, the per-row ``rope_off`` buffer) replayed on the CPU, single and
    three chained steps, and eager multi-step decode: the tokens of transformers; graphs with offsets kept apart."""
    model, _, _, prompts, *_ = vl

    for k, graphs in ((1, True), (3, True), (3, False)):
        eng = _engine(model, decode_steps=k)
        runner = eng.runner
        if graphs:
            runner.use_graphs, runner.graph_buckets = True, [2, 4]

            def capture(bsz, k, width=0, rope_off=False, runner=runner):
                buf = runner._graph_buffers(bsz, width, rope_off)
                graph = CpuGraph(runner, buf, k)
                runner.graphs[(bsz, k, width) + (("rope_off",) if rope_off else ())] = (graph, buf, graph.out)

            monkeypatch.setattr(runner, "_capture", capture)
        out = eng.generate(prompts, GREEDY)
        assert [g[0].token_ids for g in out] == want, (k, graphs)
        if graphs:
            assert any(key[-1] == "rope_off" for key in runner.graphs), runner.graphs.keys()


def test_async_engine_sdk_and_refusals(vl, want, tmp_path):
    """``AsyncEngine.submit(..., mm=)`` streams the tokens of transformers; the SDK's ``Trainer.generate`` takes chat
    messages with an image part (the checkpoint's processor) and ``MultimodalPrompt`` objects; images sent to a
    text-only model, or placeholders that do not match the images, are refused by name."""
    import asyncio

    from areno import Trainer
    from areno.api import CUDA, CudaConfig, SamplingParams
    from areno.engine.async_engine import AsyncEngine

    model, _, _, prompts, path, messages = vl
    ae = AsyncEngine(_engine(model))

    async def stream(prompt):
        events = await ae.submit(prompt.input_ids, GREEDY, mm=prompt)
        return [ev.token_id async for ev in events if ev.token_id is not None]

    try:
        assert asyncio.run(stream(prompts[2])) == want[2]
    finally:
        ae.close()
    trainer = Trainer(world_size=1, model_path=path, backend_type=CUDA, dtype="float32", tensorboard=False,
                      custom_config=CudaConfig(tp_size=1, max_running_prompts=4, runtime={"attn_backend": "native"}),
                      metrics_dir=str(tmp_path / "m"))  # fmt: skip
    with trainer:
        trainer.init()
        out = trainer.generate([messages[0], prompts[1]], SamplingParams(temperature=0.0, max_new_tokens=NEW))
    assert [g[0].token_ids for g in out] == want[:2]
    text_model = load_model(make_tiny_checkpoint(tmp_path / "qwen3", "qwen3"), device="cpu")
    with pytest.raises(ValueError, match=r"\(qwen3\) does not take image input"):
        _engine(text_model).add_request(None, GREEDY, mm=prompts[0])
    broken = MultimodalPrompt(list(prompts[0].input_ids), prompts[0].pixel_values, prompts[0].image_grid_thw)
    broken.input_ids.remove(model.config.image_token_id)  # 15 placeholders for an image of 16 tokens
    with pytest.raises(ValueError, match="needs 16 consecutive placeholder tokens"):
        _engine(model).add_request(None, GREEDY, mm=broken)


@pytest.mark.gpu
def test_gpu_cuda_graph_decode_with_images_matches_transformers(tmp_path):
    """On the GPU (fp32, Triton kernels, CUDA graphs): image prompts with n = 2 samples beside a text prompt, one-step
    graphs and 8-step graphs: every greedy sample equals transformers' ``generate``; the decode ran in graphs with
    the per-row offsets (and the text-only batch tail in graphs without)."""
    import transformers

    path = make_tiny_checkpoint(tmp_path, "qwen3_vl", seed=5)
    model = load_model(path, dtype=torch.float32, device="cuda")
    proc = MultimodalProcessor.from_pretrained(path)
    ref = transformers.Qwen3VLForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32)
    prompts = [proc.encode(_user(_image(32, 32, seed=i), "describe it " * i)) for i in range(1, 6)]
    prompts.append(proc.encode(_user("only text, and a long answer please " * 3)))
    new = [12, 20, 12, 30, 16, 40]  # the text prompt decodes last, alone
    want = [_reference(ref, p, n) if p.pixel_values is not None else None for p, n in zip(prompts, new)]
    opts = [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True, n=2) for n in new]
    for k in (1, 8):
        eng = Engine(model, None, EngineConfig(block_size=16, max_running=32, decode_steps=k), eos_token_ids=[])
        out = eng.generate(prompts, opts)
        for group, ref_tokens in zip(out[:-1], want):
            assert [c.token_ids for c in group] == [ref_tokens] * 2, k
        alone = Engine(model, None, EngineConfig(block_size=16, eager_decode=True), eos_token_ids=[]).generate(
            [prompts[-1]], opts[-1])[0][0].token_ids  # fmt: skip
        assert [c.token_ids for c in out[-1]] == [alone] * 2
        keys = [key for key in eng.runner.graphs if key[1] == k]
        assert any(key[-1] == "rope_off" for key in keys) and any(key[-1] != "rope_off" for key in keys), keys
