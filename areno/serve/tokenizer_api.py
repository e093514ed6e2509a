"""The prompt side of the server: chat rendering through the checkpoint's template (shared by chat completions
and /tokenize), and vLLM's tokenizer endpoints: ``POST /tokenize`` (``prompt`` or ``messages`` -> ``{"count",
"max_model_len", "tokens", "token_strs"}``), ``POST /detokenize`` (``tokens`` -> ``{"prompt"}``) and
``GET /tokenizer_info`` (what lm-evaluation-harness's remote tokenizer reads: special tokens, the chat template,
the context length)."""

from __future__ import annotations

import json

from fastapi import Request

from areno.serve.bodies import load_json, parse, request_body, validate
from areno.serve.protocol import APIError, DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest


def tool_arguments(args):
    """An assistant tool call's arguments for the chat template: a JSON-object string becomes the object."""
    if not isinstance(args, str) or not args.strip().startswith("{"):
        return args
    try:
        return json.loads(args)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise APIError(400, f"a tool call's arguments are not valid JSON: {exc}",
                       param="messages.tool_calls.function.arguments") from exc


def chat_messages(req, *, media: bool = False) -> list[dict]:
    """A chat request's messages as chat-template dicts; ``media``: list contents keep their parts (the shared
    schema's dicts, for ``MultimodalProcessor``), else they become their text."""
    messages = []
    for m in req.messages:
        content = [p.model_dump(exclude_none=True) for p in m.content] if media and m.has_media() else m.text() or ""
        msg = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.tool_calls:
            msg["tool_calls"] = [{"type": "function", "id": c.id, "function": {
                "name": c.function.name, "arguments": tool_arguments(c.function.arguments)}}
                for c in m.tool_calls]
        if m.name:
            msg["name"] = m.name
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        if m.reasoning_content:
            msg["reasoning_content"] = m.reasoning_content
        messages.append(msg)
    return messages


def template_kwargs(req) -> dict:
    """The chat template's arguments besides the messages and ``add_generation_prompt``."""
    kwargs = dict(req.chat_template_kwargs or {})
    if getattr(req, "reasoning_effort", None) is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    return dict(tools=tools, continue_final_message=req.continue_final_message, **kwargs)


def render_chat(tokenizer, req) -> str:
    """The prompt text of a chat request (``ChatCompletionRequest`` or ``TokenizeChatRequest``) without media parts:
    its messages and tools through the chat template, with ``add_generation_prompt``, ``continue_final_message``
    (the last assistant message left open, to be continued), ``chat_template_kwargs`` and ``reasoning_effort`` as
    template variables. Media parts go through ``areno.serve.media.ChatMedia`` instead."""
    if req.has_media():
        raise APIError(400, "messages with image, audio or video parts need the model's processor", param="messages")
    try:
        return tokenizer.apply_chat_template(chat_messages(req), add_generation_prompt=req.generation_prompt(),
                                             tokenize=False, **template_kwargs(req))
    except Exception as exc:
        raise APIError(400, f"messages could not be rendered with the chat template: {exc}",
                       param="messages") from exc


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


def add_tokenizer_routes(app, tokenizer, *, prep, check_model, max_model_len: int, media=None):
    """Register /tokenize, /detokenize and /tokenizer_info on ``app``. ``prep(fn, *args)`` runs CPU work off the
    event loop, ``check_model(name)`` refuses another model's name, ``media`` (``ChatMedia``) renders messages with
    media parts (their placeholders expanded to the image tokens, as the chat route counts them)."""
    vocab = len(tokenizer)
    info = tokenizer_info(tokenizer, max_model_len)

    def token_strs(ids):
        return tokenizer.convert_ids_to_tokens(ids)

    def tokenize(raw: bytes) -> dict:
        obj = load_json(raw)
        chat = "messages" in obj
        req = validate(obj, TokenizeChatRequest if chat else TokenizeCompletionRequest)
        if req.model is not None:
            check_model(req.model)
        if chat and req.has_media() and media is not None:
            ids = media.encode(req).input_ids
        else:
            text = render_chat(tokenizer, req) if chat else req.prompt
            ids = tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
                "token_strs": token_strs(ids) if req.return_token_strs else None}

    def detokenize(raw: bytes) -> dict:
        req = parse(raw, DetokenizeRequest)
        if req.model is not None:
            check_model(req.model)
        if any(t >= vocab for t in req.tokens):
            raise APIError(400, f"tokens must be ids in [0, {vocab})", param="tokens")
        return {"prompt": tokenizer.decode(req.tokens)}

    @app.post("/tokenize", openapi_extra=request_body(TokenizeCompletionRequest, TokenizeChatRequest, vocab=vocab))
    async def tokenize_route(request: Request):
        return await prep(tokenize, await request.body())

    @app.post("/detokenize", openapi_extra=request_body(DetokenizeRequest, vocab=vocab))
    async def detokenize_route(request: Request):
        return await prep(detokenize, await request.body())

    @app.get("/tokenizer_info")
    async def tokenizer_info_route():
        return info
