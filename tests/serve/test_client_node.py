"""The Node openai SDK (6.x) against a real ``areno serve``: a named tool choice, and the stream helper's
``tool_calls.function.arguments.delta`` / ``.done`` events joined equal to the non-streamed call. The SDK is
installed with npm into ~/.cache/areno-tests at test time; skipped (with the reason) without node/npm or offline."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "areno-tests" / "node-openai"
SCRIPT = r"""
const OpenAI = require("openai");
const client = new OpenAI({ baseURL: process.env.BASE_URL, apiKey: "unused", maxRetries: 0 });
const tools = [{ type: "function", function: { name: "book", parameters: {
  type: "object", properties: { city: { type: "string", enum: ["Paris", "Oslo"] }, days: { type: "integer",
  enum: [1, 2] } }, required: ["city", "days"], additionalProperties: false } } }];
const body = { model: "tiny", messages: [{ role: "user", content: "Plan a trip." }], tools, temperature: 0,
  max_tokens: 96, tool_choice: { type: "function", function: { name: "book" } } };
(async () => {
  const whole = await client.chat.completions.create(body);
  const deltas = [], done = [];
  const stream = client.chat.completions.stream(body);
  stream.on("tool_calls.function.arguments.delta", (e) => deltas.push(e.arguments_delta));
  stream.on("tool_calls.function.arguments.done", (e) => done.push({ name: e.name, arguments: e.arguments }));
  const final = await stream.finalChatCompletion();
  console.log(JSON.stringify({ whole: whole.choices[0], final: final.choices[0], deltas, done }));
})().catch((e) => { console.error(e); process.exit(1); });
"""


@pytest.fixture(scope="module")
def node_openai():
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are needed for the Node openai SDK test")
    if not (CACHE / "node_modules" / "openai").is_dir():
        CACHE.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(["npm", "install", "--silent", "--no-audit", "--no-fund", "openai@6"], cwd=CACHE,
                           capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            pytest.skip(f"npm install openai failed (offline?): {r.stderr.strip()[-300:]}")
    return CACHE / "node_modules"


def test_named_tool_choice_and_stream_events(tools_server, node_openai, tmp_path):
    script = tmp_path / "tools.js"
    script.write_text(SCRIPT)
    env = {**os.environ, "NODE_PATH": str(node_openai), "BASE_URL": tools_server.base_url + "/v1"}
    r = subprocess.run(["node", str(script)], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    (call,) = out["whole"]["message"]["tool_calls"]
    assert out["whole"]["finish_reason"] == out["final"]["finish_reason"] == "tool_calls"
    args = json.loads(call["function"]["arguments"])
    assert call["function"]["name"] == "book" and args["city"] in ("Paris", "Oslo") and args["days"] in (1, 2)
    assert "".join(out["deltas"]) == call["function"]["arguments"]
    assert out["done"] == [{"name": "book", "arguments": call["function"]["arguments"]}]
    (streamed,) = out["final"]["message"]["tool_calls"]
    assert streamed["function"] == call["function"]
