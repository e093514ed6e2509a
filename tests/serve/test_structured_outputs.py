"""Structured outputs over HTTP: ``response_format`` json_schema / json_object on both generation routes, streamed and
not, through the official openai client's ``parse``; schemas the converter refuses are 400s naming the field. The
tiny model is random, so every check is on the shape the grammar forces, never on content."""

import json
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from tests.serve.conftest import RunningServer

USER = [{"role": "user", "content": "Pick a number and a colour."}]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 100},
                                           "color": {"type": "string", "enum": ["red", "green", "blue"]}},
          "required": ["n", "color"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}}


class Pick(BaseModel):
    n: int = Field(ge=0, le=100)
    color: Literal["red", "green", "blue"]


def valid(text: str) -> dict:
    """``text`` as JSON that validates against SCHEMA (checked by hand: keys, types, range, enum)."""
    obj = json.loads(text)
    assert set(obj) == {"n", "color"}, text
    assert type(obj["n"]) is int and 0 <= obj["n"] <= 100 and obj["color"] in ("red", "green", "blue"), text
    return obj


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    s = RunningServer(tiny_ckpt, max_running_prompts=32)  # json_object draws 32 samples at once
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def post(server, path, body, status=200):
    r = httpx.post(server.base_url + path, json={"model": "tiny", **body}, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


def test_json_schema_chat_and_completions(server):
    out = post(server, "/v1/chat/completions", {"messages": USER, "n": 3, "max_tokens": 40, "seed": 1,
                                                "response_format": RESPONSE_FORMAT})
    assert len(out["choices"]) == 3
    for choice in out["choices"]:
        assert choice["finish_reason"] == "stop"
        valid(choice["message"]["content"])
    out = post(server, "/v1/completions", {"prompt": "the cat", "max_tokens": 40, "seed": 2, "temperature": 0,
                                           "response_format": RESPONSE_FORMAT})
    assert out["choices"][0]["finish_reason"] == "stop"
    valid(out["choices"][0]["text"])


def test_json_object_parses(server):
    # a random model writes long strings (any token may follow inside one): of 32 short samples, several close
    # their object within 12 tokens; those parse, the others are cut ("length") but still start an object
    out = post(server, "/v1/chat/completions", {"messages": USER, "n": 32, "max_tokens": 12, "seed": 1,
                                                "response_format": {"type": "json_object"}})
    done = [c["message"]["content"] for c in out["choices"] if c["finish_reason"] == "stop"]
    assert len(done) >= 2, [c["message"]["content"] for c in out["choices"]]
    assert all(isinstance(json.loads(text), dict) for text in done)
    for c in out["choices"]:
        assert c["finish_reason"] in ("stop", "length") and c["message"]["content"].startswith("{")


def test_openai_client_parse(client):
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    out = parse(model="tiny", messages=USER, response_format=Pick, max_tokens=40, seed=3)
    parsed = out.choices[0].message.parsed
    assert isinstance(parsed, Pick) and out.choices[0].finish_reason == "stop"
    assert valid(out.choices[0].message.content) == parsed.model_dump()


def test_streaming(server):
    body = {"model": "tiny", "messages": USER, "max_tokens": 40, "seed": 4, "stream": True,
            "response_format": RESPONSE_FORMAT}
    parts, finish = [], None
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                parts.append(choice["delta"].get("content") or "")
                finish = choice.get("finish_reason") or finish
    assert finish == "stop" and len([p for p in parts if p]) > 1
    valid("".join(parts))


BAD = [
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": []}}},
    {"type": "json_schema", "json_schema": {"name": "x"}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "bogus": 1}},
    {"type": "json_schema"},
    {"type": "json_object", "schema": {}},
    {"type": "regex"},
    {},
]


@pytest.mark.parametrize("response_format", BAD)
def test_bad_response_format_is_a_400_naming_it(server, response_format):
    err = post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 2,
                                                "response_format": response_format}, 400)["error"]
    assert err["param"] == "response_format" and "response_format" in err["message"], err


def test_bad_schema_reaches_the_openai_client(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body={"response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}})
    assert e.value.param == "response_format" and "nonsense" in str(e.value)
