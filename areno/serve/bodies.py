"""Each route's body schema for the OpenAPI document, from its pydantic request model(s): the routes parse bodies
themselves (``areno.serve.protocol.parse``), so FastAPI cannot infer it; and ``json_body``, a request's body once
its Content-Type says JSON (415 otherwise)."""

from __future__ import annotations

from areno.serve.errors import APIError


def is_json_type(content_type: str | None) -> bool:
    """Whether a Content-Type header names JSON (``application/json``, ``*/*+json``, parameters allowed); a request
    without one is taken as JSON, as FastAPI takes it."""
    if not content_type:
        return True
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


async def json_body(request) -> bytes:
    """The body of a JSON POST; another Content-Type (``text/plain``, a form) is a 415 naming it."""
    content_type = request.headers.get("content-type")
    if not is_json_type(content_type):
        raise APIError(415, f"Content-Type must be application/json, got {content_type!r}",
                       type="invalid_request_error", param="Content-Type")
    return await request.body()

TOKEN_ID_FIELDS = ("prompt", "tokens", "stop_token_ids")  # integers >= 0 there are token ids (< the vocabulary)


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
