"""The engine core in its own process (the default) and ``--engine-thread`` (the engine in the HTTP process) serve
the same greedy streams; ``bench/serve.py --smoke`` measures the engine alone on the same batch in the same run."""

import ast
import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from areno.serve.replicas import ReplicaPool
from areno.serve.scoring import ServeEngine
from tests.serve.conftest import RunningServer

ROOT = Path(__file__).resolve().parents[2]


def streamed(base_url: str, path: str, body: dict) -> tuple[dict, int]:
    """Text per choice index and the usage's completion tokens of one streamed request."""
    texts, tokens = {}, None
    with httpx.stream("POST", base_url + path, json={**body, "stream": True,
                                                     "stream_options": {"include_usage": True}}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            for c in obj["choices"]:
                piece = c["text"] if "text" in c else (c["delta"].get("content") or "")
                texts[c["index"]] = texts.get(c["index"], "") + piece
            tokens = (obj.get("usage") or {}).get("completion_tokens", tokens)
    return texts, tokens


def test_engine_process_and_engine_thread_stream_the_same(tiny_ckpt, server):
    assert isinstance(server.engine, ReplicaPool) and len(server.engine.replicas) == 1
    with pytest.raises(TypeError, match="picklable"):  # a call that cannot reach the engine core fails at once
        asyncio.run(server.engine.run_on_engine(lambda engine: engine.max_model_len))
    bodies = [("/v1/completions", {"model": "tiny", "prompt": ["12 + 7 =", "the cat"], "max_tokens": 24,
                                   "temperature": 0, "ignore_eos": True}),
              ("/v1/completions", {"model": "tiny", "prompt": "stop here", "max_tokens": 24, "temperature": 0,
                                   "stop": ["e"]}),
              ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                        "max_tokens": 16, "temperature": 0, "ignore_eos": True})]
    process = [streamed(server.base_url, path, body) for path, body in bodies]
    thread = RunningServer(tiny_ckpt, engine_thread=True)
    try:
        assert isinstance(thread.engine, ServeEngine)
        assert [streamed(thread.base_url, path, body) for path, body in bodies] == process
    finally:
        thread.stop()
    assert process[0][1] == 48 and set(process[0][0]) == {0, 1}
    full = httpx.post(server.base_url + "/v1/completions", json=bodies[1][1], timeout=60).json()
    assert process[1][0][0] == full["choices"][0]["text"]


def test_serve_bench_smoke_reports_the_engine_alone_and_the_ratio(tmp_path):
    env = {**os.environ, "ARENO_BENCH_CACHE": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "bench/serve.py", "--smoke", "--requests", "4", "--max-tokens", "4",
                          "--rates", "inf", "--no-warmup", "--no-save", "--clients", "2"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    record = next(ast.literal_eval(line) for line in out.stdout.splitlines() if line.startswith("{'load': 'unlimited'"))
    assert record["failed"] == 0 and record["output_tokens"] == 16, record
    assert record["engine_output_tokens"] == 16 and record["engine_tok_s"] > 0
    assert record["vs_engine"] == pytest.approx(record["tok_s"] / record["engine_tok_s"], rel=1e-3, abs=1e-3)
