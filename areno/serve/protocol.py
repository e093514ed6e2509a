"""The OpenAI request bodies areno serves, as pydantic models, and their parsing from JSON (``parse``: a 400 from
``areno.serve.errors`` naming the field).

Unknown fields are refused (``extra="forbid"``), so a feature the server lacks gets a 400 naming the field instead
of being ignored. Fields that clients send to every OpenAI-compatible server are accepted where they change nothing
here or are built (vLLM's ``chat_template_kwargs``, ``continue_final_message``, ``stop_token_ids``,
``skip_special_tokens``, ...; the SDK's ``store``, ``metadata``, ``service_tier``, ...), and refused by name where
they would change the answer and are not built (such as
``suffix``). A null value means the field's default.

``response_format`` (both routes, as vLLM): ``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type":
"json_schema", "json_schema": {"name", "schema", "description", "strict"}}`` becomes a grammar the engine decodes
under (``areno.engine.grammar``); the output always follows the schema, so ``strict`` changes nothing, and
``description`` is not shown to the model. A schema the grammar converter refuses is a 400 naming
``response_format``.

Sampling options beyond OpenAI's few (vLLM's semantics, ``SamplingParams``): ``repetition_penalty`` > 0,
``presence_penalty`` and ``frequency_penalty`` in [-2, 2], ``min_p`` in [0, 1], ``logit_bias`` (at most
``MAX_LOGIT_BIAS`` token ids, biases in [-100, 100]), ``min_tokens`` (EOS and stop ids masked until reached).
"""

from __future__ import annotations

import json
import logging
import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from areno.engine.tool_calls import ToolChoiceError, ToolPlan, check_tool_choice, plan_tools
from areno.engine.tool_calls.choice import choice_kind
from areno.serve.errors import APIError

log = logging.getLogger("areno.serve")
MAX_N = 64
MAX_TOP_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 128  # checked against every sampled token: a long list would slow every engine step
MAX_LOGIT_BIAS = 300  # token ids in one logit_bias (OpenAI's own limit)

TokenId = Annotated[int, Field(ge=0)]


