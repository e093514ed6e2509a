"""Tool calls in model output: Qwen-style ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks.

Shared by ``areno serve`` (OpenAI ``tool_calls``) and agentic rollout. A block that is not valid JSON, or lacks a
string ``name``, is left in the text as content rather than guessed at.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, serialised (OpenAI's wire form)
    id: str = ""

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """Split ``text`` into (content outside the tool-call blocks or None, parsed calls)."""
    calls, kept, last = [], [], 0
    for m in _BLOCK.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                continue
        calls.append(ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), f"call_{uuid.uuid4().hex[:24]}"))
        kept.append(text[last : m.start()])
        last = m.end()
    if not calls:
        return text, []
    kept.append(text[last:])
    content = "".join(kept).strip()
    return (content or None), calls
