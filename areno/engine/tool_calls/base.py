"""What every tool-call format shares: the parsed call (``ToolCall``, OpenAI's wire form), a parser's answer
(``Parsed``: content, calls, reasoning) and a format's entry in the registry (``ToolFormat``)."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, serialised (OpenAI's wire form)
    id: str = ""

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Parsed:
    """A parser's answer: the text outside the call blocks (None when nothing is left), the calls in order, and the
    reasoning the format marks as such (None when it marks none)."""

    content: str | None
    calls: list[ToolCall] = field(default_factory=list)
    reasoning: str | None = None


Parser = Callable[[str, Sequence[dict] | None], Parsed]


@dataclass(frozen=True)
class ToolFormat:
    """One family's tool-call format. ``parse(text, tools)`` never guesses: a block it cannot read whole stays in the
    content. ``special_markup``: the format's markers are special tokens, so the text it parses is decoded with
    them kept (and the caller strips the other special tokens from what comes back). ``always_read``: answers are read
in the format even when the request has no tools (its calls are then not returned)."""

    name: str
    parse: Parser
    special_markup: bool
    example: str  # one call in the format, for the docs and --help
    always_read: bool = False  # every answer is in the format's markup (harmony's channels): read it without tools
    # function name -> (the call's markup before its JSON arguments, after them), for the grammar of a call;
    # None: the format's arguments are not one JSON object (no grammar built for its calls yet)
    call_markup: Callable[[str], tuple[str, str]] | None = None
    trigger: str = ""  # the text every call starts with (where a grammar for "auto" + strict tools takes over)
    arguments: str = "json"  # how the call writes its arguments: one JSON object, "xml" (qwen3_coder's blocks) or
    # "gemma4" (Gemma 4's object syntax)


def make_call(name: str, arguments: dict) -> ToolCall:
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False), f"call_{uuid.uuid4().hex[:24]}")


def json_object(text: str) -> dict | None:
    """``text`` as a JSON object, or None when it is not exactly one."""
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


def name_and_arguments(obj: dict, keys: tuple[str, ...] = ("arguments", "parameters")) -> tuple[str, dict] | None:
    """``{"name": ..., "arguments" | "parameters": {...}}`` (the arguments may be a JSON string of an object) as
    (name, arguments), or None when it is not that shape."""
    if not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in keys if k in obj), {})
    if isinstance(args, str):
        args = json_object(args)
    return (obj["name"], args) if isinstance(args, dict) else None


def joined(pieces: Sequence[str]) -> str | None:
    """The content pieces left around the call blocks, joined and trimmed (None when empty)."""
    text = "".join(pieces).strip()
    return text or None


def tool_schemas(tools: Sequence[dict] | None) -> dict[str, dict]:
    """Function name -> its parameters' JSON schema, from OpenAI ``tools`` (``{"type": "function", "function":
    {...}}`` or the bare function)."""
    out = {}
    for tool in tools or ():
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            out[fn["name"]] = params if isinstance(params, dict) else {}
    return out


def declared(tools: Sequence[dict] | None) -> frozenset[str] | None:
    """The function names ``tools`` declares (a call to another one stays content), or None when there are no tools
    (nothing to check calls against)."""
    return frozenset(tool_schemas(tools)) if tools else None


def known(call: ToolCall | None, names: frozenset[str] | None) -> ToolCall | None:
    """``call`` if it calls a declared function (``names``; None: any), else None."""
    return call if call is not None and (names is None or call.name in names) else None


def read_blocks(text: str, block: re.Pattern, read: Callable[[re.Match], ToolCall | None],
                tools: Sequence[dict] | None = None) -> Parsed:
    """Each match of ``block`` that ``read`` makes a call of a declared function (``tools``) is cut from the
    content; one it cannot (None) or of another function stays there as written. No call: the text is returned
    untouched."""
    calls, kept, last = [], [], 0
    names = declared(tools)
    for m in block.finditer(text):
        call = known(read(m), names)
        if call is None:
            continue
        calls.append(call)
        kept.append(text[last : m.start()])
        last = m.end()
    if not calls:
        return Parsed(text)
    kept.append(text[last:])
    return Parsed(joined(kept), calls)


def read_answer(fmt: ToolFormat, text: str, tools: Sequence[dict] | None = None,
                specials: Sequence[str] = ()) -> Parsed:
    """``fmt.parse(text, tools)``; where the format's text was decoded with the special tokens kept, those
    (``specials``: ``special_tokens(tokenizer)``) are stripped from the content and the reasoning it returns."""
    parsed = fmt.parse(text, tools)
    if fmt.special_markup:
        parsed.content, parsed.reasoning = strip_tokens(parsed.content, specials), strip_tokens(parsed.reasoning,
                                                                                                specials)
    return parsed


def strip_tokens(text: str | None, tokens: Sequence[str]) -> str | None:
    """``text`` without any of ``tokens`` (the special tokens a format's text was decoded with), trimmed; None when
    nothing is left."""
    if text is None:
        return None
    for token in tokens:
        if token in text:
            text = text.replace(token, "")
    return text.strip() or None
