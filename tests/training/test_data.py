"""--dataset-path formats, hub references offline, row checks and the resumable batch order."""

import csv
import json
import time

import pytest

from areno.config import ConfigError
from areno.training import data
from areno.training.data import DatasetError, PromptIterator, check_rows, default_loader, load_rows

ROWS = [{"prompt": f"q{i}", "answer": str(i)} for i in range(5)]


def _write(path, rows, kind):
    if kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == "json":
        path.write_text(json.dumps(rows))
    elif kind == "json-data":
        path.write_text(json.dumps({"data": rows}))
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    elif kind == "csv":
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return path


@pytest.mark.parametrize("kind,suffix", [("jsonl", ".jsonl"), ("json", ".json"), ("json-data", ".json"),
                                         ("parquet", ".parquet"), ("csv", ".csv")])
def test_local_files(tmp_path, kind, suffix):
    path = _write(tmp_path / f"d{suffix}", ROWS, kind)
    assert load_rows(str(path)) == ROWS


def test_chat_prompts_survive_jsonl_and_parquet(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "hi"}], "answer": "1", "split": "test"}]
    for kind, suffix in (("jsonl", ".jsonl"), ("parquet", ".parquet")):
        got = load_rows(str(_write(tmp_path / f"c{suffix}", rows, kind)))
        assert got == rows  # the split key is kept for the loop to hold the row out
        check_rows(got, "grpo")


def test_save_to_disk_folders(tmp_path):
    import datasets

    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "one"))
    assert load_rows(str(tmp_path / "one")) == ROWS
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:3]),
                               "test": datasets.Dataset.from_list(ROWS[3:])})
    dd.save_to_disk(str(tmp_path / "dict"))
    assert load_rows(str(tmp_path / "dict")) == ROWS[:3]
    assert load_rows(str(tmp_path / "dict"), split="test") == ROWS[3:]
    with pytest.raises(DatasetError, match="splits train, test but not 'validation'"):
        load_rows(str(tmp_path / "dict"), split="validation")


def test_folder_of_files_picks_the_split(tmp_path):
    _write(tmp_path / "train.jsonl", ROWS[:2], "jsonl")
    _write(tmp_path / "test.jsonl", ROWS[2:], "jsonl")
    assert load_rows(str(tmp_path)) == ROWS[:2]
    assert load_rows(str(tmp_path), split="test") == ROWS[2:]
    other = tmp_path / "all"
    other.mkdir()
    _write(other / "a.jsonl", ROWS[:2], "jsonl")
    _write(other / "b.parquet", ROWS[2:], "parquet")
    assert load_rows(str(other)) == ROWS  # no split names: every file, in name order


def test_missing_file_names_the_flag(tmp_path):
    for missing in (str(tmp_path / "nope.jsonl"), "data/nope.parquet", "./nope", "a/b/c"):
        with pytest.raises(DatasetError, match=r"^--dataset-path: file not found") as e:
            load_rows(missing)
        assert e.value.flag == "--dataset-path" and isinstance(e.value, ConfigError)


