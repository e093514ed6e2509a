"""What clients send to every OpenAI-compatible server: vLLM's request extensions and the SDK's newer fields are
honoured (or accepted where they change nothing here); fields that would change the answer and are not built get a
400 naming them; errors of checks across fields name their field; streamed completion log-probs; text offsets."""

import json
import logging

import httpx
import openai
import pytest

from areno.models import load_tokenizer
from areno.serve.text import Detokenizer, token_offsets

USER = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tok(tiny_ckpt):
    return load_tokenizer(tiny_ckpt)


def post(server, path, body, status=200):
    r = httpx.post(server.base_url + path, json=body, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


def completion(server, **body):
    return post(server, "/v1/completions", {"model": "tiny", "temperature": 0, **body})


def chat(server, status=200, **body):
    return post(server, "/v1/chat/completions", {"model": "tiny", "temperature": 0, **body}, status)


def stream_events(server, path, body):
    out = []
    with httpx.stream("POST", server.base_url + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


# ---- fields accepted ---------------------------------------------------------------------------------------------
def test_sdk_and_vllm_fields_through_the_openai_client(client, caplog):
    caplog.set_level(logging.INFO, logger="areno.serve")
    out = client.chat.completions.create(
        model="tiny", messages=USER, max_completion_tokens=4, temperature=0, store=True, metadata={"run": "eval"},
        reasoning_effort="low", service_tier="auto", user="u1", response_format={"type": "text"},
        presence_penalty=0, frequency_penalty=0, logit_bias={},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}, "skip_special_tokens": True,
                    "include_stop_str_in_output": False, "stop_token_ids": [5], "repetition_penalty": 1.0,
                    "min_p": 0.0, "prompt_logprobs": None, "add_generation_prompt": True})
    assert out.choices[0].finish_reason in ("stop", "length") and out.usage.completion_tokens <= 4
    notes = [r.getMessage() for r in caplog.records if "accepted and ignored" in r.getMessage()]
    assert any("store" in n for n in notes) and any("metadata" in n for n in notes)
    assert any("reasoning_effort" in n for n in notes)  # the tiny template does not use it
    comp = client.completions.create(model="tiny", prompt="the cat", max_tokens=3, temperature=0,
                                     extra_body={"max_completion_tokens": 5, "ignore_eos": True})
    assert comp.usage.completion_tokens == 5  # max_completion_tokens, the newer name, wins on completions too


def test_null_means_the_default(server):
    out = chat(server, messages=USER, max_tokens=3, n=None, logprobs=None, stream=None, top_logprobs=None,
               stop=None, seed=None, tools=None, ignore_eos=None)
    assert len(out["choices"]) == 1 and out["choices"][0]["logprobs"] is None


def test_chat_template_kwargs_reach_the_template(server, tok):
    plain = post(server, "/tokenize", {"messages": USER})["tokens"]
    off = post(server, "/tokenize", {"messages": USER, "chat_template_kwargs": {"enable_thinking": False}})["tokens"]
    assert tok.decode(off).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") and off[: len(plain)] == plain
    a = chat(server, messages=USER, max_tokens=2)
    b = chat(server, messages=USER, max_tokens=2, chat_template_kwargs={"enable_thinking": False})
    assert b["usage"]["prompt_tokens"] - a["usage"]["prompt_tokens"] == len(off) - len(plain) > 0
    # a key that is a parameter of the template call, not a template variable, is refused by name
    err = chat(server, 400, messages=USER, chat_template_kwargs={"tokenize": True})["error"]
    assert err["param"] == "chat_template_kwargs" and "'tokenize'" in err["message"]


def test_add_generation_prompt_false(server, tok):
    ids = post(server, "/tokenize", {"messages": USER, "add_generation_prompt": False})["tokens"]
    assert tok.decode(ids).endswith("What is 2 + 3?<|im_end|>\n")
    out = chat(server, messages=USER, max_tokens=2, add_generation_prompt=False)
    assert out["usage"]["prompt_tokens"] == len(ids)


