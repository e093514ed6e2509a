"""How responses write log-probs: chat's ``logprobs.content`` entries, and completions' ``tokens`` /
``token_logprobs`` / ``top_logprobs`` / ``text_offset`` columns for the echoed prompt and the completion.
``name(token_id)`` is the token's name (``ServeState.token_namer``)."""

from __future__ import annotations


def chat_logprobs(sample: dict, k: int, name) -> dict:
    """A chat choice's ``logprobs``: each token of ``sample`` (``ids``, ``logprobs``, ``top``) with its k best."""
    content = []
    for i, lp, top in zip(sample["ids"], sample["logprobs"], sample["top"]):
        s = name(i)
        content.append({"token": s, "logprob": lp, "bytes": list(s.encode()),
                        "top_logprobs": [{"token": name(t), "logprob": v, "bytes": list(name(t).encode())}
                                         for t, v in (top or [])[:k]]})
    return {"content": content}


def top_dict(pairs, name) -> dict:
    """Top candidates as {token: log-prob}, most likely first; two ids with the same text keep the likelier."""
    out = {}
    for t, v in pairs or []:
        out.setdefault(name(t), v)
    return out


def prompt_part(name, ids, echo: dict, score, k: int) -> dict:
    """The echoed prompt's share of a choice's log-probs: the first token has no log-prob (nothing before it)."""
    lps, tops = score[:2]
    return {"tokens": [name(i) for i in ids], "token_logprobs": [None, *lps],
            "top_logprobs": [None, *(top_dict(t[:k], name) for t in tops)] if k else None,
            "text_offset": list(echo["offsets"])}


def completion_part(name, ids, lps, tops, offsets, k: int, shift: int) -> dict:
    """Generated tokens' log-probs; ``offsets`` index their text, ``shift`` is the length of what precedes it."""
    return {"tokens": [name(i) for i in ids], "token_logprobs": list(lps),
            "top_logprobs": [top_dict(t, name) for t in tops] if k else None,
            "text_offset": [x + shift for x in offsets]}


def joined(a: dict | None, b: dict) -> dict:
    """Two consecutive log-prob parts as one (``a`` None: ``b``)."""
    if a is None:
        return b
    top = None if a["top_logprobs"] is None else a["top_logprobs"] + b["top_logprobs"]
    return {"tokens": a["tokens"] + b["tokens"], "token_logprobs": a["token_logprobs"] + b["token_logprobs"],
            "top_logprobs": top, "text_offset": a["text_offset"] + b["text_offset"]}
