"""The OpenAI request bodies areno serves, as pydantic models, and OpenAI-style errors.

Unknown fields are refused (``extra="forbid"``), so a feature the server lacks gets a 400 naming the field instead
of being ignored. Fields OpenAI defines whose neutral value is a no-op (penalties of 0, ``logit_bias`` empty,
``parallel_tool_calls``, ``user``) are accepted at that value only.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_N = 64
MAX_TOP_LOGPROBS = 20


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _schema_only(**constraints) -> dict:
    """JSON-schema constraints for the OpenAPI document (what a valid request may hold), where validation itself is
    done by a validator that names the unsupported feature in its message."""
    return {"json_schema_extra": constraints}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str | dict = "{}"


class ToolCallIn(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    def text(self) -> str | None:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content


class FunctionDef(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class StreamOptions(_Strict):
    include_usage: bool = False


def _field_dependencies(schema: dict, cls) -> None:
    """The cross-field rules of the validators below, as JSON-schema ``dependentSchemas`` (for the OpenAPI document;
    stricter than the validators where null or 0 would also pass)."""
    deps = {"stream_options": {"properties": {"stream": {"const": True}}, "required": ["stream"]}}
    if "top_logprobs" in schema.get("properties", {}):
        deps["top_logprobs"] = {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}
    schema["dependentSchemas"] = deps


class _Sampling(_Strict):
    model_config = ConfigDict(extra="forbid", json_schema_extra=_field_dependencies)

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, **_schema_only(minimum=0, maximum=0))
    frequency_penalty: float | None = Field(default=None, **_schema_only(minimum=0, maximum=0))
    logit_bias: dict[str, float] | None = Field(default=None, **_schema_only(maxProperties=0))
    user: str | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if isinstance(v, list) and len(v) > 16:
            raise ValueError("at most 16 stop sequences")
        return v

    @model_validator(mode="after")
    def _unsupported(self):
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise ValueError(f"{name} is not supported by this server (only 0)")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by this server")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        if isinstance(self.tool_choice, dict):
            raise ValueError("tool_choice naming a function is not supported; use 'auto', 'none' or 'required'")
        return self


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(json_schema_extra={"anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
        {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
        {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
         "minItems": 1}]})
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = Field(default=False, **_schema_only(enum=[False]))
    suffix: str | None = Field(default=None, **_schema_only(maxLength=0))
    best_of: int | None = Field(default=None, **_schema_only(minimum=1, maximum=1))

    @model_validator(mode="after")
    def _unsupported_completion(self):
        if self.echo:
            raise ValueError("echo is not supported by this server")
        if self.suffix:
            raise ValueError("suffix is not supported by this server")
        if self.best_of not in (None, 1, self.n):
            raise ValueError("best_of is not supported by this server")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
        return self
