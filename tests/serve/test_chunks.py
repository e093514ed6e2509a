"""The chunk writer both streams share, on its own: the per-token template writes the same JSON as the general
chunk, usage rides in every chunk only with continuous_usage_stats, the end is the usage chunk (when asked) and
[DONE], and a failing stream ends with an error chunk after aborting its engine requests."""

import asyncio
import json
from types import SimpleNamespace

import pytest

from areno.serve.chunks import DONE, ChunkWriter, EventBatches, json_str


def options(include_usage=False, continuous=False):
    return SimpleNamespace(include_usage=include_usage, continuous_usage_stats=continuous)


def data(text: str) -> dict:
    assert text.startswith("data: ") and text.endswith("\n\n")
    return json.loads(text[len("data: "):])


@pytest.mark.parametrize("text", ["plain", 'quote " and \\ and \n', "ünïcödé ✓"])
def test_the_template_chunk_is_the_general_chunk(text):
    w = ChunkWriter("chatcmpl-1", "chat.completion.chunk", 123, 'm"odel', 7, None)
    fast = w.plain(2, f'"delta":{{"content":{json_str(text)}}},"finish_reason":null,"logprobs":null')
    slow = w.chunk({"index": 2, "delta": {"content": text}, "finish_reason": None, "logprobs": None})
    assert data(fast) == data(slow)
    assert data(slow) == {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 123, "model": 'm"odel',
                          "choices": [{"index": 2, "delta": {"content": text}, "finish_reason": None,
                                       "logprobs": None}]}


def test_usage_in_every_chunk_only_when_continuous_and_the_end():
    w = ChunkWriter("cmpl-1", "text_completion", 1, "m", 5, options(include_usage=True))
    w.completion_tokens = 3
    assert "usage" not in data(w.chunk({"index": 0, "text": "a"}))
    *usage, done = w.end()
    assert done == DONE and data(usage[0])["usage"] == {"prompt_tokens": 5, "completion_tokens": 3,
                                                       "total_tokens": 8}
    assert data(usage[0])["choices"] == []
    w = ChunkWriter("cmpl-1", "text_completion", 1, "m", 5, options(include_usage=True, continuous=True))
    w.completion_tokens = 1
    assert data(w.chunk({"index": 0, "text": "a"}))["usage"]["completion_tokens"] == 1
    assert ChunkWriter("c", "text_completion", 1, "m", 5, None).end() == [DONE]


class Stream:
    def __init__(self, events, fail=None):
        self.events, self.fail, self.aborted = list(events), fail, False

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for ev in self.events:
            yield ev
        if self.fail:
            raise self.fail

    def pending(self):
        return []

    def abort(self):
        self.aborted = True


def test_a_failure_ends_with_an_error_chunk_and_aborts():
    async def run():
        stream = Stream([])
        w = ChunkWriter("c", "text_completion", 1, "m", 1, None)

        async def chunks():
            yield "first"
            raise RuntimeError("boom")

        return [t async for t in w.stream(chunks(), [stream])], stream

    out, stream = asyncio.run(run())
    assert out[0] == "first" and data(out[1])["error"]["message"] == "boom" and DONE not in out
    assert stream.aborted


def test_event_batches_merge_several_streams_and_pass_errors_on():
    async def run():
        batches = EventBatches([Stream(["a", "b"]), Stream(["c"], fail=ValueError("bad"))])
        try:
            return [pair for batch in [b async for b in batches] for pair in batch]
        finally:
            batches.close()

    got = asyncio.run(run())
    assert sorted((i, str(ev)) for i, ev in got) == [(0, "a"), (0, "b"), (1, "bad"), (1, "c")]
