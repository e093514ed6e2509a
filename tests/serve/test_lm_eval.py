"""lm-evaluation-harness 0.4.x against ``areno serve``, scored the same as areno's own training forward.

``test_lm_eval_run_scores_like_the_training_forward`` runs lm-eval itself (``simple_evaluate`` with its
``local-completions`` model and its remote tokenizer, i.e. this server's /tokenizer_info, /tokenize and /detokenize)
on three local tasks the test writes (YAML + JSONL, no download): multiple choice (loglikelihood requests, ``acc``),
perplexity (loglikelihood_rolling, ``word_perplexity``) and generate-until (``exact_match``). Every per-sample
log-likelihood, every generation and every score must equal what the tiny checkpoint gives through areno's training
forward (``model(...)`` then ``model.token_logprobs``, fp32) and a greedy loop over ``model.logits``.

``test_replayed_lm_eval_requests`` needs no lm-eval: it sends the exact bodies lm-eval 0.4.x's ``local-completions``
sends (loglikelihood: token-id prompts, ``max_tokens`` 1, ``logprobs`` 1, ``echo``, ``temperature`` 0, ``seed``
1234; generate-until: token-id prompts with ``max_tokens``, ``temperature``, ``stop``, ``seed``), checks the
answers field by field and parses them as lm-eval does (sum of ``token_logprobs[ctxlen:-1]``, greedy when each
equals the top of ``top_logprobs``; ``choices[i].text`` by index).
"""

import functools
import json
import math
import re
from operator import itemgetter

import httpx
import pytest
import torch

from areno.engine.build import eos_ids_from_checkpoint
from areno.models import load_model, load_tokenizer

MC = [  # question, choices, answer index
    ("Question: What is 2 + 3?\nAnswer:", ["5", "6", "23"], 0),
    ("The cat sat on the", ["mat", "moon", "idea"], 0),
    ("Paris is the capital of", ["France", "Spain", "the ocean"], 0),
    ("One, two,", ["three", "seven", "blue"], 1),
    ("Water is", ["wet", "dry", "loud"], 2),
    ("The opposite of hot is", ["cold", "warm", "tall"], 0),
]
TEXTS = ["the quick brown fox jumps over the lazy dog", "12 + 7 = 19 and 3 * 4 = 12", "a naïve café 🙂 ok"]
GEN_PROMPTS = ["Q: 2 + 2 =", "The sky is", "Once upon a time", "def add(a, b):"]
GEN_TOKENS = 8


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    m = load_model(tiny_ckpt, dtype=torch.float32, device="cpu")
    m.eval()
    return m


@pytest.fixture(scope="module")
def tok(tiny_ckpt):
    return load_tokenizer(tiny_ckpt)


# ---- the reference: areno's training forward ------------------------------------------------------------------
def token_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1, fp32, through the training forward's fused log-prob (no logits)."""
    x = torch.tensor(ids)
    with torch.no_grad():
        hidden = model(x, torch.arange(len(ids)))
        return model.token_logprobs(hidden[:-1], x[1:])


