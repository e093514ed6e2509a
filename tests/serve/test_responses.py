"""``/v1/responses`` through the official openai Python client (``responses.create`` / ``.stream`` / ``.parse`` /
``.retrieve`` / ``.delete``) against a real areno server. The oracle is the chat route: the same conversation sent
as chat messages gives the same greedy answer and token counts. The stream's events are the documented ones, in
order, numbered 0, 1, ..., and add up to the whole answer; a checkpoint overfit to think and then call get_weather
gives reasoning and function_call items and a function-call round trip; the store keeps what it should for as long
as it should; bad input gets a 400 naming the field."""

import json

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areno.config import ConfigError, ServeConfig
from areno.serve.protocol import ChatCompletionRequest
from areno.serve.responses.output import ThinkSplitter
from areno.serve.responses.protocol import ResponsesRequest, chat_body
from areno.serve.responses.store import ResponseStore
from tests.serve.conftest import THINKING, RunningServer
from tests.serve.test_structured_outputs import SCHEMA, Pick, valid
from tests.serve.test_tool_calls_e2e import MESSAGES, TOOL

FUNCTION_TOOL = {"type": "function", **TOOL["function"]}
QUESTION = MESSAGES[0]["content"]


def make_client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(server):
    return make_client(server)


@pytest.fixture(scope="module")
def tclient(thinking_server):
    return make_client(thinking_server)


def chat(client, messages, **kw):
    return client.chat.completions.create(model="tiny", messages=messages, temperature=0, **kw)


def test_create_equals_the_chat_answer(client):
    r = client.responses.create(model="tiny", input="hello", max_output_tokens=8, temperature=0)
    oracle = chat(client, [{"role": "user", "content": "hello"}], max_tokens=8)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "tiny"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.output[0].id.startswith("msg_") and r.output[0].content[0].type == "output_text"
    assert r.output_text == oracle.choices[0].message.content
    u = oracle.usage
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (
        u.prompt_tokens, u.completion_tokens, u.total_tokens)
    assert r.max_output_tokens == 8 and r.temperature == 0 and r.store is True and r.tools == []


def test_instructions_and_input_items_are_the_chat_messages(client):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "yo",
                                                                   "annotations": []}]},
             {"role": "developer", "content": "Answer in French."},
             {"role": "user", "content": "again"}]
    r = client.responses.create(model="tiny", instructions="Be brief.", input=items, max_output_tokens=6,
                                temperature=0)
    oracle = chat(client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                           {"role": "assistant", "content": "yo"}, {"role": "system", "content": "Answer in French."},
                           {"role": "user", "content": "again"}], max_tokens=6)
    assert r.output_text == oracle.choices[0].message.content
    assert r.usage.input_tokens == oracle.usage.prompt_tokens and r.instructions == "Be brief."


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(model="tiny", instructions="Be brief.", input="hello", max_output_tokens=6,
                                    temperature=0)
    second = client.responses.create(model="tiny", input="and then?", previous_response_id=first.id,
                                     max_output_tokens=6, temperature=0)
    # as OpenAI: the earlier instructions are not carried over, the earlier input and output are
    oracle = chat(client, [{"role": "user", "content": "hello"}, {"role": "assistant", "content": first.output_text},
                           {"role": "user", "content": "and then?"}], max_tokens=6)
    assert second.previous_response_id == first.id
    assert second.output_text == oracle.choices[0].message.content
    assert second.usage.input_tokens == oracle.usage.prompt_tokens


def test_retrieve_delete_and_store_false(client):
    r = client.responses.create(model="tiny", input="hello", max_output_tokens=2, temperature=0)
    assert client.responses.retrieve(r.id).model_dump() == r.model_dump()
    client.responses.delete(r.id)
    for call in (client.responses.retrieve, client.responses.delete):
        with pytest.raises(openai.NotFoundError):
            call(r.id)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="tiny", input="x", previous_response_id=r.id, max_output_tokens=2)
    assert err.value.param == "previous_response_id" and r.id in err.value.message
    unstored = client.responses.create(model="tiny", input="hello", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_stream_events_add_up_to_the_whole_answer(client):
    kw = dict(model="tiny", input="hello", max_output_tokens=8, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]  # max_output_tokens reached: OpenAI's incomplete, not completed
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    item_id = events[2].item.id
    assert all(e.item_id == item_id and e.output_index == 0 and e.content_index == 0 for e in deltas)
    final = events[-1].response
    assert "".join(e.delta for e in deltas) == events[-4].text == whole.output_text == final.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens and final.output[0].id == item_id


def test_json_schema_text_format(client):
    fmt = {"type": "json_schema", "name": "pick", "schema": SCHEMA, "strict": True}
    r = client.responses.create(model="tiny", input="Pick a number and a colour.", text={"format": fmt},
                                max_output_tokens=40, temperature=0)
    oracle = chat(client, [{"role": "user", "content": "Pick a number and a colour."}], max_tokens=40,
                  response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA,
                                                                          "strict": True}})
    assert r.status == "completed" and valid(r.output_text)
    assert r.output_text == oracle.choices[0].message.content and r.text.format.type == "json_schema"
    parsed = client.responses.parse(model="tiny", input="Pick a number and a colour.", text_format=Pick,
                                    max_output_tokens=40, temperature=0)
    assert isinstance(parsed.output_parsed, Pick)


