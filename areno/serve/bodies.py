"""Request bodies: JSON text -> a validated pydantic request, or an OpenAI-style 400 naming the field; and each
route's body schema for the OpenAPI document (the routes parse bodies themselves, so FastAPI cannot infer it)."""

from __future__ import annotations

import json
import logging
import re

from pydantic import ValidationError

from areno.serve.errors import APIError
from areno.serve.protocol import FieldError

log = logging.getLogger("areno.serve")

# a JSON escape of a UTF-16 surrogate (\ud800-\udfff): the only way a valid UTF-8 body can yield a lone surrogate
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
TOKEN_ID_FIELDS = ("prompt", "tokens", "stop_token_ids")  # integers >= 0 there are token ids (< the vocabulary)


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
        if _SURROGATE_ESCAPE.search(raw):
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


def _inline_refs(node, defs):
    if isinstance(node, dict):
        if "$ref" in node:
            return _inline_refs(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
        return {k: _inline_refs(v, defs) for k, v in node.items() if k != "$defs"}
    if isinstance(node, list):
        return [_inline_refs(v, defs) for v in node]
    return node


def _bound_token_ids(node, vocab: int):
    if isinstance(node, dict):
        if node.get("type") == "integer" and node.get("minimum") == 0:
            node["maximum"] = vocab - 1
        for v in node.values():
            _bound_token_ids(v, vocab)
    elif isinstance(node, list):
        for v in node:
            _bound_token_ids(v, vocab)


def _schema(model_cls, vocab: int | None) -> dict:
    schema = model_cls.model_json_schema()
    if vocab is not None:
        for name in TOKEN_ID_FIELDS:
            if name in schema.get("properties", {}):
                _bound_token_ids(schema["properties"][name], vocab)
    return _inline_refs(schema, schema.get("$defs", {}))


def request_body(*model_classes, vocab: int | None = None) -> dict:
    """``openapi_extra`` describing a route's JSON body by its pydantic model(s) (several: any one of them).
    References are inlined: the models are not recursive, and the schema then stands alone under the route.
    ``vocab`` bounds the token ids of a prompt, of ``tokens`` and of ``stop_token_ids``."""
    schemas = [_schema(cls, vocab) for cls in model_classes]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


class Notes:
    """Accepted request fields that change nothing here but would elsewhere: logged once per field."""

    def __init__(self, where: str = ""):
        self.seen: set[str] = set()
        self.where = where

    def __call__(self, field: str, why: str) -> None:
        if field not in self.seen:
            self.seen.add(field)
            log.info("request field %s accepted and ignored%s: %s (logged once)", field, self.where, why)
