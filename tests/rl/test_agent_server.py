"""The agent endpoint's HTTP behaviour with a stand-in rollout: bodies validated as ``areno serve`` validates them,
errors in its OpenAI body (the same JSON for the same mistake), the endpoint's own refusals (streaming, n > 1, an
unknown session, a session's AgentError, media parts), a template or sampling setting that fails as a 400 naming the
parameter, and a completion built from the session."""

import asyncio

import pytest
from fastapi.testclient import TestClient
from jinja2 import TemplateError

from areno.config import ConfigError
from areno.engine.tool_calls import FORMATS
from areno.rl.agentic.endpoint import create_app
from areno.rl.agentic.session import SESSION_HEADER, AgentError
from areno.serve.errors import APIError
from areno.serve.protocol import ChatCompletionRequest, validate

KEY = "areno-agent-test"
MESSAGES = [{"role": "user", "content": "1+1="}]


class Session:
    def __init__(self, refuse: AgentError | None = None):
        self.lock = asyncio.Lock()
        self.refuse, self.extended = refuse, []
        self.tokens, self.mask, self.finish_reason = [], [], None

    def extend_messages(self, messages, tools):
        if self.refuse is not None:
            raise self.refuse
        self.extended.append((messages, tools))
        self.tokens, self.mask = [1, 2, 3], [0, 0, 0]


class Rollout:
    api_key = KEY
    tool_format = FORMATS["qwen3"]

    def __init__(self):
        self.sessions = {"s1": Session(), "full": Session(AgentError("too long", "context_length_exceeded",
                                                                           "messages"))}
        self.calls = []

    async def sample(self, session, **kwargs):
        self.calls.append(kwargs)
        session.tokens, session.mask, session.finish_reason = session.tokens + [7, 8], session.mask + [1, 1], "stop"
        return {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "add", "arguments": "{}"}}]}


@pytest.fixture
def client():
    rollout = Rollout()
    with TestClient(create_app(rollout)) as c:
        c.rollout = rollout
        yield c


def post(client, body, *, session="s1", key=KEY, raw=None):
    headers = {"authorization": f"Bearer {key}", SESSION_HEADER: session}
    if raw is not None:
        return client.post("/v1/chat/completions", content=raw, headers=headers)
    return client.post("/v1/chat/completions", json=body, headers=headers)


