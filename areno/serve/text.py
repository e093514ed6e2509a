"""Token ids -> the text a response carries: the streaming detokenizer, where a stop ends the text, and each
token's offset in that text (``text_offset`` of completion log-probs)."""

from __future__ import annotations


def decoder(tokenizer, skip_special_tokens: bool):
    """``ids -> tokenizer.decode(ids, skip_special_tokens=...)``; for a plain fast tokenizer that cleans up no spaces
    (what that decode then is), one direct call into the Rust tokenizer: several times cheaper per call, and the
    streaming detokenizer makes two calls per chunk of every stream."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: the tokenizer's own decode
        TokenizersBackend = PreTrainedTokenizerBase = None
    cls = type(tokenizer)
    backend = getattr(tokenizer, "_tokenizer", None)
    if (TokenizersBackend is not None and isinstance(tokenizer, TokenizersBackend) and backend is not None
            and cls._decode is TokenizersBackend._decode and cls.decode is PreTrainedTokenizerBase.decode
            and not tokenizer.clean_up_tokenization_spaces):
        fast = backend.decode
        return lambda ids: fast(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class Detokenizer:
    """Incremental text of one choice: holds back an incomplete UTF-8 tail and what may start a stop string.

    Decodes only a short window of recent tokens per step (``prefix``..end minus ``prefix``..``read``), so a long
    completion costs O(length), not O(length^2); the final text is one full decode. ``include_stop``: the stop
    string (or the stop token's text) stays in the text (vLLM's ``include_stop_str_in_output``).
    """

    def __init__(self, tokenizer, stop: list[str], *, skip_special_tokens: bool = True, include_stop: bool = False):
        self.tokenizer, self.stop = tokenizer, stop
        self.skip_special_tokens, self.include_stop = skip_special_tokens, include_stop
        self.ids: list[int] = []
        self.sent = 0
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.acc = ""  # text decoded so far (up to ``read``)
        self.prefix = self.read = 0
        self._decode = decoder(tokenizer, skip_special_tokens)

    def text(self) -> str:
        return self._decode(self.ids)

    @property
    def offset(self) -> int:
        """Where the next token's text starts (the characters complete so far)."""
        return len(self.acc)

    def final_text(self, stop_text: str | None, finish_reason: str | None = None) -> str:
        """The choice's text: cut before the stop string that ended it (after it with ``include_stop``); without
        the token that ended it (EOS or a stop token id: ``finish_reason`` "stop" and no stop string) unless
        ``include_stop``, as vLLM does."""
        ids = self.ids
        if finish_reason == "stop" and stop_text is None and ids and not self.include_stop:
            ids = ids[:-1]
        text = self._decode(ids)
        if stop_text:
            i = text.find(stop_text)
            if i >= 0:
                text = text[: i + len(stop_text)] if self.include_stop else text[:i]
        return text

    def push(self, token_id: int, emit: bool = True) -> str:
        """Add a token; return the text now safe to send (nothing when ``emit`` is False: the last token, whose
        text goes out through :meth:`flush` once the stop string is known)."""
        self.ids.append(token_id)
        if not emit:
            return ""
        return self._advance()

    def push_many(self, ids: list[int]) -> str:
        """Add several tokens at once (what a stream that fell behind has queued); the same text as pushing them
        one by one, for two decodes instead of two per token."""
        self.ids.extend(ids)
        return self._advance()

    def _advance(self) -> str:
        before = self._decode(self.ids[self.prefix : self.read])
        now = self._decode(self.ids[self.prefix :])
        if len(now) > len(before) and not now.endswith("\ufffd"):  # a complete character more
            self.acc += now[len(before) :]
            self.prefix, self.read = self.read, len(self.ids)
        end = len(self.acc) - self.hold
        if end <= self.sent:
            return ""
        delta, self.sent = self.acc[self.sent : end], end
        return delta

    def flush(self, stop_text: str | None, finish_reason: str | None = None) -> str:
        text = self.final_text(stop_text, finish_reason)
        delta = text[self.sent :]
        self.sent = len(text)
        return delta


def token_offsets(tokenizer, ids: list[int], *, skip_special_tokens: bool = True) -> list[int]:
    """Where each token's text starts in the decoded text of ``ids``: a special token dropped from the text (and
    each piece of a character split over several tokens) has no length of its own. Incremental, O(len(ids))."""
    d = Detokenizer(tokenizer, [], skip_special_tokens=skip_special_tokens)
    out = []
    for t in ids:
        out.append(d.offset)
        d.push(t)
    return out
