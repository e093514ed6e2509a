"""Forced tool calls in Gemma 4's own call syntax against a real ``areno serve`` on a tiny random gemma4_text
checkpoint, through the official openai client: a named function and "required" come back as schema-valid calls to
declared functions (whole and streamed alike under greedy), and a schema the gemma4 call grammar cannot express is a
400 naming the parameter."""

import json

import openai
import pytest

from areno.testing import make_tiny_checkpoint
from tests.serve.test_tool_choice_serve import assert_streamed_alike

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

USER = [{"role": "user", "content": "Plan a trip."}]
BOOK = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}, "days": {"type": "integer", "minimum": 1,
                                                                            "maximum": 3},
    "rail": {"type": "boolean"}, "legs": {"type": "array", "items": {"enum": [1, 2]}, "maxItems": 2}},
    "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "book", "parameters": BOOK}},
         {"type": "function", "function": {"name": "cancel", "parameters": {
             "type": "object", "properties": {"id": {"type": "string", "maxLength": 4}}, "required": ["id"]}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from tests.serve.conftest import RunningServer

    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("gemma4_tools"), family="gemma4_text", seed=5)
    server = RunningServer(ckpt, max_model_len=2048)
    yield openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    server.stop()


def _valid(call, names):
    assert call.type == "function" and call.function.name in names and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("choice, names", [({"type": "function", "function": {"name": "cancel"}}, ("cancel",)),
                                           ("required", ("book", "cancel"))])
def test_a_forced_call_is_valid_whole_and_streamed_alike(client, choice, names):
    kw = dict(model="tiny", messages=USER, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=128)
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    (call,) = whole.message.tool_calls
    _valid(call, names)
    assert_streamed_alike(client, kw, call)


def test_a_schema_the_call_grammar_cannot_express_is_a_400_naming_the_parameter(client):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}}}}}]
    with pytest.raises(openai.BadRequestError, match="parameter 'code'"):
        client.chat.completions.create(model="tiny", messages=USER, tools=tools, tool_choice="required",
                                       max_tokens=8)
