"""What the routes of one server share (``ServeState``, at ``app.state.serve``): the engine, the tokenizer, the
served model's name and context, the request limits, the metrics, the once-per-field notes, and the small thread
pool that parses, renders and tokenises request bodies off the event loop."""

from __future__ import annotations

import asyncio
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from areno.engine.tool_calls import DEFAULT_FORMAT, FORMATS, ToolFormat, special_tokens
from areno.serve.errors import APIError
from areno.serve.limits import PromptEncoder, over_tokenize_cap, release_memory, tokenize_cap
from areno.serve.lora import adapter_for
from areno.serve.metrics import ServeMetrics
from areno.serve.protocol import Notes
from areno.serve.text import Detokenizer

PREP_THREADS = max(2, min(4, os.cpu_count() or 1))  # request parsing and tokenisation, off the event loop


@dataclass
class ServeState:
    engine: Any  # an AsyncEngine or a ReplicaPool
    tokenizer: Any
    model_name: str
    max_model_len: int
    max_running: int  # --max-running-prompts: the most samples (n) one request may ask for
    media: Any = None  # a ChatMedia for chat messages with image/audio/video parts (without one they get a 400)
    tool_format: ToolFormat | None = None  # how tool calls are read from answers (--tool-call-format; None: qwen3)
    loras: Any = None  # the LoRA adapters served (areno.serve.lora.ServedAdapters); None: no LoRA slots
    prompt_encoder: PromptEncoder = field(init=False)
    tokenize_encoder: PromptEncoder = field(init=False)  # /tokenize: up to tokenize_cap tokens
    metrics: ServeMetrics = field(init=False)
    notes: Notes = field(init=False, default_factory=Notes)
    prep_pool: ThreadPoolExecutor = field(init=False)
    vocab: int = field(init=False)
    template_text: str = field(init=False)  # the chat template as text (which variables it reads)
    special_tokens: tuple[str, ...] = field(init=False)  # what skip_special_tokens drops (a format's text keeps them)

    def __post_init__(self):
        self.tool_format = self.tool_format or FORMATS[DEFAULT_FORMAT]
        self.prompt_encoder = PromptEncoder(self.tokenizer, self.max_model_len)
        self.tokenize_encoder = PromptEncoder(self.tokenizer, self.max_model_len,
                                              limit=tokenize_cap(self.max_model_len) + 1, refuse=over_tokenize_cap)
        self.metrics = ServeMetrics(self.model_name)
        # parsing, chat-template rendering and tokenisation: a few threads, so a large body never stalls the loop
        self.prep_pool = ThreadPoolExecutor(max_workers=PREP_THREADS, thread_name_prefix="areno-prep")
        self.vocab = len(self.tokenizer)
        template = getattr(self.tokenizer, "chat_template", None)
        self.template_text = template if isinstance(template, str) else json.dumps(template)
        self.special_tokens = special_tokens(self.tokenizer)

    async def prep(self, fn, *args):
        """``fn(*args)`` on the prep pool."""
        return await asyncio.get_running_loop().run_in_executor(self.prep_pool, fn, *args)

    async def after_large_request(self, size: int) -> None:
        """Hand the memory a large body used back to the OS (``RequestBodyLimit``'s ``on_large``)."""
        try:
            await self.prep(release_memory)
        except RuntimeError:  # the pool is shut down: the server is stopping anyway
            pass

    async def close(self) -> None:
        """After uvicorn has drained (or given up on) the connections: abort what is left, stop the engine thread,
        the prep pool."""
        await asyncio.to_thread(self.engine.shutdown, drain=False)
        self.prep_pool.shutdown(wait=False, cancel_futures=True)

    def check_model(self, name: str) -> None:
        if self.loras is not None:
            adapter_for(self, name)
        elif name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{self.model_name}`",
                           param="model", code="model_not_found")

    def served_name(self, name: str) -> str:
        """The name a response echoes in ``model`` for a request's (checked) ``model``: the LoRA adapter's name when
        it names one (as vLLM), else the served model's."""
        return name if self.loras is not None and name in self.loras.adapters else self.model_name

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "areno", "root": self.model_name,
                "parent": None, "max_model_len": self.max_model_len}

    def model_cards(self) -> list[dict]:
        """The base model's card, then each LoRA adapter's (``parent``: its base, as vLLM)."""
        return [self.model_card(), *(self.loras.cards(self.max_model_len) if self.loras is not None else [])]

    def token_namer(self, req):
        """How log-probs name a token: its text, or ``token_id:<id>`` (vLLM's return_tokens_as_token_ids)."""
        if req.return_tokens_as_token_ids:
            return lambda i: f"token_id:{i}"
        decode = self.tokenizer.decode
        return lambda i: decode([i])

    def tool_text(self, req, ids: list[int], stop_text: str | None, finish: str | None) -> str:
        """An answer's text as the tool-call format reads it: with the special tokens when its markers are some."""
        if not self.tool_format.special_markup:
            d = self.detokenizer(req)
        else:
            d = Detokenizer(self.tokenizer, req.stop_list(), skip_special_tokens=False,
                            include_stop=req.include_stop_str_in_output)
        d.ids = ids
        return d.final_text(stop_text, finish)

    def detokenizer(self, req) -> Detokenizer:
        return Detokenizer(self.tokenizer, req.stop_list(), skip_special_tokens=req.skip_special_tokens,
                           include_stop=req.include_stop_str_in_output)
