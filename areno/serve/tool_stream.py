"""Tool calls streamed as OpenAI streams them: a call's first delta carries its ``index``, ``id``, ``type`` and
``function.name`` (``arguments`` ""), the arguments follow in pieces, and ``finish_reason`` comes in a chunk of its
own. ``ToolDeltas`` turns one sample's text, as it grows, into those deltas.

In the formats whose arguments are one JSON object (``HEADS``: qwen3, llama3_json, deepseek_v3 in both its forms,
kimi_k2) a call's id and name go out once its header is read, then its arguments text as it is generated (a complete
object found by a JSON decode, else the text so far without trailing whitespace); in qwen3's plain-text format the
content before the first call streams too (the text that could still be a ``<tool_call>`` held back). In gemma4 and
qwen3_coder (``BLOCK_ENDS``: their arguments are not the JSON sent) each call goes out whole once its block closes.
A format whose markers are special tokens is read from its own decode with them kept. Harmony's answer is read whole
at its end and sent in the same shape. The parsers
return the arguments as the model wrote them, so whatever is sent is a prefix of the answer read whole
(``tool_answer``), and the end sends the rest: the streamed answer joined equals the non-streamed one."""

from __future__ import annotations

import json
import re

from areno.engine.tool_calls import ToolFormat, ToolPlan
from areno.engine.tool_calls.gemma4 import CLOSE as GEMMA4_CLOSE
from areno.engine.tool_calls.gemma4 import THOUGHT_CLOSE, THOUGHT_OPEN
from areno.engine.tool_calls.json_calls import DS_BEGIN, KIMI_BEGIN, PYTHON_TAG
from areno.serve.text import Detokenizer

_JSON_NAME = r'\{\s*"name"\s*:\s*(?P<quoted>"(?:[^"\\]|\\.)*")\s*,\s*"KEY"\s*:\s*(?=\{)'
# format -> the header of a call (group ``quoted``: its name as a JSON string, or ``name``; ``id``: its own id),
# after which its JSON arguments start; and the marker every call comes after (the content ends there)
HEADS: dict[str, tuple[re.Pattern, str]] = {
    "qwen3": (re.compile(r"<tool_call>\s*" + _JSON_NAME.replace("KEY", "arguments")), "<tool_call>"),
    "llama3_json": (re.compile(re.escape(PYTHON_TAG) + r"\s*" + _JSON_NAME.replace("KEY", "parameters")), PYTHON_TAG),
    "deepseek_v3": (re.compile(r"<｜tool▁call▁begin｜>(?:function<｜tool▁sep｜>(?P<name>[^\n]+)\n```json\n|"
                               r"(?P<name31>[^<\n]+)<｜tool▁sep｜>)"), DS_BEGIN),
    "kimi_k2": (re.compile(r"<\|tool_call_begin\|>\s*(?P<id>(?:functions\.)?(?P<name>[^\s:<]+):\d+)\s*"
                           r"<\|tool_call_argument_begin\|>"), KIMI_BEGIN),
}
# format -> the end of a call block: each call goes out whole once its block is closed (its arguments are not the
# JSON sent: read by the format's parser from the text so far), as OpenAI's shape
BLOCK_ENDS = {"gemma4": GEMMA4_CLOSE, "qwen3_coder": "</tool_call>"}
_DECODER = json.JSONDecoder()


def _held(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def _arguments(body: str) -> tuple[str, bool]:
    """(the arguments text of a call's body that is surely theirs, whether it is the whole object): the object a
    JSON decode finds at its start, else the body so far without trailing whitespace."""
    body = body.lstrip()
    if "}" in body:
        try:
            return body[: _DECODER.raw_decode(body)[1]], True
        except (json.JSONDecodeError, RecursionError):
            pass
    return body.rstrip(), False


def _name(m: re.Match) -> str:
    groups = m.groupdict()
    if groups.get("quoted"):
        return json.loads(groups["quoted"])
    return (groups.get("name") or groups.get("name31") or "").strip()


class ToolDeltas:
    """One streamed sample read as tool calls under ``plan`` in ``fmt``: ``step(text, ids)`` while it is generated
    (the deltas to send now; ``ids``: the tokens of ``text``, decoded here with special tokens kept where the
    format's markers are special), ``finish(message)`` at its end (the rest, from the answer read whole)."""

    def __init__(self, fmt: ToolFormat, plan: ToolPlan, tokenizer=None):
        self.fmt, self.plan = fmt, plan
        self.head, self.marker = HEADS.get(fmt.name, (None, ""))
        self.block_end = BLOCK_ENDS.get(fmt.name) if plan.returns_calls else None
        streams = self.head is not None or self.block_end is not None
        self.own = Detokenizer(tokenizer, [], skip_special_tokens=False) if (
            streams and fmt.special_markup and tokenizer is not None) else None
        if fmt.special_markup and self.own is None:
            self.head = self.block_end = None  # the markers are not in the text sent: read at the end
        self.checked = 0  # how far the text was searched for a block's end
        self.stream_content = self.head is not None and not fmt.special_markup
        self.names = {t.get("function", t).get("name") for t in plan.tools} if plan.returns_calls else set()
        self.text, self.content = "", ""
        self.calls: list[list[str]] = []  # per call sent: [id, name, arguments sent]
        self.done: list[int] = []  # the calls whose whole arguments are sent

    def step(self, piece: str, ids=()) -> list[dict]:
        self.text += self.own.push_many(list(ids)) if self.own is not None else piece
        if self.block_end is not None:
            return self._closed_calls()
        if self.head is None:
            return []
        out = []
        text = self.text
        start = text.find(self.marker)
        if self.stream_content and not self.calls:
            head = text if start < 0 else text[:start]
            ready = (head[: len(head) - _held(head, self.marker)] if start < 0 else head).rstrip()
            if ready.startswith(self.content) and len(ready) > len(self.content):
                out.append({"content": ready[len(self.content) :]})
                self.content = ready
        if start < 0:
            return out
        for j, m in enumerate(self.head.finditer(text, start)):
            name = _name(m)
            if name not in self.names or (j < len(self.calls) and self.calls[j][1] != name) or j > len(self.calls):
                break  # an undeclared function stays content: read at the end
            if j < len(self.done):
                continue  # its whole arguments are sent
            args, whole = _arguments(text[m.end() :])
            if j == len(self.calls):
                self.calls.append([m.groupdict().get("id") or f"call_{_uid()}", name, ""])
                out.append(self._call_head(j))
            sent = self.calls[j][2]
            if args.startswith(sent) and len(args) > len(sent):
                out.append(self._arguments(j, args[len(sent) :]))
                self.calls[j][2] = args
            if not whole:
                break
            self.done.append(j)
        return out

    def _closed_calls(self) -> list[dict]:
        """The calls of the blocks closed since the last step, each whole (head, then its arguments)."""
        text, end = self.text, self.block_end
        found = text.find(end, max(self.checked - len(end), 0))
        self.checked = len(text)
        lead = text.lstrip()
        if found < 0 or (lead.startswith(THOUGHT_OPEN) and THOUGHT_CLOSE not in lead):
            return []  # no block closed, or still in Gemma 4's thought (its calls are not calls)
        out = []
        for call in self.fmt.parse(text, self.plan.tools).calls[len(self.calls) :]:
            self.calls.append([call.id, call.name, call.arguments])
            out += [self._call_head(len(self.calls) - 1), self._arguments(len(self.calls) - 1, call.arguments)]
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
