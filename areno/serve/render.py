"""The prompt side of the server: chat messages rendered through the checkpoint's template (shared by chat
completions, /tokenize and the media path, ``areno.serve.media``)."""

from __future__ import annotations

import json

from areno.serve.errors import APIError


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
    """The chat template's arguments besides the messages and ``add_generation_prompt`` (no tools with
    ``tool_choice`` "none")."""
    kwargs = dict(req.chat_template_kwargs or {})
    if getattr(req, "reasoning_effort", None) is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    if getattr(req, "tool_choice", None) == "none":  # tools hidden: the model is not to call any
        tools = None
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
