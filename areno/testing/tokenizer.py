"""The tiny test tokenizer: a byte-level BPE trained on ``areno.testing.corpus``, plus a Qwen-style ChatML template.

The trained ``tokenizer.json`` is committed beside this file, so every test on every machine sees the same ids;
``train_tokenizer()`` rebuilds it from the generated corpus (``regenerate()`` rewrites the file, e.g. after a corpus
change: ``python -c "from areno.testing.tokenizer import regenerate; regenerate()"``) and a test checks that the
rebuild is identical. Layout, Qwen-like:

- ids 0..255 are the 256 byte symbols (every UTF-8 string is encodable, nothing maps to an unknown token); merges
  fill the BPE vocabulary up to ``BPE_VOCAB_SIZE``; no normaliser, so any text round-trips through encode/decode;
- the added tokens follow the BPE vocabulary: ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos) are
  special (dropped by ``skip_special_tokens``); ``<tool_call>``, ``</tool_call>``, ``<tool_response>``,
  ``</tool_response>``, ``<think>``, ``</think>`` are single added tokens that are *not* special, as in Qwen3, so
  they survive ``skip_special_tokens=True`` and tool calls can be parsed from decoded text.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

TOKENIZER_JSON = Path(__file__).with_name("tokenizer.json")
BPE_VOCAB_SIZE = 991
PAD_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EXTRA_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")
VOCAB_SIZE = BPE_VOCAB_SIZE + len(SPECIAL_TOKENS) + len(EXTRA_TOKENS)
# Qwen2/Qwen3 pre-tokenisation: contractions, letter runs, single digits, punctuation runs, newlines, spaces.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML as Qwen2.5/Qwen3 render it: tools listed in the system turn, assistant tool calls as <tool_call> blocks,
# tool results as <tool_response> blocks inside one user turn. Unlike Qwen3, earlier reasoning is never dropped, so a
# rendered conversation is always a prefix of the rendering of its continuation (multi-turn RL relies on that).
CHAT_TEMPLATE = r"""{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}
            {%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages and messages[0].role == 'system' %}
        {{- render_content(messages[0].content) + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        + "You are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- '\n' }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        + "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        + "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages and messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + render_content(messages[0].content) + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}
            {{- '<|im_start|>system\n' + render_content(message.content) + '<|im_end|>\n' }}
        {%- endif %}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\n' + render_content(message.content) + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\n' }}
        {%- if message.reasoning_content is string and message.reasoning_content %}
            {{- '<think>\n' + message.reasoning_content + '\n</think>\n\n' }}
        {%- endif %}
        {%- set content = render_content(message.content) %}
        {{- content }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if tool_call.function is defined %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or loop.previtem.role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + render_content(message.content) + '\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""


def _training_text():
    """Corpus documents with the added tokens cut out: they get their own ids, so merges need not learn them."""
    from areno.testing.corpus import generate_corpus

    for doc in generate_corpus():
        for token in SPECIAL_TOKENS + EXTRA_TOKENS:
            doc = doc.replace(token, "\n")
        yield doc


def train_tokenizer():
    """Train the byte-level BPE from the generated corpus; returns a ``tokenizers.Tokenizer`` (about 0.5 s)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(_training_text(), trainer=trainer)
    if tok.get_vocab_size() != BPE_VOCAB_SIZE:
        raise RuntimeError(
            f"BPE training reached {tok.get_vocab_size()} tokens, not {BPE_VOCAB_SIZE}: corpus too small"
        )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in EXTRA_TOKENS])
    return tok


def regenerate(path: str | Path = TOKENIZER_JSON) -> Path:
    """Train the tokenizer and write its ``tokenizer.json`` to ``path`` (default: the committed file)."""
    path = Path(path)
    train_tokenizer().save(str(path), pretty=True)
    return path


@functools.lru_cache(maxsize=1)
def load_tokenizer():
    """The committed tokenizer as a ``tokenizers.Tokenizer`` (cached; do not mutate it)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(TOKENIZER_JSON))


def token_id(token: str) -> int:
    tid = load_tokenizer().token_to_id(token)
    if tid is None:
        raise KeyError(f"{token!r} is not in the tiny tokenizer")
    return tid


def write_tokenizer_files(path: str | Path, *, model_max_length: int = 2048) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into ``path``.

    Written by hand rather than through ``PreTrainedTokenizerFast.save_pretrained`` so the files are the same under
    every transformers version (4.5x and 5.x read them all the same way): the class is the plain fast tokenizer,
    which takes ``tokenizer.json`` as it is, and the chat template sits in ``tokenizer_config.json``.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(TOKENIZER_JSON, path / "tokenizer.json")
    added = {
        str(token_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                           "single_word": False, "special": t in SPECIAL_TOKENS}
        for t in SPECIAL_TOKENS + EXTRA_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "split_special_tokens": False,
        "model_max_length": model_max_length,
        "padding_side": "right",
        "chat_template": CHAT_TEMPLATE,
    }
    special_map = {
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "eos_token": {"content": EOS_TOKEN, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False},
        "pad_token": {"content": PAD_TOKEN, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False},
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (path / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2, ensure_ascii=False) + "\n")
