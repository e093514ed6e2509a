"""``areno serve --speculative-tokens 2 --eager-decode`` with a DeepSeek-V3 checkpoint whose MTP layer agrees with
it in part (``tests.helpers.mtp``): greedy completions, streamed and not, through the official ``openai`` client equal
the plain engine's text; a request for top log-probs gets a 400 naming the flag; ``/metrics`` counts the drafts,
their tokens and those accepted (vLLM's ``vllm:spec_decode_*`` counters) and shows the gate's limit."""

import shutil

import openai
import pytest
import torch

from areno.config import SamplingParams
from areno.engine.engine import Engine, EngineConfig
from areno.models import load_model, load_tokenizer, save_model
from areno.testing import make_tiny_checkpoint
from tests.helpers.mtp import make_echo_model
from tests.serve.conftest import RunningServer
from tests.serve.test_endpoints import scrape, value

PROMPT = "hello world, 12 + 3 ="


@pytest.mark.slow
def test_greedy_completions_equal_the_plain_engine(tmp_path):
    src = make_tiny_checkpoint(tmp_path / "src", "deepseek_v3", seed=2)
    model = make_echo_model(load_model(src, dtype=torch.float32, device="cpu"), scale=2.0)
    ckpt = save_model(model, tmp_path / "echo")
    for f in src.iterdir():  # the tokenizer's files
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")) and not (ckpt / f.name).exists():
            shutil.copy(f, ckpt / f.name)
    tok = load_tokenizer(ckpt)
    plain = Engine(load_model(ckpt, dtype=torch.float32, device="cpu"), tok, EngineConfig(max_running=2))
    (want,) = plain.generate([tok.encode(PROMPT)], SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True))
    text = tok.decode(want[0].token_ids, skip_special_tokens=True)
    server = RunningServer(ckpt, speculative_tokens=2, eager_decode=True)
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
        args = dict(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
        out = client.completions.create(n=2, **args)
        assert [c.text for c in out.choices] == [text, text] and out.usage.completion_tokens == 32
        streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **args))
        assert streamed == text
        with pytest.raises(openai.BadRequestError, match="--speculative-tokens"):
            client.completions.create(logprobs=3, **args)
        m = scrape(server)
        drafts = value(m, "vllm:spec_decode_num_drafts_total")
        tokens = value(m, "vllm:spec_decode_num_draft_tokens_total")
        accepted = value(m, "vllm:spec_decode_num_accepted_tokens_total", engine="0")
        assert drafts > 0 and drafts <= tokens <= 2 * drafts and 0 < accepted <= tokens
        # each draft verified emits 1 + its accepted tokens, of the 48 generated
        assert accepted + drafts <= value(m, "vllm:generation_tokens_total") == 48
        assert value(m, "areno:spec_decode_limit") == 32 and ("areno:spec_decode_gated_steps_total",
                                                              frozenset({("model_name", "tiny"), ("engine", "0")})) in m
    finally:
        server.stop()
