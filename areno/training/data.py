"""Training rows for the RL loop: where ``--dataset-path`` points, what a row must hold, and the batch order.

``load_rows`` turns ``--dataset-path`` (a local json/jsonl/parquet/csv file, a folder saved by
``datasets.Dataset.save_to_disk``, a folder of data files, or a hub reference ``name[:config[:split]]``) into a list of
dicts, or hands the path to the user's ``load_training_dataset`` from ``--dataset-loader-fn``. ``check_rows`` says which
row lacks what before any GPU work starts. ``PromptIterator`` yields seeded, shuffled batches per epoch and can resume
exactly where a checkpoint left it. Rows may carry ``split: "eval"|"test"``; the loop holds those out for evaluation.
"""

from __future__ import annotations

import contextlib
import csv
import gzip
import inspect
import json
import logging
import os
import random
import socket
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from areno.config import ConfigError

log = logging.getLogger("areno.data")

FLAG = "--dataset-path"
DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".jsonl.gz", ".json.gz", ".csv.gz")
HUB_PROBE_TIMEOUT_S = 3.0


class DatasetError(ConfigError):
    """A dataset that cannot be used; ``flag`` names the CLI flag at fault (the message starts with it)."""

    def __init__(self, flag: str, reason: str):
        self.flag = flag
        self.reason = reason
        ValueError.__init__(self, f"{flag}: {reason}")


# ---- loading ---------------------------------------------------------------------------------------------------
def load_rows(dataset_path, *, loader_fn=None, split="train", **kwargs) -> list[dict]:
    """Rows of ``--dataset-path``; with ``loader_fn`` (``--dataset-loader-fn``) the user function decides."""
    if loader_fn is not None:
        extra = _accepted(loader_fn, {"split": split, **kwargs})
        try:
            rows = loader_fn(dataset_path, default_loader=default_loader, **extra)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's loader failed: one line naming the flag and where
            raise DatasetError("--dataset-loader-fn", f"load_training_dataset raised {type(e).__name__}: {e}"
                               f"{_user_line(e, loader_fn)}") from e
        rows = _as_rows(rows, "--dataset-loader-fn", "load_training_dataset returned")
        return _objects(rows, "--dataset-loader-fn", "load_training_dataset returned row")
    if not dataset_path:
        raise DatasetError(FLAG, "is required (or pass --dataset-loader-fn to build the rows yourself)")
    return _objects(default_loader(dataset_path, split=split, **kwargs), FLAG, f"{dataset_path} row")


JSON_KINDS = {str: "a JSON string", list: "a JSON array", int: "a JSON number", float: "a JSON number",
              bool: "a JSON boolean", type(None): "JSON null"}


def _objects(rows: list, flag: str, where: str) -> list[dict]:
    """``rows`` when every one is a dict (an object {"prompt": ...}); else a ``DatasetError`` naming the first that
    is not, so a stray string or array never reaches the loop as a traceback."""
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            kind = f"a {type(row).__name__}" if flag != FLAG else JSON_KINDS.get(type(row), "not an object")
            raise DatasetError(flag, f"{where} {i} is {kind} ({str(row)[:60]!r}), not an object like "
                                     '{"prompt": ..., "answer": ...}')
    return rows


def _user_line(e: BaseException, fn) -> str:
    """`` (file.py, line N)``: the last frame of the traceback inside ``fn``'s own file."""
    import traceback

    file = getattr(getattr(fn, "__code__", None), "co_filename", None)
    frames = [f for f in traceback.extract_tb(e.__traceback__, limit=10_000) if f.filename == file]
    return f" ({Path(file).name}, line {frames[-1].lineno})" if frames else ""


def default_loader(path, *, split="train", **kwargs) -> list[dict]:
    """The built-in loader, also handed to user loaders as ``default_loader``; ``kwargs`` go to ``load_dataset``."""
    if path is None or str(path) == "":
        raise DatasetError(FLAG, "no dataset given (pass a local file, a `datasets` folder or a hub name like "
                                 "gsm8k:main)")
    path = str(path)
    local = Path(path).expanduser()
    if local.exists():
        return _load_local(local, split)
    if _looks_like_path(path):
        raise DatasetError(FLAG, f"file not found: {path} (resolved to {local.resolve()})")
    return _load_hub(path, split, **kwargs)


