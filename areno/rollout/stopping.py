"""When a sequence stops: EOS and stop token ids, stop strings on the detokenized text, max/min new tokens."""

from __future__ import annotations

from areno.rollout.sequence import Sequence


class StopChecker:
    def __init__(self, tokenizer=None, eos_token_ids=(), max_model_len: int | None = None):
        self.tokenizer = tokenizer
        self.eos = set(int(t) for t in eos_token_ids if t is not None)
        self.max_model_len = max_model_len

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def update_text(self, seq: Sequence) -> str:
        """Detokenize incrementally: re-decode only from a few tokens back, so merges across tokens come out right."""
        out = seq.output_ids
        if self.tokenizer is None:
            return ""
        start = max(0, seq.text_offset - 4)
        prefix = self._decode(out[start : seq.text_offset]) if seq.text_offset else ""
        full = self._decode(out[start:])
        if full.startswith(prefix) and not full.endswith("\ufffd"):
            seq.text += full[len(prefix) :]
            seq.text_offset = len(out)
        return seq.text

    def check(self, seq: Sequence) -> str | None:
        """The finish reason after the newest token, or None to go on. Trims a matched stop string from the text."""
        opts, token, n = seq.options, seq.tokens[-1], seq.num_output
        can_stop = n >= opts.min_new_tokens
        if can_stop and token in opts.stop_token_ids:
            return "stop"
        if can_stop and not opts.ignore_eos and token in self.eos:
            return "stop"
        if opts.stop and self.tokenizer is not None:
            before = len(seq.text)
            text = self.update_text(seq)
            if can_stop:
                longest = max(len(s) for s in opts.stop)
                window_start = max(0, before - longest + 1)
                best = None
                for s in opts.stop:
                    i = text.find(s, window_start)
                    if i >= 0 and (best is None or i < best[0]):
                        best = (i, s)
                if best is not None:
                    seq.text = text[: best[0]]
                    seq.stop_text = best[1]
                    return "stop"
        if n >= opts.max_new_tokens:
            return "length"
        if self.max_model_len is not None and len(seq) >= self.max_model_len:
            return "length"
        return None
