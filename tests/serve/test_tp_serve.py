"""`areno serve --world-size 2 --tp-size 2` on gloo: rank 0 serves and schedules, rank 1 follows; greedy output equals
the single-process server's, and so do prompt log-probs (echo and prompt_logprobs: a forward every rank runs), and
SIGTERM stops both ranks with exit 0 (with --rollout-dtype fp8 too: each rank quantises its shard). With
``--speculative-tokens 2 --eager-decode`` (a tiny DeepSeek-V3 whose MTP layer agrees with it in part: the MTP layer
sharded too) a greedy request returns the plain engine's tokens and log-probs."""

import contextlib
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import torch

from tests.serve.conftest import RunningServer, free_port


@contextlib.contextmanager
def tp2_server(path, *extra):
    """A `python -m areno serve` of ``path`` on two gloo TP ranks; yields ``{"url": base URL}``, where its output is
    put under "log" once SIGTERM stopped it (exit 0)."""
    port = free_port()
    env = dict(os.environ, ARENO_KERNELS="native")
    proc = subprocess.Popen([sys.executable, "-m", "areno", "serve", "--model-path", str(path), "--port",
                             str(port), "--world-size", "2", "--tp-size", "2", "--dtype", "float32",
                             "--served-model-name", "tiny", "--max-running-prompts", "8", "--max-model-len", "512",
                             *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    server = {"url": base}
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
        yield server
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    server["log"] = proc.stdout.read()
    assert rc == 0, server["log"]


def test_tp2_server_matches_tp1(tiny_ckpt):
    _tp2_matches_tp1(tiny_ckpt)


def test_tp2_fp8_server_matches_tp1_fp8(tmp_path):
    """--rollout-dtype fp8 on both ranks (each quantises its shard, on the full weight's block grid: heads of 128,
    intermediate 256) gives the single-process FP8 server's tokens and log-probs."""
    from areno.testing import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", family="qwen3", seed=3, hidden_size=128, intermediate_size=256,
                                num_attention_heads=2, num_key_value_heads=2, head_dim=128)
    _tp2_matches_tp1(ckpt, "--rollout-dtype", "fp8")


def _tp2_matches_tp1(tiny_ckpt, *extra):
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

    with tp2_server(tiny_ckpt, *extra) as server:
        tp2, tp2_scored = ask(server["url"])
    single = RunningServer(tiny_ckpt, rollout_dtype=extra[-1] if extra else "bf16")
    try:
        tp1, tp1_scored = ask(single.base_url)
    finally:
        single.stop()
    assert tp2 == tp1
    for a, b in zip(tp2_scored, tp1_scored):
        assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
        # FP8: the row-parallel projections' partial sums reach the next layer's activation quantisation in another
        # summation order, which can move an element across an E4M3 rounding boundary (up to 0.03 seen)
        tol = 0.05 if "fp8" in extra else 1e-4
        assert a["logprobs"]["token_logprobs"][1:] == pytest.approx(b["logprobs"]["token_logprobs"][1:], abs=tol)
        assert [list(e or {}) for e in a["prompt_logprobs"]] == [list(e or {}) for e in b["prompt_logprobs"]]


def test_tp2_server_speculates(tmp_path):
    from areno.config import SamplingParams
    from areno.engine.engine import Engine, EngineConfig
    from areno.models import load_model
    from areno.models.saver import save_model
    from areno.testing import make_tiny_checkpoint
    from tests.helpers.mtp import make_echo_model

    src = make_tiny_checkpoint(tmp_path / "src", family="deepseek_v3", seed=1)
    model = make_echo_model(load_model(src, dtype=torch.float32, device="cpu"), scale=2.0)
    path = save_model(model, tmp_path / "echo")
    prompt = [3, 4, 5, 6, 7, 8, 9, 10, 11]
    plain = Engine(model, None, EngineConfig(block_size=16, max_running=8), eos_token_ids=[]).generate(
        [prompt], SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True))[0][0]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "return_tokens_as_token_ids": True}
    with tp2_server(path, "--speculative-tokens", "2", "--eager-decode",
                    "--speculative-disable-by-batch-size", "off") as server:
        reply = httpx.post(server["url"] + "/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    lp = reply.json()["choices"][0]["logprobs"]
    assert [int(t.removeprefix("token_id:")) for t in lp["tokens"]] == plain.token_ids
    assert lp["token_logprobs"] == pytest.approx(plain.logprobs, abs=1e-4)
    assert "every step speculates" in server["log"]  # both ranks built the (sharded) draft; rank 0 logs the gate
