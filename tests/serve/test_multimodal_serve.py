"""``areno serve`` with images: a data-URL image through the official ``openai`` client (the engine in its own
process, so the images cross the process boundary), streamed and not, greedy text equal to the engine's on the same
processor output; undecodable images, remote URLs, audio to Qwen3-VL and images to a text-only model get a 400 that
says why."""

import io

import httpx
import numpy as np
import openai
import pytest
import torch

from areno.config import SamplingParams
from areno.engine.engine import Engine, EngineConfig
from areno.models import load_model
from areno.models.multimodal import MultimodalProcessor, data_url
from areno.testing import make_tiny_checkpoint
from tests.serve.conftest import RunningServer


def _png(h, w, seed) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _messages(url, text="describe"):
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                         {"type": "image_url", "image_url": {"url": url}}]}]  # fmt: skip


@pytest.fixture(scope="module")
def vl_ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("serve_vl"), "qwen3_vl", seed=5)


@pytest.fixture(scope="module")
def vl_server(vl_ckpt):
    s = RunningServer(vl_ckpt)
    yield s
    s.stop()


def _client(s):
    return openai.OpenAI(base_url=s.base_url + "/v1", api_key="x", max_retries=0, timeout=120)


def test_chat_with_a_data_url_image_matches_the_engine_streamed_or_not(vl_server, vl_ckpt):
    url = data_url(_png(32, 24, seed=1))
    client = _client(vl_server)
    out = client.chat.completions.create(model="tiny", messages=_messages(url), max_tokens=8, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=_messages(url), max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))  # fmt: skip
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    prompt = MultimodalProcessor.from_pretrained(vl_ckpt).encode(_messages(url))
    engine = Engine(load_model(vl_ckpt, dtype=torch.float32, device="cpu"), None, EngineConfig(max_running=2))
    (want,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=8))
    assert out.usage.prompt_tokens == len(prompt.input_ids) == chunks[-1].usage.prompt_tokens
    counted = httpx.post(vl_server.base_url + "/tokenize", json={"messages": _messages(url)}, timeout=60).json()
    assert counted["tokens"] == prompt.input_ids  # /tokenize expands the image placeholders as the chat route does
    assert out.usage.completion_tokens == len(want[0].token_ids)
    tok = MultimodalProcessor.from_pretrained(vl_ckpt).tokenizer
    assert out.choices[0].message.content == streamed == tok.decode(want[0].token_ids, skip_special_tokens=True)
    # a different image changes the prompt the model sees (the same text, other pixels)
    other = client.chat.completions.create(model="tiny", messages=_messages(data_url(_png(32, 24, seed=2))),
                                           max_tokens=8, temperature=0, logprobs=True)  # fmt: skip
    first = client.chat.completions.create(model="tiny", messages=_messages(url), max_tokens=8, temperature=0,
                                           logprobs=True)  # fmt: skip
    lps = [[t.logprob for t in o.choices[0].logprobs.content] for o in (first, other)]
    assert lps[0] != lps[1]


def _error(s, messages, **extra):
    r = httpx.post(s.base_url + "/v1/chat/completions", timeout=60,
                   json={"model": "tiny", "messages": messages, "max_tokens": 2, **extra})  # fmt: skip
    return r.status_code, r.json()["error"]


def test_bad_media_get_a_400_that_says_why(vl_server, server):
    bad = "data:image/png;base64," + "iVBORw0KGgoAAAANSUhEUgAA" * 4
    code, err = _error(vl_server, _messages(bad))
    assert code == 400 and err["param"] == "messages" and "could not decode the image" in err["message"]
    code, err = _error(vl_server, _messages("https://example.com/cat.png"))
    assert code == 400 and "remote URLs are not fetched" in err["message"]
    audio = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]
    code, err = _error(vl_server, audio)
    assert code == 400 and "does not take audio input" in err["message"] and "qwen3_vl" in err["message"]
    code, err = _error(vl_server, [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(_png(8, 8, 0)), "detail": "huge"}}]}])
    assert code == 400 and "part 0 (image_url) image_url.detail" in err["message"]  # low / high / auto accepted
    # the text-only server: an image is refused by name, the text of the same request still works without it
    code, err = _error(server, _messages(data_url(_png(16, 16, 3))))
    assert code == 400 and "does not take image input" in err["message"] and "qwen3" in err["message"]
    ok = _client(server).chat.completions.create(model="tiny", messages=[{"role": "user", "content": [
        {"type": "text", "text": "describe"}]}], max_tokens=2)
    assert ok.choices[0].finish_reason in ("length", "stop")
