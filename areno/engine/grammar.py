"""Structured outputs by constrained decoding: a grammar masks the logits of the rows that carry one, so every
sampled token keeps the output inside the grammar's language.

Spec (plain data in ``SamplingParams.grammar``, so it travels to replicas and remote rollout as it is):

    {"type": "json_object"}                     any JSON object
    {"type": "json_schema", "schema": {...}}    a JSON value that validates against the schema (the OpenAI subset
                                                and more: xgrammar's converter; unknown keys -> GrammarError)
    {"type": "tool_calls", "calls": [...],      one call (``triggers`` None): one of ``calls``, each ``begin`` +
     "triggers": [...] | None}                  JSON arguments under ``schema`` + ``end``; with ``triggers``: free
                                                text, a call (under its grammar) wherever a trigger starts one

JSON is written compact: ``", "`` and ``": "`` separators and no other whitespace between tokens (``json.dumps``'s
layout), so a model cannot loop on whitespace. Under a json_schema, objects take no properties the schema does not
name (as OpenAI's strict mode). Compilation (xgrammar, against the tokenizer and the model's vocabulary, padding ids
included) happens once per spec per engine (``Grammars``, an LRU cache bounded by the compiled grammars' bytes,
``CACHE_BYTES``, and their count); a server's engine compiles on a worker thread (``compile_async``: a large enum
takes seconds, which other requests spend decoding, not waiting); each sequence gets its own matcher
(``Matcher``), advanced with every accepted token. The matcher keeps the mask of its next token:

    bitmask int32 [ceil(V / 32)]:  token t allowed  <=>  bit t % 32 of word t // 32 is set
    logits[t] = -inf for every disallowed t, before sampling (``apply_token_mask``)

so the sampled token and its log-prob come from the distribution renormalised over the allowed tokens. Once the
output is whole the mask allows only the stop tokens; the matcher accepting one finishes the sequence ("stop", the
stop token last, as any EOS). The mask needs the host after every token: steps with a grammar row run single-step,
without CUDA graphs.
xgrammar is imported only when a grammar is used.
"""

from __future__ import annotations

import json
import logging
import queue
import re
import threading
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, wait

import torch

from areno.config.sampling import GrammarError, json_safe, normalize_grammar

log = logging.getLogger("areno.engine")

CACHE_BYTES = 256 << 20  # compiled grammars kept per engine (a 30,000-value enum alone is ~80 MB)
_LAYOUT = {"any_whitespace": False}  # separators (", ", ": "), no free whitespace
_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[hh:mm:ss] file.cc:line: " before the message


def _xgrammar():
    try:
        import xgrammar
    except ImportError as exc:  # pragma: no cover - xgrammar is a dependency; this names the fix if it is missing
        raise GrammarError("structured outputs need the xgrammar package: pip install xgrammar") from exc
    return xgrammar


def _message(exc: Exception) -> str:
    return _XGR_PREFIX.sub("", str(exc).strip()).strip()


def _schema_text(spec: dict) -> tuple[str, bool]:
    """(schema JSON, strict mode) of a normalised spec: json_object is the schema ``{"type": "object"}`` with
    additional properties allowed."""
    if spec["type"] == "json_object":
        return '{"type": "object"}', False
    return json.dumps(json_safe(spec["schema"])), True


def _literal(xgr, text: str):
    return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text, ensure_ascii=False)}")


def _arguments(xgr, call: dict):
    """A call's arguments under its schema: compact JSON, (``arguments`` "xml") qwen3_coder's parameter blocks or
    ("gemma4") Gemma 4's argument object."""
    if call.get("arguments") == "gemma4":
        from areno.engine.tool_calls.gemma4_grammar import gemma4_arguments_grammar

        return gemma4_arguments_grammar(xgr, call["schema"], _LAYOUT)
    if call.get("arguments", "json") == "xml":
        from areno.engine.tool_calls.qwen3_coder import xml_arguments_grammar

        return xml_arguments_grammar(xgr, call["schema"], _LAYOUT)
    return xgr.Grammar.from_json_schema(json.dumps(json_safe(call["schema"])), strict_mode=True, **_LAYOUT)


def _call_grammar(xgr, call: dict):
    """One call: its markup around arguments that validate against its schema."""
    return xgr.Grammar.concat(_literal(xgr, call["begin"]), _arguments(xgr, call), _literal(xgr, call["end"]))


def _triggered(xgr, spec: dict):
    """Free text where each trigger starts one of the calls (xgrammar's structural tag, triggered tags)."""
    tags = []
    for call in spec["calls"]:
        arguments = str(_arguments(xgr, call))
        tags.append({"type": "tag", "begin": call["begin"], "content": {"type": "grammar", "grammar": arguments},
                     "end": call["end"]})
    return xgr.Grammar.from_structural_tag(json.dumps({"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": spec["triggers"], "tags": tags}}))


