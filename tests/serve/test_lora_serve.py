"""LoRA adapters on areno serve (vLLM's surface) driven by the real openai client: --lora-modules (both forms), the
request's model picks the adapter, /v1/models lists them with their parent, requests for different adapters at once
equal each alone and PEFT's model (greedy), /v1/load_lora_adapter and /v1/unload_lora_adapter with their 4xx
refusals naming the adapter, behind the API key; the flags' refusals."""

import concurrent.futures
import json

import httpx
import openai
import pytest

from areno.config import ConfigError, ServeConfig
from areno.models import load_tokenizer
from areno.testing import make_tiny_checkpoint
from tests.helpers.lora_adapters import make_adapter, peft_greedy
from tests.serve.conftest import RunningServer

pytest.importorskip("peft")

KEY = "sekret"
STEPS = 6


@pytest.fixture(scope="module")
def adapters(tiny_ckpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    other = make_tiny_checkpoint(root / "other", family="qwen3", seed=1, hidden_size=48)
    return {
        "a": make_adapter(tiny_ckpt, root / "a", rank=4, alpha=8, targets="all-linear", seed=1),
        "b": make_adapter(tiny_ckpt, root / "b", rank=8, alpha=8, targets=["q_proj", "v_proj"], seed=2),
        "c": make_adapter(tiny_ckpt, root / "c", rank=2, alpha=4, targets=["o_proj", "up_proj"], seed=3),
        "big": make_adapter(tiny_ckpt, root / "big", rank=16, alpha=16, targets=["q_proj"], seed=4),
        "wrong": make_adapter(other, root / "wrong", rank=2, alpha=2, targets=["q_proj"], seed=5),
    }


@pytest.fixture(scope="module")
def lora_server(tiny_ckpt, adapters):
    modules = [f"a={adapters['a']}", json.dumps({"name": "b", "path": str(adapters["b"]), "base_model_name": "tiny"})]
    s = RunningServer(tiny_ckpt, lora_modules=modules, max_loras=3, max_lora_rank=8, api_key=KEY)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(lora_server):
    return openai.OpenAI(base_url=lora_server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def tokens(client, model, prompt):
    """Greedy token ids of a completion (vLLM's return_tokens_as_token_ids names each token by its id)."""
    out = client.completions.create(model=model, prompt=prompt, max_tokens=STEPS, temperature=0, logprobs=0,
                                    extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    return [int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens]


def admin(server, path, body, key=KEY):
    return httpx.post(f"{server.base_url}/v1/{path}", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=60)


def test_models_list_the_adapters_with_their_parent(client):
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == ["tiny", "a", "b"]
    assert cards["a"].parent == cards["b"].parent == "tiny" and cards["tiny"].parent is None
    assert client.models.retrieve("b").id == "b"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="zz", prompt="hi", max_tokens=2)


def test_responses_echo_the_adapters_name_as_vllm(client):
    """``model`` in chat, completions (whole and each streamed chunk) and /v1/responses: the adapter asked for."""
    for model in ("a", "tiny"):
        chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=2)
        text = client.completions.create(model=model, prompt="hi", max_tokens=2)
        chunks = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=2, stream=True))
        chunks += list(client.completions.create(model=model, prompt="hi", max_tokens=2, stream=True))
        resp = client.responses.create(model=model, input="hi", max_output_tokens=2)
        assert chat.model == text.model == resp.model == model and {c.model for c in chunks} == {model}


