"""The formats whose call bodies are JSON. Qwen3's (Qwen2.5's, Hermes'): ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`` blocks; Llama 3's JSON form (``{"name": ..., "parameters": {...}}``, after ``<|python_tag|>`` or
as the whole answer, several separated by ``;``); DeepSeek-V3's ``<｜tool▁calls▁begin｜>`` section (the V3 form with
``function`` and a fenced JSON block, and the V3.1 form with the name before ``<｜tool▁sep｜>``); Kimi's
``<|tool_calls_section_begin|>`` section (Kimi K2 and Kimi-Linear: ``<|tool_call_begin|>functions.NAME:N
<|tool_call_argument_begin|>{...}<|tool_call_end|>``, the header kept as the call's id, as Kimi's template reads it
back)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from areno.engine.tool_calls.base import (
    Parsed,
    ToolCall,
    declared,
    joined,
    json_object,
    known,
    make_call,
    name_and_arguments,
    read_blocks,
)

_DECODER = json.JSONDecoder()
_QWEN_BLOCK = re.compile(r"<tool_call>\s*((?:(?!<tool_call>).)*?)\s*</tool_call>", re.DOTALL)  # an unclosed block
# never swallows the next one


def member_spans(text: str) -> dict[str, tuple[int, int]]:
    """Key -> (start, end) of its value's text, for each member of the JSON object ``text`` (already known to be
    one) at the top level."""
    spans, i, ws = {}, text.index("{") + 1, " \t\r\n"
    while True:
        while i < len(text) and text[i] in ws + ",":
            i += 1
        if i >= len(text) or text[i] == "}":
            return spans
        key, i = _DECODER.raw_decode(text, i)
        while text[i] in ws + ":":
            i += 1
        start = i
        _, i = _DECODER.raw_decode(text, i)
        spans[key] = (start, i)


def written_call(text: str, obj: dict, keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | None:
    """The call of a ``{"name", "arguments" | "parameters"}`` object ``obj`` decoded from ``text``, its arguments as
    the model wrote them (as they are streamed) where they are an object; None when it is not that shape."""
    call = name_and_arguments(obj, keys)
    if call is None:
        return None
    made = make_call(*call)
    key = next((k for k in keys if k in obj), None)
    if key is not None and isinstance(obj[key], dict):
        start, end = member_spans(text)[key]
        made.arguments = text[start:end]
    return made


def written(call: ToolCall | None, text: str) -> ToolCall | None:
    """``call`` with its arguments as the model wrote them (``text``, one JSON object, trimmed)."""
    if call is not None:
        call.arguments = text.strip()
    return call


def _qwen3_call(m: re.Match):
    obj = json_object(m.group(1))
    return written_call(m.group(1), obj) if obj is not None else None


def parse_qwen3(text: str, tools: Sequence[dict] | None = None) -> Parsed:
    return read_blocks(text, _QWEN_BLOCK, _qwen3_call, tools)


def qwen3_markup(name: str) -> tuple[str, str]:
    return f'<tool_call>\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": ', "}\n</tool_call>"


PYTHON_TAG = "<|python_tag|>"


def _json_calls(text: str) -> list | None:
    """``text`` as one or more ``{"name", "parameters"}`` objects separated by ``;`` (or whitespace), or None."""
    calls, i = [], 0
    while True:
        while i < len(text) and (text[i].isspace() or (text[i] == ";" and calls)):
            i += 1
        if i == len(text):
            return calls or None
        try:
            begin = i
            obj, i = _DECODER.raw_decode(text, i)
        except (json.JSONDecodeError, RecursionError):
            return None
        call = written_call(text[begin:i], obj, ("parameters", "arguments")) if isinstance(obj, dict) else None
        if call is None:
            return None
        calls.append(call)


def parse_llama3_json(text: str, tools: Sequence[dict] | None = None) -> Parsed:
    """The whole answer after ``<|python_tag|>`` (what comes before it is content), or the whole answer without it,
    must be calls; anything else is content."""
    head, tag, body = text.partition(PYTHON_TAG)
    calls = _json_calls(body if tag else head)
    names = declared(tools)
    if calls is None or (names is not None and any(c.name not in names for c in calls)):
        return Parsed(text)
    return Parsed(joined([head]) if tag else None, calls)


def llama3_markup(name: str) -> tuple[str, str]:
    return f'{PYTHON_TAG}{{"name": {json.dumps(name, ensure_ascii=False)}, "parameters": ', "}"


DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
_DS_CALL = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁call▁end｜>", re.DOTALL)
_DS_V3 = re.compile(r"function<｜tool▁sep｜>([^\n]+)\n```json\n(.*)\n```", re.DOTALL)  # V3 / R1
_DS_V31 = re.compile(r"([^<\n]+)<｜tool▁sep｜>(.*)", re.DOTALL)  # V3.1 / V3.2


def _deepseek_call(inner: str):
    m = _DS_V3.fullmatch(inner.strip()) or _DS_V31.fullmatch(inner.strip())
    obj = json_object(m.group(2)) if m else None
    return written(make_call(m.group(1).strip(), obj), m.group(2)) if obj is not None and m.group(1).strip() else None


def read_section(text: str, begin: str, end: str, block: re.Pattern, read, tools=None) -> Parsed:
    """One ``begin``...``end`` section of call blocks (``read(match)`` -> a call or None); a block that does not parse
    (or calls a function ``tools`` does not declare) stays in the content, and a section where none parses stays
    whole."""
    names = declared(tools)
    start = text.find(begin)
    if start < 0:
        return Parsed(text)
    stop = text.find(end, start)
    section = text[start + len(begin) : stop if stop >= 0 else len(text)]
    after = text[stop + len(end) :] if stop >= 0 else ""
    calls, kept, last = [], [text[:start]], 0
    for m in block.finditer(section):
        call = known(read(m), names)
        if call is not None:
            calls.append(call)
            kept.append(section[last : m.start()])
            last = m.end()
    if not calls:
        return Parsed(text)
    kept += [section[last:], after]
    return Parsed(joined(kept), calls)


def parse_deepseek_v3(text: str, tools: Sequence[dict] | None = None) -> Parsed:
    return read_section(text, DS_BEGIN, DS_END, _DS_CALL, lambda m: _deepseek_call(m.group(1)), tools)


def deepseek_v3_markup(name: str) -> tuple[str, str]:
    return (f"{DS_BEGIN}<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n",
            f"\n```<｜tool▁call▁end｜>{DS_END}")


KIMI_BEGIN, KIMI_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
_KIMI_CALL = re.compile(r"<\|tool_call_begin\|>\s*([^<]*?)\s*<\|tool_call_argument_begin\|>\s*"
                        r"((?:(?!<\|tool_call_begin\|>).)*?)\s*<\|tool_call_end\|>", re.DOTALL)
_KIMI_HEADER = re.compile(r"(?:functions\.)?([^\s:]+):\d+")


def _kimi_call(m: re.Match) -> ToolCall | None:
    header, obj = _KIMI_HEADER.fullmatch(m.group(1)), json_object(m.group(2))
    if header is None or obj is None:
        return None
    call = written(make_call(header.group(1), obj), m.group(2))
    call.id = m.group(1)  # Kimi's own id (functions.NAME:N): its chat template matches tool results by it
    return call


def parse_kimi_k2(text: str, tools: Sequence[dict] | None = None) -> Parsed:
    return read_section(text, KIMI_BEGIN, KIMI_END, _KIMI_CALL, _kimi_call, tools)


def kimi_k2_markup(name: str) -> tuple[str, str]:
    return (f"{KIMI_BEGIN}<|tool_call_begin|>functions.{name}:0<|tool_call_argument_begin|>",
            f"<|tool_call_end|>{KIMI_END}")
