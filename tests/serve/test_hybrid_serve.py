"""``areno serve`` with the hybrid Ling 3 (bailing_hybrid: recurrent KDA layers with per-sequence state slots, MLA,
sparse MoE) and GPT-OSS (sinks, sliding windows, biased MoE): the command accepts them, and a request through the
official ``openai`` client returns the engine's own greedy text."""

import openai
import pytest
import torch

from areno.config import SamplingParams
from areno.engine.engine import Engine, EngineConfig
from areno.models import load_model, load_tokenizer
from areno.models.loader import check_engine_support
from areno.testing import make_tiny_checkpoint
from tests.serve.conftest import RunningServer


@pytest.mark.parametrize("family", ["bailing_hybrid", "gpt_oss"])
def test_one_request_through_the_openai_client(tmp_path, family):
    ckpt = make_tiny_checkpoint(tmp_path / family, family, seed=2)
    check_engine_support("--model-path", ckpt)  # `areno serve --model-path` no longer refuses it
    server = RunningServer(ckpt)
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
        out = client.completions.create(model="tiny", prompt="hello world, 12 + 3 =", max_tokens=8, temperature=0,
                                        n=2)
    finally:
        server.stop()
    tok = load_tokenizer(ckpt)
    engine = Engine(load_model(ckpt, dtype=torch.float32, device="cpu"), tok, EngineConfig(max_running=2))
    (want,) = engine.generate([tok.encode("hello world, 12 + 3 =")], SamplingParams(temperature=0.0,
                                                                                        max_new_tokens=8))
    text = tok.decode(want[0].token_ids, skip_special_tokens=True)
    assert [c.text for c in out.choices] == [text, text] and out.usage.completion_tokens == 16
