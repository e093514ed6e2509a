"""What a request's ``tools`` and ``tool_choice`` ask of an answer, as OpenAI defines them, in the served model's
tool-call format: the tools the chat template shows, the grammar generation runs under, and how the answer is read
back. Shared by chat completions, the Responses route and the agentic endpoint (``plan_tools``, ``read_calls``).

| tool_choice                              | template shows | generation                           | calls returned  |
| "none"                                   | no tools       | free                                 | none: markup cut |
| "auto" (the default with tools)          | the tools      | free; a strict tool's call under its | declared        |
|                                          |                | schema (grammar from the trigger on) | functions only  |
| "required"                               | the tools      | one call to a declared function, its | that call       |
|                                          |                | arguments valid under its schema     |                 |
| {"type": "function", "function":         | the tools      | one call to ``f``, valid under its   | that call       |
|  {"name": "f"}} (or Responses' form)     |                | schema                               |                 |

"required" or a named function with no such tool declared is refused (a ``ToolChoiceError`` naming the field, a
400 on the HTTP routes), as OpenAI refuses it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from areno.engine.tool_calls.base import Parsed, ToolFormat, read_answer, tool_schemas

CHOICES = ("none", "auto", "required")


class ToolChoiceError(ValueError):
    """A ``tools`` / ``tool_choice`` combination that cannot be served; ``field`` names the request field."""

    def __init__(self, field_name: str, message: str):
        super().__init__(message)
        self.field = field_name


def choice_kind(tool_choice) -> tuple[str, str | None]:
    """(``none`` | ``auto`` | ``required`` | ``function``, the named function or None) of a ``tool_choice`` value:
    a string, ``{"type": "function", "function": {"name": f}}`` (chat) or ``{"type": "function", "name": f}``
    (Responses). None is "auto" (what it means with tools; without tools nothing is called anyway)."""
    if tool_choice is None:
        return "auto", None
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise ToolChoiceError("tool_choice", f"tool_choice must be one of {', '.join(CHOICES)} or a function, "
                                  f"got {tool_choice!r}")
        return tool_choice, None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function", tool_choice)
        name = fn.get("name") if isinstance(fn, dict) else None
        if isinstance(name, str) and name and set(tool_choice) <= {"type", "function", "name"}:
            return "function", name
        raise ToolChoiceError("tool_choice", 'tool_choice naming a function is {"type": "function", "function": '
                              '{"name": "..."}}')
    kind = tool_choice.get("type") if isinstance(tool_choice, dict) else type(tool_choice).__name__
    raise ToolChoiceError("tool_choice", f"tool_choice of type {kind!r} is not supported by this server; use none, "
                          "auto, required or a function")


def check_tool_choice(tools: Sequence[dict] | None, tool_choice) -> tuple[str, str | None]:
    """``choice_kind`` of ``tool_choice``, refused where it asks for a call no tool can make."""
    kind, name = choice_kind(tool_choice)
    declared = tool_schemas(tools)
    if kind == "required" and not declared:
        raise ToolChoiceError("tool_choice", "tool_choice 'required' needs at least one tool in tools")
    if kind == "function" and name not in declared:
        raise ToolChoiceError("tool_choice", f"tool_choice names function {name!r}, which tools does not declare")
    return kind, name


def _strict(tool: dict) -> bool:
    fn = tool.get("function", tool)
    return isinstance(fn, dict) and fn.get("strict") is True


def arguments_schema(params: dict | None) -> dict:
    """The JSON schema a call's arguments follow: the function's parameters (an object; none: an empty object)."""
    if not params:
        return {"type": "object", "properties": {}}
    return params if "type" in params else {"type": "object", **params}


def call_grammar(fmt: ToolFormat, schemas: dict[str, dict], triggered: bool) -> dict:
    """The grammar spec (``areno.engine.grammar``'s ``tool_calls``) of calls in ``fmt`` to the functions
    ``schemas`` names (name -> parameters): exactly one of them, or with ``triggered`` free text where the
    format's call start begins one."""
    if fmt.call_markup is None:
        raise ToolChoiceError("tool_choice", f"constrained tool calls (tool_choice required or a function, strict "
                              f"tools) are not built yet for the {fmt.name} tool-call format")
    calls = []
    for name, params in schemas.items():
        try:
            begin, end = fmt.call_markup(name)
        except ValueError as exc:
            raise ToolChoiceError("tools", f"tools: {exc}") from exc
        calls.append({"begin": begin, "schema": arguments_schema(params), "end": end,
                      **({"arguments": fmt.arguments} if fmt.arguments != "json" else {})})
    return {"type": "tool_calls", "calls": calls, "triggers": [fmt.trigger] if triggered else None}


@dataclass(frozen=True)
class ToolPlan:
    """What ``plan_tools`` worked out: the declared ``tools`` (OpenAI's dicts), the choice's kind and named
    function, and the grammar spec generation runs under (None: free)."""

    tools: list[dict] = field(default_factory=list)
    kind: str = "auto"
    name: str | None = None
    grammar: dict | None = None

    @property
    def shown(self) -> list[dict] | None:
        """The tools the chat template renders (none with "none")."""
        return self.tools if self.tools and self.kind != "none" else None

    @property
    def returns_calls(self) -> bool:
        return bool(self.tools) and self.kind != "none"


def plan_tools(fmt: ToolFormat, tools: Sequence[dict] | None, tool_choice) -> ToolPlan:
    """The plan of a request's ``tools`` (OpenAI's dicts) and ``tool_choice`` in ``fmt`` (ToolChoiceError where it
    cannot be served). The grammar is converted here, so a schema xgrammar refuses fails now, naming tools."""
    tools = list(tools or ())
    kind, name = check_tool_choice(tools, tool_choice)
    schemas = tool_schemas(tools)
    grammar = None
    if kind == "required":
        grammar = call_grammar(fmt, schemas, triggered=False)
    elif kind == "function":
        grammar = call_grammar(fmt, {name: schemas[name]}, triggered=False)
    elif kind == "auto" and any(_strict(t) for t in tools):
        grammar = call_grammar(fmt, schemas, triggered=True)
    if grammar is not None:
        from areno.config.sampling import GrammarError
        from areno.engine.grammar import check

        try:
            check(grammar)
        except GrammarError as exc:
            raise ToolChoiceError("tools", f"tools: a function's parameters cannot be enforced: {exc}") from exc
    return ToolPlan(tools, kind, name, grammar)


def read_calls(fmt: ToolFormat, text: str, plan: ToolPlan, specials: Sequence[str] = ()) -> Parsed:
    """An answer read in ``fmt`` under ``plan``: calls to declared functions come back (another one stays
    content); with "none" the call markup is cut and no call comes back."""
    if plan.returns_calls:
        return read_answer(fmt, text, plan.tools, specials)
    parsed = read_answer(fmt, text, None, specials)
    parsed.calls = []
    return parsed
