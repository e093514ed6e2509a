"""`areno eval` end to end on a tiny random checkpoint: the table, results JSON and samples; the metrics recomputed
from the samples with exact references (rational pass@k, a by-hand vote count); the same samples from the same seed
whatever the dataset order or file format (JSONL, Parquet, a `datasets` folder); field names, chat/plain prompts and
the system prompt; a zero LoRA adapter changes nothing, a trained one does; bad input exits 2 naming the flag."""

import json
import math
from collections import Counter
from fractions import Fraction

import pytest

from areno.cli import main
from areno.quickstart.preset import MODEL, cached_model
from areno.quickstart.task import generate
from areno.rl.eval_sets import PromptOptions, load_eval_set

REWARD = '''
def reward_fn(record):
    return 1.0 if len(set(record.completion)) % 2 == 0 else 0.0


def extract_answer(completion):
    return completion[:1] or None
'''


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    model = cached_model(root / "model", MODEL)
    rows = [r for r in generate(n_eval=12) if r.get("split") == "eval"]
    (root / "add.jsonl").write_text("".join(json.dumps({"q": r["prompt"][0]["content"], "a": r["answer"]}) + "\n"
                                            for r in rows))
    (root / "chat.jsonl").write_text("".join(json.dumps({"q": r["prompt"], "a": r["answer"]}) + "\n"
                                             for r in rows[:6]))
    (root / "reward.py").write_text(REWARD)
    return root, model


def run(files, *extra, datasets=("add",), fields=("--prompt-field", "q", "--answer-field", "a"), out="out"):
    root, model = files
    argv = ["eval", "--model-path", str(model), "--reward-fn-path", str(root / "reward.py"), "--n-samples", "4",
            "--max-new-tokens", "4", "--output-dir", str(root / out), *fields, *extra]
    for d in datasets:
        argv += ["--dataset-path", d if "=" in d else f"{d}={root / d}.jsonl"]
    rc = main(argv)
    if rc:
        return rc, None, None
    results = json.loads((root / out / "results.json").read_text())
    samples = [json.loads(line) for line in (root / out / "samples.jsonl").read_text().splitlines()]
    return rc, results, samples


@pytest.fixture(scope="module")
def baseline(files):
    """One run on `add` with the defaults (seed 0, K = 4): (results, samples)."""
    rc, results, samples = run(files)
    assert rc == 0
    return results, samples


def exact_pass(n, c, k):
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


def test_metrics_match_a_recount_of_the_samples(baseline):
    results, samples = baseline
    got = results["datasets"]["add"]
    assert got["prompts"] == 12 and len(samples) == 48 and len(got["sha256"]) == 64
    assert results["decoding"]["n_samples"] == 4 and results["seed"] == 0 and len(results["model_sha256"]) == 64
    by_prompt = {}
    for s in samples:
        assert s["score"] == (1.0 if len(set(s["completion"])) % 2 == 0 else 0.0)  # the reward, recomputed
        by_prompt.setdefault(s["index"], []).append(s)
    avg, passes, maj = [], {k: [] for k in (1, 2, 4)}, []
    for group in by_prompt.values():
        group.sort(key=lambda s: s["sample"])
        c = sum(s["score"] for s in group)
        avg.append(Fraction(int(c), 4))
        for k in passes:
            passes[k].append(exact_pass(4, int(c), k))
        votes = Counter(s["completion"][:1] for s in group if s["completion"][:1])
        if votes:  # the most votes; a tie goes to the answer seen first
            best = max(votes.values())
            first = next(s for s in group if s["completion"][:1] and votes[s["completion"][:1]] == best)
            maj.append(first["score"])
        else:
            maj.append(0.0)
    m = got["metrics"]
    assert m["avg@4"] == pytest.approx(float(sum(avg) / 12), abs=1e-12)
    for k, values in passes.items():
        assert m[f"pass@{k}"] == pytest.approx(float(sum(values) / 12), abs=1e-12)
        assert m[f"pass@{k}_lo"] <= m[f"pass@{k}"] <= m[f"pass@{k}_hi"]
    assert m["maj@4"] == pytest.approx(sum(maj) / 12, abs=1e-12)
    assert 0 < m["avg@4"] < 1  # the constructed reward splits the samples


