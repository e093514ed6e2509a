"""The pieces of a generation response shared by chat and text completions: ``usage``, server-sent-event framing,
and ``ChunkWriter``, which writes one stream's chunks (the constant chunk prefix of the per-token path, usage in
every chunk with ``continuous_usage_stats``, the final usage chunk and ``[DONE]``) and runs the stream to its end
(``ChunkWriter.stream``: an error chunk on a failure, the engine requests aborted however it ends)."""

from __future__ import annotations

import asyncio
import json

from areno.serve.errors import APIError

json_str = json.encoder.encode_basestring  # a str as a JSON string (C), as json.dumps(ensure_ascii=False) writes it
DONE = "data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class ChunkWriter:
    """One stream's chunks: ``{"id", "object", "created", "model", "choices": [choice]}`` (+ ``usage`` so far with
    ``continuous_usage_stats``). ``completion_tokens`` is counted by the caller as tokens are sent."""

    def __init__(self, rid: str, kind: str, created: int, model: str, prompt_tokens: int, stream_options):
        self.head = {"id": rid, "object": kind, "created": created, "model": model}
        self.prompt_tokens, self.completion_tokens = prompt_tokens, 0
        so = stream_options
        self.final_usage = bool(so and so.include_usage)
        self.every = bool(so and so.include_usage and so.continuous_usage_stats)  # usage in every chunk
        # the constant start of each chunk, up to the choice's index: the common chunk (text only) is then a few
        # string joins (the per-token path: no dict, no json.dumps of the whole body)
        self.prefix = (f'data: {{"id":{json_str(rid)},"object":"{kind}","created":{created},"model":{json_str(model)},'
                       f'"choices":[{{"index":')

    def usage(self) -> dict:
        return usage(self.prompt_tokens, self.completion_tokens)

    def chunk(self, choice: dict) -> str:
        body = {**self.head, "choices": [choice]}
        if self.every:
            body["usage"] = self.usage()
        return sse(body)

    def plain(self, index: int, fields: str) -> str:
        """The per-token chunk from a template: ``fields`` is the choice's JSON after its index, without braces."""
        return f"{self.prefix}{index},{fields}}}]}}\n\n"

    @staticmethod
    def error(exc: Exception) -> str:
        return sse(APIError(400, str(exc)).body())

    def end(self) -> list[str]:
        """The last chunks: usage (``stream_options.include_usage``), then ``[DONE]``."""
        tail = [sse({**self.head, "choices": [], "usage": self.usage()})] if self.final_usage else []
        return [*tail, DONE]

    async def stream(self, chunks, streams):
        """``chunks`` (an async generator of SSE text), then the end; a failure on the way becomes an error chunk.
        The engine ``streams`` are aborted however it ends (a client gone included)."""
        try:
            async for text in chunks:
                yield text
            for text in self.end():
                yield text
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as exc:
            _abort(streams)
            yield self.error(exc)
        finally:
            _abort(streams)
            await chunks.aclose()


def _abort(streams) -> None:
    for s in streams:
        s.abort()


class EventBatches:
    """The events of several engine streams as batches of (stream index, event or exception): everything queued
    at the time, so a client far behind gets one chunk per sample. One stream is read directly; several through a
    pump task each, merged. ``close()`` cancels the pumps."""

    def __init__(self, streams):
        self.streams = streams
        self.merged: asyncio.Queue = asyncio.Queue()
        self.tasks = ([asyncio.create_task(self._pump(i, s)) for i, s in enumerate(streams)]
                      if len(streams) > 1 else [])

    async def _pump(self, index: int, stream) -> None:
        try:
            async for ev in stream:
                self.merged.put_nowait([(index, ev), *((index, e) for e in stream.pending())])
        except Exception as exc:
            self.merged.put_nowait([(index, exc)])
        self.merged.put_nowait([(index, None)])

    async def __aiter__(self):
        if len(self.streams) == 1:
            stream = self.streams[0]
            try:
                async for ev in stream:
                    yield [(0, ev), *((0, e) for e in stream.pending())]
            except Exception as exc:
                yield [(0, exc)]
            return
        live = len(self.streams)
        while live:
            batch = await self.merged.get()
            while not self.merged.empty():
                batch += self.merged.get_nowait()
            live -= sum(ev is None for _, ev in batch)
            yield [(i, ev) for i, ev in batch if ev is not None]

    def close(self) -> None:
        for t in self.tasks:
            t.cancel()