def _looks_like_path(path: str) -> bool:
    # "owner/name[:config[:split]]" is a hub id; anything with a data-file suffix, a leading ./ ../ / ~, a trailing
    # slash or more than one slash is meant as a local path.
    name = path.split(":", 1)[0]
    if path.lower().endswith(DATA_SUFFIXES) or name.lower().endswith(DATA_SUFFIXES):
        return True
    return path.startswith(("/", "./", "../", "~", ".\\")) or name.endswith("/") or name.count("/") > 1


def _load_local(path: Path, split: str) -> list[dict]:
    if path.is_file():
        return _load_file(path)
    if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
        return _load_saved(path, split)
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.name.lower().endswith(DATA_SUFFIXES)
                   and not any(part.startswith(".") for part in p.relative_to(path).parts))
    if not files:
        raise DatasetError(FLAG, f"{path} is a folder with no {'/'.join(DATA_SUFFIXES)} files and is not a "
                                 "`datasets` folder saved with save_to_disk")
    # HF-style layouts (train.jsonl, train-00000-of-00001.parquet, ...): keep the requested split's files
    chosen = [p for p in files if _split_of(p) == split] or files
    rows = []
    for p in chosen:
        rows += _load_file(p)
    return rows


def _split_of(p: Path) -> str:
    stem = p.name.lower()
    for suffix in DATA_SUFFIXES:
        if stem.endswith(suffix):
            stem = stem[: -len(suffix)]
            break
    for sep in ("-", "_", "."):
        stem = stem.split(sep, 1)[0]
    return stem


def _load_file(path: Path) -> list[dict]:
    name = path.name.lower()
    opener = gzip.open if name.endswith(".gz") else open
    try:
        if name.endswith((".jsonl", ".jsonl.gz")):
            with opener(path, "rt", encoding="utf-8") as f:
                return _json_lines(f, path)
        if name.endswith((".json", ".json.gz")):
            with opener(path, "rt", encoding="utf-8") as f:
                text = f.read()
            try:
                data = json.loads(text)
            except json.JSONDecodeError:
                return _json_lines(text.splitlines(), path)  # JSON lines saved as .json
            if isinstance(data, dict):
                if isinstance(data.get("data"), list):
                    data = data["data"]
                else:
                    raise DatasetError(FLAG, f"{path}: a JSON object must hold its rows under \"data\" "
                                             f"(found keys: {', '.join(list(data)[:10])})")
            return _as_rows(data, FLAG, str(path))
        if name.endswith(".parquet"):
            return _parquet_rows(path)
        if name.endswith((".csv", ".csv.gz")):
            with opener(path, "rt", encoding="utf-8", newline="") as f:
                return [dict(r) for r in csv.DictReader(f)]
    except (OSError, UnicodeDecodeError, EOFError, zlib.error, csv.Error) as e:  # cut, corrupt or not text
        raise DatasetError(FLAG, f"cannot read {path}: {type(e).__name__}: {_first_line(e)}") from e
    raise DatasetError(FLAG, f"{path}: unsupported file type (use {', '.join(DATA_SUFFIXES)})")


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else ""


def _parquet_rows(path: Path) -> list[dict]:
    import pyarrow
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except pyarrow.ArrowException as e:  # a cut or corrupt file, or not parquet at all
        raise DatasetError(FLAG, f"cannot read {path}: not a readable parquet file ({type(e).__name__}: "
                                 f"{_first_line(e)})") from e


def _json_lines(lines, path) -> list[dict]:
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(FLAG, f"{path} line {n} is not valid JSON: {e}") from e
        if not isinstance(row, dict):
            raise DatasetError(FLAG, f"{path} line {n} is {JSON_KINDS.get(type(row), 'not an object')} "
                                     f"({line.strip()[:60]!r}), not an object like " '{"prompt": ..., "answer": ...}')
        rows.append(row)
    return rows


def _load_saved(path: Path, split: str) -> list[dict]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 - datasets/pyarrow raise many types for a cut or corrupt folder
        raise DatasetError(FLAG, f"cannot read the `datasets` folder {path}: {type(e).__name__}: "
                                 f"{_first_line(e)}") from e
    if isinstance(ds, datasets.DatasetDict):
        if split in ds:
            ds = ds[split]
        elif len(ds) == 1:
            ds = next(iter(ds.values()))
        else:
            raise DatasetError(FLAG, f"{path} holds the splits {', '.join(ds)} but not {split!r}")
    return ds.to_list()


