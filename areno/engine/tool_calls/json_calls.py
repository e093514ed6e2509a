"""The formats whose call bodies are JSON. Qwen3's (Qwen2.5's, Hermes'): ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`` blocks; Llama 3's JSON form (``{"name": ..., "parameters": {...}}``, after ``<|python_tag|>`` or
as the whole answer, several separated by ``;``); DeepSeek-V3's ``<｜tool▁calls▁begin｜>`` section (the V3 form with
``function`` and a fenced JSON block, and the V3.1 form with the name before ``<｜tool▁sep｜>``)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from areno.engine.tool_calls.base import Parsed, joined, json_object, make_call, name_and_arguments, read_blocks

_QWEN_BLOCK = re.compile(r"<tool_call>\s*((?:(?!<tool_call>).)*?)\s*</tool_call>", re.DOTALL)  # an unclosed block
# never swallows the next one


def _qwen3_call(m: re.Match):
    obj = json_object(m.group(1))
    call = name_and_arguments(obj) if obj is not None else None
    return make_call(*call) if call is not None else None


def parse_qwen3(text: str, tools: Sequence[dict] | None = None) -> Parsed:
    return read_blocks(text, _QWEN_BLOCK, _qwen3_call)


PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


def _json_calls(text: str) -> list | None:
    """``text`` as one or more ``{"name", "parameters"}`` objects separated by ``;`` (or whitespace), or None."""
    calls, i = [], 0
    while True:
        while i < len(text) and (text[i].isspace() or (text[i] == ";" and calls)):
            i += 1
        if i == len(text):
            return calls or None
        try:
            obj, i = _DECODER.raw_decode(text, i)
        except (json.JSONDecodeError, RecursionError):
            return None
        call = name_and_arguments(obj, ("parameters", "arguments")) if isinstance(obj, dict) else None
        if call is None:
            return None
        calls.append(make_call(*call))


def parse_llama3_json(text: str, tools: Sequence[dict] | None = None) -> Parsed:
    """The whole answer after ``<|python_tag|>`` (what comes before it is content), or the whole answer without it,
    must be calls; anything else is content."""
    head, tag, body = text.partition(PYTHON_TAG)
    calls = _json_calls(body if tag else head)
    if calls is None:
        return Parsed(text)
    return Parsed(joined([head]) if tag else None, calls)


DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
_DS_CALL = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁call▁end｜>", re.DOTALL)
_DS_V3 = re.compile(r"function<｜tool▁sep｜>([^\n]+)\n```json\n(.*)\n```", re.DOTALL)  # V3 / R1
_DS_V31 = re.compile(r"([^<\n]+)<｜tool▁sep｜>(.*)", re.DOTALL)  # V3.1 / V3.2


def _deepseek_call(inner: str):
    m = _DS_V3.fullmatch(inner.strip()) or _DS_V31.fullmatch(inner.strip())
    obj = json_object(m.group(2)) if m else None
    return make_call(m.group(1).strip(), obj) if obj is not None and m.group(1).strip() else None


def parse_deepseek_v3(text: str, tools: Sequence[dict] | None = None) -> Parsed:
    """One section of calls; a call block that does not parse stays in the content, and a section where none parses
    stays whole."""
    start = text.find(DS_BEGIN)
    if start < 0:
        return Parsed(text)
    end = text.find(DS_END, start)
    section = text[start + len(DS_BEGIN) : end if end >= 0 else len(text)]
    after = text[end + len(DS_END) :] if end >= 0 else ""
    calls, kept, last = [], [text[:start]], 0
    for m in _DS_CALL.finditer(section):
        call = _deepseek_call(m.group(1))
        if call is not None:
            calls.append(call)
            kept.append(section[last : m.start()])
            last = m.end()
    if not calls:
        return Parsed(text)
    kept += [section[last:], after]
    return Parsed(joined(kept), calls)
