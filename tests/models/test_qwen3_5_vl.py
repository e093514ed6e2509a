"""Qwen3.5 vision-language checkpoints (the Hub's composite ``qwen3_5`` / ``qwen3_5_moe``, written here by
transformers itself): logits and every gradient with images against transformers' own model, the round trip
(``model.language_model.*`` / ``model.visual.*`` names, bit-identical), and the rollout engine's greedy tokens with
images (n > 1, chunked prefill through an image, preemption) against transformers' ``generate``."""

import hashlib

import pytest
import torch
import transformers
from hf_reference import hub_tensors, reference_grads

from areno.config import SamplingParams
from areno.engine.engine import Engine, EngineConfig
from areno.engine.kv_cache import kv_bytes_per_block, state_bytes
from areno.models import iter_hf_tensors, load_model, save_model
from areno.models.multimodal import MultimodalPrompt

FAMILIES = ("qwen3_5", "qwen3_5_moe")
pytestmark = pytest.mark.skipif(not hasattr(transformers, "Qwen3_5Config"),
                                reason=f"transformers {transformers.__version__} has no qwen3_5")


def vl_checkpoint(folder, family):
    """A tiny composite checkpoint as the Hub ships Qwen3.5; returns transformers' model (fp32, eval)."""
    from areno.testing import tiny_config

    text = tiny_config(family)
    for key in ("architectures", "dtype", "torch_dtype", "transformers_version", "mtp_num_hidden_layers"):
        text.pop(key, None)
    text["rope_parameters"].update(mrope_section=[2, 1, 1], mrope_interleaved=True)  # rotary dim 8 = 2 * (2+1+1)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"],
                  patch_size=4, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
    moe = family == "qwen3_5_moe"
    config = (transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config)(
        text_config=text, vision_config=vision, image_token_id=250, video_token_id=251, vision_start_token_id=252,
        vision_end_token_id=253)
    torch.manual_seed(0)
    cls = transformers.Qwen3_5MoeForConditionalGeneration if moe else transformers.Qwen3_5ForConditionalGeneration
    model = cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1 if p.dim() > 1 else 0.05)
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module", params=FAMILIES)
def vl(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    ref = vl_checkpoint(folder, request.param)
    return folder, ref, load_model(folder, device="cpu")


def _prompt(cfg, seed=0):
    """Two images (4x4 and 4x8 patches: 4 and 8 tokens) between text tokens, and their pixel rows."""
    grid = torch.tensor([[1, 4, 4], [1, 4, 8]])
    pv = torch.randn(48, 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(seed))
    start, end, image = cfg.vision_start_token_id, cfg.vision_end_token_id, cfg.image_token_id
    ids = [5, 6, 7, start] + [image] * 4 + [end, 9, 10, start] + [image] * 8 + [end, 11, 12, 13 + seed]
    return torch.tensor(ids), pv, grid


def _reference(ref, ids, pv, grid, **kwargs):
    mm = (ids == ref.config.image_token_id).int()[None]
    return ref(ids[None], pixel_values=pv, image_grid_thw=grid, mm_token_type_ids=mm, **kwargs)


def test_logits_and_gradients_with_images_match_transformers_fp32(vl):
    folder, ref, model = vl
    assert model.is_multimodal and model.is_hybrid and model.config.vision.deepstack_visual_indexes == []
    assert model.hf_config["model_type"] in FAMILIES and not model.mtp_names
    ids, pv, grid = _prompt(model.config)
    positions = model.mrope_positions(ids, grid)[0]
    with torch.no_grad():
        want = _reference(ref, ids, pv, grid).logits[0]
        got = model.compute_logits(model(ids, positions, pixel_values=pv, image_grid_thw=grid))
        text = model.logits(ids[None, :3])[0]
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    assert (text - want[:3]).abs().max() <= 1e-4 * want.abs().max()  # text alone: plain positions
    model.train(), ref.train()
    targets = torch.cat([ids[1:], torch.tensor([-100])])
    hidden = model(ids, positions, pixel_values=pv, image_grid_thw=grid)
    loss = -model.token_logprobs(hidden, targets).sum() / (targets >= 0).sum()
    loss.backward()
    ref_loss = _reference(ref, ids, pv, grid, labels=ids[None]).loss
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    got, want = dict(iter_hf_tensors(model, grads=True)), reference_grads(ref)
    assert set(got) == set(want) and any(k.startswith("model.visual.") for k in got)
    for name, g in want.items():
        assert (got[name] - g).abs().max() <= 1e-4 * g.abs().max().clamp_min(1e-8), name
    model.eval(), ref.eval()
    model.zero_grad(), ref.zero_grad()


def test_round_trip_is_bit_identical(vl, tmp_path):
    folder, _, model = vl
    out = save_model(model, tmp_path / "out")
    a, b = hub_tensors(folder), hub_tensors(out)
    assert sorted(a) == sorted(b) and any(k.startswith("model.language_model.layers.0.linear_attn.") for k in a)
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def test_engine_greedy_with_images_matches_transformers_generate(vl):
    """n = 2 samples a prompt, a token budget that splits an image across prefill chunks (the recurrent state and
    the image rows carried between chunks), and a cache small enough to preempt: transformers' greedy tokens."""
    _, ref, model = vl
    cfg, prompts, want = model.config, [], []
    for seed in (0, 1):
        ids, pv, grid = _prompt(cfg, seed)
        positions, deltas = model.mrope_positions(ids, grid)
        prompts.append(MultimodalPrompt(ids.tolist(), pv, grid, [hashlib.sha256(pv.numpy().tobytes()).hexdigest()],
                                        positions, deltas[0], cfg.image_token_id))
        mm = (ids == cfg.image_token_id).int()[None]
        with torch.inference_mode():
            out = ref.generate(ids[None], pixel_values=pv, image_grid_thw=grid, mm_token_type_ids=mm,
                               attention_mask=torch.ones_like(ids)[None], max_new_tokens=6, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
        want.append(out[0, len(ids):].tolist())
    opts = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True, n=2)
    budget = 9 * kv_bytes_per_block(model, 4, torch.float32) + state_bytes(model, 4, torch.float32)
    for kw in (dict(max_batched_tokens=11), dict(max_running=4, kv_cache_memory=budget)):
        eng = Engine(model, None, EngineConfig(block_size=4, **kw), eos_token_ids=[])
        out = eng.generate(prompts, opts)
        assert [[c.token_ids for c in g] for g in out] == [[w, w] for w in want]
    assert eng.scheduler.num_preemptions > 0