@contextlib.contextmanager
def _hub_offline():
    """Offline mode for one call (only a cached copy can load), without waiting on retries to an unreachable hub."""
    import datasets.config
    import huggingface_hub.constants as hub

    saved = hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE
    hub.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True
    try:
        yield
    finally:
        hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE = saved


def _hub_reachable(timeout: float = HUB_PROBE_TIMEOUT_S) -> bool:
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


def _load_hub(ref: str, split: str, **kwargs) -> list[dict]:
    import datasets
    import huggingface_hub.constants as hub

    parts = ref.split(":")
    if len(parts) > 3 or not parts[0]:
        raise DatasetError(FLAG, f"{ref!r} is neither an existing local path nor a hub reference name[:config[:split]]")
    name, config, split = parts[0], (parts[1] if len(parts) > 1 else None) or None, (parts[2:] or [split])[0]
    offline = bool(hub.HF_HUB_OFFLINE) or not _hub_reachable()
    hint = (f"no local file or folder named {ref!r} exists either; download the data elsewhere and pass a local "
            f"file, e.g. {FLAG} data/train.jsonl (json/jsonl/parquet/csv or a save_to_disk folder)")
    try:
        with _hub_offline() if offline else contextlib.nullcontext():
            ds = datasets.load_dataset(name, config, split=split, **kwargs)
    except Exception as e:  # noqa: BLE001 - datasets raises many types; all mean "could not fetch"
        why = "the Hugging Face hub is not reachable (offline) and no cached copy was found" if offline else \
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        raise DatasetError(FLAG, f"could not fetch the hub dataset {name!r} (config {config}, split {split}): "
                                 f"{why}; {hint}") from e
    if isinstance(ds, datasets.DatasetDict):  # split=None was asked for explicitly
        ds = ds[split] if split in ds else next(iter(ds.values()))
    return ds.to_list()


def _as_rows(rows, flag: str, what: str) -> list[dict]:
    if hasattr(rows, "to_list") and not isinstance(rows, list):  # datasets.Dataset
        rows = rows.to_list()
    if not isinstance(rows, list):
        try:
            rows = list(rows)
        except TypeError:
            raise DatasetError(flag, f"{what} a {type(rows).__name__}, not a list of row dicts") from None
    return rows