def test_same_seed_same_samples_whatever_the_other_datasets(files, baseline, capsys):
    first, a = baseline
    _, both, b = run(files, datasets=("chat", "add"), out="o2")
    table = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(table) if line.startswith("dataset "))
    assert table[at].split() == ["dataset", "prompts", "avg@4", "pass@1", "pass@2", "pass@4", "maj@4"]
    assert table[at + 1].split()[:2] == ["chat", "6"] and table[at + 2].split()[:2] == ["add", "12"]
    key = [(s["index"], s["sample"], s["completion"]) for s in a]
    assert key == [(s["index"], s["sample"], s["completion"]) for s in b if s["dataset"] == "add"]
    assert both["datasets"]["add"]["metrics"] == first["datasets"]["add"]["metrics"]
    assert list(both["datasets"]) == ["chat", "add"] and both["datasets"]["chat"]["prompts"] == 6
    _, _, e = run(files, "--seed", "1", out="o3")
    assert [s["completion"] for s in e] != [s["completion"] for s in a]


def test_jsonl_parquet_and_a_datasets_folder_give_the_same_prompts(files, tmp_path):
    datasets = pytest.importorskip("datasets")
    root, _ = files
    rows = [json.loads(line) for line in (root / "add.jsonl").read_text().splitlines()]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "add.parquet"))
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "saved"))
    options = PromptOptions("q", "a", "chat", "Add.")
    sets = [load_eval_set("add", str(p), options) for p in (root / "add.jsonl", tmp_path / "add.parquet",
                                                            tmp_path / "saved")]
    assert sets[0].rows == sets[1].rows == sets[2].rows
    assert sets[0].rows[0]["prompt"] == [{"role": "system", "content": "Add."},
                                         {"role": "user", "content": rows[0]["q"]}]
    assert sets[0].rows[0]["answer"] == rows[0]["a"]
    assert len({s.sha256 for s in sets}) == 3
    plain = load_eval_set("add", str(root / "add.jsonl"), PromptOptions("q", "a", "plain", None))
    assert plain.rows[0]["prompt"] == rows[0]["q"]


@pytest.mark.parametrize("extra, fields, flag", [
    ((), ("--prompt-field", "q", "--answer-field", "nope"), "--answer-field"),
    (("--dataset-path", "add=/no/such.jsonl"), ("--prompt-field", "q", "--answer-field", "a"), "--dataset-path"),
    (("--prompt-format", "plain", "--system-prompt", "x"), ("--prompt-field", "q"), "--system-prompt"),
    (("--lora-path", "/no/such/adapter"), ("--prompt-field", "q"), "--lora-path"),
    (("--top-p", "0"), ("--prompt-field", "q"), "--top-p"),
])
def test_bad_input_exits_2_naming_the_flag(files, capsys, extra, fields, flag):
    with pytest.raises(SystemExit) as e:
        rc = run(files, *extra, fields=fields)[0]
        raise SystemExit(rc)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("areno eval: error: " + flag), err


def test_duplicate_dataset_names_are_refused(files, capsys):
    with pytest.raises(SystemExit) as e:
        run(files, datasets=("add", "add"))
    assert e.value.code == 2 and "twice" in capsys.readouterr().err


def test_a_lora_adapter_is_applied(files, baseline, tmp_path):
    import torch

    from areno.models import load_model
    from areno.models.lora import LoraSpec, attach

    _, model_dir = files
    adapter = attach(load_model(str(model_dir), dtype=torch.float32, device=torch.device("cpu")), LoraSpec(4, 8.0))
    adapter.save(tmp_path / "zero")  # B = 0: the base model exactly
    with torch.no_grad():
        for p in adapter.parameters():
            p.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    adapter.save(tmp_path / "moved")
    a = baseline[1]
    _, zero, b = run(files, "--lora-path", str(tmp_path / "zero"), out="l1")
    _, moved, c = run(files, "--lora-path", str(tmp_path / "moved"), out="l2")
    assert [s["completion"] for s in b] == [s["completion"] for s in a]
    assert [s["completion"] for s in c] != [s["completion"] for s in a]
    assert len(moved["lora_sha256"]) == 64 and moved["lora_path"] == str(tmp_path / "moved")


@pytest.mark.gpu
def test_on_cuda_the_same_seed_gives_the_same_samples_and_greedy_samples_agree(files):
    """On the GPU (bf16, CUDA-graph decode, the Triton sampler): a rerun with the same seed repeats every sample, and
    at temperature 0 a prompt's K samples are one answer (all right or all wrong: pass@K == avg@K)."""
    _, first, a = run(files, "--dtype", "bfloat16", out="g1")
    _, _, b = run(files, "--dtype", "bfloat16", out="g2")
    assert [s["completion"] for s in a] == [s["completion"] for s in b]
    _, greedy, g = run(files, "--dtype", "bfloat16", "--temperature", "0", out="g3")
    for i in range(12):
        assert len({s["completion"] for s in g if s["index"] == i}) == 1
    m = greedy["datasets"]["add"]["metrics"]
    assert m["avg@4"] == m["pass@4"] == m["pass@1"] and first["tokens_per_s"] > 0
