"""``echo`` with prompt log-probs on /v1/completions, what lm-evaluation-harness's loglikelihood tasks send: the
prompt's tokens echoed with log p(token | tokens before it) from areno's own model (checked against
``log_softmax(model.logits(prompt))`` in fp32), the k likeliest tokens at each position, then the completion's own
tokens; the forward runs on the engine thread, between decode steps, so concurrent generations are unchanged."""

import asyncio
import json
import os
import threading
from operator import itemgetter

import httpx
import openai
import pytest
import torch

from areno.models import load_model, load_tokenizer

PROMPTS = ["The capital of France is Paris", "12 + 7 = 19", "a🙂b naïve"]


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    m = load_model(tiny_ckpt, dtype=torch.float32, device="cpu")
    m.eval()
    return m


@pytest.fixture(scope="module")
def tok(tiny_ckpt):
    return load_tokenizer(tiny_ckpt)


def reference(model, ids):
    """fp32 log-softmax of the plain forward: [T, V]."""
    with torch.no_grad():
        return torch.log_softmax(model.logits(torch.tensor([ids]))[0].float(), dim=-1)


def completions(server, **body):
    r = httpx.post(server.base_url + "/v1/completions", json={"model": "tiny", "temperature": 0, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("k", [0, 3])
def test_echoed_prompt_logprobs_equal_the_models(server, model, tok, k):
    ids = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    out = completions(server, prompt=ids, max_tokens=0, echo=True, logprobs=k)
    assert out["usage"] == {"prompt_tokens": sum(map(len, ids)), "completion_tokens": 0,
                            "total_tokens": sum(map(len, ids))}
    for choice, p, text in zip(sorted(out["choices"], key=itemgetter("index")), ids, PROMPTS):
        lp = choice["logprobs"]
        assert choice["text"] == text and choice["finish_reason"] == "length"
        ref = reference(model, p)
        assert lp["tokens"] == [tok.decode([t]) for t in p]
        assert lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) == len(p)
        want = ref[:-1].gather(1, torch.tensor(p[1:])[:, None])[:, 0]
        assert torch.allclose(torch.tensor(lp["token_logprobs"][1:]), want, atol=1e-4)
        if not k:
            assert lp["top_logprobs"] is None
            continue
        assert lp["top_logprobs"][0] is None
        top_vals, top_ids = ref[:-1].topk(k, dim=-1)
        for pos, top in enumerate(lp["top_logprobs"][1:]):
            expected = {}
            for t, v in zip(top_ids[pos].tolist(), top_vals[pos].tolist()):
                expected.setdefault(tok.decode([t]), v)
            assert list(top) == list(expected)  # most likely first
            assert list(top.values()) == pytest.approx(list(expected.values()), abs=1e-4)
        offsets = lp["text_offset"]
        assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] <= len(text)