def _accepted(fn, kwargs: dict) -> dict:
    """The keyword arguments ``fn`` can take (all of them when it has ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return kwargs
    names = {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    return {k: v for k, v in kwargs.items() if k in names}


# ---- checking --------------------------------------------------------------------------------------------------
REQUIRED = {
    "grpo": ("prompt",), "gspo": ("prompt",), "ppo": ("prompt",),
    "sft": ("prompt", "response"), "dpo": ("chosen", "rejected"),
}


def check_rows(rows, algo: str, *, flag: str = FLAG) -> None:
    """Raise ``DatasetError`` naming the first row that ``algo`` cannot train on, and what it lacks."""
    if algo not in REQUIRED:
        raise ValueError(f"--algo {algo!r}: unknown algorithm (choose from {', '.join(REQUIRED)})")
    if not rows:
        raise DatasetError(flag, f"the dataset has no training rows ({algo} needs at least one)")
    need = REQUIRED[algo]
    what = f"{algo} rows need " + " and ".join(repr(k) for k in need) + (" (plus an optional 'prompt')"
                                                                          if algo == "dpo" else "")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DatasetError(flag, f"row {i} is a {type(row).__name__}, not an object; {what}")
        for key in need + (("prompt",) if algo == "dpo" and row.get("prompt") is not None else ()):
            if key not in row:
                raise DatasetError(flag, f"row {i} has no {key!r} key (its keys: {', '.join(map(str, row)) or 'none'})"
                                         f"; {what}; map your columns with --dataset-loader-fn")
            problem = _text_problem(row[key])
            if problem:
                raise DatasetError(flag, f"row {i}: {key!r} {problem}")


def _text_problem(value) -> str | None:
    """None when ``value`` is a string or a list of chat messages {role, content}; else what is wrong."""
    if isinstance(value, str):
        return None
    if isinstance(value, list):
        if not value:
            return "is an empty message list"
        for j, m in enumerate(value):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                return f"message {j} is not a chat message {{role, content}}: {str(m)[:80]}"
        return None
    return f"must be a string or a list of chat messages {{role, content}}, got {type(value).__name__}"


# ---- batches ---------------------------------------------------------------------------------------------------
class PromptIterator:
    """Batches of ``batch_size`` rows in a seeded shuffled order per epoch, for ``epochs`` epochs.

    A dataset larger than one batch drops its last partial batch each epoch; a smaller one repeats rows to fill one
    batch per epoch. ``epochs`` of None or 0 means no end. ``state_dict()`` after a yielded batch records it as
    consumed, so a resumed iterator produces exactly the batches an uninterrupted one would have.
    """

    def __init__(self, rows, batch_size: int, *, seed: int = 0, epochs: int | None = 1):
        if batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
        if not rows:
            raise DatasetError(FLAG, "no rows left to train on (the dataset is empty, or every prompt was dropped)")
        self.rows = list(rows)
        self.batch_size = batch_size
        self.seed = seed
        self.epochs = epochs or None
        self.epoch = 0
        self.position = 0  # batches already produced in this epoch

    @property
    def batches_per_epoch(self) -> int:
        return max(1, len(self.rows) // self.batch_size)

    def __len__(self) -> int:
        """Batches left (the full count for an unbounded iterator is not defined)."""
        if self.epochs is None:
            raise TypeError("an iterator with no epoch limit has no length")
        return max(0, (self.epochs - self.epoch) * self.batches_per_epoch - self.position)

    def order(self, epoch: int) -> list[int]:
        """Row indices of ``epoch``, in batch order (long enough to fill every batch of the epoch)."""
        rng = random.Random(self.seed * 1_000_003 + epoch)
        n = len(self.rows)
        idx = list(range(n))
        rng.shuffle(idx)
        while len(idx) < self.batch_size:  # fewer rows than one batch: repeat, each round reshuffled
            more = list(range(n))
            rng.shuffle(more)
            idx += more
        return idx

    def __iter__(self):
        while self.epochs is None or self.epoch < self.epochs:
            idx = self.order(self.epoch)
            while self.position < self.batches_per_epoch:
                start = self.position * self.batch_size
                batch = [self.rows[i] for i in idx[start : start + self.batch_size]]
                self.position += 1
                yield batch
            self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "batch_size": self.batch_size,
                "num_rows": len(self.rows)}

    def load_state_dict(self, state: dict) -> None:
        for key, mine in (("seed", self.seed), ("batch_size", self.batch_size), ("num_rows", len(self.rows))):
            if key in state and state[key] != mine:
                log.warning("resuming the data order with %s=%s, saved with %s=%s: batches will differ from an "
                            "uninterrupted run", key, mine, key, state[key])
        self.epoch = int(state["epoch"])
        self.position = min(int(state["position"]), self.batches_per_epoch)


@dataclass
class Prompt:
    """One dataset row as the loop uses it: the user's ``row`` untouched, beside what was derived from it."""

    row: dict  # the user's row, never mutated (reward records and agents see exactly it)
    index: int | None  # its place in the dataset (errors name it; the media cache's key)
    ids: list[int]  # the prompt's token ids (an image prompt: the processor's, placeholders expanded)
    has_media: bool = False  # the prompt shows images (``DatasetMedia.encode`` gives its ``MultimodalPrompt``)
    responses: dict[str, list[int]] = field(default_factory=dict)  # e.g. "response" / "chosen" -> ids + EOS


def prompt_ids(tokenizer, prompt) -> list[int]:
    """A prompt's token ids: chat messages through the chat template (generation prompt added), text as it is."""
    if isinstance(prompt, list):
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    else:
        text = prompt
    return tokenizer.encode(text, add_special_tokens=False)


def response_ids(tokenizer, response, eos: int | None) -> list[int]:
    """A response's token ids and EOS (chat messages: the assistant text)."""
    if isinstance(response, list):
        response = "".join(m.get("content", "") for m in response if m.get("role") == "assistant")
    ids = tokenizer.encode(response, add_special_tokens=False)
    return ids + ([eos] if eos is not None else [])


def text_chars(value) -> int:
    """Characters of text in a prompt or response: a string, or chat messages' text contents (image parts: none)."""
    if isinstance(value, str):
        return len(value.strip())
    if isinstance(value, list):
        total = 0
        for m in value:
            content = m.get("content") if isinstance(m, dict) else m
            if isinstance(content, list):  # parts: {"type": "text", "text": ...} / images
                total += sum(len(str(p.get("text") or "")) for p in content if isinstance(p, dict))
            elif content is not None:
                total += len(str(content).strip())
        return total
    return 0


