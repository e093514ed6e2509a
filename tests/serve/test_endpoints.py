"""The routes beside the two generation ones: vLLM's /tokenize, /detokenize and /tokenizer_info (as
lm-evaluation-harness's remote tokenizer uses them), /version, /v1/models/{id}, Prometheus /metrics, and
OpenAI-shaped errors for unknown routes and methods."""

import asyncio
import re
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest

import areno
from areno.config import SamplingParams
from areno.engine.block_manager import BlockManager
from areno.engine.sequence import Sequence
from areno.models import load_tokenizer
from areno.serve.metrics import ServeMetrics, engine_kv_stats
from tests.serve.conftest import RunningServer

USER = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def tok(tiny_ckpt):
    return load_tokenizer(tiny_ckpt)


def post(server, path, body, status=200, **kw):
    r = httpx.post(server.base_url + path, json=body, timeout=60, **kw)
    assert r.status_code == status, r.text
    return r.json()


def test_tokenize_prompt_and_messages(server, tok):
    text = "hello world <|im_end|> 12+3"
    out = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False, "return_token_strs": True})
    ids = tok.encode(text, add_special_tokens=False)
    assert out == {"count": len(ids), "max_model_len": 512, "tokens": ids,
                   "token_strs": tok.convert_ids_to_tokens(ids)}
    assert post(server, "/tokenize", {"model": "tiny", "prompt": text})["tokens"] == tok.encode(text)
    chat = post(server, "/tokenize", {"messages": USER})
    assert chat["tokens"] == tok.encode(tok.apply_chat_template(USER, add_generation_prompt=True, tokenize=False),
                                        add_special_tokens=False)
    served = httpx.post(server.base_url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": USER, "max_tokens": 1}).json()
    assert served["usage"]["prompt_tokens"] == chat["count"]  # the same rendering as the chat route
    err = post(server, "/tokenize", {"prompt": "x", "model": "other"}, 404)["error"]
    assert err["param"] == "model" and err["code"] == "model_not_found"
    assert post(server, "/tokenize", {"prompt": 5}, 400)["error"]["param"] == "prompt"
    assert post(server, "/tokenize", {"messages": []}, 400)["error"]["param"] == "messages"


def test_detokenize(server, tok):
    ids = tok.encode("naïve 🙂 text", add_special_tokens=False) + [tok.eos_token_id]
    assert post(server, "/detokenize", {"tokens": ids}) == {"prompt": tok.decode(ids)}
    assert post(server, "/detokenize", {"tokens": [len(tok)]}, 400)["error"]["param"] == "tokens"
    assert post(server, "/detokenize", {"tokens": [-1]}, 400)["error"]["param"].startswith("tokens")


def test_tokenizer_info_and_lm_eval_remote_tokenizer_probe(server, tok):
    info = httpx.get(server.base_url + "/tokenizer_info").json()
    assert info["tokenizer_class"] == type(tok).__name__
    assert info["eos_token"] == "<|im_end|>" and info["eos_token_id"] == tok.eos_token_id
    assert info["pad_token"] == "<|endoftext|>" and "<|im_start|>" in info["all_special_tokens"]
    assert info["model_max_length"] == info["max_model_len"] == 512 and info["vocab_size"] == len(tok)
    assert info["chat_template"] == tok.chat_template
    assert info["added_tokens_decoder"][str(tok.eos_token_id)] == {"content": "<|im_end|>", "special": True}
    # what lm-eval's check_remote_tokenizer_support and RemoteTokenizer do with a base URL of .../v1/completions
    base = (server.base_url + "/v1/completions").replace("/v1/completions", "")
    assert "eos_token" in httpx.get(base + "/tokenizer_info").json()
    tokens = post(server, "/tokenize", {"prompt": "test", "add_special_tokens": False})["tokens"]
    assert isinstance(tokens, list) and post(server, "/detokenize", {"tokens": tokens})["prompt"] == "test"
    eos_id = post(server, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False})["tokens"][0]
    assert eos_id == tok.eos_token_id


def test_version_and_model_by_id(server):
    assert httpx.get(server.base_url + "/version").json() == {"version": areno.__version__}
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    m = client.models.retrieve("tiny")
    assert m.id == "tiny" and m.object == "model"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert e.value.code == "model_not_found" and e.value.param == "model"