def build(xgr, spec: dict):
    """The xgrammar Grammar of a normalised spec (GrammarError with the converter's reason)."""
    try:
        if spec["type"] != "tool_calls":
            text, strict = _schema_text(spec)
            return xgr.Grammar.from_json_schema(text, strict_mode=strict, **_LAYOUT)
        if spec["triggers"] is not None:
            return _triggered(xgr, spec)
        calls = [_call_grammar(xgr, call) for call in spec["calls"]]
        return xgr.Grammar.union(*calls) if len(calls) > 1 else calls[0]
    except Exception as exc:  # xgrammar raises RuntimeError/ValueError with the converter's message
        raise GrammarError(f"unsupported JSON schema: {_message(exc)}") from exc


def check(spec) -> dict:
    """Normalise and convert ``spec`` to a grammar without a tokenizer (the server's validation); returns the
    normalised spec or raises GrammarError with the converter's reason."""
    spec = normalize_grammar(spec)
    build(_xgrammar(), spec)
    return spec


class Matcher:
    """One sequence's position in its grammar and the mask of its next token."""

    def __init__(self, xgr, compiled, stop_token_ids: list[int], vocab_size: int):
        self.inner = xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids) or None)
        self.mask = xgr.allocate_token_bitmask(1, vocab_size)
        self.inner.fill_next_token_bitmask(self.mask, 0)

    @property
    def finished(self) -> bool:
        """A stop token ended the whole output."""
        return self.inner.is_terminated()

    def accept(self, token: int) -> bool:
        """Advance by one sampled token and compute the next mask; False if the grammar refuses the token."""
        if self.finished or not self.inner.accept_token(int(token)):
            return False
        if not self.finished:
            self.inner.fill_next_token_bitmask(self.mask, 0)
        return True