def test_bad_json_line_is_located(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(DatasetError, match="line 2 is not valid JSON"):
        load_rows(str(p))


def test_a_row_that_is_not_an_object_is_one_line_naming_where(tmp_path):
    # a .jsonl line that is a JSON string (or array, number, null): before, it reached the loop and crashed there
    for line, kind in (('"just text"', "a JSON string"), ("[1, 2]", "a JSON array"), ("7", "a JSON number"),
                       ("null", "JSON null")):
        p = tmp_path / "rows.jsonl"
        p.write_text('{"prompt": "a"}\n\n' + line + '\n{"prompt": "b"}\n')
        with pytest.raises(DatasetError, match=rf"^--dataset-path: \S*rows.jsonl line 3 is {kind} ") as e:
            load_rows(str(p))
        assert "\n" not in str(e.value)
    (tmp_path / "rows.json").write_text('[{"prompt": "a"}, "b"]')  # a JSON array of rows
    with pytest.raises(DatasetError, match=r"rows.json row 1 is a JSON string \('b'\), not an object"):
        load_rows(str(tmp_path / "rows.json"))
    with pytest.raises(DatasetError, match=r"^--dataset-loader-fn: load_training_dataset returned row 0 is a str "):
        load_rows(None, loader_fn=lambda path, *, default_loader: ["a prompt"])


def test_cut_or_corrupt_data_files_are_one_line_naming_the_file(tmp_path):
    good = _write(tmp_path / "good.parquet", ROWS, "parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(good[: len(good) // 2])
    (tmp_path / "noise.parquet").write_bytes(bytes(range(256)) * 8)
    gz = tmp_path / "cut.jsonl.gz"
    import gzip

    whole = gzip.compress(("".join(json.dumps(r) + "\n" for r in ROWS) * 50).encode())
    gz.write_bytes(whole[: len(whole) // 2])
    for name in ("cut.parquet", "noise.parquet", "cut.jsonl.gz"):
        with pytest.raises(DatasetError, match=rf"^--dataset-path: cannot read \S*{name}: ") as e:
            load_rows(str(tmp_path / name))
        assert "\n" not in str(e.value)


def test_hub_reference_offline_fails_fast_and_clearly(monkeypatch):
    monkeypatch.setattr(data, "_hub_reachable", lambda timeout=0: False)
    t0 = time.perf_counter()
    with pytest.raises(DatasetError) as e:
        load_rows("areno-no-such-dataset:main")
    assert time.perf_counter() - t0 < 20
    msg = str(e.value)
    assert msg.startswith("--dataset-path: could not fetch the hub dataset 'areno-no-such-dataset' (config main")
    assert "not reachable" in msg and "pass a local file" in msg


def test_hub_reference_parts(monkeypatch):
    calls = []

    def fake(name, config, split, **kw):
        calls.append((name, config, split, kw))
        import datasets

        return datasets.Dataset.from_list(ROWS[:1])

    import datasets

    monkeypatch.setattr(datasets, "load_dataset", fake)
    monkeypatch.setattr(data, "_hub_reachable", lambda timeout=0: True)
    assert load_rows("gsm8k:main") == ROWS[:1]
    load_rows("openai/gsm8k:main:test")
    load_rows("gsm8k", split="test", revision="x")
    assert calls == [("gsm8k", "main", "train", {}), ("openai/gsm8k", "main", "test", {}),
                     ("gsm8k", None, "test", {"revision": "x"})]


def test_user_loader_decides(tmp_path):
    seen = {}

    def loader(path, *, default_loader):  # no **kwargs: split is not forced on it
        seen["path"] = path
        return [dict(r, prompt=r["prompt"].upper()) for r in default_loader(path)]

    path = _write(tmp_path / "d.jsonl", ROWS, "jsonl")
    rows = load_rows(str(path), loader_fn=loader)
    assert seen["path"] == str(path) and rows[0]["prompt"] == "Q0"

    def from_nothing(path, *, default_loader, **kwargs):
        import datasets

        assert path is None and kwargs["split"] == "train"
        return datasets.Dataset.from_list(ROWS)  # a Dataset becomes a list of dicts

    assert load_rows(None, loader_fn=from_nothing) == ROWS
    assert default_loader(str(path)) == ROWS


@pytest.mark.parametrize("algo,rows,needle", [
    ("grpo", [], "no training rows"),
    ("grpo", [{"prompt": "a"}, {"question": "b"}], "row 1 has no 'prompt' key (its keys: question)"),
    ("gspo", [{"prompt": 3}], "row 0: 'prompt' must be a string or a list of chat messages"),
    ("ppo", [{"prompt": [{"role": "user"}]}], "row 0: 'prompt' message 0 is not a chat message"),
    ("sft", [{"prompt": "a", "response": "b"}, {"prompt": "c"}], "row 1 has no 'response' key"),
    ("dpo", [{"chosen": "a"}], "row 0 has no 'rejected' key"),
    ("dpo", [{"chosen": "a", "rejected": "b", "prompt": 5}], "row 0: 'prompt' must be"),
    ("grpo", ["just text"], "row 0 is a str, not an object"),
])
def test_check_rows_names_row_key_and_flag(algo, rows, needle):
    with pytest.raises(DatasetError) as e:
        check_rows(rows, algo)
    assert str(e.value).startswith("--dataset-path: ") and needle in str(e.value)


def test_check_rows_accepts_valid_rows():
    check_rows([{"prompt": "a"}, {"prompt": [{"role": "user", "content": "b"}]}], "grpo")
    check_rows([{"prompt": "a", "response": "b"}], "sft")
    check_rows([{"chosen": "a", "rejected": "b"}, {"prompt": "p", "chosen": "a", "rejected": "b"}], "dpo")


def _ids(batches):
    return [[r["i"] for r in b] for b in batches]


def test_iterator_order_is_seeded_and_covers_each_epoch():
    rows = [{"i": i} for i in range(10)]
    a = _ids(PromptIterator(rows, 3, seed=1, epochs=2))
    assert a == _ids(PromptIterator(rows, 3, seed=1, epochs=2))
    assert a != _ids(PromptIterator(rows, 3, seed=2, epochs=2))
    assert len(a) == 6 and all(len(b) == 3 for b in a)  # 10 rows: 3 full batches per epoch, the partial one dropped
    for epoch in (a[:3], a[3:]):
        flat = [i for b in epoch for i in b]
        assert len(set(flat)) == 9
    assert a[:3] != a[3:]  # reshuffled per epoch
    assert len(PromptIterator(rows, 5, seed=0, epochs=3)) == 6


def test_iterator_fills_a_batch_from_a_small_dataset():
    batches = _ids(PromptIterator([{"i": 0}, {"i": 1}], 5, seed=0, epochs=3))
    assert len(batches) == 3 and all(len(b) == 5 and set(b) == {0, 1} for b in batches)
    assert _ids(PromptIterator([{"i": 0}, {"i": 1}], 2, seed=0, epochs=1)) in ([[0, 1]], [[1, 0]])


def test_iterator_resumes_exactly():
    rows = [{"i": i} for i in range(7)]
    full = _ids(PromptIterator(rows, 2, seed=5, epochs=3))
    for cut in (1, 3, 4, 7):
        it = PromptIterator(rows, 2, seed=5, epochs=3)
        head = []
        for b in it:
            head.append([r["i"] for r in b])
            if len(head) == cut:
                state = json.loads(json.dumps(it.state_dict()))  # survives a JSON round trip
                break
        resumed = PromptIterator(rows, 2, seed=5, epochs=3)
        resumed.load_state_dict(state)
        assert head + _ids(resumed) == full


def test_iterator_unbounded_and_empty():
    it = iter(PromptIterator([{"i": 0}], 1, seed=0, epochs=None))
    assert [next(it) for _ in range(5)] == [[{"i": 0}]] * 5
    with pytest.raises(DatasetError, match="no rows left"):
        PromptIterator([], 2, seed=0, epochs=1)


class _WordTokenizer:
    eos_token_id = 0

    def encode(self, text, add_special_tokens=False):
        return [len(w) for w in text.split()]

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        return " ".join(m["content"] for m in messages) + " go"


class _NoMedia:
    has_media = staticmethod(lambda prompt: False)
    forgotten: list = []

    def forget(self, index):
        self.forgotten.append(index)


def test_tokenize_prompts_wraps_rows_without_mutating_them():
    rows = [{"prompt": "aa bbb", "response": "c", "answer": "5"},
            {"prompt": [{"role": "user", "content": "dddd"}], "response": "ee ff"},
            {"prompt": "x " * 9, "response": "g"}]
    before = json.loads(json.dumps(rows))
    media = _NoMedia()
    prompts = data.tokenize_prompts(rows, _WordTokenizer(), media, max_prompt_tokens=4, responses=("response",),
                                    indices=[3, 4, 5])
    assert rows == before  # the user's rows, untouched
    assert [p.row for p in prompts] == rows[:2] and [p.index for p in prompts] == [3, 4]
    assert [p.ids for p in prompts] == [[2, 3], [4, 2]]
    assert [p.responses for p in prompts] == [{"response": [1, 0]}, {"response": [2, 2, 0]}]
    assert media.forgotten == [5]  # the too-long row was dropped


class _VocabTokenizer(_WordTokenizer):
    """Word tokenizer whose longest vocabulary entry is 5 characters; records the length of every text encoded."""

    def __init__(self):
        self.seen = []

    def get_vocab(self):
        return {"hello": 0, "a": 1}

    def encode(self, text, add_special_tokens=False):
        self.seen.append(len(text))
        return super().encode(text)


def test_a_huge_row_is_dropped_before_it_is_tokenized(caplog):
    # one 50 MB dataset line cost 75 s and 9.9 GB in the tokenizer before it was dropped: a text with more characters
    # than (limit x the longest token) cannot fit and is dropped without being tokenized
    huge = "a " * 20_000_000
    rows = [{"prompt": huge, "response": "b"}, {"prompt": "aa bb", "response": "b"}, {"prompt": "x", "response": huge},
            {"prompt": [{"role": "user", "content": huge}], "response": "b"}]
    tok, media = _VocabTokenizer(), _NoMedia()
    with caplog.at_level("WARNING", logger="areno.train"):
        prompts = data.tokenize_prompts(rows, tok, media, max_prompt_tokens=64, responses=("response",),
                                        prompt_optional=True, max_tokens=2048)
    assert [p.index for p in prompts] == [1]
    assert max(tok.seen) < 1000  # the huge texts never reached the tokenizer
    assert "dropped 3 of 4 rows (not truncated): 2 whose prompt is longer than --max-prompt-tokens 64; 1 whose " \
           "prompt + response is longer than the model's context (2048 tokens)" in caplog.text


def test_rows_longer_than_the_context_are_dropped_and_counted_not_truncated(caplog):
    # SFT/DPO rows: prompt + response past the model's context crashed the step (IndexError in the rotary table)
    from areno.config.rollout import RolloutSection

    rows = [{"prompt": "a b", "response": "c d e"}, {"prompt": "a", "response": "b " * 9},
            {"prompt": "a " * 7, "response": "b"}, {"prompt": "", "response": "c"}, {"prompt": "a", "response": "b"}]
    with caplog.at_level("WARNING", logger="areno.train"):
        prompts = data.tokenize_prompts(rows, _WordTokenizer(), _NoMedia(), max_prompt_tokens=6,
                                        responses=("response",), max_tokens=8)
    assert [p.index for p in prompts] == [0, 4]
    assert [len(p.ids) + len(p.responses["response"]) for p in prompts] == [6, 3]  # ids + EOS, untruncated
    assert ("dropped 3 of 5 rows (not truncated): 1 whose prompt is longer than --max-prompt-tokens 6 (longest 7 "
            "tokens); 1 whose prompt + response is longer than the model's context (8 tokens); 1 with an empty "
            "prompt") in caplog.text
    help_text = RolloutSection.__dataclass_fields__["max_prompt_tokens"].metadata["help"]
    assert "dropped, not truncated" in help_text and "truncated from the left" not in help_text