def test_reasoning_and_function_call_items(tclient):
    kw = dict(model="tiny", input=QUESTION, tools=[FUNCTION_TOOL], temperature=0, max_output_tokens=64)
    r = tclient.responses.create(**kw)
    assert r.status == "completed" and [o.type for o in r.output] == ["reasoning", "function_call"]
    reasoning, call = r.output
    assert reasoning.id.startswith("rs_") and reasoning.summary == []
    assert [c.text for c in reasoning.content] == [THINKING.split("\n")[1]]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and r.output_text == ""
    oracle = chat(tclient, MESSAGES, tools=[TOOL], max_tokens=64)
    assert r.usage.output_tokens == oracle.usage.completion_tokens

    with tclient.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    for kind in ("reasoning_text.delta", "reasoning_text.done", "function_call_arguments.delta",
                 "function_call_arguments.done", "completed"):
        assert f"response.{kind}" in types
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == call.arguments == final.output[1].arguments
    assert [(o.type, o.status) for o in final.output] == [("reasoning", "completed"), ("function_call", "completed")]


def test_streamed_and_whole_items_are_equal_token_by_token(tclient):
    """With calls not read (``tool_choice: "none"``) the chat route streams the text token by token: the reasoning
    block and the text are split as they stream, into the same items as the whole answer."""
    kw = dict(model="tiny", input=QUESTION, tools=[FUNCTION_TOOL], tool_choice="none", temperature=0,
              max_output_tokens=64)
    whole = tclient.responses.create(**kw)
    events = list(tclient.responses.create(stream=True, **kw))
    final = events[-1].response
    assert events[-1].type == f"response.{whole.status}" and whole.status == "completed"
    assert [o.model_dump(exclude={"id"}) for o in final.output] == [o.model_dump(exclude={"id"}) for o in whole.output]
    for kind, item in (("reasoning_text", "reasoning"), ("output_text", "message")):
        deltas = [e.delta for e in events if e.type == f"response.{kind}.delta"]
        texts = [o.content[0].text for o in whole.output if o.type == item]
        assert "".join(deltas) == "".join(texts)
    assert len([e for e in events if e.type.endswith(".delta")]) > len(whole.output)  # not one delta per item


def test_function_call_round_trip(tclient):
    first = tclient.responses.create(model="tiny", input=QUESTION, tools=[FUNCTION_TOOL], temperature=0,
                                     max_output_tokens=64)
    call = first.output[1]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'}
    kw = dict(model="tiny", tools=[FUNCTION_TOOL], temperature=0, max_output_tokens=8)
    chained = tclient.responses.create(previous_response_id=first.id, input=[result], **kw)
    # the same conversation sent whole, as items read back from the first response
    items = [{"role": "user", "content": QUESTION}, *(o.model_dump(exclude_none=True) for o in first.output), result]
    whole = tclient.responses.create(input=items, **kw)
    assert [o.model_dump(exclude={"id"}) for o in chained.output] == [
        o.model_dump(exclude={"id"}) for o in whole.output]
    oracle = chat(tclient, [*MESSAGES, {"role": "assistant", "content": None, "reasoning_content": "weather",
                                        "tool_calls": [{"id": call.call_id, "type": "function", "function": {
                                            "name": call.name, "arguments": call.arguments}}]},
                            {"role": "tool", "tool_call_id": call.call_id, "content": '{"temperature": 21}'}],
                  tools=[TOOL], max_tokens=8)
    assert chained.usage.input_tokens == whole.usage.input_tokens == oracle.usage.prompt_tokens
    assert chained.usage.output_tokens == oracle.usage.completion_tokens


def post(server, body):
    return httpx.post(server.base_url + "/v1/responses", json={"model": "tiny", "input": "hi", **body}, timeout=60)


@pytest.mark.parametrize("tool", ["web_search", "web_search_preview", "file_search", "computer_use_preview",
                                  "code_interpreter", "image_generation", "mcp"])
def test_built_in_tools_are_refused_by_name(server, tool):
    r = post(server, {"tools": [FUNCTION_TOOL, {"type": tool}]})
    assert r.status_code == 400 and tool in r.json()["error"]["message"]
    assert r.json()["error"]["param"].startswith("tools")


