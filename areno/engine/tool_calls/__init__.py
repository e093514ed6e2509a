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
| kimi_k2       | Kimi K2, Kimi-Linear               | ``<|tool_call_begin|>functions.f:0<|tool_call_argument_...`` |
"""

from __future__ import annotations

from collections.abc import Sequence

from areno.config.constants import TOOL_CALL_FORMATS
from areno.engine.tool_calls.base import Parsed, ToolCall, ToolFormat, read_answer, strip_tokens
from areno.engine.tool_calls.choice import ToolChoiceError, ToolPlan, check_tool_choice, plan_tools, read_calls
from areno.engine.tool_calls.gemma4 import OPEN as GEMMA4_OPEN
from areno.engine.tool_calls.gemma4 import gemma4_markup, parse_gemma4
from areno.engine.tool_calls.harmony import harmony_markup, parse_harmony
from areno.engine.tool_calls.json_calls import (
    DS_BEGIN,
    KIMI_BEGIN,
    PYTHON_TAG,
    deepseek_v3_markup,
    kimi_k2_markup,
    llama3_markup,
    parse_deepseek_v3,
    parse_kimi_k2,
    parse_llama3_json,
    parse_qwen3,
    qwen3_markup,
)
from areno.engine.tool_calls.qwen3_coder import parse_qwen3_coder, qwen3_coder_markup

__all__ = ["FORMATS", "MODEL_FORMATS", "Parsed", "ToolCall", "ToolChoiceError", "ToolFormat", "ToolPlan",
           "check_tool_choice", "format_for", "parse_tool_calls", "plan_tools", "read_answer", "read_calls",
           "special_tokens", "strip_tokens"]

FORMATS: dict[str, ToolFormat] = {f.name: f for f in (
    ToolFormat("qwen3", parse_qwen3, False, '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>',
               call_markup=qwen3_markup, trigger="<tool_call>"),
    ToolFormat("qwen3_coder", parse_qwen3_coder, False,
               "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
               call_markup=qwen3_coder_markup, trigger="<tool_call>", arguments="xml"),
    ToolFormat("gemma4", parse_gemma4, True, '<|tool_call>call:f{a:1,b:<|"|>text<|"|>}<tool_call|>',
               call_markup=gemma4_markup, trigger=GEMMA4_OPEN, arguments="gemma4"),
    ToolFormat("harmony", parse_harmony, True,
               '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": 1}<|call|>', always_read=True,
               call_markup=harmony_markup, trigger="<|channel|>commentary to=functions."),
    ToolFormat("deepseek_v3", parse_deepseek_v3, True,
               "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{\"a\": 1}\n```"
               "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", call_markup=deepseek_v3_markup, trigger=DS_BEGIN),
    ToolFormat("llama3_json", parse_llama3_json, True, '<|python_tag|>{"name": "f", "parameters": {"a": 1}}',
               call_markup=llama3_markup, trigger=PYTHON_TAG),
    ToolFormat("kimi_k2", parse_kimi_k2, True,
               '<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"a": 1}'
               "<|tool_call_end|><|tool_calls_section_end|>", call_markup=kimi_k2_markup, trigger=KIMI_BEGIN),
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
    **dict.fromkeys(("kimi_linear", "kimi_k2"), "kimi_k2"),
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


def special_tokens(tokenizer) -> tuple[str, ...]:
    """The texts ``skip_special_tokens`` drops from ``tokenizer``'s output, longest first (for ``strip_tokens``)."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    found = {t.content for t in added.values() if getattr(t, "special", False)}
    found |= set(getattr(tokenizer, "all_special_tokens", ()))
    return tuple(sorted(found, key=len, reverse=True))
