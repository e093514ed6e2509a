"""Fuzz the real server from its own OpenAPI schema (schemathesis): valid and invalid bodies for the POST routes
(the generation routes, /tokenize and /detokenize), never a 5xx, and the server still healthy afterwards; plus
the 5xx the fuzzing found, as regressions.

CI runs a fixed (derandomized) sample; ``ARENO_FUZZ_EXAMPLES=2000 pytest tests/serve/test_fuzz.py`` draws that many
fresh examples per route and mode. Against a running ``areno serve``, the stock command also works:
``schemathesis run http://127.0.0.1:8000/openapi.json --checks not_a_server_error``.
"""

import os

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis", reason="a test extra: bash scripts/install.sh --test")
# hypothesis comes with schemathesis; schemathesis' own pytest plugin (lazy schemas) does not run under pytest 9, so
# each operation's strategy is driven by a plain @given
from hypothesis import HealthCheck, given, settings  # noqa: E402

MAX_EXAMPLES = int(os.environ.get("ARENO_FUZZ_EXAMPLES", 50))  # per route and generation mode
DERANDOMIZE = "ARENO_FUZZ_EXAMPLES" not in os.environ


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server.base_url + "/openapi.json")


def bounded(body, path="/v1/completions"):
    """Steer generated bodies towards the engine, and keep them cheap: the served model's name in ``model`` (else
    nearly every case stops at the 404), and a small ``max_tokens`` where a valid one (or none) was drawn. Invalid
    values and huge ones (which exceed the context, a fast 400) are left as drawn."""
    if not isinstance(body, dict):
        return body
    if isinstance(body.get("model"), str):
        body["model"] = "tiny"
    if not path.startswith("/v1/"):  # the tokenizer routes generate nothing
        return body
    if path == "/v1/responses":  # its token limit has another name; a drawn previous_response_id is never stored
        body.pop("previous_response_id", None)
        v = body.get("max_output_tokens")
        body["max_output_tokens"] = 4 if v is None or (isinstance(v, int) and 4 < v < 10_000) else v
        return body
    if path == "/v1/chat/completions":  # fields the schema shows so their refusal can name them (a 400 by design)
        for key in ("prediction", "web_search_options", "modalities"):
            body.pop(key, None)
        if not body.get("tools"):
            body.pop("tool_choice", None)
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and 4 < v < 10_000:
            body[key] = 4
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 4
    return body


@pytest.mark.parametrize("mode", ["positive", "negative"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/tokenize",
                                  "/detokenize"])
def test_no_server_errors(api_schema, server, path, mode):
    operation = api_schema[path]["POST"]
    n = MAX_EXAMPLES
    seen = {"cases": 0, "ok": 0}

    @given(case=operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode)))
    @settings(max_examples=n, deadline=None, database=None, derandomize=DERANDOMIZE,
              suppress_health_check=list(HealthCheck))
    def fuzz(case):
        if isinstance(case.body, (dict, list)):
            case.body = bounded(case.body, path)
        response = case.call(timeout=60)
        assert response.status_code < 500, (f"{case.method} {case.path} {case.body!r} -> {response.status_code}: "
                                            f"{response.text}")
        if response.status_code >= 400:
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        seen["cases"] += 1
        seen["ok"] += response.status_code == 200

    fuzz()
    assert seen["cases"] >= n // 2
    if mode == "positive":  # the bodies reached the engine, not just the validators
        assert seen["ok"] > seen["cases"] // 2, seen


M = [{"role": "user", "content": "hi"}]
FOUND = [  # what fuzzing turned up as 5xx, each now a 4xx (or served)
    ("completions", b"[" * 100_000, 400),  # RecursionError in json.loads
    ("completions", b'{"model": "tiny", "prompt": "\\ud800 x", "max_tokens": 2}', 400),  # lone surrogate
    ("chat", {"model": "tiny", "max_tokens": 2, "messages": [  # assistant tool-call arguments that are not JSON
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}, *M]}, 400),
    ("completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2, "top_k": 2**70}, 200),  # int64 overflow
]


@pytest.mark.parametrize("endpoint,body,status", FOUND)
def test_found_by_fuzzing(server, endpoint, body, status):
    url = server.base_url + ("/v1/chat/completions" if endpoint == "chat" else "/v1/completions")
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(url, headers={"content-type": "application/json"}, timeout=30, **kw)
    assert r.status_code == status, r.text


def test_server_still_healthy_after_fuzzing(server):
    assert httpx.get(server.base_url + "/v1/models").json()["data"][0]["id"] == "tiny"
    health = httpx.get(server.base_url + "/health").json()  # (the engine-core process listed under "replicas")
    assert health["status"] == "ok" and health["active_requests"] == 0
    assert all(r["alive"] and r["active_requests"] == 0 for r in health.get("replicas", []))
    out = httpx.post(server.base_url + "/v1/completions", timeout=60,
                     json={"model": "tiny", "prompt": "hi", "max_tokens": 3, "ignore_eos": True}).json()
    assert out["usage"]["completion_tokens"] == 3
