"""Chat requests with media parts (``image_url``, ``input_audio``, ``audio_url``, ``video_url``).

The messages keep their parts (the shared schema of ``areno.models.multimodal``) and go through the checkpoint's
``MultimodalProcessor``, the path datasets and rollout take, into a ``MultimodalPrompt`` (token ids with each image's
placeholders expanded, pixel rows, M-RoPE positions) that the engine takes with the request (``submit(..., mm=)``).
It runs on the server's prep threads; the processor is built on the first such request. Only data URLs are accepted
(no local paths, no fetching). Every refusal (a modality the model lacks, audio to a vision model, a remote URL, an
undecodable or oversized image) is an HTTP 400 naming ``messages``.

What decoding may cost: each image's size is read from its header before anything is decoded, and a request whose
images hold more than ``--max-request-pixels`` in all gets a 400 naming the flag. Decoding then waits, on the event
loop (no thread held), for its share of a server-wide ``PixelBudget``: that many pixels decoded at once (the memory)
and ``PIXELS_PER_SECOND_PER_CAP`` times that a second (the CPU); a request not started within ``DECODE_WAIT_S``
gets a 429.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import threading
import time

from areno.serve.errors import APIError
from areno.serve.render import chat_messages, template_kwargs

PIXELS_PER_SECOND_PER_CAP = 2  # pixels decoded per second, in --max-request-pixels
DECODE_WAIT_S = 10.0  # longest a request waits for the pixel budget before its 429


class PixelBudget:
    """Decoded pixels across the server: at most ``in_flight`` at once and ``per_second`` a second (a token bucket
    holding one second's worth). ``hold(pixels)`` waits on the event loop for both, up to ``max_wait_s``."""

    def __init__(self, in_flight: int, per_second: int, max_wait_s: float = DECODE_WAIT_S):
        self.in_flight, self.per_second, self.max_wait_s = in_flight, per_second, max_wait_s
        self.used, self.tokens, self.stamp = 0, float(per_second), time.monotonic()

    def _take(self, pixels: int) -> bool:
        now = time.monotonic()
        self.tokens = min(float(self.per_second), self.tokens + (now - self.stamp) * self.per_second)
        self.stamp = now
        if self.used + pixels > self.in_flight or self.tokens < pixels:
            return False
        self.used += pixels
        self.tokens -= pixels
        return True

    @contextlib.asynccontextmanager
    async def hold(self, pixels: int):
        deadline = time.monotonic() + self.max_wait_s
        while not self._take(pixels):
            left = deadline - time.monotonic()
            if left <= 0:
                raise APIError(429, f"image decoding is at this server's capacity ({self.in_flight} pixels at once, "
                               f"{self.per_second} a second; --max-request-pixels): retry later", param="messages",
                               type="rate_limit_error", code="image_decode_capacity")  # fmt: skip
            await asyncio.sleep(min(left, 0.02))
        try:
            yield
        finally:
            self.used -= pixels


def _image_url(part: dict):
    """The URL of an image part (``image_url`` or transformers' ``image``), None where it has none."""
    value = part.get("image_url") if part.get("type") == "image_url" else (part.get("image") or part.get("url"))
    url = value.get("url") if isinstance(value, dict) else value
    return url if isinstance(url, str) else None


def declared_pixels(messages, limits) -> int:
    """The pixels the messages' images declare in their headers (nothing decoded). Undecodable images count 0:
    the processor names them."""
    from PIL import Image

    from areno.models.multimodal import media_parts, read_image_bytes

    total = 0
    for _, modality, part in media_parts(messages):
        url = _image_url(part) if modality == "image" else None
        if url is None:
            continue
        data = read_image_bytes(url, allow_paths=False, limits=limits)
        try:
            with Image.open(io.BytesIO(data)) as image:
                total += image.width * image.height
        except Exception:  # noqa: BLE001 - PIL raises several types; decode_image reports them by name
            continue
    return total


class ChatMedia:
    def __init__(self, model_path, limits=None, *, max_request_pixels: int = 50_000_000):
        self.model_path, self.limits, self.max_request_pixels = model_path, limits, max_request_pixels
        self.budget = PixelBudget(max_request_pixels, PIXELS_PER_SECOND_PER_CAP * max_request_pixels)
        self._processor = None
        self._lock = threading.Lock()

    @property
    def processor(self):
        with self._lock:
            if self._processor is None:
                from areno.models.multimodal import MultimodalProcessor

                self._processor = MultimodalProcessor.from_pretrained(self.model_path, limits=self.limits)
            return self._processor

    def measure(self, req) -> tuple[list, int]:
        """(the request's messages, the pixels its images declare), or a 400 over --max-request-pixels. On the
        prep pool."""
        from areno.models.multimodal import MediaError

        messages = chat_messages(req, media=True)
        try:
            self.processor.check(messages)
            pixels = declared_pixels(messages, self.processor.limits)
        except MediaError as exc:
            raise APIError(400, str(exc), param="messages") from exc
        if pixels > self.max_request_pixels:
            raise APIError(400, f"the request's images hold {pixels} pixels, over this server's cap of "
                           f"{self.max_request_pixels} per request (--max-request-pixels)", param="messages",
                           code="too_many_pixels")  # fmt: skip
        return messages, pixels

    def _encode(self, req, messages):
        from areno.models.multimodal import MediaError

        try:
            return self.processor.encode(messages, add_generation_prompt=req.generation_prompt(), allow_paths=False,
                                         **template_kwargs(req))  # fmt: skip
        except MediaError as exc:
            raise APIError(400, str(exc), param="messages") from exc
        except Exception as exc:  # the chat template failed on these messages
            raise APIError(400, f"messages could not be rendered with the chat template: {exc}",
                           param="messages") from exc

    async def encode(self, req, prep):
        """A chat request with media parts -> its ``MultimodalPrompt`` (or an ``APIError``): measured, then decoded
        within the pixel budget, both on the prep pool (``prep(fn, *args)``)."""
        messages, pixels = await prep(self.measure, req)
        async with self.budget.hold(pixels):
            return await prep(self._encode, req, messages)
