"""Evaluation sets: a ``name=FILE`` dataset (jsonl / json / parquet / csv / a ``datasets`` save_to_disk folder, read by
``areno.training.data.load_rows``) as prompts to sample, with its content hash; the fields and prompt form chosen by
--prompt-field / --answer-field / --prompt-format / --system-prompt."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from areno.config import ConfigError
from areno.training.data import DatasetError, load_rows, prompt_ids


@dataclass
class PromptOptions:
    """How a row becomes a prompt (the flags of ``areno.config.evaluate``)."""

    prompt_field: str = "prompt"
    answer_field: str = "answer"
    prompt_format: str = "auto"  # auto | chat | plain
    system_prompt: str | None = None


@dataclass
class EvalSet:
    """One dataset to evaluate: its rows (``prompt`` and ``answer`` set from the chosen fields) and token ids."""

    name: str
    path: str
    sha256: str
    rows: list[dict]
    ids: list[list[int]] = field(default_factory=list)


def content_hash(path) -> str:
    """sha256 over a file's bytes, or over a folder's files (relative path and bytes, in sorted order)."""
    path = Path(path).expanduser()
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for f in files:
        if f != path:
            h.update(f.relative_to(path).as_posix().encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def model_hash(path) -> str | None:
    """sha256 over a local model folder's config, tokenizer and weight files; None for a hub id."""
    folder = Path(str(path)).expanduser()
    if not folder.is_dir():
        return None
    h = hashlib.sha256()
    for f in sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in (".json", ".safetensors", ".model",
                                                                                   ".txt", ".jinja")):
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 24), b""):
                h.update(chunk)
    return h.hexdigest()


def as_prompt(value, options: PromptOptions, where: str, flag: str):
    """A row's prompt in the form the options ask: chat messages (system prompt added) or a plain string."""
    fmt = options.prompt_format
    if isinstance(value, str):
        if fmt != "chat" and not (fmt == "auto" and options.system_prompt):
            return value
        value = [{"role": "user", "content": value}]
    elif not (isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value)):
        raise ConfigError(flag, f"{where}: the prompt is {type(value).__name__}, not a string or chat messages")
    elif fmt == "plain":
        raise ConfigError("--prompt-format", f"is plain, but {where} holds chat messages (use auto or chat)")
    if options.system_prompt and not (value and value[0].get("role") == "system"):
        value = [{"role": "system", "content": options.system_prompt}, *value]
    return value


def load_eval_set(name: str, path: str, options: PromptOptions, *, flag: str = "--dataset-path") -> EvalSet:
    """The rows of ``path`` (every row, whatever its ``split``; a ``datasets`` folder: its test split) as an
    ``EvalSet``; a missing field or unreadable file is a ``ConfigError`` naming the flag and the row."""
    try:
        raw = load_rows(path, split="test")
    except DatasetError as e:
        raise ConfigError(flag, f"{name}={path}: {e.reason}") from e
    if not raw:
        raise ConfigError(flag, f"{name}={path} holds no rows")
    rows = []
    for i, row in enumerate(raw):
        where = f"{path} row {i}"
        for key, option in ((options.prompt_field, "--prompt-field"), (options.answer_field, "--answer-field")):
            if row.get(key) is None:
                raise ConfigError(option, f"{where} has no {key!r} field (it has: {', '.join(map(str, row))})")
        prompt = as_prompt(row[options.prompt_field], options, where, flag)
        rows.append({**row, "prompt": prompt, "answer": row[options.answer_field]})
    return EvalSet(name, str(path), content_hash(path), rows)


def tokenize_set(data: EvalSet, tokenizer) -> EvalSet:
    """``data`` with every prompt's token ids (chat prompts through the tokenizer's chat template)."""
    data.ids = [prompt_ids(tokenizer, row["prompt"]) for row in data.rows]
    return data
