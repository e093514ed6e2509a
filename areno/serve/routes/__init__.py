"""The server's routes, one module per family: ``info`` (health, version, models, metrics), ``tokenizer`` (vLLM's
tokenize / detokenize / tokenizer_info), ``chat`` and ``completions``. Each reads the shared ``ServeState`` from
``request.app.state.serve``."""

from __future__ import annotations

from areno.serve.lora import add_lora_routes
from areno.serve.routes.chat import add_chat_routes
from areno.serve.routes.completions import add_completion_routes
from areno.serve.routes.info import add_info_routes
from areno.serve.routes.tokenizer import add_tokenizer_routes


def add_routes(app, state) -> None:
    """Every route on ``app``, in the order the OpenAPI document lists them."""
    for add in (add_info_routes, add_tokenizer_routes, add_chat_routes, add_completion_routes, add_lora_routes):
        add(app, state)
