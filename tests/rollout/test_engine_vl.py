"""The engine with images (Qwen3-VL, tiny random checkpoint): greedy rollout equals transformers' ``generate`` for
prompts with images batched together, with n > 1 samples forked from one prefill (the tower once per prompt),
with chunked prefill splitting an image, with a prefix-cache hit for the same (image, prompt) and none for another
image behind the same token ids; M-RoPE decode offsets through the CUDA-graph inputs and multi-step decode."""

import io

import numpy as np
import pytest
import torch

from areno.models import load_model
from areno.models.multimodal import MultimodalProcessor, data_url
from areno.rollout.engine import Engine, EngineConfig
from areno.rollout.sequence import SamplingOptions
from areno.testing import make_tiny_checkpoint

NEW = 8
GREEDY = SamplingOptions(temperature=0.0, max_new_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    """(model, processor, transformers model, prompts): prompts 0 and 1 have the same token ids and other images."""
    import transformers

    path = make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_vl_engine"), "qwen3_vl", seed=3)
    model = load_model(path, device="cpu")
    proc = MultimodalProcessor.from_pretrained(path)
    ref = transformers.Qwen3VLForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32,
                                                                      attn_implementation="eager")  # fmt: skip
    prompts = [
        proc.encode(_user(_image(32, 32, seed=1), "what is in the picture? answer in detail")),
        proc.encode(_user(_image(32, 32, seed=2), "what is in the picture? answer in detail")),
        proc.encode(_user("first", _image(24, 40, seed=3), "then", _image(16, 24, seed=4), "which is larger?")),
    ]
    assert prompts[0].input_ids == prompts[1].input_ids and prompts[0].image_hashes != prompts[1].image_hashes
    return model, proc, ref, prompts


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
    _, _, ref, prompts = vl
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
    """Three prompts with images in one batch, n = 3 samples each (greedy: all equal), a token budget that splits
    an image across prefill chunks: every sample equals transformers; one tower run per prompt, none per sample."""
    model, _, _, prompts = vl
    tower = TowerCalls(model, monkeypatch)
    eng = _engine(model, max_batched_tokens=13)
    opts = SamplingOptions(temperature=0.0, max_new_tokens=NEW, ignore_eos=True, n=3)
    out = eng.generate([prompts[0], prompts[1], prompts[2]], opts)
    for group, ref in zip(out, want):
        assert [c.token_ids for c in group] == [ref] * 3
    assert sum(tower.images) == 4 and len(tower.images) <= 3  # every image once (prompts starting together share)
    assert not eng.runner.images.resident and not eng.runner.images.readers
    assert eng.blocks.num_used == 0


def test_text_and_image_prompts_mixed_one_at_a_time(vl, want):
    """Each prompt alone (whole-prompt prefill) gives the batched tokens; a text-only prompt beside image prompts
    gives what it gives alone (plain positions)."""
    model, proc, _, prompts = vl
    text = proc.encode(_user("no picture here, only text"))
    assert text.pixel_values is None
    alone = _engine(model).generate([text], GREEDY)[0][0].token_ids
    out = _engine(model, max_batched_tokens=4096).generate([prompts[2], text, prompts[0]], GREEDY)
    assert [g[0].token_ids for g in out] == [want[2], alone, want[0]]


def test_prefix_cache_keys_include_the_image(vl, want, monkeypatch):
    """The same (image, prompt) again hits the prefix cache past its image (so the tower does not run); another
    image behind the same token ids shares only the blocks before the image and still gives its own tokens."""
    model, _, _, prompts = vl
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


def test_decode_offsets_through_graph_inputs_and_multi_step(vl, want, monkeypatch):
    """The CUDA-graph path's inputs (padded bucket, the per-row ``rope_off`` buffer) replayed on the CPU, single and
    three chained steps, and eager multi-step decode: the tokens of transformers; graphs with offsets kept apart."""
    model, _, _, prompts = vl

    class Replay:  # runs the graph's body on its static buffers, as a replay does
        def __init__(self, runner, buf, k):
            self.run = lambda: runner.decode_steps(buf, k)
            self.out = tuple(torch.zeros_like(t) for t in self.run())

        def replay(self):
            for dst, src in zip(self.out, self.run()):
                dst.copy_(src)

    for k, graphs in ((1, True), (3, True), (3, False)):
        eng = _engine(model, decode_steps=k)
        runner = eng.runner
        if graphs:
            runner.use_graphs, runner.graph_buckets = True, [2, 4]

            def capture(bsz, k, width=0, rope_off=False, runner=runner):
                buf = runner._graph_buffers(bsz, width, rope_off)
                graph = Replay(runner, buf, k)
                runner.graphs[(bsz, k, width) + (("rope_off",) if rope_off else ())] = (graph, buf, graph.out)

            monkeypatch.setattr(runner, "_capture", capture)
        out = eng.generate(prompts, GREEDY)
        assert [g[0].token_ids for g in out] == want, (k, graphs)
        if graphs:
            assert any(key[-1] == "rope_off" for key in runner.graphs), runner.graphs.keys()