def test_adapters_at_once_equal_each_alone_and_peft(client, tiny_ckpt, adapters):
    tok = load_tokenizer(tiny_ckpt)
    prompts = [tok.encode("hello world, 12 + 3 ="), tok.encode("the cat sat on")]
    jobs = [("a", prompts[0]), ("b", prompts[1]), ("tiny", prompts[0]), ("b", prompts[0])]
    alone = [tokens(client, m, p) for m, p in jobs]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda j: tokens(client, *j), jobs))
    assert together == alone
    assert alone[0] != alone[2] and alone[3] != alone[2]  # each adapter changes the answer
    assert alone[0] == peft_greedy(tiny_ckpt, adapters["a"], prompts[0], STEPS)
    chat = client.chat.completions.create(model="b", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert chat.usage.completion_tokens == 3


def test_load_use_and_unload_at_run_time(lora_server, client, adapters, tiny_ckpt):
    tok = load_tokenizer(tiny_ckpt)
    prompt = tok.encode("hello world, 12 + 3 =")
    r = admin(lora_server, "load_lora_adapter", {"lora_name": "c", "lora_path": str(adapters["c"])})
    assert r.status_code == 200 and "c" in r.text
    assert [m.id for m in client.models.list().data] == ["tiny", "a", "b", "c"]
    got = tokens(client, "c", prompt)
    assert got == peft_greedy(tiny_ckpt, adapters["c"], prompt, STEPS)
    r = admin(lora_server, "load_lora_adapter", {"lora_name": "d", "lora_path": str(adapters["a"])})
    assert r.status_code == 400 and "d" in r.json()["error"]["message"] and "slots" in r.json()["error"]["message"]
    assert admin(lora_server, "unload_lora_adapter", {"lora_name": "c"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="c", prompt="hi", max_tokens=2)
    assert [m.id for m in client.models.list().data] == ["tiny", "a", "b"]
    r = admin(lora_server, "load_lora_adapter", {"lora_name": "c2", "lora_path": str(adapters["c"])})
    assert r.status_code == 200  # the freed slot takes another adapter
    assert tokens(client, "c2", prompt) == got
    assert admin(lora_server, "unload_lora_adapter", {"lora_name": "c2"}).status_code == 200


@pytest.mark.parametrize("body,status,words", [
    ({"lora_name": "big", "lora_path": "BIG"}, 400, ["big", "rank 16 is over --max-lora-rank 8"]),
    ({"lora_name": "gone", "lora_path": "/nonexistent/adapter"}, 400, ["gone", "does not exist"]),
    ({"lora_name": "wrong", "lora_path": "WRONG"}, 400, ["wrong", "another base model"]),
    ({"lora_name": "a", "lora_path": "BIG"}, 400, ["'a'", "already been loaded"]),
    ({"lora_name": "tiny", "lora_path": "BIG"}, 400, ["base model"]),
    ({"lora_name": "x"}, 400, ["lora_path"]),
])
def test_bad_loads_get_a_4xx_naming_the_adapter(lora_server, client, adapters, body, status, words):
    body = {k: str(adapters["big"]) if v == "BIG" else str(adapters["wrong"]) if v == "WRONG" else v
            for k, v in body.items()}
    r = admin(lora_server, "load_lora_adapter", body)
    assert r.status_code == status, r.text
    for w in words:
        assert w in r.json()["error"]["message"], r.text
    assert [m.id for m in client.models.list().data] == ["tiny", "a", "b"]


def test_unload_errors_and_the_api_key(lora_server):
    r = admin(lora_server, "unload_lora_adapter", {"lora_name": "nope"})
    assert r.status_code == 404 and "nope" in r.json()["error"]["message"]
    assert admin(lora_server, "load_lora_adapter", {"lora_name": "x", "lora_path": "/x"}, key="bad").status_code == 401
    assert admin(lora_server, "unload_lora_adapter", {"lora_name": "a"}, key="bad").status_code == 401


def test_prompt_logprobs_for_an_adapter_are_refused(client):
    with pytest.raises(openai.BadRequestError, match="LoRA adapter"):
        client.completions.create(model="a", prompt="hi", max_tokens=1, extra_body={"prompt_logprobs": 1})


def test_the_flags(tiny_ckpt):
    base = {"model_path": str(tiny_ckpt), "served_model_name": "tiny"}
    cfg = ServeConfig(**base, lora_modules=["x=/p", '{"name": "y", "path": "/q"}'])
    assert cfg.lora_adapters() == [{"name": "x", "path": "/p", "base_model_name": "tiny"},
                                   {"name": "y", "path": "/q", "base_model_name": "tiny"}]
    assert cfg.lora_engine_kwargs() == {"max_loras": 2, "max_lora_rank": 16, "lora_modules": {"x": "/p", "y": "/q"}}
    assert ServeConfig(**base).lora_engine_kwargs() == {}
    from areno.cli import make_parser

    argv = ["--model-path", "m", "--lora-modules", "x=/p", '{"name": "y", "path": "/q"}', "--max-loras", "3"]
    assert make_parser("serve", ServeConfig).parse_explicit(argv) == {
        "model_path": "m", "lora_modules": ["x=/p", '{"name": "y", "path": "/q"}'], "max_loras": 3}
    for kw, flag, words in [
        ({"lora_modules": ["x"]}, "--lora-modules", "not name=path"),
        ({"lora_modules": ['{"name": "y"}']}, "--lora-modules", "JSON form"),
        ({"lora_modules": ["x=/p", "x=/q"]}, "--lora-modules", "twice"),
        ({"lora_modules": ["tiny=/p"]}, "--lora-modules", "base model"),
        ({"lora_modules": ["x=/p", "y=/q"], "max_loras": 1}, "--max-loras", "cannot hold"),
        ({"max_lora_rank": 8}, "--max-lora-rank", "applies only with"),
        ({"max_loras": 2, "tp_size": 2, "world_size": 2}, "--max-loras", "--tp-size > 1 is not built yet"),
    ]:
        with pytest.raises(ConfigError, match=f"^{flag} .*{words}"):
            ServeConfig(**base, **kw)