def test_continue_final_message_continues_the_assistant_turn(server, tok):
    messages = USER + [{"role": "assistant", "content": "The answer is"}]
    ids = post(server, "/tokenize", {"messages": messages, "continue_final_message": True})["tokens"]
    text = tok.decode(ids)
    assert text.endswith("<|im_start|>assistant\nThe answer is")  # left open: no <|im_end|>
    cont = chat(server, messages=messages, continue_final_message=True, max_tokens=8, ignore_eos=True)
    same = completion(server, prompt=[ids], max_tokens=8, ignore_eos=True)
    assert cont["usage"]["prompt_tokens"] == len(ids)
    assert cont["choices"][0]["message"]["content"] == same["choices"][0]["text"]
    err = chat(server, 400, messages=messages, continue_final_message=True, add_generation_prompt=True)["error"]
    assert err["param"] == "continue_final_message" and not err["message"].startswith("Value error")
    err = chat(server, 400, messages=USER, continue_final_message=True)["error"]
    assert err["param"] == "continue_final_message" and "assistant" in err["message"]


def test_stop_token_ids_and_include_stop_str_in_output(server, tok):
    free = completion(server, prompt="the cat", max_tokens=12, ignore_eos=True, logprobs=0,
                      return_tokens_as_token_ids=True)
    ids = [int(t.split(":")[1]) for t in free["choices"][0]["logprobs"]["tokens"]]
    j = next(j for j in range(2, len(ids)) if ids[j] not in ids[:j] and tok.decode(ids[j]).strip())
    cut = completion(server, prompt="the cat", max_tokens=12, stop_token_ids=[ids[j]])
    assert cut["choices"][0]["finish_reason"] == "stop" and cut["usage"]["completion_tokens"] == j + 1
    assert cut["choices"][0]["text"] == tok.decode(ids[:j])  # the stop token's text is left out, as vLLM does
    kept = completion(server, prompt="the cat", max_tokens=12, stop_token_ids=[ids[j]],
                      include_stop_str_in_output=True)
    assert kept["choices"][0]["text"] == tok.decode(ids[: j + 1])
    text = free["choices"][0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    plain = completion(server, prompt="the cat", max_tokens=12, stop=[stop])["choices"][0]["text"]
    with_stop = completion(server, prompt="the cat", max_tokens=12, stop=[stop], include_stop_str_in_output=True)
    assert plain == text[: text.index(stop)] and with_stop["choices"][0]["text"] == plain + stop
    streamed = stream_events(server, "/v1/completions", {"model": "tiny", "prompt": "the cat", "max_tokens": 12,
                                                         "temperature": 0, "stop": [stop], "stream": True,
                                                         "include_stop_str_in_output": True})
    assert "".join(e["choices"][0]["text"] for e in streamed if e["choices"]) == plain + stop
    err = post(server, "/v1/completions", {"model": "tiny", "prompt": "x", "stop_token_ids": [10**6]}, 400)["error"]
    assert err["param"] == "stop_token_ids"


def test_skip_special_tokens(server, tok):
    ids = tok.encode("132", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    shown = completion(server, prompt=ids, max_tokens=0, echo=True, skip_special_tokens=False)
    hidden = completion(server, prompt=ids, max_tokens=0, echo=True)
    assert shown["choices"][0]["text"] == "132<|im_end|>" and hidden["choices"][0]["text"] == "132"
    d = Detokenizer(tok, [], skip_special_tokens=False)
    d.ids = ids
    assert d.final_text(None, "length") == "132<|im_end|>"
    assert d.final_text(None, "stop") == "132"  # the token that stopped it is not part of the text


def test_return_tokens_as_token_ids(server, client):
    comp = completion(server, prompt="abc", max_tokens=4, logprobs=2, return_tokens_as_token_ids=True)
    lp = comp["choices"][0]["logprobs"]
    assert all(t.startswith("token_id:") and t[9:].isdigit() for t in lp["tokens"])
    assert all(k.startswith("token_id:") for top in lp["top_logprobs"] for k in top)
    out = client.chat.completions.create(model="tiny", messages=USER, max_tokens=3, temperature=0, logprobs=True,
                                         top_logprobs=2, extra_body={"return_tokens_as_token_ids": True})
    assert all(c.token.startswith("token_id:") for c in out.choices[0].logprobs.content)


def test_continuous_usage_stats(server):
    for path, extra in (("/v1/completions", {"prompt": "the cat"}), ("/v1/chat/completions", {"messages": USER})):
        events = stream_events(server, path, {"model": "tiny", "max_tokens": 6, "ignore_eos": True, "stream": True,
                                              "stream_options": {"include_usage": True,
                                                                 "continuous_usage_stats": True}, **extra})
        counts = [e["usage"]["completion_tokens"] for e in events]
        assert all("usage" in e for e in events) and counts == sorted(counts) and counts[-1] == 6
        assert events[-1]["choices"] == []
    plain = stream_events(server, "/v1/completions", {"model": "tiny", "prompt": "the cat", "max_tokens": 3,
                                                      "stream": True, "stream_options": {"include_usage": True}})
    assert [("usage" in e) for e in plain] == [False] * (len(plain) - 1) + [True]


# ---- fields refused until built ----------------------------------------------------------------------------------
REFUSED = [  # (route, field, value)
    ("completions", "suffix", " and then"),
    ("completions", "best_of", 3),
]


@pytest.mark.parametrize("endpoint,field,value", REFUSED)
def test_fields_that_would_change_the_answer_are_refused_by_name(server, endpoint, field, value):
    body = {"model": "tiny", "max_tokens": 2, field: value}
    body.update({"messages": USER} if endpoint == "chat" else {"prompt": "hi"})
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    err = post(server, path, body, 400)["error"]
    assert err["param"] == field and f"{field} is not supported yet" in err["message"], err


def test_refusals_reach_the_openai_client_as_bad_requests(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=USER, max_tokens=2,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "x", "schema": {"type": "nonsense"}}})
    assert e.value.param == "response_format"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="hi", max_tokens=2, presence_penalty=2.5)
    assert e.value.param == "presence_penalty"


