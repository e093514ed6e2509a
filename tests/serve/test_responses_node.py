"""``/v1/responses`` through the official Node client (the ``openai`` npm package, installed at test time into a
cache folder; skipped with the reason when node, npm or the registry is not there): ``responses.create`` equals the
chat route's answer, and ``responses.stream`` gives the documented events, numbered in order, whose deltas add up to
the whole answer."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import openai
import pytest

NODE_OPENAI = "openai@6"
CACHE = Path(os.environ.get("ARENO_NODE_CACHE", Path.home() / ".cache" / "areno" / "node-openai"))

SCRIPT = r"""
const OpenAI = require("openai");
const client = new OpenAI({ baseURL: process.argv[2], apiKey: "unused", maxRetries: 0 });
(async () => {
  const kw = { model: "tiny", input: "hello", max_output_tokens: 8, temperature: 0 };
  const whole = await client.responses.create(kw);
  const events = [];
  const stream = client.responses.stream(kw);
  for await (const ev of stream) events.push(ev);
  const stored = await client.responses.retrieve(whole.id);
  console.log(JSON.stringify({ whole, output_text: whole.output_text, events, stored_id: stored.id }));
})().catch((e) => { console.error(e); process.exit(1); });
"""


@pytest.fixture(scope="module")
def node_openai():
    """The folder whose node_modules holds the openai package (installed once into the cache)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are not installed")
    if not (CACHE / "node_modules" / "openai" / "package.json").exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        try:
            done = subprocess.run(["npm", "install", "--prefix", str(CACHE), "--no-audit", "--no-fund", NODE_OPENAI],
                                  capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            pytest.skip("npm install openai timed out (offline?)")
        if done.returncode != 0:
            pytest.skip(f"npm install openai failed (offline?): {done.stderr.strip()[-300:]}")
    return CACHE


def test_node_create_and_stream(server, node_openai, tmp_path):
    script = tmp_path / "responses.js"
    script.write_text(SCRIPT)
    done = subprocess.run(["node", str(script), server.base_url + "/v1"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "NODE_PATH": str(node_openai / "node_modules")})
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    oracle = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0)
    assert got["output_text"] == oracle.choices[0].message.content
    assert got["whole"]["id"].startswith("resp_") and got["stored_id"] == got["whole"]["id"]
    events = got["events"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.incomplete"
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == got["output_text"]
