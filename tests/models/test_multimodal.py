"""The message schema: images through the checkpoint's template and image processor into Qwen3-VL inputs, and every
refusal (remote URL, undecodable, oversized, a modality the model lacks) as a MediaError naming it."""

import io

import numpy as np
import pytest
import torch

from areno.models import load_model
from areno.models.multimodal import MediaError, MediaLimits, MultimodalProcessor, data_url


@pytest.fixture(scope="module")
def vl_path(tmp_path_factory):
    from areno.testing import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_vl_mm"), "qwen3_vl")


def _png(h, w, seed=0) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _user(*parts):
    return [{"role": "user", "content": list(parts)}]


def _image(url):
    return {"type": "image_url", "image_url": {"url": url}}


def test_data_url_images_become_model_inputs_matching_transformers(vl_path):
    import transformers

    proc = MultimodalProcessor.from_pretrained(vl_path)
    assert proc.modalities == {"text", "image"}
    first, second = _png(32, 32, seed=1), _png(24, 40, seed=2)
    messages = _user(_image(data_url(first)), {"type": "text", "text": "and"}, _image(data_url(second)),
                     {"type": "text", "text": "how many?"})  # fmt: skip
    prompt = proc.encode(messages)
    cfg = proc.config
    assert prompt.image_grid_thw.tolist() == [[1, 8, 8], [1, 6, 10]]
    ids = torch.tensor(prompt.input_ids)
    assert int((ids == cfg.image_token_id).sum()) == 16 + 15 == prompt.pixel_values.shape[0] // 4
    text = proc.tokenizer.decode(prompt.input_ids)
    assert text.startswith("<|im_start|>user\n<|vision_start|><|image_pad|>")
    assert text.endswith("<|im_start|>assistant\n")
    assert text.count("<|vision_start|>") == 2 and "<|vision_end|>and<|vision_start|>" in text
    # the same image twice hashes the same; a different one does not
    again = proc.encode(_user(_image(data_url(second)), _image(data_url(second))))
    assert again.image_hashes[0] == again.image_hashes[1] == prompt.image_hashes[1] != prompt.image_hashes[0]
    # end to end: areno's model on these inputs gives transformers' logits
    model = load_model(vl_path, device="cpu")
    ref = transformers.Qwen3VLForConditionalGeneration.from_pretrained(str(vl_path), dtype=torch.float32)
    with torch.no_grad():
        got = model.compute_logits(model(ids, prompt.positions, pixel_values=prompt.pixel_values,
                                         image_grid_thw=prompt.image_grid_thw))  # fmt: skip
        want = ref(ids[None], pixel_values=prompt.pixel_values, image_grid_thw=prompt.image_grid_thw,
                   mm_token_type_ids=(ids == cfg.image_token_id).int()[None]).logits[0]  # fmt: skip
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    assert prompt.rope_delta == int(prompt.positions.max()) + 1 - len(ids) < 0


def test_local_paths_only_where_allowed_and_remote_urls_never(vl_path, tmp_path):
    proc = MultimodalProcessor.from_pretrained(vl_path)
    (tmp_path / "a.png").write_bytes(_png(16, 16))
    prompt = proc.encode(_user(_image("a.png")), allow_paths=True, base_dir=tmp_path)
    assert prompt.image_grid_thw.tolist() == [[1, 4, 4]]
    assert proc.encode(_user(_image(f"file://{tmp_path}/a.png")), allow_paths=True).image_hashes == prompt.image_hashes
    with pytest.raises(MediaError, match="only data URLs are accepted here"):
        proc.encode(_user(_image(str(tmp_path / "a.png"))))
    with pytest.raises(MediaError, match="no such image file"):
        proc.encode(_user(_image("missing.png")), allow_paths=True, base_dir=tmp_path)
    for url in ("https://example.com/cat.png", "http://10.0.0.1/x.jpg"):
        with pytest.raises(MediaError, match="remote URLs are not fetched"):
            proc.encode(_user(_image(url)), allow_paths=True)


def test_undecodable_and_oversized_images_are_refused(vl_path):
    proc = MultimodalProcessor.from_pretrained(vl_path)
    png = _png(32, 32)
    cases = [
        ("data:image/png;base64,!!notbase64!!", "not valid base64"),
        (data_url(b"this is not an image"), "could not decode the image"),
        (data_url(png[: len(png) // 2]), "could not decode the image"),  # truncated
        ("data:image/png,rawbytes", "must be data:image/<type>;base64"),
    ]
    for url, message in cases:
        with pytest.raises(MediaError, match=message):
            proc.encode(_user(_image(url)))
    small = MultimodalProcessor.from_pretrained(vl_path, limits=MediaLimits(max_image_bytes=len(png) - 1))
    with pytest.raises(MediaError, match="over the size cap"):
        small.encode(_user(_image(data_url(png))))
    few = MultimodalProcessor.from_pretrained(vl_path, limits=MediaLimits(max_image_pixels=32 * 32 - 1))
    with pytest.raises(MediaError, match="32x32 pixels is over the cap"):
        few.encode(_user(_image(data_url(png))))
    assert issubclass(MediaError, ValueError)


def test_modalities_a_model_lacks_are_refused_by_name(vl_path, tiny_checkpoint):
    vl = MultimodalProcessor.from_pretrained(vl_path)
    audio = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
    with pytest.raises(MediaError, match=r"\(qwen3_vl\) does not take audio input \('input_audio' part\)"):
        vl.encode(_user(audio))
    with pytest.raises(MediaError, match="does not take audio input \\('audio_url' part\\)"):
        vl.encode(_user({"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,AA=="}}))
    with pytest.raises(MediaError, match="video input \\('video_url' part\\) is not supported yet"):
        vl.encode(_user({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AA=="}}))
    with pytest.raises(MediaError, match="unknown content part type 'picture'"):
        vl.encode(_user({"type": "picture", "url": "x"}))
    text_only = MultimodalProcessor.from_pretrained(tiny_checkpoint("qwen3"))
    assert text_only.modalities == {"text"}
    with pytest.raises(MediaError, match=r"\(qwen3\) does not take image input \('image_url' part\); it takes text"):
        text_only.encode(_user({"type": "text", "text": "hi"}, _image(data_url(_png(8, 8)))))
    # text parts alone go through the usual template: the same ids as the plain chat-template path
    messages = _user({"type": "text", "text": "hello "}, {"type": "text", "text": "there"})
    prompt = text_only.encode(messages)
    plain = text_only.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.input_ids == text_only.tokenizer.encode(plain, add_special_tokens=False)
    assert prompt.positions is None and prompt.pixel_values is None
    assert vl.encode(messages).positions.shape == (3, len(vl.encode(messages).input_ids))