def max_token_chars(tokenizer) -> int | None:
    """The most characters one token of ``tokenizer`` can stand for (its longest vocabulary entry), None when the
    tokenizer does not list its vocabulary. A text of n characters needs at least n / this many tokens."""
    try:
        vocab = tokenizer.get_vocab()
    except (AttributeError, NotImplementedError, TypeError):
        return None
    return max((len(t) for t in vocab if isinstance(t, str)), default=0) or None


@dataclass
class Dropped:
    """Rows ``tokenize_prompts`` left out, by reason (one warning line names them all)."""

    empty: int = 0
    long_prompt: int = 0
    over_context: int = 0
    longest: int = 0  # the longest prompt measured (tokens), or 0 when only the cheap bound was applied

    def log(self, total: int, max_prompt_tokens: int, max_tokens: int | None, label: str = "rows") -> None:
        parts = [f"{self.long_prompt} whose prompt is longer than --max-prompt-tokens {max_prompt_tokens}"
                 + (f" (longest {self.longest} tokens)" if self.longest else "")] if self.long_prompt else []
        if self.over_context:
            parts.append(f"{self.over_context} whose prompt + response is longer than the model's context "
                         f"({max_tokens} tokens)")
        if self.empty:
            parts.append(f"{self.empty} with an empty prompt")
        if parts:
            logging.getLogger("areno.train").warning(
                "dropped %d of %d %s (not truncated): %s", self.empty + self.long_prompt + self.over_context,
                total, label, "; ".join(parts))


def tokenize_prompts(rows, tokenizer, media, *, max_prompt_tokens: int, responses=(), prompt_optional=False,
                     first_index: int = 0, indices=None, max_tokens: int | None = None,
                     label: str = "rows") -> list[Prompt]:
    """``rows`` as Prompts: prompt ids (images through ``media``, a ``DatasetMedia``) and the ``responses`` fields'
    ids. A row is dropped, never truncated, and counted in one warning line when its prompt is empty (unless
    ``prompt_optional``) or longer than ``max_prompt_tokens``, or its prompt + a response is longer than
    ``max_tokens`` (the model's context). A text too long to fit at any tokenization (more characters than the
    limit times the longest token) is dropped before it is tokenized, so one huge row costs no time or memory.
    ``indices``: each row's place in the dataset (default ``first_index`` + position); ``label``: what the warning
    calls the rows."""
    out, dropped = [], Dropped()
    eos = tokenizer.eos_token_id
    per_token = max_token_chars(tokenizer)
    room = max_tokens if max_tokens is not None else float("inf")

    def too_long(value, limit) -> bool:  # certainly more than ``limit`` tokens (4x slack for normalisers)
        return per_token is not None and text_chars(value) > 4 * per_token * limit

    for k, r in enumerate(rows):
        index = indices[k] if indices is not None else first_index + k
        ids, has_media = None, media.has_media(r.get("prompt"))
        if too_long(r.get("prompt"), max_prompt_tokens):
            dropped.long_prompt += 1
        elif has_media:  # images: the processor's ids (placeholders expanded)
            ids = media.encode(r["prompt"], index).input_ids
        elif r.get("prompt") is not None or not prompt_optional:
            ids = prompt_ids(tokenizer, r["prompt"])
        else:
            ids = []
        if ids is not None and len(ids) > max_prompt_tokens:
            dropped.long_prompt, dropped.longest, ids = dropped.long_prompt + 1, max(dropped.longest, len(ids)), None
        elif ids is not None and not prompt_optional and not ids:
            dropped.empty, ids = dropped.empty + 1, None
        answers = {}
        if ids is not None:
            answers = {f: None if too_long(r[f], room) else response_ids(tokenizer, r[f], eos) for f in responses}
            if any(a is None or len(ids) + len(a) > room for a in answers.values()):
                dropped.over_context, ids = dropped.over_context + 1, None
        if ids is None:
            media.forget(index)
            continue
        out.append(Prompt(r, index, ids, has_media, answers))
    dropped.log(len(rows), max_prompt_tokens, max_tokens, label)
    return out
