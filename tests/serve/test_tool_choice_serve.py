"""``tool_choice`` and the newer OpenAI fields against a real ``areno serve`` on a tiny random checkpoint: forced
calls ("required", a named function) come back as schema-valid calls to declared functions through the official
openai client, whole and streamed alike; "required" with no tools is a 400 as OpenAI's; fields that change nothing
are accepted, those that would are refused by name; ``stream`` must be a JSON boolean and the body JSON; an aborted
stream is counted in ``vllm:request_success_total{finished_reason="abort"}``."""

import json
import re
import time

import httpx
import openai
import pytest

jsonschema = pytest.importorskip("jsonschema")

USER = [{"role": "user", "content": "Plan a trip."}]
SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}, "days": {"type": "integer", "enum": [1, 2, 3]},
    "rail": {"type": "boolean"}}, "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "book", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "cancel", "parameters": {
             "type": "object", "properties": {"id": {"type": "string", "enum": ["a1", "b2"]}}, "required": ["id"]}}}]


@pytest.fixture(scope="module")
def server(tools_server):
    return tools_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def post(server, body, status, **kw):
    r = httpx.post(server.base_url + "/v1/chat/completions", timeout=120, **({"json": body} | kw))
    assert r.status_code == status, r.text
    return r.json()


def _valid(call, names=("book", "cancel")):
    assert call.type == "function" and call.function.name in names and call.id.startswith("call_")
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)


def test_a_named_function_is_the_one_called(client):
    choice = {"type": "function", "function": {"name": "cancel"}}
    whole = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice=choice,
                                           temperature=0, max_tokens=96).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    (call,) = whole.message.tool_calls
    _valid(call, ("cancel",))


def test_a_required_call_is_a_valid_call_whole_and_streamed_alike(client):
    """Greedy: the streamed call (the SDK's stream helper: argument-delta and done events) equals the whole one."""
    kw = dict(model="tiny", messages=USER, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=96)
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    (call,) = whole.message.tool_calls
    _valid(call)
    assert_streamed_alike(client, kw, call)


def assert_streamed_alike(client, kw: dict, call) -> None:
    """The answer to ``kw`` streamed through the SDK's stream helper is ``call`` (whole, greedy): its argument-delta
    events join to the arguments, one done event, finish_reason tool_calls."""
    with client.chat.completions.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_completion().choices[0]
    (streamed,) = final.message.tool_calls
    assert (streamed.function.name, streamed.function.arguments) == (call.function.name, call.function.arguments)
    deltas = "".join(e.arguments_delta for e in events if e.type == "tool_calls.function.arguments.delta")
    done = [e for e in events if e.type == "tool_calls.function.arguments.done"]
    assert deltas == call.function.arguments
    assert [(d.name, d.arguments) for d in done] == [(call.function.name, call.function.arguments)]
    assert final.finish_reason == "tool_calls"


def test_strict_tools_keep_auto_free_but_calls_valid(client):
    tools = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}]
    out = client.chat.completions.create(model="tiny", messages=USER, tools=tools, temperature=0, max_tokens=24)
    choice = out.choices[0]  # a random model rarely starts a call: free text comes back; a call would be valid
    for call in choice.message.tool_calls or ():
        _valid(call)


@pytest.mark.parametrize("body, param, status", [
    ({"tool_choice": "required"}, "tool_choice", 400),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", 400),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     400),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction", 400),
    ({"modalities": ["text", "audio"]}, "modalities", 400),
    ({"web_search_options": {}}, "web_search_options", 400),
    ({"stream": "yes"}, "stream", 400),
    ({"stream": 1}, "stream", 400),
])
def test_what_would_change_the_answer_is_refused_by_name(server, body, param, status):
    err = post(server, {"model": "tiny", "messages": USER, "max_tokens": 2, **body}, status)["error"]
    assert err["param"] == param, err


def test_fields_that_change_nothing_are_accepted(server):
    body = {"model": "tiny", "messages": USER, "max_tokens": 2, "prompt_cache_key": "k", "safety_identifier": "s",
            "store": False, "metadata": {"a": "b"}, "user": "u", "service_tier": "auto", "verbosity": "low",
            "modalities": ["text"], "prediction": None}
    assert post(server, body, 200)["choices"][0]["finish_reason"] in ("length", "stop")


def test_image_detail_is_accepted():
    from areno.serve.protocol import ChatCompletionRequest, parse

    for detail in ("low", "high", "auto"):
        part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": detail}}
        req = parse(json.dumps({"model": "tiny", "messages": [{"role": "user", "content": [part]}]}).encode(),
                    ChatCompletionRequest)
        assert req.messages[0].content[0].image_url.detail == detail


@pytest.mark.parametrize("content_type, status", [("text/plain", 415), ("application/x-www-form-urlencoded", 415),
                                                  ("application/json; charset=utf-8", 200)])
def test_the_body_must_be_declared_json(server, content_type, status):
    raw = json.dumps({"model": "tiny", "messages": USER, "max_tokens": 2})
    r = httpx.post(server.base_url + "/v1/chat/completions", content=raw, headers={"content-type": content_type},
                   timeout=120)
    assert r.status_code == status, r.text
    if status != 200:
        assert r.json()["error"]["param"] == "Content-Type"


def _aborted(server) -> float:
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    m = re.search(r'vllm:request_success_total\{[^}]*finished_reason="abort"[^}]*\} ([0-9.e+]+)', text)
    return float(m.group(1)) if m else 0.0


def test_an_aborted_stream_is_counted(server):
    before = _aborted(server)
    body = {"model": "tiny", "messages": USER, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=120) as r:
        next(r.iter_lines())  # the first chunk, then the client goes away
    deadline = time.time() + 30
    while _aborted(server) < before + 1 and time.time() < deadline:
        time.sleep(0.1)
    assert _aborted(server) == before + 1