@pytest.mark.parametrize("method,path,status", [
    ("GET", "/nope", 404), ("POST", "/v1/nope", 404), ("GET", "/v1/chat/completions", 405),
    ("DELETE", "/v1/models", 405), ("GET", "/tokenize", 405), ("PUT", "/health", 405),
])
def test_unknown_routes_and_methods_get_openai_errors(server, method, path, status):
    r = httpx.request(method, server.base_url + path, timeout=10)
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and path in err["message"]
    if status == 405:
        assert r.headers["allow"] and r.headers["allow"] in err["message"]


# ---- /metrics ----------------------------------------------------------------------------------------------------
SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$')


def parse_exposition(text: str) -> dict:
    """The exposition text parsed strictly: every line a comment or ``name{labels} value``; returns
    {(name, frozenset(labels)): value} after checking the format."""
    out, types = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
            continue
        if line.startswith("# HELP "):
            continue
        m = SAMPLE.match(line)
        assert m, line
        labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m.group(3) or ""))
        out[(m.group(1), labels)] = float(m.group(4))
    for name, kind in types.items():  # each declared family has samples; histograms are consistent
        if kind == "histogram":  # per label set: cumulative buckets ending at +Inf, which equals _count
            groups: dict = {}
            for (n, lb), v in out.items():
                if n == name + "_bucket":
                    le = dict(lb)["le"]
                    groups.setdefault(lb - {("le", le)}, []).append((float(le), v))
            assert groups, name
            for rest, buckets in groups.items():
                counts = [v for _, v in sorted(buckets)]
                assert max(buckets)[0] == float("inf") and counts == sorted(counts)
                assert counts[-1] == out[(name + "_count", rest)]
        else:  # a counter's family may be declared with or without its _total suffix
            assert any(n in (name, name + "_total") for n, _ in out), name
    return out


