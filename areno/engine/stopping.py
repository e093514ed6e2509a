"""When a sequence stops: EOS and stop token ids, stop strings on the detokenized text, max/min new tokens."""

from __future__ import annotations

from areno.engine.sequence import Sequence


class StopChecker:
    def __init__(self, tokenizer=None, eos_token_ids=(), max_model_len: int | None = None):
        self.tokenizer = tokenizer
        self.eos = set(int(t) for t in eos_token_ids if t is not None)
        self.max_model_len = max_model_len

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def check(self, seq: Sequence) -> str | None:
        """The finish reason after the newest token, or None to go on. On a stop string, ``seq.text`` becomes the
        output text cut at its first occurrence."""
        opts, token, n = seq.options, seq.tokens[-1], seq.num_output
        can_stop = n >= opts.min_new_tokens
        if can_stop and token in opts.stop_token_ids:
            return "stop"
        if can_stop and not opts.ignore_eos and token in self.eos:
            return "stop"
        if opts.stop and self.tokenizer is not None and can_stop:
            # look for a stop string in the text of the last few tokens (a token holds at least one byte, a
            # character at most four), then trim the full text at its first occurrence
            longest = max(len(x) for x in opts.stop)
            out = seq.output_ids
            window = self._decode(out[-(4 * longest + 2) :])
            hits = [x for x in opts.stop if x in window]
            if hits:
                full = self._decode(out)
                found = sorted((full.find(x), x) for x in hits if x in full)
                seq.text, seq.stop_text = (full[: found[0][0]], found[0][1]) if found else (full, hits[0])
                return "stop"
        if n >= opts.max_new_tokens:
            return "length"
        if self.max_model_len is not None and len(seq) >= self.max_model_len:
            return "length"
        return None

    def extend(self, seq: Sequence, tokens: list[int], logprobs: list[float]) -> str | None:
        """Append ``tokens`` (a multi-step decode's tokens for ``seq``) up to the first finish; returns its reason
        or None. The same outcome as ``append`` + ``check`` per token; without stop strings one scan, no per-token
        calls."""
        opts = seq.options
        if opts.stop and self.tokenizer is not None:  # stop strings need the text after every token
            for token, lp in zip(tokens, logprobs):
                seq.append(token, lp)
                reason = self.check(seq)
                if reason is not None:
                    return reason
            return None
        done = seq.num_output
        take = min(len(tokens), opts.max_new_tokens - done)
        if self.max_model_len is not None:
            take = min(take, self.max_model_len - len(seq))
        stops = set(opts.stop_token_ids) if opts.ignore_eos else self.eos.union(opts.stop_token_ids)
        reason = None
        if stops:
            for i in range(max(0, opts.min_new_tokens - done - 1), take):
                if tokens[i] in stops:
                    take, reason = i + 1, "stop"
                    break
        seq.extend(tokens[:take], logprobs[:take])
        if reason is None and (seq.num_output >= opts.max_new_tokens
                               or (self.max_model_len is not None and len(seq) >= self.max_model_len)):
            reason = "length"
        return reason
