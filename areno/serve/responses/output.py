"""A response's output items built from the chat answer's pieces (reasoning, text, tool calls), whole or as they
stream: ``OutputBuilder`` keeps the items and, when streaming, writes the documented events for each piece
(``response.output_item.added``, ``response.content_part.added``, ``response.output_text.delta``,
``response.reasoning_text.delta``, ``response.function_call_arguments.delta``, their ``.done`` and
``response.output_item.done``), so a streamed response and a whole one are built by the same code.

``ThinkSplitter`` reads a leading ``<think>...</think>`` block of a thinking model's text (Qwen3, DeepSeek-R1 style,
for chat templates that write ``</think>``) as its reasoning; formats that mark reasoning themselves (harmony,
Gemma 4) come with it already split by the chat path."""

from __future__ import annotations

import copy
import json
import uuid

OPEN, CLOSE = "<think>", "</think>"
# an output item of text: (its id's prefix, its fields, its one content part)
NEW_ITEMS = {
    "reasoning": ("rs", {"type": "reasoning", "summary": [], "status": "in_progress"},
                  {"type": "reasoning_text", "text": ""}),
    "message": ("msg", {"type": "message", "role": "assistant", "status": "in_progress"},
                {"type": "output_text", "text": "", "annotations": [], "logprobs": []}),
}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _held_tag(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could start ``tag`` (held back until the next piece)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ThinkSplitter:
    """Streamed text -> ``("reasoning" | "text", piece)`` pairs: a leading ``<think>`` block is reasoning (its
    surrounding blank lines dropped), everything else text. Text that could still be a tag is held back."""

    def __init__(self, active: bool):
        self.mode = "start" if active else "text"
        self.held = ""

    def push(self, text: str) -> list[tuple[str, str]]:
        if self.mode == "text":
            return [("text", text)] if text else []
        self.held += text
        out: list[tuple[str, str]] = []
        if self.mode == "start":
            lead = self.held.lstrip()
            if len(lead) < len(OPEN) and OPEN.startswith(lead):
                return out  # still maybe the tag
            if not lead.startswith(OPEN):
                self.mode = "text"
                return self._release("text")
            self.mode, self.held = "open", lead[len(OPEN):]
        if self.mode == "open":  # blank lines after the tag are not reasoning
            self.held = self.held.lstrip()
            if not self.held:
                return out
            self.mode = "reasoning"
        if self.mode == "reasoning":
            end = self.held.find(CLOSE)
            if end < 0:
                keep = len(self.held) - _held_tag(self.held, CLOSE)
                keep = len(self.held[:keep].rstrip())  # blank lines before the tag are not reasoning
                out += [("reasoning", self.held[:keep])] if keep else []
                self.held = self.held[keep:]
                return out
            out += [("reasoning", self.held[:end].rstrip())] if self.held[:end].strip() else []
            self.mode, self.held = "after", self.held[end + len(CLOSE):]
        if self.mode == "after":
            self.held = self.held.lstrip()
            if self.held:
                self.mode = "text"
                out += self._release("text")
        return out

    def _release(self, kind: str) -> list[tuple[str, str]]:
        text, self.held = self.held, ""
        return [(kind, text)] if text else []

    def finish(self) -> list[tuple[str, str]]:
        """What is held at the end: an unclosed block is all reasoning, an unfinished tag is text."""
        if self.mode == "reasoning":
            return self._release("reasoning")
        return self._release("text") if self.mode == "start" else []


class OutputBuilder:
    """A response's output items; with ``events``, each change also as an SSE event (numbered from
    ``sequence``)."""

    def __init__(self, events: bool = False):
        self.items: list[dict] = []
        self.open: dict | None = None
        self.calls: dict[int, dict] = {}  # the chat answer's tool-call index -> its function_call item
        self.out: list[str] | None = [] if events else None
        self.sequence = 0

    def event(self, kind: str, **fields) -> None:
        if self.out is not None:
            body = {"type": kind, "sequence_number": self.sequence, **fields}
            self.out.append(f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n")
            self.sequence += 1

    def drain(self) -> list[str]:
        out, self.out = self.out, []
        return out

    def _start(self, item: dict) -> dict:
        self.close()
        self.items.append(item)
        self.open = item
        self.event("response.output_item.added", output_index=len(self.items) - 1, item=item)
        return item

    def _part(self, item: dict, part: dict) -> None:
        item["content"].append(part)
        self.event("response.content_part.added", item_id=item["id"], output_index=len(self.items) - 1,
                   content_index=0, part=part)

    def _delta(self, kind: str, delta: str, event: str, **extra) -> None:
        """``delta`` onto the open item of ``kind`` (a new one opened first when none or another kind is open)."""
        if not delta:
            return
        item = self.open
        if item is None or item["type"] != kind:
            prefix, fields, part = NEW_ITEMS[kind]
            item = self._start({"id": new_id(prefix), **copy.deepcopy(fields), "content": []})
            self._part(item, copy.deepcopy(part))
        item["content"][0]["text"] += delta
        self.event(event, item_id=item["id"], output_index=len(self.items) - 1, content_index=0, delta=delta,
                   **extra)

    def reasoning(self, delta: str) -> None:
        self._delta("reasoning", delta, "response.reasoning_text.delta")

    def text(self, delta: str) -> None:
        self._delta("message", delta, "response.output_text.delta", logprobs=[])

    def call(self, index: int, call_id: str | None, name: str | None, arguments: str | None) -> None:
        """A piece of the chat answer's tool call ``index``: its id and name first, then its arguments."""
        item = self.calls.get(index)
        if item is None:
            item = self._start({"id": new_id("fc"), "type": "function_call", "status": "in_progress",
                                "arguments": "", "call_id": call_id or new_id("call"), "name": name or ""})
            self.calls[index] = item
        elif name and not item["name"]:
            item["name"] = name
        if arguments:
            item["arguments"] += arguments
            self.event("response.function_call_arguments.delta", item_id=item["id"],
                       output_index=self.items.index(item), delta=arguments)

    def close(self, status: str = "completed") -> None:
        """The open item done (its ``.done`` events, then ``response.output_item.done``)."""
        item, self.open = self.open, None
        if item is None:
            return
        where = {"item_id": item["id"], "output_index": self.items.index(item)}
        if item["type"] == "function_call":
            self.event("response.function_call_arguments.done", **where, name=item["name"],
                       arguments=item["arguments"])
        else:
            part = item["content"][0]
            if item["type"] == "message":
                self.event("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[])
            else:
                self.event("response.reasoning_text.done", **where, content_index=0, text=part["text"])
            self.event("response.content_part.done", **where, content_index=0, part=part)
        item["status"] = status
        self.event("response.output_item.done", output_index=where["output_index"], item=item)

    def assistant_message(self) -> dict:
        """The output as one chat assistant message (what ``previous_response_id`` carries to the next turn)."""
        kinds = {k: [i for i in self.items if i["type"] == k] for k in ("reasoning", "message", "function_call")}
        msg = {"role": "assistant",
               "content": "".join(i["content"][0]["text"] for i in kinds["message"]) if kinds["message"] else None}
        if kinds["reasoning"]:
            msg["reasoning_content"] = "".join(i["content"][0]["text"] for i in kinds["reasoning"])
        if kinds["function_call"]:
            msg["tool_calls"] = [{"id": i["call_id"], "type": "function", "function": {
                "name": i["name"], "arguments": i["arguments"]}} for i in kinds["function_call"]]
        return msg


def response_usage(input_tokens: int, output_tokens: int) -> dict:
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


def response_object(rid: str, req, created: float, output: list[dict], *, status: str, usage: dict | None = None,
                    error: dict | None = None, incomplete: str | None = None) -> dict:
    """The Response object as OpenAI documents it, with the request's settings echoed."""
    fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else None
    return {
        "id": rid, "object": "response", "created_at": int(created), "status": status, "background": False,
        "error": error, "incomplete_details": {"reason": incomplete} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "max_tool_calls": None,
        "model": req.model, "output": output,
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": req.reasoning.effort if req.reasoning else None,
                      "summary": req.reasoning.summary if req.reasoning else None},
        "service_tier": "default", "store": req.store,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": fmt or {"type": "text"}, "verbosity": "medium"},
        "tool_choice": req.tool_choice or "auto",
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
        "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": req.truncation or "disabled",
        "usage": usage, "user": req.user, "metadata": req.metadata or {},
    }