def scrape(server) -> dict:
    r = httpx.get(server.base_url + "/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    return parse_exposition(r.text)


def value(samples, name, **labels):
    return sum(v for (n, lb), v in samples.items() if n == name and set(labels.items()) <= set(lb))


def test_metrics_count_tokens_and_times(server):
    before = scrape(server)
    out = httpx.post(server.base_url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": [[5, 6, 7, 8, 9]], "max_tokens": 7, "ignore_eos": True, "n": 2}).json()
    assert out["usage"]["completion_tokens"] == 14
    after = scrape(server)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("vllm:prompt_tokens_total") == 5
    assert delta("vllm:generation_tokens_total") == 14
    assert delta("vllm:request_success_total", finished_reason="length") == 2
    assert delta("vllm:request_success_total", finished_reason="stop") == 0  # present before any stop
    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:time_per_output_token_seconds_count") == 2  # one per sample
    assert delta("vllm:e2e_request_latency_seconds_count") == 1
    assert delta("vllm:time_to_first_token_seconds_sum") > 0
    assert value(after, "vllm:num_requests_running") == value(after, "vllm:num_requests_waiting") == 0
    assert all(dict(lb).get("model_name") == "tiny" for (_, lb) in after)


def test_metrics_prefix_cache_hits_and_kv_usage(server):
    """A prompt of three full blocks (16 tokens each) sent twice: the second time its first blocks come from the
    prefix cache (the last block is recomputed, its logits give the first token)."""
    prompt = [[(7 * i) % 500 + 3 for i in range(48)]]
    before = scrape(server)
    assert value(before, "vllm:kv_cache_usage_perc", engine="0") == 0  # nothing in flight holds a block
    for _ in range(2):
        httpx.post(server.base_url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": prompt, "max_tokens": 2, "ignore_eos": True})
    after = scrape(server)
    queries = value(after, "vllm:prefix_cache_queries_total", engine="0") - value(
        before, "vllm:prefix_cache_queries_total", engine="0")
    hits = value(after, "vllm:prefix_cache_hits_total", engine="0") - value(
        before, "vllm:prefix_cache_hits_total", engine="0")
    assert queries == 2 * 48 and hits == 32
    stats = asyncio.run(engine_kv_stats(server.engine))  # read from the engine itself, wherever it runs
    assert value(after, "vllm:prefix_cache_hits_total") == stats[0]["prefix_hits"]
    assert value(after, "vllm:kv_cache_usage_perc", engine="0", model_name="tiny") == 0


def test_metrics_registries_of_two_apps_do_not_clash():
    a, b = ServeMetrics("a"), ServeMetrics("b")
    a.track(type("S", (), {})(), prompt_tokens=3, arrival=0.0)
    sa, sb = (parse_exposition(asyncio.run(m.render(None)).decode()) for m in (a, b))
    assert value(sa, "vllm:prompt_tokens_total", model_name="a") == 3 and value(sa, "vllm:num_requests_waiting") == 1
    assert value(sb, "vllm:prompt_tokens_total", model_name="b") == 0 and value(sb, "vllm:num_requests_waiting") == 0


def test_metrics_read_the_engine_in_this_process():
    """--engine-thread: the KV and prefix-cache series come straight from the engine's BlockManager (engine 0)."""
    blocks = BlockManager(8, 4)
    seq = Sequence(list(range(9)), SamplingParams(max_new_tokens=2))
    blocks.allocate(seq)
    front = SimpleNamespace(engine=SimpleNamespace(blocks=blocks))  # what ServeEngine holds: .engine, an Engine
    s = parse_exposition(asyncio.run(ServeMetrics("t").render(front)).decode())
    assert value(s, "vllm:kv_cache_usage_perc", engine="0", model_name="t") == 3 / 8
    assert value(s, "vllm:prefix_cache_queries_total", engine="0") == 9
    assert value(s, "vllm:prefix_cache_hits_total", engine="0") == 0


def hold_engine(engine, entered: str, release: str):
    """Run on the engine (its thread or its process) between two steps: say so, then wait for ``release``."""
    Path(entered).touch()
    deadline = time.time() + 30
    while not Path(release).exists() and time.time() < deadline:
        time.sleep(0.01)


def test_metrics_running_and_waiting(server, tmp_path):
    """A request the engine has not started is waiting; one that is decoding is running and holds KV blocks. The
    engine is held busy (a function run between two of its steps) so the request cannot start until it is
    released; meanwhile a scrape answers at once, with the KV counters the engine last gave."""
    entered, release = tmp_path / "entered", tmp_path / "release"
    holder = threading.Thread(daemon=True, target=lambda: asyncio.run(
        server.engine.run_on_engine(hold_engine, str(entered), str(release))))
    holder.start()
    deadline = time.time() + 20
    while not entered.exists():
        assert time.time() < deadline
        time.sleep(0.02)
    body = {"model": "tiny", "prompt": "waiting", "max_tokens": 300, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as r:
        deadline = time.time() + 20
        while value(scrape(server), "vllm:num_requests_waiting") != 1:  # the stream starts when its head is read
            assert time.time() < deadline
            time.sleep(0.05)
        assert value(scrape(server), "vllm:num_requests_running") == 0
        release.touch()
        lines = r.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
        s = scrape(server)
        assert value(s, "vllm:num_requests_running") == 1 and value(s, "vllm:num_requests_waiting") == 0
        num_blocks = asyncio.run(engine_kv_stats(server.engine))[0]["num_blocks"]
        assert 0 < value(s, "vllm:kv_cache_usage_perc", engine="0") <= 20 / num_blocks
    holder.join(10)
    deadline = time.time() + 20
    while value(scrape(server), "vllm:num_requests_running") != 0:  # the disconnect aborts it
        assert time.time() < deadline
        time.sleep(0.05)
    assert value(scrape(server), "vllm:kv_cache_usage_perc", engine="0") == 0  # its blocks are free again


def test_api_key_covers_the_tokenizer_routes_not_health_or_metrics(tiny_ckpt):
    s = RunningServer(tiny_ckpt, api_key="sekret")
    try:
        key = {"Authorization": "Bearer sekret"}
        for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5]})):
            assert httpx.post(s.base_url + path, json=body).status_code == 401
            assert httpx.post(s.base_url + path, json=body, headers=key).status_code == 200
        assert httpx.get(s.base_url + "/tokenizer_info").status_code == 401
        assert httpx.get(s.base_url + "/v1/models/tiny").status_code == 401
        for path in ("/health", "/metrics", "/version"):
            assert httpx.get(s.base_url + path).status_code == 200
    finally:
        s.stop()
