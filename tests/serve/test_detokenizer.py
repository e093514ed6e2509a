"""The streaming detokenizer: its pieces always add up to the full decode, for real text and for random token ids
(incomplete UTF-8), with and without stop-string hold-back."""

import random

from areno.models import load_tokenizer
from areno.serve.text import Detokenizer
from areno.testing import make_tiny_checkpoint


def test_streamed_pieces_reassemble_to_the_full_decode(tmp_path):
    tok = load_tokenizer(make_tiny_checkpoint(tmp_path / "ckpt", family="qwen3"))
    rng = random.Random(0)
    for trial in range(200):
        text = "".join(rng.choice(["héllo ", "世界", "🙂", " 12+3=", "abc", "\n", "ü"]) for _ in range(20))
        ids = tok.encode(text) if trial % 2 else [rng.randrange(0, 1000) for _ in range(40)]
        d = Detokenizer(tok, ["xyz"] if trial % 3 else [])
        pieces = [d.push(i) for i in ids[:-1]]
        d.push(ids[-1], emit=False)
        assert "".join(pieces) + d.flush(None) == tok.decode(ids, skip_special_tokens=True)


def test_pieces_of_several_tokens_at_once_reassemble_too(tmp_path):
    """A stream that fell behind pushes its queued tokens together (``push_many``): same full text, the decoder
    (a direct call into the Rust tokenizer where that is what ``decode`` does) agreeing with ``tokenizer.decode``."""
    from areno.serve.text import decoder

    tok = load_tokenizer(make_tiny_checkpoint(tmp_path / "ckpt", family="qwen3"))
    rng = random.Random(1)
    assert "fast" in decoder(tok, True).__code__.co_freevars  # the direct call is the path under test
    special = sorted(tok.all_special_ids)
    for trial in range(100):
        text = "".join(rng.choice(["héllo ", "世界", "🙂", " 12+3=", "abc", "\n", "ü"]) for _ in range(20))
        ids = tok.encode(text) if trial % 2 else [rng.randrange(0, 1000) for _ in range(40)]
        ids[rng.randrange(len(ids))] = rng.choice(special)
        for skip in (True, False):
            assert decoder(tok, skip)(ids) == tok.decode(ids, skip_special_tokens=skip)
        d = Detokenizer(tok, ["xyz"] if trial % 3 else [])
        pieces, i = [], 0
        while i < len(ids) - 1:
            n = rng.randint(1, 6)
            pieces.append(d.push_many(ids[i : min(i + n, len(ids) - 1)]))
            i += n
        d.push(ids[-1], emit=False)
        assert "".join(pieces) + d.flush(None) == tok.decode(ids, skip_special_tokens=True)
