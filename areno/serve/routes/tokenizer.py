"""vLLM's tokenizer endpoints: ``POST /tokenize`` (``prompt`` or ``messages`` -> ``{"count", "max_model_len",
"tokens", "token_strs"}``), ``POST /detokenize`` (``tokens`` -> ``{"prompt"}``) and ``GET /tokenizer_info`` (what
lm-evaluation-harness's remote tokenizer reads: special tokens, the chat template, the context length)."""

from __future__ import annotations

import json

from fastapi import Request
from fastapi.responses import Response

from areno.serve.bodies import request_body
from areno.serve.errors import APIError
from areno.serve.protocol import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    load_json,
    parse,
    validate,
)
from areno.serve.render import render_chat
from areno.serve.state import ServeState


def tokenizer_info(tokenizer, max_model_len: int) -> dict:
    """``GET /tokenizer_info``: the tokenizer's class, special tokens (text and id), added tokens, context length
    and chat template."""
    info: dict = {"tokenizer_class": type(tokenizer).__name__}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token"):
        value = getattr(tokenizer, name, None)
        info[name] = None if value is None else str(value)
        token_id = getattr(tokenizer, f"{name}_id", None)
        info[f"{name}_id"] = token_id if isinstance(token_id, int) else None
    info["all_special_tokens"] = [str(t) for t in getattr(tokenizer, "all_special_tokens", [])]
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    info["added_tokens_decoder"] = {str(i): {"content": str(t.content), "special": bool(t.special)}
                                    for i, t in sorted(added.items())}
    info["vocab_size"] = len(tokenizer)
    info["model_max_length"] = info["max_model_len"] = max_model_len
    template = getattr(tokenizer, "chat_template", None)
    info["chat_template"] = template if isinstance(template, (str, dict)) or template is None else str(template)
    return info


def tokenize(state: ServeState, raw: bytes) -> dict | TokenizeChatRequest:
    """Messages are counted as the chat route counts them: media parts through the model's processor (their
    placeholders expanded to the image tokens) when the server has one. A text of more than ``tokenize_cap``
    tokens (a few contexts) is a 400, refused before its id list is built. On the prep pool. A request with media
parts comes back as it is: ``tokenize_route`` decodes its images within the pixel budget."""
    tokenizer = state.tokenizer
    obj = load_json(raw)
    chat = "messages" in obj
    req = validate(obj, TokenizeChatRequest if chat else TokenizeCompletionRequest)
    if req.model is not None:
        state.check_model(req.model)
    if chat and req.has_media() and state.media is not None:
        return req
    text = render_chat(tokenizer, req) if chat else req.prompt
    ids = state.tokenize_encoder(text, "messages" if chat else "prompt", add_special_tokens=req.add_special_tokens)
    return tokenized(state, req, ids)


def tokenized(state: ServeState, req, ids: list[int]) -> dict:
    return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids,
            "token_strs": state.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None}


def detokenize(state: ServeState, raw: bytes) -> dict:
    req = parse(raw, DetokenizeRequest)
    if req.model is not None:
        state.check_model(req.model)
    if any(t >= state.vocab for t in req.tokens):
        raise APIError(400, f"tokens must be ids in [0, {state.vocab})", param="tokens")
    return {"prompt": state.tokenizer.decode(req.tokens)}


def json_bytes(obj) -> bytes:
    """``obj`` as the JSON a route's dict becomes (Starlette's layout), built on the prep pool: FastAPI would
    encode a returned dict on the event loop, where a long token list stalls every other request."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


def json_response(obj) -> Response:
    return Response(json_bytes(obj), media_type="application/json")


def tokenize_response(state: ServeState, raw: bytes) -> Response | TokenizeChatRequest:
    out = tokenize(state, raw)
    return out if isinstance(out, TokenizeChatRequest) else json_response(out)


def tokenized_response(state: ServeState, req, ids: list[int]) -> Response:
    return json_response(tokenized(state, req, ids))


async def tokenize_route(request: Request):
    state: ServeState = request.app.state.serve
    out = await state.prep(tokenize_response, state, await request.body())
    if isinstance(out, Response):
        return out
    mm = await state.media.encode(out, state.prep)  # images: within the pixel budget
    return await state.prep(tokenized_response, state, out, mm.input_ids)


async def detokenize_route(request: Request):
    state: ServeState = request.app.state.serve
    return await state.prep(detokenize, state, await request.body())


async def tokenizer_info_route(request: Request):
    state: ServeState = request.app.state.serve
    return tokenizer_info(state.tokenizer, state.max_model_len)


def add_tokenizer_routes(app, state: ServeState) -> None:
    """Register /tokenize, /detokenize and /tokenizer_info on ``app``."""
    vocab = state.vocab
    app.add_api_route("/tokenize", tokenize_route, methods=["POST"],
                      openapi_extra=request_body(TokenizeCompletionRequest, TokenizeChatRequest, vocab=vocab))
    app.add_api_route("/detokenize", detokenize_route, methods=["POST"],
                      openapi_extra=request_body(DetokenizeRequest, vocab=vocab))
    app.add_api_route("/tokenizer_info", tokenizer_info_route, methods=["GET"])