class Grammars:
    """Compiled grammars of one tokenizer and vocabulary (``vocab_size``: the logits' width, >= the tokenizer's),
    cached per spec: least recently used first out once they hold more than ``capacity_bytes`` (xgrammar's own
    count of each one's memory) or ``capacity`` entries; a grammar larger than the whole budget is used, not kept."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids=(), capacity: int = 64,
                 capacity_bytes: int = CACHE_BYTES):  # fmt: skip
        self.xgr = _xgrammar()
        self.vocab_size = max(int(vocab_size), len(tokenizer))
        self.stop_token_ids = sorted(int(t) for t in stop_token_ids)
        info = self.xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                       stop_token_ids=self.stop_token_ids or None)
        self.compiler = self.xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self.capacity, self.capacity_bytes = capacity, capacity_bytes
        self._cache: OrderedDict[str, tuple[object, int]] = OrderedDict()  # key -> (compiled, bytes)
        self._pending: dict[str, Future] = {}  # key -> its compile on the worker thread
        self._jobs: queue.SimpleQueue | None = None  # (future, spec, key) for the compile thread
        self._lock = threading.Lock()

    @property
    def cached_bytes(self) -> int:
        return sum(size for _, size in self._cache.values())

    def _cached(self, key: str):
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key][0]
        return None

    def _compile(self, spec: dict, key: str):
        try:
            if spec["type"] == "tool_calls":
                compiled = self.compiler.compile_grammar(build(self.xgr, spec))
            else:
                text, strict = _schema_text(spec)
                compiled = self.compiler.compile_json_schema(text, strict_mode=strict, **_LAYOUT)
        except GrammarError:
            raise
        except Exception as exc:
            raise GrammarError(f"unsupported JSON schema: {_message(exc)}") from exc
        size = int(compiled.memory_size_bytes)
        with self._lock:
            if size <= self.capacity_bytes:
                self._cache[key] = (compiled, size)
            while self._cache and (len(self._cache) > self.capacity or self.cached_bytes > self.capacity_bytes):
                self._cache.popitem(last=False)
        return compiled

    def compile(self, spec):
        """The compiled grammar of ``spec``, compiled here unless cached."""
        spec = normalize_grammar(spec)
        key = json.dumps(spec, sort_keys=True)
        compiled = self._cached(key)
        return compiled if compiled is not None else self._compile(spec, key)

    def compile_async(self, spec) -> Future | None:
        """None when ``spec`` is compiled already; else the Future of its compile on this cache's worker thread
        (one per spec however many requests wait for it), whose result is the compiled grammar (or GrammarError)."""
        spec = normalize_grammar(spec)
        key = json.dumps(spec, sort_keys=True)
        if self._cached(key) is not None:
            return None
        with self._lock:
            if key not in self._pending:
                if self._jobs is None:
                    self._jobs = queue.SimpleQueue()
                    # a daemon thread: a compile in progress never holds up the process's exit
                    threading.Thread(target=self._compile_jobs, name="areno-grammar", daemon=True).start()
                future = Future()
                self._pending[key] = future
                future.add_done_callback(lambda _: self._pending.pop(key, None))
                self._jobs.put((future, spec, key))
            return self._pending[key]

    def _compile_jobs(self) -> None:
        while True:
            future, spec, key = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self._compile(spec, key))
            except Exception as exc:  # GrammarError, or xgrammar's own: the waiting request fails with it
                future.set_exception(exc)

    def matcher(self, spec, stop_token_ids=None, *, compiled=None) -> Matcher:
        """A fresh matcher for one sequence (of ``compiled``, else of ``spec`` compiled); ``stop_token_ids``
        (default: the engine's) end the output."""
        stops = self.stop_token_ids if stop_token_ids is None else sorted(set(int(t) for t in stop_token_ids))
        return Matcher(self.xgr, compiled if compiled is not None else self.compile(spec), stops, self.vocab_size)


class EngineGrammars:
    """An engine's structured outputs: the compiled-grammar cache (``cache``, built on first use), a matcher per
    sample, and, with ``off_loop`` (a server's engine), the requests waiting while their new grammar compiles on
    the cache's worker thread (``waiting``: [(future, group, options)]); they join the scheduler on a later step
    (``admit``), so a compile never stalls the decode loop."""

    def __init__(self, engine):
        self.engine, self.cache, self.off_loop = engine, None, False
        self.waiting: list = []

    def attach(self, group: list, options, compiled=None) -> bool:
        """One matcher per sample (the stop tokens end the output); False when the group waits for a compile
        (refused first if the scheduler would refuse it: the caller hears now, not once it is compiled)."""
        engine = self.engine
        if self.cache is None:
            if engine.tokenizer is None:
                raise GrammarError("structured outputs need the engine's tokenizer")
            vocab = engine.model.config.vocab_size or len(engine.tokenizer)
            self.cache = Grammars(engine.tokenizer, vocab, engine.stopper.eos)
        if compiled is None and self.off_loop:
            future = self.cache.compile_async(options.grammar)
            if future is not None:
                engine.scheduler.check(group)
                self.waiting.append((future, group, options))
                return False
        eos = engine.stopper.eos
        stops = set(options.stop_token_ids) if options.ignore_eos else eos.union(options.stop_token_ids)
        for seq in group:
            seq.grammar = self.cache.matcher(options.grammar, stops, compiled=compiled)
        return True

    def abort(self, seq) -> bool:
        """Finish ``seq`` ("abort") if it waits for a compile; False if it does not."""
        if any(seq is s for _, group, _ in self.waiting for s in group):
            seq.finish("abort")
            return True
        return False

    def admit(self) -> list:
        """Groups whose grammar is compiled join the scheduler; those whose compile failed finish ("abort", the
        reason logged) and are returned. With nothing else to run, waits up to 10 ms for a compile (no spinning)."""
        scheduler = self.engine.scheduler
        if not scheduler.has_work():
            wait([future for future, _, _ in self.waiting], timeout=0.01, return_when=FIRST_COMPLETED)
        waiting, failed = [], []
        for future, group, options in self.waiting:
            if all(seq.is_finished for seq in group):  # aborted while it waited
                continue
            if not future.done():
                waiting.append((future, group, options))
            elif future.exception() is not None:
                log.warning("structured output request failed: %s", future.exception())
                for seq in group:
                    seq.finish("abort")
                failed += group
            else:
                self.attach(group, options, compiled=future.result())
                scheduler.add(group)
        self.waiting = waiting
        return failed


def token_mask(matchers: list) -> tuple[list[int], torch.Tensor] | None:
    """The step's mask from its rows' matchers (None where a row has no grammar): (row indices, bitmask int32
    ``[rows, ceil(V / 32)]`` on the host, all bits set on the rows without a grammar), or None when no row has one."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return None
    width = matchers[rows[0]].mask.shape[1]
    mask = torch.full((len(matchers), width), -1, dtype=torch.int32)
    for i in rows:
        mask[i] = matchers[i].mask[0]
    return rows, mask


def apply_token_mask(logits: torch.Tensor, mask: tuple[list[int], torch.Tensor]) -> None:
    """Set the disallowed logits of the masked rows to -inf, in place (xgrammar's kernel: CPU, or Triton on CUDA)."""
    from xgrammar import apply_token_bitmask_inplace

    rows, bits = mask
    apply_token_bitmask_inplace(logits, bits.to(logits.device, non_blocking=True), indices=rows)
