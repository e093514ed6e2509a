"""Chat requests with media parts (``image_url``, ``input_audio``, ``audio_url``, ``video_url``).

The messages keep their parts (the shared schema of ``areno.models.multimodal``) and go through the checkpoint's
``MultimodalProcessor``, the path datasets and rollout take, into a ``MultimodalPrompt`` (token ids with each image's
placeholders expanded, pixel rows, M-RoPE positions) that the engine takes with the request (``submit(..., mm=)``).
It runs on the server's prep threads; the processor is built on the first such request. Only data URLs are accepted
(no local paths, no fetching). Every refusal (a modality the model lacks, audio to a vision model, a remote URL, an
undecodable or oversized image) is an HTTP 400 naming ``messages``.
"""

from __future__ import annotations

import threading

from areno.serve.errors import APIError
from areno.serve.render import chat_messages, template_kwargs


class ChatMedia:
    def __init__(self, model_path, limits=None):
        self.model_path, self.limits = model_path, limits
        self._processor = None
        self._lock = threading.Lock()

    @property
    def processor(self):
        with self._lock:
            if self._processor is None:
                from areno.models.multimodal import MultimodalProcessor

                self._processor = MultimodalProcessor.from_pretrained(self.model_path, limits=self.limits)
            return self._processor

    def encode(self, req):
        """A chat request with media parts -> its ``MultimodalPrompt`` (or an ``APIError`` 400)."""
        from areno.models.multimodal import MediaError

        try:
            return self.processor.encode(chat_messages(req, media=True), add_generation_prompt=req.generation_prompt(),
                                         allow_paths=False, **template_kwargs(req))  # fmt: skip
        except MediaError as exc:
            raise APIError(400, str(exc), param="messages") from exc
        except Exception as exc:  # the chat template failed on these messages
            raise APIError(400, f"messages could not be rendered with the chat template: {exc}",
                           param="messages") from exc
