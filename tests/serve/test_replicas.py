"""Data-parallel serving on the CPU: ``areno serve --world-size 2 --tp-size 1`` runs two replica processes; requests
spread over both, greedy outputs equal the single-replica server's, aborts reach the replica, SIGTERM stops all."""

import asyncio
import os
import signal
import time

import httpx
import openai
import pytest

from areno.config import ConfigError, ServeConfig
from areno.serve.replicas import check_topology
from tests.serve.conftest import ServeProcess

PROMPTS = ["the cat", "12 + 7 =", "one two three", "hello", "What is 2 + 3?", "abc"]


@pytest.fixture(scope="module")
def pool_server(tiny_ckpt):
    s = ServeProcess(tiny_ckpt, "--world-size", "2", "--tp-size", "1", "--max-running-prompts", "8",
                     "--max-model-len", "512")
    yield s
    s.kill()


def health(s):
    return httpx.get(s.base_url + "/health", timeout=10).json()


def completions(base_url, **kw):
    c = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=120)
    return c.completions.create(model="tiny", temperature=0, **kw)


def test_topology_rules(tiny_ckpt):
    assert check_topology(2, 1, 0) == 2  # CPU-only host: replicas on the CPU
    assert check_topology(4, 4, 4) == 1  # one TP replica: the single-replica path
    assert check_topology(4, 2, 4) == 2  # two replicas of TP 2
    with pytest.raises(ConfigError, match="needs 4 GPUs; 2 are visible"):
        check_topology(4, 1, 2)
    with pytest.raises(ConfigError, match="--world-size.*not divisible by --tp-size 2"):
        check_topology(3, 2, 0)
    from areno.serve.server import run_server

    with pytest.raises(ConfigError, match="not divisible"):
        run_server(ServeConfig(model_path=str(tiny_ckpt), world_size=3, tp_size=2))


def test_both_replicas_serve_and_match_one_replica(pool_server, server):
    h = health(pool_server)
    assert [r["rank"] for r in h["replicas"]] == [0, 1] and all(r["alive"] for r in h["replicas"])
    assert len({r["pid"] for r in h["replicas"]} | {os.getpid()}) == 3

    async def fire(base_url):  # concurrently, so least-loaded dispatch has to spread them
        c = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=120)
        outs = await asyncio.gather(*(c.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0,
                                                           logprobs=2) for p in PROMPTS))
        chat = await c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=10, temperature=0, n=2)
        return outs, chat

    many, chat = asyncio.run(fire(pool_server.base_url))
    one, chat_one = asyncio.run(fire(server.base_url))
    assert [o.choices[0].text for o in many] == [o.choices[0].text for o in one]
    for a, b in zip(many, one):
        assert a.choices[0].logprobs.token_logprobs == pytest.approx(b.choices[0].logprobs.token_logprobs, abs=1e-4)
        assert a.usage == b.usage
    assert [c.message.content for c in chat.choices] == [c.message.content for c in chat_one.choices]
    served = [r["requests"] for r in health(pool_server)["replicas"]]
    assert sum(served) == len(PROMPTS) + 1 and min(served) >= 2, served

    # sequential requests alternate: least loaded, then fewest served
    before = [r["requests"] for r in health(pool_server)["replicas"]]
    for p in PROMPTS[:4]:
        completions(pool_server.base_url, prompt=p, max_tokens=2)
    after = [r["requests"] for r in health(pool_server)["replicas"]]
    assert [a - b for a, b in zip(after, before)] == [2, 2]