class FieldError(ValueError):
    """A value refused by a check across fields (or as a feature not built): carries the field it is about, which
    the error's ``param`` names."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def not_supported(field: str, detail: str = "") -> FieldError:
    return FieldError(field, f"{field} is not supported yet by this server{detail}")


def _schema_only(**constraints) -> dict:
    """JSON-schema constraints for the OpenAPI document (what a valid request may hold), where validation itself is
    done by a validator that names the unsupported feature in its message."""
    return {"json_schema_extra": constraints}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str  # a data:image/...;base64 URL (remote URLs are refused: the server never fetches)
    # accepted, changes nothing: the checkpoint's image processor decides the resolution (as vLLM)
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL | str


class InputAudio(_Strict):
    data: str  # base64
    format: str


class InputAudioPart(_Strict):
    type: Literal["input_audio"]
    input_audio: InputAudio


class MediaURL(_Strict):
    url: str


class AudioURLPart(_Strict):
    type: Literal["audio_url"]
    audio_url: MediaURL | str


class VideoURLPart(_Strict):
    type: Literal["video_url"]
    video_url: MediaURL | str


# the shared message schema's parts (areno.models.multimodal): the model's processor takes or refuses the media ones
ContentPart = Annotated[TextPart | ImagePart | InputAudioPart | AudioURLPart | VideoURLPart,
                        Field(discriminator="type")]  # fmt: skip
_PARTS = TypeAdapter(list[ContentPart])


def _content_parts(value):
    """A list content validated part by part, its first problem named by part index and field (the union of a
    string and a part list would otherwise report "should be a valid string")."""
    if not isinstance(value, list):
        return value
    try:
        return _PARTS.validate_python(value)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [str(x) for x in err.get("loc", ())]
        kind = value[int(loc[0])].get("type") if loc and isinstance(value[int(loc[0])], dict) else None
        where = ".".join(x for x in loc[2:] if x != "str" and not x[:1].isupper())  # drop the tag and branch names
        msg = err.get("msg", "invalid").removeprefix("Value error, ")
        raise ValueError(f"part {loc[0] if loc else '?'}" + (f" ({kind})" if kind else "")
                         + (f" {where}" if where else "") + f": {msg}") from None


class FunctionCall(_Strict):
    name: str
    arguments: str | dict = "{}"


class ToolCallIn(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    # what an assistant message read back from an OpenAI-compatible response may carry when sent again
    reasoning_content: str | None = None  # earlier reasoning, for the chat templates that render it
    refusal: str | None = None  # ignored
    annotations: list | None = None  # ignored

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, v):
        return _content_parts(v)

    def text(self) -> str | None:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content if p.type == "text")
        return self.content

    def has_media(self) -> bool:
        return isinstance(self.content, list) and any(p.type != "text" for p in self.content)


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
    continuous_usage_stats: bool = False  # vLLM: usage so far in every chunk (with include_usage)


def _field_dependencies(schema: dict, cls) -> None:
    """The cross-field rules of the validators below, as JSON-schema ``dependentSchemas`` (for the OpenAPI document;
    stricter than the validators where null or 0 would also pass)."""
    deps = {"stream_options": {"properties": {"stream": {"const": True}}, "required": ["stream"]},
            "prompt_logprobs": {"properties": {"stream": {"const": False}}}}
    props = schema.get("properties", {})
    if "top_logprobs" in props:
        deps["top_logprobs"] = {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}
    if "continue_final_message" in props:  # continuing the last message adds no generation prompt
        deps["continue_final_message"] = {"properties": {"add_generation_prompt": {"const": False}}}
    schema["dependentSchemas"] = deps


JSON_SCHEMA_FORMAT = {"type": "object", "properties": {
    "name": {"type": "string"}, "description": {"type": "string"}, "schema": {"type": "object"},
    "strict": {"type": ["boolean", "null"]}}, "required": ["schema"], "additionalProperties": False}


def response_format_grammar(response_format: dict | None, *, check: bool = False) -> dict | None:
    """The grammar spec (``areno.engine.grammar``) of an OpenAI ``response_format``, None for text; ``check``
    also converts the schema (xgrammar), so a schema it refuses fails here. Errors are FieldErrors on
    ``response_format``."""
    rf = response_format
    if rf is None or rf == {"type": "text"}:
        return None
    kind = rf.get("type")
    if kind == "json_object" and set(rf) == {"type"}:
        spec = {"type": "json_object"}
    elif kind == "json_schema":
        js = rf.get("json_schema")
        if set(rf) != {"type", "json_schema"} or not isinstance(js, dict):
            raise FieldError("response_format", "response_format of type json_schema needs a json_schema object "
                             "(and no other keys)")
        extra = set(js) - set(JSON_SCHEMA_FORMAT["properties"])
        if extra:
            raise FieldError("response_format", f"response_format.json_schema: unknown keys {sorted(extra)}")
        if not isinstance(js.get("schema"), dict):
            raise FieldError("response_format", "response_format.json_schema.schema must be a JSON schema object")
        for key, types in (("name", str), ("description", str), ("strict", (bool, type(None)))):
            if key in js and not isinstance(js[key], types):
                raise FieldError("response_format", f"response_format.json_schema.{key} has the wrong type")
        spec = {"type": "json_schema", "schema": js["schema"]}
    elif kind in ("text", "json_object"):
        raise FieldError("response_format", f"response_format of type {kind} takes no other keys")
    else:
        raise FieldError("response_format", "response_format type must be one of text, json_object, json_schema; "
                         f"got {kind!r}")
    if check:
        from areno.engine.grammar import GrammarError
        from areno.engine.grammar import check as check_grammar

        try:
            check_grammar(spec)
        except GrammarError as exc:
            raise FieldError("response_format", f"response_format: {exc}") from exc
    return spec


class _Sampling(_Strict):
    model_config = ConfigDict(extra="forbid", json_schema_extra=_field_dependencies)

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None
    stream: StrictBool = False  # a JSON boolean: "yes" or 1 is a 400, not true
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    return_tokens_as_token_ids: bool = False
    # accepted, change nothing here
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None  # prefix caching here is automatic
    safety_identifier: str | None = None
    # refused by name: each would change the answer and is not built (None or, for modalities, ["text"] passes)
    prediction: dict | None = Field(default=None, **_schema_only(type="null"))
    modalities: list[str] | None = Field(default=None, **_schema_only(items={"const": "text"}))
    web_search_options: dict | None = Field(default=None, **_schema_only(type="null"))
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=3.4028234663852886e38)  # a finite fp32
    min_p: float | None = Field(default=None, ge=0.0, le=1.0, allow_inf_nan=False)
    logit_bias: dict[Annotated[str, Field(pattern=r"^[0-9]{1,9}$")],
                     Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]] | None = Field(
        default=None, max_length=MAX_LOGIT_BIAS)
    response_format: dict[str, Any] | None = Field(default=None, json_schema_extra={"anyOf": [
        *({"type": "object", "properties": {"type": {"const": kind}}, "required": ["type"],
           "additionalProperties": False} for kind in ("text", "json_object")),
        {"type": "object", "properties": {"type": {"const": "json_schema"}, "json_schema": JSON_SCHEMA_FORMAT},
         "required": ["type", "json_schema"], "additionalProperties": False},
        {"type": "null"}]})
    # vLLM's extension: per prompt token, its own log-prob and rank and the k likeliest (not with stream=true)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        """``"n": null`` (as some clients send every field) means the default, for fields whose default is not null."""
        if isinstance(data, dict) and any(v is None for v in data.values()):
            fields = cls.model_fields
            data = {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].default is None}
        return data

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if isinstance(v, list) and len(v) > 16:
            raise ValueError("at most 16 stop sequences")
        return v

    @model_validator(mode="after")
    def _unsupported(self):
        response_format_grammar(self.response_format, check=True)
        if self.prediction is not None:
            raise not_supported("prediction", " (predicted outputs)")
        if self.modalities is not None and self.modalities != ["text"]:
            raise not_supported("modalities", f": only ['text'] is generated, got {self.modalities}")
        if self.web_search_options is not None:
            raise not_supported("web_search_options", " (no web search)")
        if self.prompt_logprobs is not None and self.stream:
            raise FieldError("prompt_logprobs", "prompt_logprobs is not available with stream=true")
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "stream_options is only allowed with stream=true")
        return self

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def logit_bias_ids(self) -> dict[int, float]:
        """``logit_bias`` keyed by token id (its JSON keys are the ids' decimal strings)."""
        return {int(t): b for t, b in (self.logit_bias or {}).items()}

    def grammar(self) -> dict | None:
        """The structured-output grammar spec of ``response_format`` (None: free text)."""
        return response_format_grammar(self.response_format)

    def token_limit(self) -> int | None:
        """The completion's token budget: ``max_completion_tokens`` (the newer name) else ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# parameters of tokenizer.apply_chat_template and of the template's own render call: chat_template_kwargs may not
# set them (they would change how the template is called, not what it renders)
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "conversations", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


class _ChatRendering(_Strict):
    """How messages become the prompt: the chat template's switches (vLLM's extensions)."""

    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    add_generation_prompt: bool | None = None  # default: true, false with continue_final_message
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, json_schema_extra={
        "propertyNames": {"not": {"enum": sorted(RESERVED_TEMPLATE_KWARGS)}}})

    @model_validator(mode="after")
    def _rendering(self):
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise FieldError("continue_final_message", "continue_final_message and add_generation_prompt "
                                 "cannot both be true (continuing the last message adds no generation prompt)")
            if self.messages[-1].role != "assistant":
                raise FieldError("continue_final_message", "continue_final_message needs the last message to be "
                                 f"an assistant message (it is {self.messages[-1].role!r})")
        for key in self.chat_template_kwargs or {}:
            if key in RESERVED_TEMPLATE_KWARGS:
                raise FieldError("chat_template_kwargs", f"chat_template_kwargs may not set {key!r} (a parameter "
                                 "of the template call itself, not a template variable)")
        return self

    def has_media(self) -> bool:
        """Whether a message holds an image, audio or video part (the model's processor renders those)."""
        return any(m.has_media() for m in self.messages)

    def generation_prompt(self) -> bool:
        return (not self.continue_final_message) if self.add_generation_prompt is None else self.add_generation_prompt


class ChatCompletionRequest(_ChatRendering, _Sampling):
    model_config = ConfigDict(extra="forbid", json_schema_extra=_field_dependencies)

    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tool_choice: Literal["none", "auto", "required"] | dict | None = None  # areno.engine.tool_calls.choice
    parallel_tool_calls: bool | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None  # a template variable
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted, changes nothing (no model here reads it)
    _plan: ToolPlan | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs requires logprobs=true")
        try:
            check_tool_choice(self.tool_dicts(), self.tool_choice)
        except ToolChoiceError as exc:
            raise FieldError(exc.field, str(exc)) from exc
        return self

    def tool_dicts(self) -> list[dict]:
        return [t.model_dump(exclude_none=True) for t in self.tools or ()]

    def plan_tools(self, fmt) -> ToolPlan:
        """The tools and tool_choice in the served tool-call format ``fmt`` (kept: ``tool_plan``); a 400 naming
        the field where they cannot be served."""
        try:
            self._plan = plan_tools(fmt, self.tool_dicts(), self.tool_choice)
        except ToolChoiceError as exc:
            raise APIError(400, str(exc), param=exc.field) from exc
        if self._plan.grammar is not None and super().grammar() is not None:
            raise APIError(400, "response_format and a constrained tool call (tool_choice required or a function, "
                           "strict tools) cannot both be given", param="response_format")
        return self._plan

    @property
    def tool_plan(self) -> ToolPlan:
        """The plan ``plan_tools`` made, or (not planned in a format yet) the tools and choice without a grammar."""
        return self._plan if self._plan is not None else ToolPlan(self.tool_dicts(), *choice_kind(self.tool_choice))

    def grammar(self) -> dict | None:
        """The tool-call grammar of the plan where it has one, else ``response_format``'s."""
        if self._plan is not None and self._plan.grammar is not None:
            return self._plan.grammar
        return super().grammar()


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(json_schema_extra={"anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
        {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
        {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
         "minItems": 1}]})
    # 0 with echo: score the prompt, generate nothing
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = Field(default=None, **_schema_only(maxLength=0))
    best_of: int | None = Field(default=None, **_schema_only(minimum=1, maximum=1))

    @model_validator(mode="after")
    def _unsupported_completion(self):
        if self.suffix:
            raise not_supported("suffix")
        if self.best_of not in (None, 1, self.n):
            raise not_supported("best_of", " (only best_of = n)")
        if isinstance(self.prompt, list) and not self.prompt:
            raise FieldError("prompt", "prompt must not be empty")
        if self.token_limit() == 0 and not self.echo:
            name = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
            raise FieldError(name, f"{name} = 0 generates nothing; it is only allowed with echo=true")
        return self


# ---- vLLM's /tokenize and /detokenize ----------------------------------------------------------------------------
class TokenizeCompletionRequest(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_ChatRendering):
    model: str | None = None
    add_special_tokens: bool = False  # the template writes the special tokens itself
    return_token_strs: bool = False
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[TokenId]


# ---- request bodies: JSON text -> a validated request, or an OpenAI-style 400 naming the field -------------------
# a JSON escape of a UTF-16 surrogate (\ud800-\udfff): the only way a valid UTF-8 body can yield a lone surrogate
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def load_json(raw: bytes) -> dict:
    """A request body as a JSON object, or an APIError saying what is wrong with it. CPU work proportional to the
    body: runs on the prep pool, never on the event loop."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, "the request body is not valid UTF-8") from exc
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise APIError(400, f"malformed JSON in the request body: {exc}") from exc
    except RecursionError as exc:
        raise APIError(400, "the request body is nested too deeply") from exc
    del text
    if not isinstance(obj, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:  # a \ud800-style escape decodes to a lone surrogate: not text the tokenizer (or UTF-8) can hold
        if SURROGATE_ESCAPE.search(raw):
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise APIError(400, "the request body holds a lone UTF-16 surrogate escape (not valid Unicode text)") from exc
    except RecursionError as exc:
        raise APIError(400, "the request body is nested too deeply") from exc
    return obj


def validate(obj: dict, model_cls):
    """``obj`` as ``model_cls``; the first problem as a 400 whose ``param`` names the field (for a check across
    fields too: its FieldError says which) and whose message has no "Value error," prefix."""
    try:
        return model_cls.model_validate(obj)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err.get("loc", ())) or None
        msg = err.get("msg", "invalid request")
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, FieldError):
            param = f"{param}.{cause.field}" if param else cause.field
            raise APIError(400, str(cause), param=param) from exc
        if err.get("type") == "extra_forbidden":
            msg = f"unsupported field: {param} (this server does not implement it)"
        elif err.get("type") == "value_error":
            msg = msg.removeprefix("Value error, ")
        raise APIError(400, f"{param}: {msg}" if param else msg, param=param) from exc


def parse(raw: bytes, model_cls):
    return validate(load_json(raw), model_cls)


class Notes:
    """Accepted request fields that change nothing here but would elsewhere: logged once per field."""

    def __init__(self, where: str = ""):
        self.seen: set[str] = set()
        self.where = where

    def __call__(self, field: str, why: str) -> None:
        if field not in self.seen:
            self.seen.add(field)
            log.info("request field %s accepted and ignored%s: %s (logged once)", field, self.where, why)