CROSS_FIELD = [  # (body, the field the error names)
    ({"messages": USER, "top_logprobs": 3}, "top_logprobs"),
    ({"messages": USER, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": USER, "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"prompt": "hi", "suffix": "x"}, "suffix"),
    ({"prompt": "hi", "best_of": 3}, "best_of"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": [], "max_tokens": 1}, "prompt"),
]


@pytest.mark.parametrize("body,field", CROSS_FIELD)
def test_cross_field_errors_name_their_field(server, body, field):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    err = post(server, path, {"model": "tiny", **body}, 400)["error"]
    assert err["param"] == field and not err["message"].startswith("Value error"), err
    assert set(err) == {"message", "type", "param", "code"}


# ---- log-probs of streamed completions, text offsets -----------------------------------------------------------
def joined_logprobs(events):
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in events:
        for c in e["choices"]:
            lp = c["logprobs"]
            if lp is not None:
                for key in out:
                    out[key] += lp[key]
    return out


@pytest.mark.parametrize("stop", [None, "zz"])
def test_streamed_completion_logprobs_match_the_full_response(server, stop):
    body = {"model": "tiny", "prompt": "12 + 7 =", "max_tokens": 24, "temperature": 0, "logprobs": 2,
            "ignore_eos": True, "stop": stop}
    full = post(server, "/v1/completions", body)["choices"][0]
    events = stream_events(server, "/v1/completions", {**body, "stream": True})
    assert all(c["logprobs"] is not None for e in events for c in e["choices"])  # was null in every chunk
    got = joined_logprobs(events)
    assert got["tokens"] == full["logprobs"]["tokens"] and got["text_offset"] == full["logprobs"]["text_offset"]
    assert got["token_logprobs"] == pytest.approx(full["logprobs"]["token_logprobs"], abs=1e-5)
    assert [list(t) for t in got["top_logprobs"]] == [list(t) for t in full["logprobs"]["top_logprobs"]]
    assert "".join(c["text"] for e in events for c in e["choices"]) == full["text"]


def test_text_offsets_index_into_the_returned_text(server, tok):
    """Special tokens the text leaves out have no length (text "132" used to give offsets [0, 1, 2, 3, 13, 23])."""
    special = [tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    ids = tok.encode("132", add_special_tokens=False) + special
    assert token_offsets(tok, ids) == [0, 1, 2, 3, 3]
    assert token_offsets(tok, ids, skip_special_tokens=False) == [0, 1, 2, 3, 13]
    echoed = completion(server, prompt=ids, max_tokens=0, echo=True, logprobs=0)["choices"][0]
    assert echoed["text"] == "132" and echoed["logprobs"]["text_offset"] == [0, 1, 2, 3, 3]
    emoji = tok.encode("a🙂b", add_special_tokens=False)  # a character split over byte tokens
    offs = token_offsets(tok, emoji)
    assert offs[0] == 0 and offs[-1] == 2 and offs == sorted(offs)
    for prompt in ("the cat", "What is 2 + 3?", "12 + 7 ="):
        c = completion(server, prompt=prompt, max_tokens=20, logprobs=1, ignore_eos=True)["choices"][0]
        offsets, text = c["logprobs"]["text_offset"], c["text"]
        assert offsets == sorted(offsets) and all(0 <= x <= len(text) for x in offsets)
        assert offsets[0] == 0


def test_assistant_messages_read_back_from_a_response(server, tok):
    """An assistant message sent back as a client library read it (``refusal``, ``annotations``) is accepted;
    ``reasoning_content`` reaches the templates that render it."""
    messages = USER + [{"role": "assistant", "content": "5", "refusal": None, "annotations": [],
                        "reasoning_content": "2 plus 3"}, {"role": "user", "content": "And 2 + 4?"}]
    ids = post(server, "/tokenize", {"messages": messages})["tokens"]
    assert "<|im_start|>assistant\n<think>\n2 plus 3\n</think>\n\n5<|im_end|>" in tok.decode(ids)
    assert chat(server, messages=messages, max_tokens=2)["usage"]["prompt_tokens"] == len(ids)


# ---- sampling options in the engine's sampler ----------------------------------------------------------------------
def token_ids(choice) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]


def test_penalties_min_p_and_logit_bias_reach_the_sampler(client, tiny_ckpt, tok):
    """Through the openai client: the tokens and log-probs are those of the engine given the same options."""
    import torch

    from areno.config import SamplingParams
    from areno.engine.engine import Engine, EngineConfig
    from areno.models import load_model

    kw = dict(temperature=0.9, seed=7, frequency_penalty=1.0, presence_penalty=0.5, logit_bias={"17": 3.0})
    extra = {"repetition_penalty": 1.3, "min_p": 0.05, "ignore_eos": True, "return_tokens_as_token_ids": True}
    out = client.completions.create(model="tiny", prompt="a b a b a b", max_tokens=8, logprobs=0, extra_body=extra,
                                    **kw).choices[0]  # fmt: skip
    engine = Engine(load_model(tiny_ckpt, dtype=torch.float32, device="cpu"), tok, EngineConfig(block_size=4))
    ref = engine.generate([tok.encode("a b a b a b")], SamplingParams(
        temperature=0.9, seed=7, frequency_penalty=1.0, presence_penalty=0.5, logit_bias={17: 3.0},
        repetition_penalty=1.3, min_p=0.05, ignore_eos=True, max_new_tokens=8))[0][0]
    assert token_ids(out) == ref.token_ids
    assert out.logprobs.token_logprobs == pytest.approx(ref.logprobs, abs=1e-5)
    forced = client.completions.create(model="tiny", prompt="the cat", max_tokens=4, temperature=0, logprobs=0,
                                       logit_bias={"17": 100}, extra_body=extra).choices[0]  # fmt: skip
    assert token_ids(forced) == [17] * 4


def test_min_tokens_masks_eos(client, tok):
    """EOS (pushed to the top by a bias) comes only once min_tokens tokens are out: no hidden EOS in the text, the
    usage or the log-probs before it."""
    eos = tok.eos_token_id
    out = client.completions.create(model="tiny", prompt="the cat", max_tokens=12, temperature=1.0, seed=3, logprobs=0,
                                    logit_bias={str(eos): 30},
                                    extra_body={"min_tokens": 5, "return_tokens_as_token_ids": True})  # fmt: skip
    ids = token_ids(out.choices[0])
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == 6
    assert ids[-1] == eos and eos not in ids[:-1] and all(lp > -50 for lp in out.choices[0].logprobs.token_logprobs)
    chat_out = client.chat.completions.create(model="tiny", messages=USER, max_tokens=12, temperature=0,
                                              logit_bias={str(eos): 30}, extra_body={"min_tokens": 3})  # fmt: skip
    assert chat_out.usage.completion_tokens == 4 and chat_out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("field,value,param", [
    ("repetition_penalty", 0, "repetition_penalty"), ("presence_penalty", 2.5, "presence_penalty"),
    ("frequency_penalty", -3, "frequency_penalty"), ("min_p", 1.5, "min_p"), ("logit_bias", {"5": 101}, "logit_bias"),
    ("logit_bias", {"abc": 1}, "logit_bias"), ("logit_bias", {"100000": 1}, "logit_bias")])
def test_sampling_option_ranges_name_the_field(server, field, value, param):
    err = post(server, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2, field: value}, 400)
    err = err["error"]
    assert err["param"].split(".")[0] == param and not err["message"].startswith("Value error"), err
