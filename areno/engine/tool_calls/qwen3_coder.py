"""Qwen3.5's (and Qwen3-Coder's) XML-ish format: ``<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nvalue\\n
</parameter>\\n...</function>\\n</tool_call>``. The chat template writes a string value as is and anything else as
JSON (a bool through Jinja's ``string``: ``True``), so each value is typed against the declared parameter's JSON
schema: the first of its types (null, integer, number, boolean, object, array, string) the text is exactly, else the
text as written. A parameter the schema does not declare stays a string."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence

from areno.config.sampling import json_safe
from areno.engine.tool_calls.base import Parsed, make_call, read_blocks, tool_schemas

_BLOCK = re.compile(r"<tool_call>\s*<function=([^>\n]+)>((?:(?!<tool_call>).)*?)</function>\s*</tool_call>",
                    re.DOTALL)  # an unclosed block never swallows the next one
_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
_INT = re.compile(r"-?(?:0|[1-9][0-9]*)")
_ORDER = ("null", "integer", "number", "boolean", "object", "array", "string")
_MISS = object()


def schema_types(schema) -> set[str]:
    """The JSON types a property's schema allows: ``type`` (one or a list), an ``enum``'s members' types,
    ``anyOf``/``oneOf``/``allOf`` branches; empty when it says none."""
    if not isinstance(schema, dict):
        return set()
    kind = schema.get("type")
    out = {kind} if isinstance(kind, str) else {t for t in kind if isinstance(t, str)} if isinstance(kind, list) \
        else set()
    if not out and isinstance(schema.get("enum"), list):
        names = {bool: "boolean", int: "integer", float: "number", str: "string", type(None): "null",
                 dict: "object", list: "array"}
        out = {names[type(v)] for v in schema["enum"] if type(v) in names}
    for key in ("anyOf", "oneOf", "allOf"):
        for branch in schema.get(key) or ():
            out |= schema_types(branch)
    return out


def _as(kind: str, text: str):
    """``text`` read as JSON type ``kind``, or _MISS when it is not exactly that."""
    if kind == "null":
        return None if text == "null" else _MISS
    if kind == "integer":
        return int(text) if _INT.fullmatch(text) else _MISS
    if kind == "boolean":
        return {"true": True, "false": False}.get(text.lower(), _MISS)
    if kind == "string":
        return text
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return _MISS
    want = {"number": (int, float), "object": dict, "array": list}.get(kind)
    ok = want is not None and isinstance(value, want) and not isinstance(value, bool)
    if isinstance(value, float) and not math.isfinite(value):  # NaN / Infinity: not JSON
        ok = False
    return value if ok else _MISS


def typed_value(text: str, schema) -> object:
    """A parameter's text as the first of its schema's types it is exactly; the text itself otherwise."""
    kinds = schema_types(schema)
    for kind in _ORDER:
        if kind in kinds:
            value = _as(kind, text)
            if value is not _MISS:
                return value
    return text


def _arguments(body: str, props: dict) -> dict | None:
    """The ``<parameter=...>`` blocks of a function body (nothing else but whitespace), or None."""
    out, last = {}, 0
    for m in _PARAM.finditer(body):
        name = m.group(1).strip()
        if body[last : m.start()].strip() or name in out:
            return None
        raw = m.group(2)
        raw = raw[1:] if raw.startswith("\n") else raw  # the template's newline after the tag and before its end
        raw = raw[:-1] if raw.endswith("\n") else raw
        out[name] = typed_value(raw, props[name]) if name in props else raw
        last = m.end()
    return None if body[last:].strip() else out


def parse_qwen3_coder(text: str, tools: Sequence[dict] | None = None) -> Parsed:
    schemas = tool_schemas(tools)

    def call(m: re.Match):
        name = m.group(1).strip()
        props = schemas.get(name, {}).get("properties")
        args = _arguments(m.group(2), props if isinstance(props, dict) else {}) if name else None
        return make_call(name, args) if args is not None else None

    return read_blocks(text, _BLOCK, call, tools)


def qwen3_coder_markup(name: str) -> tuple[str, str]:
    return f"<tool_call>\n<function={name}>\n", "</function>\n</tool_call>"


def _text_value(schema: dict) -> str | None:
    """The regex of a string parameter's text as the template writes it (as is: no ``<``, so it never ends the
    block early), or None when the schema is not a plain string (enum, length bounds allowed)."""
    if schema.get("type") != "string" or set(schema) - {"type", "description", "title", "enum", "minLength",
                                                         "maxLength"}:
        return None
    if "enum" in schema:
        values = schema["enum"]
        ok = isinstance(values, list) and values and all(isinstance(v, str) and "<" not in v for v in values)
        return "|".join(re.escape(v) for v in values) if ok else None
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    return f"[^<]{{{low},{'' if high is None else high}}}"


def xml_arguments_grammar(xgr, schema: dict, layout: dict):
    """The xgrammar Grammar of a call's ``<parameter=...>`` blocks under ``schema`` (an object's properties, in
    their declared order; the required ones always, the others optional; no other parameter): a string parameter
    as text, any other as compact JSON under its schema. A parameter that may be a string or something else is a
    ValueError (its text could not be typed back)."""
    def lit(text: str):
        return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text, ensure_ascii=False)}")

    props = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    parts = []
    for name, prop in props.items():
        prop = prop if isinstance(prop, dict) else {}
        kinds = schema_types(prop)
        text = _text_value(prop)
        if text is not None:
            value = xgr.Grammar.from_regex(text)
        elif "string" in kinds or not kinds:
            raise ValueError(f"parameter {name!r}: a value that may be text is not enforced in the qwen3_coder "
                             "format yet (give it a non-string type, or a plain/enum string)")
        else:
            value = xgr.Grammar.from_json_schema(json.dumps(json_safe(prop)), strict_mode=True, **layout)
        block = xgr.Grammar.concat(lit(f"<parameter={name}>\n"), value, lit("\n</parameter>\n"))
        parts.append(block if name in required else xgr.Grammar.union(block, lit("")))
    return xgr.Grammar.concat(*parts) if len(parts) > 1 else parts[0] if parts else lit("")