@functools.cache
def loglikelihood(model, tok, context: str, continuation: str) -> tuple[float, bool]:
    """lm-eval's loglikelihood of ``continuation`` after ``context`` (its encoding: the context's trailing spaces
    move to the continuation, the continuation is what the whole text adds after the context's tokens) and whether
    every continuation token is the argmax: one training forward."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    n = len(tok.encode(context, add_special_tokens=False))
    x = torch.tensor(tok.encode(context + continuation, add_special_tokens=False))
    with torch.no_grad():
        hidden = model(x, torch.arange(len(x)))[n - 1 : -1]
        lps = model.token_logprobs(hidden, x[n:])
        greedy = model.compute_logits(hidden).argmax(-1)
    return lps.sum().item(), bool((greedy == x[n:]).all())


@functools.cache
def greedy_text(model, tok, eos: frozenset, prompt: str, until: str) -> str:
    """Greedy decoding by full forwards (no KV cache), cut at the first ``until``, as generate-until reads it."""
    ids = tok.encode(prompt, add_special_tokens=False)
    out = []
    with torch.no_grad():
        for _ in range(GEN_TOKENS):
            nxt = int(model.logits(torch.tensor([ids + out]))[0, -1].argmax())
            if nxt in eos:
                break
            out.append(nxt)
    return tok.decode(out, skip_special_tokens=True).split(until)[0]


@pytest.fixture(scope="module")
def eos(tiny_ckpt, tok):
    return frozenset(eos_ids_from_checkpoint(tiny_ckpt)) | {tok.eos_token_id}


# ---- lm-eval itself --------------------------------------------------------------------------------------------
def write_tasks(folder, targets: list[str]) -> None:
    def jsonl(name, rows):
        (folder / name).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))

    jsonl("mc.jsonl", [{"question": q, "choices": c, "answer": a} for q, c, a in MC])
    jsonl("ppl.jsonl", [{"text": t} for t in TEXTS])
    jsonl("gen.jsonl", [{"prompt": p, "target": t} for p, t in zip(GEN_PROMPTS, targets)])

    def data(name):
        return {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(folder / name)}},
                "test_split": "test"}

    tasks = {
        "areno_mc": {**data("mc.jsonl"), "output_type": "multiple_choice", "doc_to_text": "question",
                     "doc_to_choice": "choices", "doc_to_target": "answer", "metric_list": [{"metric": "acc"}]},
        "areno_ppl": {**data("ppl.jsonl"), "output_type": "loglikelihood_rolling", "doc_to_text": "",
                      "doc_to_target": "text", "metric_list": [{"metric": "word_perplexity"}]},
        "areno_gen": {**data("gen.jsonl"), "output_type": "generate_until", "doc_to_text": "prompt",
                      "doc_to_target": "target",
                      "generation_kwargs": {"until": ["\n"], "max_gen_toks": GEN_TOKENS, "do_sample": False,
                                            "temperature": 0},
                      "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}]},
    }
    for name, cfg in tasks.items():  # JSON is YAML
        (folder / f"{name}.yaml").write_text(json.dumps({"task": name, **cfg}, ensure_ascii=False, indent=1))


@pytest.mark.slow
def test_lm_eval_run_scores_like_the_training_forward(server, model, tok, eos, tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is a test extra: bash scripts/install.sh --test")
    from lm_eval.tasks import TaskManager

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    # the model's own greedy text is the target of every other prompt: exact_match must come out 0.5
    expected_gen = [greedy_text(model, tok, eos, p, "\n") for p in GEN_PROMPTS]
    targets = [g if i % 2 == 0 else g + " (not this)" for i, g in enumerate(expected_gen)]
    write_tasks(tmp_path, targets)

    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"model": "tiny", "base_url": server.base_url + "/v1/completions", "tokenizer_backend": "remote",
                    "batch_size": 4, "num_concurrent": 1, "max_retries": 1, "max_length": 512},
        tasks=["areno_mc", "areno_ppl", "areno_gen"],
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        log_samples=True, bootstrap_iters=0, random_seed=0,
    )
    results, samples = out["results"], out["samples"]

    # multiple choice: every choice's log-likelihood, and acc = argmax of the summed continuation log-probs
    correct = []
    for s in sorted(samples["areno_mc"], key=itemgetter("doc_id")):
        q, choices, answer = MC[s["doc_id"]]
        want = [loglikelihood(model, tok, q, " " + c) for c in choices]
        got = s["filtered_resps"]
        assert [g[0] for g in got] == pytest.approx([w[0] for w in want], abs=1e-4)
        assert [bool(g[1]) for g in got] == [w[1] for w in want]
        correct.append(max(range(len(want)), key=lambda i: want[i][0]) == answer)
    assert len(correct) == len(MC)
    assert results["areno_mc"]["acc,none"] == pytest.approx(sum(correct) / len(correct))

    # perplexity: each text scored after the prefix token (lm-eval: BOS, else EOS), word perplexity from the sums
    prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    lls = {t: token_logprobs(model, [prefix, *tok.encode(t, add_special_tokens=False)]).sum().item() for t in TEXTS}
    for s in samples["areno_ppl"]:
        text = TEXTS[s["doc_id"]]
        assert s["filtered_resps"][0] == pytest.approx(lls[text], abs=1e-4)
    words = sum(len(re.split(r"\s+", t)) for t in TEXTS)
    assert results["areno_ppl"]["word_perplexity,none"] == pytest.approx(math.exp(-sum(lls.values()) / words),
                                                                         rel=1e-5)

    # generate-until: the server's greedy text is the training forward's, so exactly every other one matches
    for s in samples["areno_gen"]:
        assert s["filtered_resps"][0] == expected_gen[s["doc_id"]]
    assert results["areno_gen"]["exact_match,none"] == 0.5


# ---- the same requests, replayed without lm-eval -----------------------------------------------------------------
def test_replayed_lm_eval_requests(server, model, tok, eos):
    # loglikelihood: what LocalCompletionsAPI._create_payload(generate=False) sends for a batch of (context,
    # continuation) token lists, context + continuation as one prompt
    pairs = [(q, " " + c[0]) for q, c, _ in MC[:3]] + [("One, two", ", three")]
    reqs = []
    for context, continuation in pairs:
        ctx = tok.encode(context, add_special_tokens=False)
        whole = tok.encode(context + continuation, add_special_tokens=False)
        reqs.append((whole, len(ctx), loglikelihood(model, tok, context, continuation)))
    body = {"model": "tiny", "prompt": [w for w, _, _ in reqs], "temperature": 0, "max_tokens": 1, "logprobs": 1,
            "seed": 1234, "echo": True}
    r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "text_completion" and out["model"] == "tiny"
    assert out["usage"]["prompt_tokens"] == sum(len(w) for w, _, _ in reqs)
    assert out["usage"]["completion_tokens"] == len(reqs)
    assert sorted(c["index"] for c in out["choices"]) == list(range(len(reqs)))
    for choice, (whole, ctxlen, (want_ll, want_greedy)) in zip(sorted(out["choices"], key=itemgetter("index")), reqs):
        assert set(choice) >= {"index", "text", "logprobs", "finish_reason"} and choice["finish_reason"] == "length"
        lp = choice["logprobs"]
        assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
        # the prompt echoed (first log-prob null), then the one generated token
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(whole) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["tokens"][: len(whole)] == [tok.decode([t]) for t in whole]
        assert choice["text"].startswith(tok.decode(whole))
        assert all(len(top) == 1 for top in lp["top_logprobs"][1:])
        # lm-eval's parse_logprobs
        continuation = lp["token_logprobs"][ctxlen:-1]
        ll = sum(continuation)
        is_greedy = all(t == max(top.values()) for t, top in zip(continuation, lp["top_logprobs"][ctxlen:-1]))
        assert ll == pytest.approx(want_ll, abs=1e-4) and is_greedy == want_greedy
        assert lp["token_logprobs"][1:len(whole)] == pytest.approx(token_logprobs(model, whole).tolist(), abs=1e-4)

    # generate-until: what _create_payload(generate=True) sends (token-id prompts, the task's until plus the EOS
    # string as stop, max_gen_toks as max_tokens), parsed as choices[i].text by index
    prompts = [tok.encode(p, add_special_tokens=False) for p in GEN_PROMPTS]
    body = {"prompt": prompts, "model": "tiny", "max_tokens": GEN_TOKENS, "temperature": 0,
            "stop": ["\n", tok.eos_token], "seed": 1234}
    r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=itemgetter("index"))
    assert [c["text"] for c in choices] == [greedy_text(model, tok, eos, p, "\n") for p in GEN_PROMPTS]
    assert all(c["finish_reason"] in ("stop", "length") for c in choices)
