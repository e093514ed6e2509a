"""What one request may cost the server: a cap on the body's size, checked as it arrives; a prompt too long for the
context refused without building its token list (by its length in characters, where the tokenizer bounds the bytes
a token covers); /tokenize's cap of a few contexts (``tokenize_cap``), refused the same way; and the memory a large
request used handed back to the OS afterwards.

Parsing and tokenisation themselves run on a small thread pool (``areno.serve.state``), so the event loop keeps
answering other requests (``/health`` too) while a large body is being handled.
"""

from __future__ import annotations

import ctypes
import json
import sys

from areno.serve.errors import APIError, error_response

DEFAULT_MAX_REQUEST_BYTES = 32 << 20  # ~8M tokens of JSON text: far above any context a served model has
TRIM_AFTER_BYTES = 256 << 10  # after a body this large, hand the freed memory back to the OS (a trim takes < 1 ms)


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than this server's limit of {limit} bytes "
                    f"(--max-request-bytes)", param=None, code="request_too_large")


class RequestBodyLimit:
    """Plain ASGI middleware: a body over ``limit`` bytes gets a 413 (OpenAI-shaped) without being buffered: at once
    when its Content-Length says so, else as soon as the bytes counted on arrival pass the limit (a chunked body has
    no Content-Length, and the count does not rely on the header), raised from ``receive`` into the route, whose
    APIError handler answers it. After a large body, ``on_large(size)`` runs (the app hands freed memory back to
    the OS there)."""

    def __init__(self, app, limit: int, on_large=None):
        self.app, self.limit, self.on_large = app, limit, on_large

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and length.strip().isdigit() and int(length) > self.limit:
            exc = body_too_large(self.limit)
            await error_response(exc)(scope, receive, send)
            return
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise body_too_large(self.limit)
            return message

        try:
            await self.app(scope, limited_receive, send)
        finally:
            if received >= TRIM_AFTER_BYTES and self.on_large is not None:
                await self.on_large(received)


def release_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc keeps them, per thread arena, after a large request's
    temporaries are freed); a no-op off glibc."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # musl or another libc: nothing to trim
        return
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim(0)


# pre-tokenizers that keep every byte of the text (Split and Punctuation drop what they match only when "Removed")
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Split", "Digits", "Punctuation"}


def max_bytes_per_token(tokenizer) -> int | None:
    """The most UTF-8 bytes of text one token can stand for, where the tokenizer's structure guarantees a bound:
    a byte-level BPE with no normaliser, whose pre-tokenizers drop nothing, whose byte alphabet is complete (no
    byte is ever dropped as unknown) and whose added tokens strip no whitespace. Then a text of ``c`` characters
    (at least ``c`` bytes) has at least ``c / bound`` tokens. None where that cannot be shown."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
    except Exception:  # an unusual backend: no bound
        return None
    if spec.get("normalizer") is not None or spec.get("truncation") is not None:
        return None
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if not any(s.get("type") == "ByteLevel" for s in steps):
        return None
    for s in steps:
        if s.get("type") not in _KEEPING_PRE_TOKENIZERS or s.get("behavior") == "Removed":
            return None
    model = spec.get("model") or {}
    vocab = model.get("vocab")
    if model.get("type") != "BPE" or not isinstance(vocab, dict) or not vocab:
        return None
    from tokenizers.pre_tokenizers import ByteLevel

    if not all(ch in vocab for ch in ByteLevel.alphabet()):  # a byte missing from it would be dropped, unseen
        return None
    bound = max(len(token) for token in vocab)  # one character of the byte alphabet per byte
    for added in spec.get("added_tokens") or []:
        if added.get("lstrip") or added.get("rstrip"):
            return None
        bound = max(bound, len(added.get("content", "").encode("utf-8")))
    return bound



def context_exceeded(what: str, max_model_len: int, param: str) -> APIError:
    return APIError(400, f"the prompt has {what}; this model's context is {max_model_len}", param=param,
                    code="context_length_exceeded")


TOKENIZE_CONTEXTS = 4  # /tokenize counts texts up to this many contexts long (a client measuring what to cut)


def tokenize_cap(max_model_len: int) -> int:
    """The most tokens ``/tokenize`` counts: a few contexts, so a client can measure a text it has to cut, while a
    30 MB body (millions of ids, a response three times its size) is refused before its id list is built."""
    return TOKENIZE_CONTEXTS * max_model_len


def over_tokenize_cap(what: str, max_model_len: int, param: str) -> APIError:
    return APIError(400, f"the text has {what}; /tokenize counts at most {tokenize_cap(max_model_len)} tokens "
                    f"({TOKENIZE_CONTEXTS} x this model's context of {max_model_len})", param=param,
                    code="context_length_exceeded")


class PromptEncoder:
    """``tokenizer.encode(text, add_special_tokens=False)`` for prompts, refusing one of ``limit`` tokens or more
    (default ``max_model_len``; ``refuse(what, max_model_len, param)`` builds the error) cheaply: by its length in
    characters where :func:`max_bytes_per_token` gives a bound (no tokenisation at all), else by the length of the
    fast tokenizer's encoding before its id list is built (a Python list of millions of ids takes the GIL, and so
    the event loop, for a noticeable time). Runs on a worker thread."""

    def __init__(self, tokenizer, max_model_len: int, *, limit: int | None = None, refuse=context_exceeded):
        self.tokenizer, self.max_model_len = tokenizer, max_model_len
        self.limit, self.refuse = limit or max_model_len, refuse
        self.bytes_per_token = max_bytes_per_token(tokenizer)
        backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
        # encode_batch_fast: the same ids without character offsets (less to build and to free)
        self.encode_batch = getattr(backend, "encode_batch_fast", None) or getattr(backend, "encode_batch", None)

    def __call__(self, text: str, param: str, *, add_special_tokens: bool = False) -> list[int]:
        limit = self.limit
        if self.bytes_per_token and len(text) > (limit - 1) * self.bytes_per_token:
            at_least = -(-len(text) // self.bytes_per_token)
            raise self.refuse(f"at least {at_least} tokens ({len(text)} characters)", self.max_model_len, param)
        if self.encode_batch is None:
            ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        else:  # what a fast tokenizer's encode() runs (encode_batch: unlike encode, it lets go of the GIL while it
            # works), with the length looked at before the ids become a list
            encoding = self.encode_batch([text], add_special_tokens=add_special_tokens)[0]
            if len(encoding) >= limit:
                raise self.refuse(f"{len(encoding)} tokens", self.max_model_len, param)
            ids = encoding.ids
        if len(ids) >= limit:
            raise self.refuse(f"{len(ids)} tokens", self.max_model_len, param)
        return ids