def test_disconnect_aborts_on_the_replica(pool_server):
    body = {"model": "tiny", "prompt": "stream me", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", pool_server.base_url + "/v1/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 3:
                break
    deadline = time.time() + 20  # the front end counts a sequence done only once its replica reports the abort
    while time.time() < deadline and health(pool_server)["active_requests"]:
        time.sleep(0.1)
    h = health(pool_server)
    assert h["active_requests"] == 0 and all(r["active_requests"] == 0 for r in h["replicas"])
    assert completions(pool_server.base_url, prompt="after", max_tokens=3).usage.completion_tokens >= 1


def test_echo_logprobs_run_in_a_replica(pool_server, server):
    """Prompt log-probs (echo + logprobs) are computed by a replica's engine, between its steps: the same as the
    single-process server's."""
    body = {"model": "tiny", "prompt": ["the cat sat", "12 + 7 = 19"], "max_tokens": 1, "logprobs": 2, "echo": True,
            "temperature": 0}
    many = httpx.post(pool_server.base_url + "/v1/completions", json=body, timeout=60).json()
    one = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60).json()
    for a, b in zip(many["choices"], one["choices"]):
        assert a["text"] == b["text"] and a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
        assert a["logprobs"]["token_logprobs"][0] is None
        assert a["logprobs"]["token_logprobs"][1:] == pytest.approx(b["logprobs"]["token_logprobs"][1:], abs=1e-4)


def test_sigterm_stops_front_end_and_replicas(pool_server):
    pids = [r["pid"] for r in health(pool_server)["replicas"]]
    pool_server.proc.send_signal(signal.SIGTERM)
    assert pool_server.proc.wait(30) == 0, pool_server.output()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_two_replicas_of_tp2_serve_and_match_one_process(tiny_ckpt, server):
    """``--world-size 4 --tp-size 2``: two replicas, each a TP group of two processes (gloo); greedy outputs equal
    the single-process server's and both replicas take requests; SIGTERM stops all five processes."""
    s = ServeProcess(tiny_ckpt, "--world-size", "4", "--tp-size", "2", "--max-running-prompts", "8",
                     "--max-model-len", "512", env={"ARENO_KERNELS": "native"})
    try:
        h = health(s)
        assert [r["rank"] for r in h["replicas"]] == [0, 1] and all(r["alive"] for r in h["replicas"])

        async def fire(base_url):
            c = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=120)
            return await asyncio.gather(*(c.completions.create(model="tiny", prompt=p, max_tokens=8,
                                                               temperature=0) for p in PROMPTS))

        many = asyncio.run(fire(s.base_url))
        one = asyncio.run(fire(server.base_url))
        assert [o.choices[0].text for o in many] == [o.choices[0].text for o in one]
        served = [r["requests"] for r in health(s)["replicas"]]
        assert sum(served) == len(PROMPTS) and min(served) >= 1, served
        body = {"model": "tiny", "prompt": "hi there", "max_tokens": 0, "logprobs": 1, "echo": True}
        r, r1 = (httpx.post(u + "/v1/completions", timeout=60, json=body) for u in (s.base_url, server.base_url))
        assert r.status_code == 200 == r1.status_code, r.text  # prompt log-probs under TP: every rank scores
        lp, lp1 = (x.json()["choices"][0]["logprobs"] for x in (r, r1))
        assert lp["tokens"] == lp1["tokens"] and lp["token_logprobs"][0] is None
        assert lp["token_logprobs"][1:] == pytest.approx(lp1["token_logprobs"][1:], abs=1e-4)
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(60) == 0, s.output()
    finally:
        s.kill()


def test_health_is_503_once_the_engine_process_is_gone(tiny_ckpt):
    """An engine-core process that dies leaves the HTTP front end up; /health must stop saying "ok" (every request
    now gets 503), so a supervisor or load balancer sees it."""
    s = ServeProcess(tiny_ckpt, "--max-running-prompts", "4", "--max-model-len", "256")
    try:
        h = health(s)
        assert h["status"] == "ok" and h["replicas"][0]["alive"]
        os.kill(h["replicas"][0]["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while (r := httpx.get(s.base_url + "/health", timeout=10)).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert r.status_code == 503 and r.json()["status"] == "unavailable", r.text
        assert not r.json()["replicas"][0]["alive"]
        with pytest.raises(openai.APIStatusError) as e:
            completions(s.base_url, prompt="hi", max_tokens=2)
        assert e.value.status_code == 503
    finally:
        s.kill()
