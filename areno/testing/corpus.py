"""Deterministic generated text: the training corpus of the tiny test tokenizer.

No downloads: the text is made here from small word lists and templates, with a seeded ``random.Random``, so the
tokenizer trained on it (``areno.testing.tokenizer``) is the same on every machine. It mixes what tests and demos
feed a model: English-like sentences, digits and arithmetic ("12 + 345 = 357"), a little Python and JSON, chat turns
and tool calls in the Qwen style, plus a sprinkle of non-ASCII words so some multi-byte merges exist.
"""

from __future__ import annotations

import json
import random

NOUNS = (
    "cat dog bird fish tree river mountain city village house garden road car train ship plane book letter story "
    "song music teacher student doctor farmer child friend family team market shop price money time day night year "
    "week morning evening window door table chair computer program model answer question problem number result "
    "apple bread water coffee tea rain snow wind sun moon star sky ocean island forest field road bridge school "
    "library museum park kitchen language word sentence paper idea reason plan game test file list value system"
).split()
VERBS = (
    "sees finds makes takes gives reads writes builds opens closes likes wants needs helps carries moves starts "
    "stops learns teaches counts solves checks computes returns sends brings keeps leaves follows answers explains"
).split()
ADJECTIVES = (
    "small large quick slow bright dark happy quiet loud old new young warm cold green blue red yellow simple "
    "clever careful strange early late long short heavy light clean busy empty full correct wrong"
).split()
NAMES = "Alice Bob Carol David Emma Frank Grace Henry Irene Jack Laura Mike Nora Oscar Paula Sam".split()
PLACES = "Paris London Tokyo Berlin Madrid Rome Cairo Lima Oslo Seoul Sydney Toronto".split()
ADVERBS = "quickly slowly carefully happily quietly again today tomorrow often never always".split()
UNICODE_WORDS = "café naïve résumé Zürich São Paulo Ελλάδα Москва 你好 世界 東京 こんにちは 안녕하세요 🙂 🚀 ✓ — … €"
UNICODE_WORDS = UNICODE_WORDS.split()
TOOLS = {
    "get_weather": {"city": PLACES, "unit": ["celsius", "fahrenheit"]},
    "search": {"query": NOUNS, "top_k": [1, 3, 5, 10]},
    "calculator": {"expression": ["12 + 7", "3 * 14", "100 - 58", "81 / 9"]},
    "get_time": {"timezone": ["UTC", "CET", "JST", "PST"]},
}


def _sentence(rng: random.Random) -> str:
    kind = rng.randrange(5)
    n1, n2 = rng.choice(NOUNS), rng.choice(NOUNS)
    a1, a2 = rng.choice(ADJECTIVES), rng.choice(ADJECTIVES)
    name, verb = rng.choice(NAMES), rng.choice(VERBS)
    if kind == 0:
        return f"The {a1} {n1} {verb} the {a2} {n2}."
    if kind == 1:
        return f"{name} {verb} a {a1} {n1} in {rng.choice(PLACES)} {rng.choice(ADVERBS)}."
    if kind == 2:
        return f"Why does the {n1} look so {a1}? Because the {n2} is {a2}."
    if kind == 3:
        return f"{name} said, \"I think the {n1} is {a1}, and it {verb} {rng.randint(2, 99)} {n2}s.\""
    return f"In {rng.randint(1900, 2030)}, {name} wrote a {a1} {n1} about a {n2} ({rng.choice(UNICODE_WORDS)})."


def _arithmetic(rng: random.Random) -> str:
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    op = rng.choice("+-*")
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    kind = rng.randrange(3)
    if kind == 0:
        return f"{a} {op} {b} = {value}"
    if kind == 1:
        return f"What is {a} {op} {b}? The answer is {value}."
    return f"Let x = {a}. Then x {op} {b} = {value}, so the final answer is \\boxed{{{value}}}."


def _code(rng: random.Random) -> str:
    name, arg = rng.choice(VERBS).rstrip("s"), rng.choice(NOUNS)
    kind = rng.randrange(3)
    if kind == 0:
        return (
            f"def {name}_{arg}({arg}, n={rng.randint(1, 9)}):\n"
            f"    \"\"\"Return the {rng.choice(ADJECTIVES)} {arg}.\"\"\"\n"
            f"    result = []\n    for i in range(n):\n        result.append({arg} * i)\n    return result\n"
        )
    if kind == 1:
        obj = {"id": rng.randint(1, 9999), "name": rng.choice(NAMES), "city": rng.choice(PLACES),
               "tags": [rng.choice(ADJECTIVES) for _ in range(rng.randint(1, 3))], "ok": rng.random() < 0.5}
        return json.dumps(obj)
    return f"if {arg} > {rng.randint(0, 100)}:\n    print(\"{arg} is {rng.choice(ADJECTIVES)}\")\nelse:\n    x += 1\n"


def _tool_call(rng: random.Random) -> dict:
    name = rng.choice(sorted(TOOLS))
    return {"name": name, "arguments": {k: rng.choice(v) for k, v in TOOLS[name].items()}}


def _chat(rng: random.Random) -> str:
    """One ChatML conversation, as the chat template renders it (tool calls and responses included)."""
    turns = ["<|im_start|>system\nYou are a helpful assistant.<|im_end|>"]
    question = f"What is {rng.randint(0, 999)} {rng.choice('+-*')} {rng.randint(0, 999)}?"
    turns.append(f"<|im_start|>user\n{_sentence(rng)} {question}<|im_end|>")
    if rng.random() < 0.4:
        call = _tool_call(rng)
        turns.append(f"<|im_start|>assistant\n<tool_call>\n{json.dumps(call)}\n</tool_call><|im_end|>")
        turns.append(f"<|im_start|>user\n<tool_response>\n{_code(rng) if rng.random() < 0.3 else _sentence(rng)}"
                     "\n</tool_response><|im_end|>")
    think = f"<think>\n{_sentence(rng)}\n</think>\n\n" if rng.random() < 0.3 else ""
    turns.append(f"<|im_start|>assistant\n{think}{_sentence(rng)} {_arithmetic(rng)}<|im_end|>")
    return "\n".join(turns) + "\n"


def generate_corpus(num_documents: int = 3000, seed: int = 0) -> list[str]:
    """Return ``num_documents`` short documents; the same list for the same arguments, on every machine."""
    rng = random.Random(seed)
    makers = (_sentence, _sentence, _arithmetic, _code, _chat)
    docs = []
    for _ in range(num_documents):
        make = rng.choice(makers)
        k = rng.randint(1, 4) if make in (_sentence, _arithmetic) else 1
        docs.append(" ".join(make(rng) for _ in range(k)))
    return docs
