"""Gemma 4's call arguments as an xgrammar EBNF grammar generated from a function's JSON schema: objects (bare keys,
the declared properties in order, the required ones always, no others), strings between ``<|"|>`` markers, numbers
and integers (their bounds: xgrammar's own JSON-schema rules), booleans, null, arrays (item counts), enums, consts,
anyOf / oneOf, local ``$ref`` (recursive ones too). What the syntax or this builder cannot express is a ValueError
naming the parameter. Strings never hold ``<|`` or ``<<`` (so no string can end early at a marker) and a string with
length bounds is printable ASCII without ``<``."""

from __future__ import annotations

import json
import re

from areno.engine.tool_calls.gemma4 import KEY, QUOTE

_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[A-Za-z_][A-Za-z0-9_]*')
_NOTES = {"description", "title", "default", "examples", "$schema", "$comment", "deprecated", "readOnly",
          "writeOnly"}
_NUMBER_KEYS = {"type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}
_KEYS = {"string": {"minLength", "maxLength"}, "integer": _NUMBER_KEYS, "number": _NUMBER_KEYS, "boolean": set(),
         "null": set(), "array": {"items", "minItems", "maxItems"},
         "object": {"properties", "required", "additionalProperties"}}
_Q = json.dumps(QUOTE)
_GENERIC = f"""g_any ::= g_str | g_num | "true" | "false" | "null" | g_obj | g_arr
g_str ::= {_Q} g_chars {_Q}
g_chars ::= ([^<] | "<" [^|<])*
g_num ::= "-"? ("0" | [1-9] [0-9]*) ("." [0-9]+)? ([eE] [+\\-]? [0-9]+)?
g_key ::= [A-Za-z_] [A-Za-z0-9_.\\-]*
g_obj ::= "{{" "}}" | "{{" g_key ":" g_any ("," g_key ":" g_any)* "}}"
g_arr ::= "[" "]" | "[" g_any ("," g_any)* "]"
"""


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def render(value) -> str:
    """A JSON value in Gemma 4's argument syntax (as the parser reads it back)."""
    if isinstance(value, str):
        if QUOTE in value:
            raise ValueError(f"{value!r} holds the string marker")
        return QUOTE + value + QUOTE
    if isinstance(value, dict):
        return "{" + ",".join(f"{_key(k)}:{render(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(render(v) for v in value) + "]"
    return json.dumps(value)


def _key(name: str) -> str:
    if KEY.fullmatch(name):
        return name
    if QUOTE in name:
        raise ValueError(f"key {name!r} holds the string marker")
    return QUOTE + name + QUOTE


class ArgumentsEbnf:
    """One schema's grammar text: ``text(schema)``; rules are added as the schema is walked."""

    def __init__(self, xgr, layout: dict):
        self.xgr, self.layout = xgr, layout
        self.rules: dict[str, str] = {}
        self.leaves: dict[str, str] = {}  # a delegated leaf's schema JSON -> its root rule
        self.refs: dict[str, str] = {}
        self.defs: dict = {}
        self.generic = False

    def text(self, schema: dict) -> str:
        self.defs = {**(schema.get("definitions") or {}), **(schema.get("$defs") or {})}
        root = self.value(schema, "", top=True)
        lines = [f"root ::= {root}"] + [f"{name} ::= {body}" for name, body in self.rules.items()]
        return "\n".join(lines) + "\n" + (_GENERIC if self.generic else "")

    def rule(self, body: str) -> str:
        name = f"r{len(self.rules)}"
        self.rules[name] = body
        return name

    def value(self, schema, path: str, top: bool = False) -> str:
        where = f"parameter {path!r}" if path else "the arguments"
        if schema is True or schema == {} or (isinstance(schema, dict) and not set(schema) - _NOTES):
            if top:
                return '"{" "}"'
            self.generic = True
            return "g_any"
        if not isinstance(schema, dict):
            raise ValueError(f"{where}: schema {schema!r} is not enforced in the gemma4 format")
        if "$ref" in schema:
            return self.ref(schema["$ref"], path, where)
        for key in ("enum", "const"):
            if key in schema:
                values = schema[key] if key == "enum" else [schema[key]]
                if not isinstance(values, list) or not values:
                    raise ValueError(f"{where}: {key} needs at least one value")
                try:
                    return "(" + " | ".join(_lit(render(v)) for v in values) + ")"
                except ValueError as exc:
                    raise ValueError(f"{where}: {exc}") from exc
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return "(" + " | ".join(self.value(s, path) for s in schema[key]) + ")"
        kind = schema.get("type", "object" if "properties" in schema else None)
        if isinstance(kind, list):
            return "(" + " | ".join(self.value({**schema, "type": k}, path) for k in kind) + ")"
        extra = set(schema) - _NOTES - {"type", "$defs", "definitions"} - _KEYS.get(kind, set())
        if kind not in _KEYS or extra:
            what = f"keyword {sorted(extra)[0]!r}" if kind in _KEYS else f"type {kind!r}"
            raise ValueError(f"{where}: {what} is not enforced in the gemma4 format")
        return getattr(self, kind)(schema, path, where)

    def ref(self, ref, path: str, where: str) -> str:
        if ref in self.refs:
            return self.refs[ref]
        m = re.fullmatch(r"#/(?:\$defs|definitions)/([^/]+)", ref) if isinstance(ref, str) else None
        if m is None or m.group(1) not in self.defs:
            raise ValueError(f"{where}: $ref {ref!r} is not a local definition")
        name = self.rule("")  # reserved first: a recursive reference finds it
        self.refs[ref] = name
        self.rules[name] = self.value(self.defs[m.group(1)], path)
        return name

    def string(self, schema: dict, path: str, where: str) -> str:
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        if low == 0 and high is None:
            body = '([^<] | "<" [^|<])*'
        else:
            # printable ASCII but "<": xgrammar 0.2.9's negated classes let token pieces of a multi-byte character
            # through that never complete it (each bad byte one more character than the bound allows), as
            # config.sampling.json_safe says for the JSON formats
            body = f"[ -;=-~]{{{low},{'' if high is None else high}}}"
        return f"({_Q} {body} {_Q})"

    def boolean(self, schema: dict, path: str, where: str) -> str:
        return '("true" | "false")'

    def null(self, schema: dict, path: str, where: str) -> str:
        return '"null"'

    def integer(self, schema: dict, path: str, where: str) -> str:
        """Numbers are written as JSON writes them: xgrammar's JSON-schema rules, renamed into this grammar."""
        leaf = json.dumps({k: v for k, v in schema.items() if k in _NUMBER_KEYS}, sort_keys=True)
        if leaf not in self.leaves:
            try:
                text = str(self.xgr.Grammar.from_json_schema(leaf, strict_mode=True, **self.layout))
            except Exception as exc:
                raise ValueError(f"{where}: {exc}") from exc
            prefix = f"n{len(self.leaves)}_"
            self.leaves[leaf] = prefix + "root"
            renamed = _TOKEN.sub(lambda m: prefix + m.group(0) if m.group(0)[0] not in '"[' else m.group(0), text)
            for line in renamed.splitlines():
                if line.strip():
                    name, body = line.split(" ::= ", 1)
                    self.rules[name] = body
        return self.leaves[leaf]

    number = integer

    def array(self, schema: dict, path: str, where: str) -> str:
        item = self.value(schema.get("items", {}), f"{path}[]")
        low, high = schema.get("minItems", 0), schema.get("maxItems")
        if high == 0:
            return '("[" "]")'
        more = f'("," {item})' + ("*" if high is None else f"{{{max(low - 1, 0)},{high - 1}}}")
        if low > 1:
            more = f'("," {item})' + (f"{{{low - 1},}}" if high is None else f"{{{low - 1},{high - 1}}}")
        filled = f'"[" {item} {more} "]"'
        return f"({filled})" if low > 0 else f'("[" "]" | {filled})'

    def object(self, schema: dict, path: str, where: str) -> str:
        props = schema.get("properties") or {}
        required = set(schema.get("required") or ())
        missing = required - set(props)
        if missing:
            raise ValueError(f"{where}: required {sorted(missing)[0]!r} is not among its properties")
        members = []
        for name, prop in props.items():
            try:
                key = _lit(_key(name) + ":")
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from exc
            members.append((f"{key} {self.value(prop, f'{path}.{name}' if path else name)}", name in required))
        # first[i] / rest[i]: the members from i on, before any member was written / after one was
        first, rest = ['""'], ['""']
        for body, need in reversed(members):
            after = self.rule(f'("," {body} {rest[-1]})' + ("" if need else f" | {rest[-1]}"))
            start = self.rule(f"({body} {rest[-1]})" + ("" if need else f" | {first[-1]}"))
            rest.append(after)
            first.append(start)
        return f'("{{" {first[-1]} "}}")'


def gemma4_arguments_grammar(xgr, schema: dict, layout: dict):
    """The xgrammar Grammar of a call's arguments object in Gemma 4's syntax under ``schema``; ValueError naming
    the parameter where it cannot be expressed."""
    return xgr.Grammar.from_ebnf(ArgumentsEbnf(xgr, layout).text(schema))
