"""`areno serve --world-size 2 --tp-size 2` on gloo: rank 0 serves and schedules, rank 1 follows; greedy output equals
the single-process server's, and so do prompt log-probs (echo and prompt_logprobs: a forward every rank runs), and
SIGTERM stops both ranks with exit 0."""

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.serve.conftest import RunningServer, free_port


def test_tp2_server_matches_tp1(tiny_ckpt):
    port = free_port()
    env = dict(os.environ, ARENO_KERNELS="native")
    proc = subprocess.Popen([sys.executable, "-m", "areno", "serve", "--model-path", str(tiny_ckpt), "--port",
                             str(port), "--world-size", "2", "--tp-size", "2", "--dtype", "float32",
                             "--served-model-name", "tiny", "--max-running-prompts", "8", "--max-model-len", "512"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "TP server did not come up"
            time.sleep(0.5)
        body = {"model": "tiny", "prompt": ["12 + 7 =", "the cat"], "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}
        # prompt log-probs (echo, vLLM's prompt_logprobs): every TP rank runs the scoring forward on its shard
        score = {"model": "tiny", "prompt": ["12 + 7 = 19", "the cat sat on"], "max_tokens": 1, "temperature": 0,
                 "echo": True, "logprobs": 2, "prompt_logprobs": 1}

        def ask(url):
            gen = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"]
            scored = httpx.post(url + "/v1/completions", json=score, timeout=60)
            assert scored.status_code == 200, scored.text
            return [c["text"] for c in gen], scored.json()["choices"]

        tp2, tp2_scored = ask(base)
        single = RunningServer(tiny_ckpt)
        try:
            tp1, tp1_scored = ask(single.base_url)
        finally:
            single.stop()
        assert tp2 == tp1
        for a, b in zip(tp2_scored, tp1_scored):
            assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
            assert a["logprobs"]["token_logprobs"][1:] == pytest.approx(b["logprobs"]["token_logprobs"][1:], abs=1e-4)
            assert [list(e or {}) for e in a["prompt_logprobs"]] == [list(e or {}) for e in b["prompt_logprobs"]]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert rc == 0