def test_lm_eval_loglikelihood_request(server, model, tok):
    """The body lm-eval 0.4.x's ``local-completions`` sends for loglikelihood, and what its parse_logprobs reads:
    token_logprobs[ctxlen:-1] summed, is_greedy from top_logprobs[ctxlen:-1], choices by index."""
    pairs = [("Question: 2 + 3 =", " 5"), ("The cat sat on the", " mat"), ("One, two,", " three")]
    reqs = [(tok.encode(c, add_special_tokens=False), tok.encode(c + x, add_special_tokens=False)) for c, x in pairs]
    body = {"model": "tiny", "prompt": [full for _, full in reqs], "temperature": 0, "max_tokens": 1, "logprobs": 1,
            "seed": 1234, "echo": True}
    r = httpx.post(server.base_url + "/v1/completions", content=json.dumps(body),
                   headers={"Content-Type": "application/json"}, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    for choice, (ctx, full) in zip(sorted(out["choices"], key=itemgetter("index")), reqs):
        ctxlen = len(ctx)
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(full) + 1
        assert len(lp["text_offset"]) == len(full) + 1 and lp["text_offset"] == sorted(lp["text_offset"])
        continuation = lp["token_logprobs"][ctxlen:-1]
        ref = reference(model, full)
        want = ref[ctxlen - 1 : -1].gather(1, torch.tensor(full[ctxlen:])[:, None])[:, 0]
        assert sum(continuation) == pytest.approx(want.sum().item(), abs=1e-4)
        is_greedy = all(t == max(top.values()) for t, top in zip(continuation, lp["top_logprobs"][ctxlen:-1]))
        assert is_greedy == bool((ref[ctxlen - 1 : -1].argmax(-1) == torch.tensor(full[ctxlen:])).all())
        assert all(len(top) == 1 for top in lp["top_logprobs"][1:])
        # the one generated token comes last, greedy: its log-prob is the top one
        assert lp["token_logprobs"][-1] == pytest.approx(max(lp["top_logprobs"][-1].values()), abs=1e-5)
        assert lp["text_offset"][len(full)] == len(tok.decode(full))
    # a token whose top candidate is the context's own next token is greedy: check the flag can be true
    greedy_ctx = reqs[0][0]
    nxt = int(reference(model, greedy_ctx)[-1].argmax())
    out = completions(server, prompt=[greedy_ctx + [nxt]], max_tokens=1, logprobs=1, echo=True, seed=1234)
    lp = out["choices"][0]["logprobs"]
    assert lp["token_logprobs"][len(greedy_ctx)] == max(lp["top_logprobs"][len(greedy_ctx)].values())


def test_echo_through_the_openai_client_and_streaming(server, tok):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
    full = client.completions.create(model="tiny", prompt="the cat", max_tokens=5, temperature=0, echo=True,
                                     logprobs=2, extra_body={"ignore_eos": True})
    plain = client.completions.create(model="tiny", prompt="the cat", max_tokens=5, temperature=0, logprobs=2,
                                      extra_body={"ignore_eos": True})
    c = full.choices[0]
    n_prompt = len(tok.encode("the cat", add_special_tokens=False))
    assert c.text == "the cat" + plain.choices[0].text
    assert c.logprobs.tokens[n_prompt:] == plain.choices[0].logprobs.tokens
    assert c.logprobs.token_logprobs[n_prompt:] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-5)
    assert c.logprobs.text_offset[n_prompt:] == [x + len("the cat") for x in plain.choices[0].logprobs.text_offset]
    chunks = list(client.completions.create(model="tiny", prompt="the cat", max_tokens=5, temperature=0, echo=True,
                                            logprobs=2, stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].text == "the cat"  # the prompt first, with its log-probs
    assert chunks[0].choices[0].logprobs.token_logprobs[0] is None
    assert "".join(ch.choices[0].text for ch in chunks) == c.text
    tokens = [t for ch in chunks for t in ch.choices[0].logprobs.tokens]
    offsets = [x for ch in chunks for x in ch.choices[0].logprobs.text_offset]
    assert tokens == c.logprobs.tokens and offsets == c.logprobs.text_offset
    # echo without log-probs: the text only, no forward needed; max_tokens 0 streamed: the prompt, then the end
    assert completions(server, prompt="the cat", max_tokens=0, echo=True)["choices"][0]["text"] == "the cat"
    only = list(client.completions.create(model="tiny", prompt="the cat", max_tokens=0, echo=True, stream=True))
    assert [(ch.choices[0].text, ch.choices[0].finish_reason) for ch in only] == [("the cat", "length")]


def test_scoring_never_races_decoding(server):
    """Prompt forwards interleaved with running generations leave both exactly as they are alone."""
    long_body = {"model": "tiny", "prompt": "slow and steady", "max_tokens": 160, "ignore_eos": True,
                 "temperature": 0, "logprobs": 1}
    alone = completions(server, **{k: v for k, v in long_body.items() if k != "model"})
    score_body = {"prompt": ["The capital of France is Paris", "one two three four"], "max_tokens": 0,
                  "echo": True, "logprobs": 2}
    solo = completions(server, **score_body)

    async def main():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:
            longs = [asyncio.create_task(http.post("/v1/completions", json=long_body)) for _ in range(3)]
            await asyncio.sleep(0.2)
            scores = await asyncio.gather(*(http.post("/v1/completions", json={"model": "tiny", **score_body})
                                            for _ in range(6)))
            return [r.json() for r in await asyncio.gather(*longs)], [r.json() for r in scores]

    longs, scores = asyncio.run(main())
    for out in longs:
        assert out["choices"][0]["text"] == alone["choices"][0]["text"]
        assert out["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
            alone["choices"][0]["logprobs"]["token_logprobs"], abs=1e-4)
    for out in scores:
        for a, b in zip(out["choices"], solo["choices"]):
            assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
            assert a["logprobs"]["token_logprobs"][1:] == pytest.approx(b["logprobs"]["token_logprobs"][1:],
                                                                        abs=1e-5)


def where_am_i(engine):
    """Run by run_on_engine: the engine it was given, and the process and thread it ran in."""
    return engine.max_model_len, os.getpid(), threading.current_thread().name


def test_engine_call_runs_between_steps(server):
    """run_on_engine hands the function the engine itself, where the engine runs: its engine-core process, or
    (--engine-thread) the engine thread of this process."""
    max_len, pid, thread = asyncio.run(server.engine.run_on_engine(where_am_i))
    assert max_len == 512
    if pid == os.getpid():
        assert thread == "areno-engine"
    else:
        assert pid in [r.process.pid for r in server.engine.replicas]


# ---- vLLM's prompt_logprobs ----------------------------------------------------------------------------------------
def check_prompt_logprobs(plp, model, tok, ids, k):
    """vLLM's format: None first, then {token id: {logprob, rank, decoded_token}} with the prompt's own token (its
    rank: how many tokens are at least as likely) and the k likeliest (ranks 1..k), from the model's forward."""
    ref = reference(model, ids)
    assert len(plp) == len(ids) and plp[0] is None
    for pos, entry in enumerate(plp[1:]):
        row, own = ref[pos], ids[pos + 1]
        top_vals, top_ids = row.topk(k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
        want_ids = [own, *(t for t in top_ids.tolist() if t != own)]
        assert [int(t) for t in entry] == want_ids  # the prompt's token first, then the likeliest
        got = entry[str(own)]
        assert got["logprob"] == pytest.approx(row[own].item(), abs=1e-4)
        assert got["rank"] == int((row >= row[own]).sum()) and got["decoded_token"] == tok.decode([own])
        for r, (t, v) in enumerate(zip(top_ids.tolist(), top_vals.tolist()), start=1):
            e = entry[str(t)]
            assert e["logprob"] == pytest.approx(v, abs=1e-4) and e["decoded_token"] == tok.decode([t])
            assert e["rank"] == (r if t != own else got["rank"])


@pytest.mark.parametrize("k", [0, 2])
def test_prompt_logprobs_on_completions(server, model, tok, k):
    ids = [tok.encode(p, add_special_tokens=False) for p in PROMPTS[:2]]
    out = completions(server, prompt=ids, max_tokens=2, n=2, prompt_logprobs=k, logprobs=1, echo=k > 0)
    choices = sorted(out["choices"], key=itemgetter("index"))
    assert len(choices) == 4
    for c in choices:
        p = ids[c["index"] // 2]
        check_prompt_logprobs(c["prompt_logprobs"], model, tok, p, k)
        if k:  # echo's own top_logprobs keep logprobs=1 candidates while prompt_logprobs has k
            assert all(len(top) == 1 for top in c["logprobs"]["top_logprobs"][1 : len(p)])
    # absent unless asked for; the bounds and streaming are refused by name
    assert "prompt_logprobs" not in completions(server, prompt="the cat", max_tokens=1)["choices"][0]
    for body in ({"prompt_logprobs": 21}, {"prompt_logprobs": -1}, {"prompt_logprobs": 1, "stream": True}):
        r = httpx.post(server.base_url + "/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": "the cat", "max_tokens": 1, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text


def test_prompt_logprobs_on_chat_through_the_openai_client(server, model, tok):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0,
                                         extra_body={"prompt_logprobs": 3, "return_tokens_as_token_ids": True})
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False)
    plp = out.model_extra["prompt_logprobs"]
    assert out.usage.prompt_tokens == len(ids) == len(plp)
    ref = reference(model, ids)
    for pos, entry in enumerate(plp[1:]):
        own = ids[pos + 1]
        assert entry[str(own)]["decoded_token"] == f"token_id:{own}"
        assert entry[str(own)]["logprob"] == pytest.approx(ref[pos, own].item(), abs=1e-4)
        assert len(entry) in (3, 4) and sorted(e["rank"] for e in entry.values())[:3] == [1, 2, 3]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, stream=True,
                                       extra_body={"prompt_logprobs": 1})
    assert e.value.param == "prompt_logprobs"
