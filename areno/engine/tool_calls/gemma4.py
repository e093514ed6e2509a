"""Gemma 4's format: ``<|tool_call>call:NAME{key:<|"|>text<|"|>,n:42,flag:true,o:{k:1},l:[1,2]}<tool_call|>``,
several concatenated; keys bare, strings between ``<|"|>`` markers (no escapes inside), numbers, booleans and null
as in JSON. A leading ``<|channel>thought\\n...<channel|>`` is the reasoning."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence

from areno.engine.tool_calls.base import Parsed, declared, joined, known, make_call

OPEN, CLOSE, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
THOUGHT_OPEN, THOUGHT_CLOSE = "<|channel>thought\n", "<channel|>"
_NAME = re.compile(r"call:([A-Za-z_][\w.\-]*)")
KEY = re.compile(r"[A-Za-z_][\w.\-]*")
_ATOM = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?|true|false|null")
_SPACE = re.compile(r"\s*")
MAX_DEPTH = 64


class _Bad(ValueError):
    pass


class _Reader:
    """A recursive-descent reader of one argument object; raises _Bad on anything outside the grammar."""

    def __init__(self, text: str):
        self.text, self.i = text, 0

    def skip(self) -> None:
        self.i = _SPACE.match(self.text, self.i).end()

    def eat(self, token: str) -> bool:
        self.skip()
        if self.text.startswith(token, self.i):
            self.i += len(token)
            return True
        return False

    def string(self) -> str:
        end = self.text.find(QUOTE, self.i)
        if end < 0:
            raise _Bad("unterminated string")
        out, self.i = self.text[self.i : end], end + len(QUOTE)
        return out

    def value(self, depth: int):
        if depth > MAX_DEPTH:
            raise _Bad("too deep")
        if self.eat(QUOTE):
            return self.string()
        if self.eat("{"):
            return self.members(depth + 1)
        if self.eat("["):
            return self.items(depth + 1)
        m = _ATOM.match(self.text, self.i)
        if m is None:
            raise _Bad(f"no value at {self.i}")
        self.i = m.end()
        value = json.loads(m.group(0))
        if isinstance(value, float) and not math.isfinite(value):
            raise _Bad("not a finite number")
        return value

    def members(self, depth: int) -> dict:
        out: dict = {}
        if self.eat("}"):
            return out
        while True:
            self.skip()
            if self.eat(QUOTE):
                key = self.string()
            else:
                m = KEY.match(self.text, self.i)
                if m is None:
                    raise _Bad(f"no key at {self.i}")
                key, self.i = m.group(0), m.end()
            if key in out or not self.eat(":"):
                raise _Bad("a repeated key or no ':'")
            out[key] = self.value(depth)
            if self.eat("}"):
                return out
            if not self.eat(","):
                raise _Bad("no ',' or '}'")

    def items(self, depth: int) -> list:
        out: list = []
        if self.eat("]"):
            return out
        while True:
            out.append(self.value(depth))
            if self.eat("]"):
                return out
            if not self.eat(","):
                raise _Bad("no ',' or ']'")


def gemma4_arguments(text: str) -> dict | None:
    """``{...}`` in Gemma 4's argument syntax as a dict, or None when it is not exactly one object."""
    r = _Reader(text)
    try:
        if not r.eat("{"):
            return None
        out = r.members(1)
    except _Bad:
        return None
    r.skip()
    return out if r.i == len(text) else None


def _call(block: str):
    m = _NAME.match(block)
    args = gemma4_arguments(block[m.end() :]) if m else None
    return make_call(m.group(1), args) if args is not None else None


def parse_gemma4(text: str, tools: Sequence[dict] | None = None) -> Parsed:
    reasoning = None
    lead = len(text) - len(text.lstrip())
    if text.startswith(THOUGHT_OPEN, lead) and THOUGHT_CLOSE in text:
        end = text.index(THOUGHT_CLOSE)
        reasoning, text = text[lead + len(THOUGHT_OPEN) : end].strip() or None, text[end + len(THOUGHT_CLOSE) :]
    calls, kept, i = [], [], 0
    names = declared(tools)
    while (start := text.find(OPEN, i)) >= 0:
        end = text.find(CLOSE, start)
        if end < 0:
            break
        call = known(_call(text[start + len(OPEN) : end]), names)
        if call is not None:
            calls.append(call)
            kept.append(text[i:start])
        else:  # stays in the content, as written
            kept.append(text[i : end + len(CLOSE)])
        i = end + len(CLOSE)
    kept.append(text[i:])
    return Parsed(joined(kept) if calls or reasoning else text, calls, reasoning)


def gemma4_markup(name: str) -> tuple[str, str]:
    """A call's markup before its arguments object and after it (the name as the parser reads it back)."""
    if not KEY.fullmatch(name):
        raise ValueError(f"function name {name!r} cannot be written in the gemma4 format (call:NAME)")
    return f"{OPEN}call:{name}", CLOSE