@pytest.mark.parametrize("body,param", [
    ({"input": []}, "input"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}, "input"),
    ({"stream": "yes"}, "stream"),
    ({"store": "no"}, "store"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 100_000}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"background": True}, "background"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, "text.format"),
    ({"bogus": 1}, "bogus"),
])
def test_bad_input_is_a_400_naming_the_field(server, body, param):
    r = post(server, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"].startswith(param), err


def test_unknown_model_and_ids_are_404(server):
    assert post(server, {"model": "other"}).status_code == 404
    assert httpx.get(server.base_url + "/v1/responses/resp_nope").status_code == 404
    assert httpx.delete(server.base_url + "/v1/responses/resp_nope").status_code == 404


def test_ignored_fields_are_accepted(client):
    r = client.responses.create(model="tiny", input="hello", max_output_tokens=2, prompt_cache_key="k",
                                safety_identifier="s", user="u", service_tier="auto", truncation="disabled",
                                metadata={"a": "b"}, reasoning={"effort": "low", "summary": "auto"},
                                text={"verbosity": "low"}, include=["reasoning.encrypted_content"])
    assert r.metadata == {"a": "b"} and r.reasoning.effort == "low"


def test_store_bounds():
    t = [0.0]
    store = ResponseStore(max_count=2, max_age_s=10, clock=lambda: t[0])
    for i in range(3):
        store.put({"id": f"r{i}"}, [])
    assert store.get("r0") is None and store.get("r1") and store.get("r2")  # the oldest dropped by count
    t[0] = 5.0
    store.put({"id": "r3"}, [])
    t[0] = 10.5  # r1 and r2 (stored at 0) are past 10 s; r3 (at 5) is not
    assert store.get("r1") is None and store.get("r2") is None and store.get("r3") and len(store) == 1
    assert store.delete("r3") and not store.delete("r3")


@pytest.mark.parametrize("value", [0, -1])
def test_store_max_flag_refuses_non_positive(tiny_ckpt, value):
    with pytest.raises(ConfigError, match="--responses-store-max"):
        ServeConfig(model_path=str(tiny_ckpt), responses_store_max=value)


def test_store_max_flag_reaches_the_server(tiny_ckpt):
    s = RunningServer(tiny_ckpt, responses_store_max=1)
    try:
        c = make_client(s)
        a, b = (c.responses.create(model="tiny", input="hi", max_output_tokens=1) for _ in range(2))
        assert c.responses.retrieve(b.id).id == b.id
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(a.id)
    finally:
        s.stop()


def split_all(text: str, cuts: list[int]) -> list[tuple[str, str]]:
    """``text`` through a ThinkSplitter in pieces cut at ``cuts``, the output merged by kind."""
    splitter, out = ThinkSplitter(True), []
    bounds = [0, *sorted(set(cuts)), len(text)]
    for a, b in zip(bounds, bounds[1:]):
        out += splitter.push(text[a:b])
    out += splitter.finish()
    merged: list[tuple[str, str]] = []
    for kind, piece in out:
        assert piece
        if merged and merged[-1][0] == kind:
            merged[-1] = (kind, merged[-1][1] + piece)
        else:
            merged.append((kind, piece))
    return merged


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.sampled_from(["<think>\nplan it\n</think>\n\nThe answer.", "  <think>a</think>b", "<think>unfinished",
                        "<thinking is not a tag", "no think at all", "<think>\n\n</think>\n\nonly text", "<thi",
                        "text <think>late</think> stays text", "<think>x < y </thin k></think>z"]),
       st.lists(st.integers(0, 60), max_size=8))
def test_think_splitter_reads_a_leading_block_however_it_is_cut(text, cuts):
    cuts = [c for c in cuts if c <= len(text)]
    expected = {
        "<think>\nplan it\n</think>\n\nThe answer.": [("reasoning", "plan it"), ("text", "The answer.")],
        "  <think>a</think>b": [("reasoning", "a"), ("text", "b")],
        "<think>unfinished": [("reasoning", "unfinished")],
        "<think>\n\n</think>\n\nonly text": [("text", "only text")],
        "<think>x < y </thin k></think>z": [("reasoning", "x < y </thin k>"), ("text", "z")],
    }.get(text, [("text", text)])
    assert split_all(text, cuts) == expected
    assert ThinkSplitter(False).push(text) == [("text", text)]  # a template without </think>: all text


def test_items_become_chat_messages():
    req = ResponsesRequest.model_validate({"model": "m", "instructions": "sys", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "r"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "let me look"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"x\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "2"}]},
        {"role": "assistant", "content": "done"},
        {"role": "assistant", "content": "again"}]})
    body = chat_body(req, [{"role": "user", "content": "earlier"}])
    assert body["messages"] == [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "earlier"}, {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "let me look", "reasoning_content": "r", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"}, {"role": "tool", "tool_call_id": "c2", "content": "2"},
        {"role": "assistant", "content": "done"}, {"role": "assistant", "content": "again"}]
    assert ChatCompletionRequest.model_validate(body).messages[3].tool_calls[1].function.name == "g"


def test_the_body_must_be_declared_json(server):
    raw = json.dumps({"model": "tiny", "input": "hi", "max_output_tokens": 2})
    r = httpx.post(server.base_url + "/v1/responses", content=raw, headers={"content-type": "text/plain"}, timeout=60)
    assert r.status_code == 415 and r.json()["error"]["param"] == "Content-Type", r.text
    ok = httpx.post(server.base_url + "/v1/responses", content=raw, headers={"content-type": "application/json"},
                    timeout=120)
    assert ok.status_code == 200 and ok.json()["object"] == "response", ok.text
