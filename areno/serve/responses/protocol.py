"""The body of ``POST /v1/responses`` as pydantic models (unknown fields refused by name, as the chat route does),
and its translation into a chat-completions body: input items become chat messages, function tools chat tools,
``text.format`` a ``response_format``, ``max_output_tokens`` ``max_completion_tokens``.

Built-in tools (web search, file search, computer use, code interpreter, ...) and fields that would change the answer
and are not built (``background``, ``conversation``, ``prompt``, logprobs through ``include``) get a 400 naming them.
Fields that change nothing here (``prompt_cache_key``, ``safety_identifier``, ``user``, ``service_tier``,
``truncation``, ``text.verbosity``, ``reasoning.summary``, an image's ``detail``) are accepted and ignored."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from areno.serve.protocol import FieldError, not_supported

BUILT_IN_TOOLS = ("web_search", "web_search_preview", "web_search_preview_2025_03_11", "web_search_2025_08_26",
                  "file_search", "computer_use", "computer_use_preview", "computer", "code_interpreter",
                  "image_generation", "mcp", "local_shell", "shell", "apply_patch", "custom", "namespace",
                  "tool_search")
IGNORED_INCLUDES = ("reasoning.encrypted_content", "message.input_image.image_url")  # nothing more to send back
# the OpenAPI schema of a field refused when set (validation itself names it)
_NOT_BUILT = {"json_schema_extra": {"anyOf": [{"type": "null"}]}}


def first_error(exc: ValidationError, head: str) -> ValueError:
    """The first problem of a union member's validation, named by ``head`` and the field (the union's tag and
    branch names dropped): a string-or-list field would otherwise report "should be a valid string"."""
    err = exc.errors()[0]
    where = ".".join(str(x) for x in err.get("loc", ())[1:] if not str(x)[:1].isupper() and x != "str")
    cause = (err.get("ctx") or {}).get("error")
    msg = str(cause) if isinstance(cause, FieldError) else err.get("msg", "invalid").removeprefix("Value error, ")
    return ValueError(f"{head}{' ' + where if where else ''}: {msg}")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class InputText(_Strict):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list | None = None  # an output_text part sent back: ignored
    logprobs: list | None = None


class InputImage(_Strict):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"required": ["type", "image_url"]})

    type: Literal["input_image"]
    image_url: str | None = Field(default=None, json_schema_extra={"anyOf": [{"type": "string"}]})
    file_id: str | None = Field(default=None, **_NOT_BUILT)
    detail: Literal["low", "high", "auto", "original"] | None = None  # the model's processor decides: ignored

    @model_validator(mode="after")
    def _url(self):
        if self.file_id is not None or self.image_url is None:
            raise not_supported("file_id", " (send the image as a data: URL in image_url)")
        return self


class Refusal(_Strict):
    type: Literal["refusal"]
    refusal: str


Part = Annotated[InputText | InputImage | Refusal, Field(discriminator="type")]
_PART = TypeAdapter(Part)


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]
    id: str | None = None
    status: str | None = None
    phase: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, v):
        if not isinstance(v, list):
            return v
        parts = []
        for i, part in enumerate(v):
            try:
                parts.append(_PART.validate_python(part))
            except ValidationError as exc:
                kind = part.get("type") if isinstance(part, dict) else None
                raise first_error(exc, f"part {i} ({kind})") from None
        return parts

    def chat_content(self) -> str | list[dict]:
        """The content as a chat message's: a string, or text and image_url parts when there are images."""
        if isinstance(self.content, str):
            return self.content
        if not any(p.type == "input_image" for p in self.content):
            return "".join(p.text if p.type != "refusal" else p.refusal for p in self.content)
        return [{"type": "image_url", "image_url": {"url": p.image_url}} if p.type == "input_image"
                else {"type": "text", "text": p.text if p.type != "refusal" else p.refusal} for p in self.content]


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None
    namespace: str | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningText(_Strict):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Strict):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: str | None = None

    def text(self) -> str:
        return "".join(p.text for p in (self.content or self.summary))


Item = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem, Field(discriminator="type")]
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
_ITEM = TypeAdapter(Item)


def _non_empty(schema: dict) -> None:
    for branch in schema.get("anyOf", ()):
        branch.update({"minLength": 1} if branch.get("type") == "string" else {"minItems": 1})


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def chat_tool(self) -> dict:
        fn = {"name": self.name, "description": self.description, "parameters": self.parameters,
              "strict": self.strict or None}  # strict false is the default: the same tool as without it
        return {"type": "function", "function": {k: v for k, v in fn.items() if v is not None}}


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema(self):
        if self.type == "json_schema" and self.schema_ is None:
            raise FieldError("format.schema", "text.format of type json_schema needs a schema")
        if self.type != "json_schema" and self.model_fields_set - {"type"}:
            raise FieldError("format", f"text.format of type {self.type} takes no other keys")
        return self

    def response_format(self) -> dict:
        if self.type != "json_schema":
            return {"type": self.type}
        js = {"name": self.name or "response", "schema": self.schema_, "description": self.description,
              "strict": self.strict}
        return {"type": "json_schema", "json_schema": {k: v for k, v in js.items() if v is not None}}