def error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def test_a_completion_from_the_session_with_the_request_sampling_fields(client):
    r = post(client, {"messages": MESSAGES, "max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "stop": "x",
                      "tools": [{"type": "function", "function": {"name": "add"}}]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == "policy"
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    (plan,) = [c.pop("plan") for c in client.rollout.calls]
    assert client.rollout.calls == [{"max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "stop": "x",
                                     "assistant_message": True,  # the tools type the answer's call arguments
                                     "tools": [{"type": "function", "function": {"name": "add"}}]}]
    assert (plan.kind, plan.grammar) == ("auto", None)
    (messages, tools), = client.rollout.sessions["s1"].extended
    assert messages == MESSAGES and tools == [{"type": "function", "function": {"name": "add"}}]  # as sent


def test_the_endpoints_own_refusals(client):
    e = error(post(client, {"messages": MESSAGES}, key="wrong"), 401)
    assert e["code"] == "invalid_api_key" and "ctx.api_key" in e["message"] and e["type"] == "authentication_error"
    e = error(post(client, {"messages": MESSAGES, "stream": True}), 400)
    assert (e["code"], e["param"]) == ("unsupported", "stream")
    e = error(post(client, {"messages": MESSAGES, "n": 2}), 400)
    assert (e["code"], e["param"]) == ("unsupported", "n")
    e = error(post(client, {"messages": MESSAGES}, session="nobody"), 400)
    assert (e["code"], e["param"]) == ("unknown_session", "user") and "'nobody'" in e["message"]
    e = error(post(client, {"messages": MESSAGES}, session="full"), 400)
    assert e == {"message": "too long", "type": "invalid_request_error", "param": "messages",
                 "code": "context_length_exceeded"}
    assert client.rollout.calls == []


def test_tool_choice_is_planned_as_areno_serve_plans_it(client):
    """The served tool-call code: a named function samples under its call grammar; "none" hides the tools from the
    template; "required" with no tools is the same 400 as areno serve's."""
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]
    choice = {"type": "function", "function": {"name": "add"}}
    assert post(client, {"messages": MESSAGES, "tools": tools, "tool_choice": choice}).status_code == 200
    plan = client.rollout.calls[-1]["plan"]
    assert plan.grammar["calls"][0]["begin"].startswith('<tool_call>\n{"name": "add"')
    assert post(client, {"messages": MESSAGES, "tools": tools, "tool_choice": "none"}).status_code == 200
    assert client.rollout.calls[-1]["tools"] is None and client.rollout.sessions["s1"].extended[-1][1] is None
    e = error(post(client, {"messages": MESSAGES, "tool_choice": "required"}), 400)
    with pytest.raises(APIError) as serve_error:
        validate({"model": "policy", "messages": MESSAGES, "tool_choice": "required"}, ChatCompletionRequest)
    assert e == serve_error.value.body()["error"] and e["param"] == "tool_choice"


@pytest.mark.parametrize("body", [
    {"messages": []},
    {"messages": [{"role": "robot", "content": "hi"}]},
    {"messages": MESSAGES, "temperature": 5},
    {"messages": MESSAGES, "max_tokens": 0},
    {"messages": MESSAGES, "frobnicate": 1},
])
def test_a_bad_body_gets_the_same_error_as_areno_serve(client, body):
    with pytest.raises(APIError) as serve_error:
        validate({"model": "policy", **body}, ChatCompletionRequest)
    assert error(post(client, body), 400) == serve_error.value.body()["error"]


def test_a_body_that_is_not_json(client):
    e = error(post(client, None, raw=b"{not json"), 400)
    assert e["message"].startswith("malformed JSON")


def test_fields_the_endpoint_does_not_use_are_logged_once(client, caplog):
    with caplog.at_level("INFO", logger="areno.serve"):
        for _ in range(2):
            assert post(client, {"messages": MESSAGES, "seed": 3, "logprobs": False}).status_code == 200
    lines = [r.getMessage() for r in caplog.records if "accepted and ignored" in r.getMessage()]
    assert lines == ["request field seed accepted and ignored by the agent endpoint: it samples "
                     "with the run's settings (logged once)"]


# ---- issue 37: bad parameters are 400s naming them, never a 500 --------------------------------------------------
class PickyRollout(Rollout):
    """A template that raises (as Qwen3's does for a conversation with no user message) and an engine that refuses a
    sampling setting."""

    def __init__(self):
        super().__init__()
        self.sessions["template"] = Session(TemplateError("No user query found in messages."))

    async def sample(self, session, **kwargs):
        if kwargs.get("stop") == "\x00":
            raise ConfigError("stop", "must be a list of non-empty strings")
        return await super().sample(session, **kwargs)


@pytest.fixture
def picky():
    with TestClient(create_app(PickyRollout()), raise_server_exceptions=False) as c:  # a 500 is an answer too
        yield c


def test_bad_parameters_are_400s_naming_the_parameter(picky):
    e = error(post(picky, {"messages": [{"role": "system", "content": "only a system prompt"}]}, session="template"),
              400)
    assert e["param"] == "messages" and "chat template" in e["message"] and "No user query" in e["message"]
    e = error(post(picky, {"messages": MESSAGES, "stop": "\x00"}), 400)
    assert e["param"] == "stop" and "non-empty strings" in e["message"]
    image = {"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                         {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}
    e = error(post(picky, {"messages": [image]}), 400)  # before: the image part was dropped without a word
    assert (e["param"], e["code"]) == ("messages", "unsupported") and "text messages only" in e["message"]
    assert picky.get("/v1/models").status_code == 200
