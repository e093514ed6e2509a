"""GPT-OSS's harmony format: the answer is a run of messages, ``[<|start|>assistant]<|channel|>CHANNEL[ to=RECIPIENT]
[<|constrain|>json]<|message|>BODY`` each ended by ``<|end|>``, ``<|call|>`` or ``<|return|>`` (the last one's end is
the stop token, cut off). ``analysis`` is the reasoning, ``final`` (and a ``commentary`` preamble with no recipient)
the content, and a message to ``functions.NAME`` (on ``commentary``, or ``analysis`` where a model puts it) whose body
is a JSON object a call. Text outside that grammar, a call to another recipient (a built-in tool) or with a body that
is not a JSON object stays content."""

from __future__ import annotations

import re
from collections.abc import Sequence

from areno.engine.tool_calls.base import Parsed, declared, joined, json_object, make_call

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
_ENDS = re.compile(r"<\|end\|>|<\|call\|>|<\|return\|>")
_RECIPIENT = re.compile(r"(?:^|\s)to=(\S+)")
_ROLE = "assistant"


def _messages(text: str) -> list[tuple[str, str, str]] | None:
    """(header, body, raw text) per message, or None when ``text`` is not a run of harmony messages."""
    out, i = [], 0
    while text[i:].strip():
        begin = i
        if text.startswith(START, i):
            i += len(START)
        elif out:  # only the first message's start is the prompt's
            return None
        j = text.find(MESSAGE, i)
        if j < 0:
            return None
        end = _ENDS.search(text, j + len(MESSAGE))
        stop, after = (end.start(), end.end()) if end else (len(text), len(text))
        out.append((text[i:j], text[j + len(MESSAGE) : stop], text[begin:after]))
        i = after
    return out


def _header(header: str) -> tuple[str, str | None] | None:
    """(channel, recipient or None) of a message header, or None when it names no channel or another role."""
    role, sep, rest = header.partition(CHANNEL)
    words = role.split()
    channel = rest.split(CONSTRAIN)[0].split()
    if not sep or not channel or (words and words[0] != _ROLE):
        return None
    recipient = _RECIPIENT.search(role) or _RECIPIENT.search(rest)
    return channel[0], recipient.group(1) if recipient else None


def parse_harmony(text: str, tools: Sequence[dict] | None = None) -> Parsed:
    msgs = _messages(text) if CHANNEL in text else None
    if not msgs:
        return Parsed(text)
    reasoning, content, calls = [], [], []
    names = declared(tools)
    for header, body, raw in msgs:
        head = _header(header)
        if head is None:
            content.append(raw)
            continue
        channel, recipient = head
        if recipient is None:
            (reasoning if channel == "analysis" else content).append(body)
            continue
        name = recipient.removeprefix("functions.") if recipient.startswith("functions.") else ""
        args = json_object(body) if name else None  # a function's call on whichever channel it came
        if args is None or (names is not None and name not in names):
            content.append(raw)
            continue
        calls.append(make_call(name, args))
    return Parsed(_lines(content), calls, _lines(reasoning))


def _lines(pieces: list[str]) -> str | None:
    return joined(["\n".join(p.strip() for p in pieces if p.strip())])


def harmony_markup(name: str) -> tuple[str, str]:
    return f"{CHANNEL}commentary to=functions.{name} {CONSTRAIN}json{MESSAGE}", "<|call|>"
