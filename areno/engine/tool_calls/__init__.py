"""Tool calls in model output, in each family's own format: a registry of formats (name -> parser), the format a
checkpoint's ``model_type`` uses, and ``parse_tool_calls``. Shared by ``areno serve`` (OpenAI ``tool_calls``) and the
agentic rollout. A parser never guesses: a block it cannot read whole stays in the text as content.

| format        | families (model_type)              | a call                                                       |
| qwen3         | Qwen2.5/3, Qwen3-VL, others        | ``<tool_call>{"name": "f", "arguments": {...}}</tool_call>`` |
| qwen3_coder   | Qwen3.5 (dense, MoE, vision)       | ``<tool_call><function=f><parameter=a>v</parameter>...``     |
| gemma4        | Gemma 4                            | ``<|tool_call>call:f{a:<|"|>v<|"|>}<tool_call|>``            |
| harmony       | GPT-OSS                            | ``<|channel|>commentary to=functions.f ...<|message|>{...}`` |
| deepseek_v3   | DeepSeek-V3 / R1 / V3.1            | ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>f ...``          |
| llama3_json   | Llama 3.x                          | ``<|python_tag|>{"name": "f", "parameters": {...}}``         |
"""

from __future__ import annotations

from collections.abc import Sequence

from areno.config.constants import TOOL_CALL_FORMATS
from areno.engine.tool_calls.base import Parsed, ToolCall, ToolFormat
from areno.engine.tool_calls.gemma4 import parse_gemma4
from areno.engine.tool_calls.harmony import parse_harmony
from areno.engine.tool_calls.json_calls import parse_deepseek_v3, parse_llama3_json, parse_qwen3
from areno.engine.tool_calls.qwen3_coder import parse_qwen3_coder

__all__ = ["FORMATS", "MODEL_FORMATS", "Parsed", "ToolCall", "ToolFormat", "format_for", "parse_tool_calls",
           "read_answer", "special_tokens", "strip_tokens"]

FORMATS: dict[str, ToolFormat] = {f.name: f for f in (
    ToolFormat("qwen3", parse_qwen3, False, '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'),
    ToolFormat("qwen3_coder", parse_qwen3_coder, False,
               "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>"),
    ToolFormat("gemma4", parse_gemma4, True, '<|tool_call>call:f{a:1,b:<|"|>text<|"|>}<tool_call|>'),
    ToolFormat("harmony", parse_harmony, True,
               '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": 1}<|call|>', always_read=True),
    ToolFormat("deepseek_v3", parse_deepseek_v3, True,
               "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{\"a\": 1}\n```"
               "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    ToolFormat("llama3_json", parse_llama3_json, True, '<|python_tag|>{"name": "f", "parameters": {"a": 1}}'),
)}

assert tuple(FORMATS) == TOOL_CALL_FORMATS[1:], "config.constants.TOOL_CALL_FORMATS names these formats"

DEFAULT_FORMAT = "qwen3"  # a model_type not listed below: what areno parsed before formats were per family
MODEL_FORMATS: dict[str, str] = {
    **dict.fromkeys(("qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "qwen3_vl", "qwen3_vl_moe"), "qwen3"),
    **dict.fromkeys(("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"), "qwen3_coder"),
    **dict.fromkeys(("gemma4", "gemma4_text"), "gemma4"),
    "gpt_oss": "harmony",
    "deepseek_v3": "deepseek_v3",
    "llama": "llama3_json",
}


def format_for(model_type: str | None, name: str | None = None) -> ToolFormat:
    """The format ``name`` names (``--tool-call-format``), or else the one ``model_type`` uses (qwen3 for a
    model_type with no entry). An unknown name is a ValueError naming the known ones."""
    if name is not None and name != "auto":
        if name not in FORMATS:
            raise ValueError(f"unknown tool-call format {name!r}; known: auto, {', '.join(FORMATS)}")
        return FORMATS[name]
    return FORMATS[MODEL_FORMATS.get(model_type or "", DEFAULT_FORMAT)]


def parse_tool_calls(text: str, fmt: ToolFormat | None = None,
                     tools: Sequence[dict] | None = None) -> tuple[str | None, list[ToolCall]]:
    """Split ``text`` into (content outside the call blocks or None, parsed calls), in ``fmt`` (Qwen3's by
    default); ``tools`` (OpenAI's) type the arguments of formats that write them as text."""
    parsed = (fmt or FORMATS[DEFAULT_FORMAT]).parse(text, tools)
    return parsed.content, parsed.calls


def read_answer(fmt: ToolFormat, text: str, tools: Sequence[dict] | None = None,
                specials: Sequence[str] = ()) -> Parsed:
    """``fmt.parse(text, tools)``; where the format's text was decoded with the special tokens kept, those
    (``specials``: ``special_tokens(tokenizer)``) are stripped from the content and the reasoning it returns."""
    parsed = fmt.parse(text, tools)
    if fmt.special_markup:
        parsed.content, parsed.reasoning = strip_tokens(parsed.content, specials), strip_tokens(parsed.reasoning,
                                                                                                specials)
    return parsed


def special_tokens(tokenizer) -> tuple[str, ...]:
    """The texts ``skip_special_tokens`` drops from ``tokenizer``'s output, longest first (for ``strip_tokens``)."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    found = {t.content for t in added.values() if getattr(t, "special", False)}
    found |= set(getattr(tokenizer, "all_special_tokens", ()))
    return tuple(sorted(found, key=len, reverse=True))


def strip_tokens(text: str | None, tokens: Sequence[str]) -> str | None:
    """``text`` without any of ``tokens`` (the special tokens a format's text was decoded with), trimmed; None when
    nothing is left."""
    if text is None:
        return None
    for token in tokens:
        if token in text:
            text = text.replace(token, "")
    return text.strip() or None
