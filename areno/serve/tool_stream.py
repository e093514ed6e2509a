"""Tool calls streamed as OpenAI streams them: a call's first delta carries its ``index``, ``id``, ``type`` and
``function.name`` (``arguments`` ""), the arguments follow in pieces, and ``finish_reason`` comes in a chunk of its
own. ``ToolDeltas`` turns one sample's text, as it grows, into those deltas.

In Qwen3's format (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, plain text) the content before the
first call and each call's arguments go out as they are generated: the text that could still turn out to be call
markup (a partial ``<tool_call>``, a closing ``}``, trailing whitespace) is held back. Other formats are read whole
at the answer's end and sent in the same shape. Whatever is sent is a prefix of the answer read whole
(``tool_answer``), and the end sends the rest, so the streamed answer joined equals the non-streamed one."""

from __future__ import annotations

import json
import re

from areno.engine.tool_calls import ToolFormat, ToolPlan

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_HEAD = re.compile(r'<tool_call>\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\{)')


def _held(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def _safe_arguments(body: str, closed: bool) -> str:
    """The arguments text of a call body (after ``"arguments": ``) that is surely theirs: closed, without the
    wrapper's last ``}``; open, without a last ``}`` (it may be the wrapper's) and the partial close tag."""
    body = body[: len(body) - _held(body, CLOSE)] if not closed else body
    body = body.rstrip()
    return body[:-1].rstrip() if body.endswith("}") else body


class ToolDeltas:
    """One streamed sample read as tool calls under ``plan`` in ``fmt``: ``step(text)`` while it is generated
    (the deltas to send now), ``finish(message)`` at its end (the rest, from the answer read whole)."""

    def __init__(self, fmt: ToolFormat, plan: ToolPlan):
        self.incremental = fmt.name == "qwen3"
        self.names = {t.get("function", t).get("name") for t in plan.tools} if plan.returns_calls else set()
        self.text, self.content = "", ""
        self.calls: list[list[str]] = []  # per call sent: [id, name, arguments sent]

    def step(self, piece: str) -> list[dict]:
        self.text += piece
        if not self.incremental:
            return []
        out = []
        text = self.text
        start = text.find(OPEN)
        head = text if start < 0 else text[:start]
        ready = head[: len(head) - _held(head, OPEN)].rstrip() if start < 0 else head.rstrip()
        if ready.startswith(self.content) and len(ready) > len(self.content) and not self.calls:
            out.append({"content": ready[len(self.content) :]})
            self.content = ready
        for j, m in enumerate(_HEAD.finditer(text, max(start, 0))):
            name = json.loads(m.group(1))
            if name not in self.names or (j < len(self.calls) and self.calls[j][1] != name) or j > len(self.calls):
                break  # an undeclared function stays content: read at the end
            close = text.find(CLOSE, m.end())
            args = _safe_arguments(text[m.end() : close if close >= 0 else len(text)], close >= 0)
            if j == len(self.calls):
                self.calls.append([f"call_{_uid()}", name, ""])
                out.append(self._call_head(j))
            sent = self.calls[j][2]
            if args.startswith(sent) and len(args) > len(sent):
                out.append(self._arguments(j, args[len(sent) :]))
                self.calls[j][2] = args
            if close < 0:
                break
        return out

    def _call_head(self, j: int) -> dict:
        cid, name, _ = self.calls[j]
        return {"tool_calls": [{"index": j, "id": cid, "type": "function",
                                "function": {"name": name, "arguments": ""}}]}

    @staticmethod
    def _arguments(j: int, piece: str) -> dict:
        return {"tool_calls": [{"index": j, "function": {"arguments": piece}}]}

    def finish(self, message: dict) -> list[dict]:
        """The deltas still to send of the answer read whole (``message``: its content, reasoning_content and
        tool_calls); the ids already sent stand in for the message's own."""
        out = []
        if message.get("reasoning_content"):
            out.append({"reasoning_content": message["reasoning_content"]})
        content = message.get("content") or ""
        if content.startswith(self.content) and len(content) > len(self.content):
            out.append({"content": content[len(self.content) :]})
        for j, call in enumerate(message.get("tool_calls") or ()):
            name, args = call["function"]["name"], call["function"]["arguments"]
            if j < len(self.calls) and self.calls[j][1] == name:
                call["id"] = self.calls[j][0]
                sent = self.calls[j][2]
                rest = args[len(sent) :] if args.startswith(sent) else ""
            else:
                self.calls.append([call["id"], name, ""])
                out.append(self._call_head(len(self.calls) - 1))
                rest = args
            if rest:
                out.append(self._arguments(j, rest))
        return out


def _uid() -> str:
    import uuid

    return uuid.uuid4().hex[:24]