class TextOptions(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # no model here reads it: ignored


class Reasoning(_Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # no summaries: the reasoning text itself
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


def _tool(value):
    """A tool as a FunctionTool, or a FieldError naming the built-in (or unknown) tool type."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "function":
        return value
    if isinstance(kind, str) and (kind in BUILT_IN_TOOLS or kind.startswith(("web_search", "computer_use"))):
        raise ValueError(f"built-in tool {kind!r} is not supported by this server (only function tools)")
    raise ValueError(f"tool type {kind!r} is not supported (only function tools)")


def _item(index: int, value):
    """One input item validated (a bare ``{"role", "content"}`` is a message item); its first problem named by
    index, type and field, and an item type not built by its name."""
    if isinstance(value, dict) and "type" not in value and "role" in value:
        value = {"type": "message", **value}
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ITEM_TYPES:
        raise ValueError(f"item {index}: input item type {kind!r} is not supported (only {', '.join(ITEM_TYPES)})")
    try:
        return _ITEM.validate_python(value)
    except ValidationError as exc:
        raise first_error(exc, f"item {index} ({kind})") from None


class ResponsesRequest(_Strict):
    model: str
    input: str | list[Item] = Field(json_schema_extra=_non_empty)
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = Field(default=None, json_schema_extra={"anyOf": [
        {"enum": ["none", "auto", "required"]}, {"type": "null"},
        {"type": "object", "properties": {"type": {"const": "function"}, "name": {"type": "string"}},
         "required": ["type", "name"], "additionalProperties": False}]})
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    reasoning: Reasoning | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: StrictBool = False
    stream_options: dict | None = None  # include_obfuscation: nothing to obfuscate here
    store: StrictBool = True
    metadata: dict[str, str] | None = None
    include: list[str] | None = Field(default=None, json_schema_extra={"anyOf": [
        {"type": "array", "items": {"enum": list(IGNORED_INCLUDES)}}, {"type": "null"}]})
    max_tool_calls: int | None = Field(default=None, **_NOT_BUILT)
    # accepted, change nothing here
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # refused by name when set: they would change the answer and are not built
    background: bool | None = Field(default=None, json_schema_extra={"anyOf": [{"const": False}, {"type": "null"}]})
    conversation: str | dict | None = Field(default=None, **_NOT_BUILT)
    prompt: dict | None = Field(default=None, **_NOT_BUILT)
    top_logprobs: int | None = Field(default=None, json_schema_extra={"anyOf": [{"const": 0}, {"type": "null"}]})

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        if isinstance(data, dict) and any(v is None for v in data.values()):
            data = {k: v for k, v in data.items() if v is not None}
        return data

    @field_validator("input", mode="before")
    @classmethod
    def _items(cls, v):
        return [_item(i, x) for i, x in enumerate(v)] if isinstance(v, list) else v

    @field_validator("tools", mode="before")
    @classmethod
    def _tools(cls, v):
        return [_tool(x) for x in v] if isinstance(v, list) else v

    @model_validator(mode="after")
    def _unsupported(self):
        if not self.input:
            raise FieldError("input", "input must not be empty")
        for name in ("background", "conversation", "prompt", "top_logprobs"):
            if getattr(self, name):
                raise not_supported(name)
        for name in self.include or ():
            if name not in IGNORED_INCLUDES:
                raise FieldError("include", f"include {name!r} is not supported yet by this server")
        if self.max_tool_calls is not None:
            raise not_supported("max_tool_calls")
        choice = self.tool_choice
        if isinstance(choice, dict) and (choice.get("type") != "function" or set(choice) != {"type", "name"}):
            raise FieldError("tool_choice", "tool_choice must be 'none', 'auto', 'required' or "
                             "{'type': 'function', 'name': ...}")
        return self

    def chat_tool_choice(self):
        if isinstance(self.tool_choice, dict):
            return {"type": "function", "function": {"name": self.tool_choice["name"]}}
        return self.tool_choice

    def input_items(self) -> list:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return self.input


def chat_messages(items) -> list[dict]:
    """Input items as chat messages: consecutive function calls (and the assistant text and reasoning before them)
    are one assistant message with ``tool_calls``; a function call's output is a ``tool`` message."""
    messages: list[dict] = []
    reasoning: str | None = None

    def assistant() -> dict:
        last = messages[-1] if messages else None
        if last is None or last["role"] != "assistant" or last.get("_closed"):
            messages.append({"role": "assistant", "content": None})
            last = messages[-1]
        return last

    for item in items:
        if item.type == "reasoning":
            reasoning = (reasoning or "") + item.text()
            continue
        if item.type == "function_call":
            msg = assistant()
            msg.setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}})
        elif item.type == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        elif item.role == "assistant":
            msg = assistant()
            if msg.get("tool_calls") or msg["content"] is not None:
                msg["_closed"] = True
                msg = assistant()
            msg["content"] = item.chat_content()
        else:
            messages.append({"role": item.role, "content": item.chat_content()})
        if reasoning is not None and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"], reasoning = reasoning, None
    for m in messages:
        m.pop("_closed", None)
    return messages


def chat_body(req: ResponsesRequest, history: list[dict]) -> dict:
    """The chat-completions body a Responses request asks for: ``instructions`` as the system message, then the
    previous response's conversation (``history``, chat messages), then this request's input items."""
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + history
    messages += chat_messages(req.input_items())
    body = {"model": req.model, "messages": messages, "max_completion_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "parallel_tool_calls": req.parallel_tool_calls,
            "tool_choice": req.chat_tool_choice(), "stream": req.stream}
    if req.tools:
        body["tools"] = [t.chat_tool() for t in req.tools]
    if req.text is not None and req.text.format is not None:
        body["response_format"] = req.text.format.response_format()
    if req.reasoning is not None and req.reasoning.effort is not None:
        body["reasoning_effort"] = "high" if req.reasoning.effort == "xhigh" else req.reasoning.effort
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    return {k: v for k, v in body.items() if v is not None}
