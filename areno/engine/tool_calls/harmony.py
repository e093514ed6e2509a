"""GPT-OSS's harmony format: the answer is a run of messages, ``[<|start|>assistant]<|channel|>CHANNEL[ to=RECIPIENT]
[<|constrain|>json]<|message|>BODY`` each ended by ``<|end|>``, ``<|call|>`` or ``<|return|>`` (the last one's end is
the stop token, cut off). ``analysis`` is the reasoning, ``final`` (and a ``commentary`` preamble with no recipient)
the content, and a ``commentary`` message to ``functions.NAME`` whose body is a JSON object a call. Text outside that
grammar, a call to another recipient (a built-in tool) or with a body that is not a JSON object stays content."""

from __future__ import annotations

import re
from collections.abc import Sequence

from areno.engine.tool_calls.base import Parsed, joined, json_object, make_call

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
    if not sep or not (role.strip() == _ROLE or role.strip().startswith(_ROLE + " ") or not role.strip()):
        return None
    recipient = _RECIPIENT.search(role) or _RECIPIENT.search(rest)
    channel = rest.split(CONSTRAIN)[0].split()
    return (channel[0] if channel else "", recipient.group(1) if recipient else None) if channel else None


def parse_harmony(text: str, tools: Sequence[dict] | None = None) -> Parsed:
    msgs = _messages(text) if CHANNEL in text else None
    if not msgs:
        return Parsed(text)
    reasoning, content, calls = [], [], []
    for header, body, raw in msgs:
        head = _header(header)
        if head is None:
            content.append(raw)
            continue
        channel, recipient = head
        if recipient is None:
            (reasoning if channel == "analysis" else content).append(body)
            continue
        args = json_object(body) if channel == "commentary" and recipient.startswith("functions.") else None
        name = recipient[len("functions."):]
        if args is None or not name:
            content.append(raw)
            continue
        calls.append(make_call(name, args))
    return Parsed(_lines(content), calls, _lines(reasoning))


def _lines(pieces: list[str]) -> str | None:
    return joined(["\n".join(p.strip() for p in pieces if p.strip())])
