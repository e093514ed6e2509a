"""One agent sample's side of an agentic rollout: what the agent sees (``AgentItem``, ``AgentBatch``, ``AgentContext``,
``Generation``), the session's growing token sequence (``Session``) and the refusals the endpoint answers with
(``AgentError``, named by ``SESSION_HEADER``). The package docstring (areno.rl.agentic) describes the whole."""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass, field

from areno.serve.errors import APIError

SESSION_HEADER = "X-Areno-Session"


class AgentError(APIError):
    """A call the session refuses (HTTP 400 with serve's OpenAI error body); ``code`` is the OpenAI error code."""

    def __init__(self, message: str, code: str, param: str | None = None):
        super().__init__(400, message, param=param, code=code)


# ---- what the agent sees -----------------------------------------------------------------------------------------
@dataclass
class AgentItem:
    record: dict  # the dataset row (internal keys left out)
    messages: list  # the prompt as chat messages
    prompt_index: int
    sample_index: int
    id: str = field(default_factory=lambda: uuid.uuid4().hex)


class AgentBatch:
    def __init__(self, items: list[AgentItem]):
        self.items = items

    def iter_samples(self):
        yield from self.items

    def __len__(self):
        return len(self.items)


@dataclass
class Generation:
    """What ``ctx.generate`` returns."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str


class AgentContext:
    def __init__(self, rollout):  # an AgentRollout
        self._rollout = rollout
        self.base_url = rollout.base_url
        self.api_key = rollout.api_key
        self._pool = None  # one HTTP connection pool per sample (per event loop), shared by its clients

    def get_base_url(self) -> str:
        return self.base_url

    def client(self, item: AgentItem, **kwargs):
        """An ``openai.AsyncOpenAI`` client whose calls belong to ``item``'s session (``kwargs`` go to
        ``AsyncOpenAI``). The sample's clients share one connection pool, which closing a client leaves open (the
        rollout closes it when the sample ends); pools share one SSL context and ignore proxy settings (the endpoint
        is local), which makes one cost about a millisecond instead of 30-100."""
        import openai

        if self._pool is None:
            self._pool = _shared_pool(openai)
        headers = {**kwargs.pop("default_headers", {}), SESSION_HEADER: item.id}
        kwargs.setdefault("http_client", self._pool)
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, default_headers=headers, **kwargs)

    async def aclose(self) -> None:
        if self._pool is not None:
            await self._pool.close_pool()
            self._pool = None

    async def generate(self, item: AgentItem, prompt_ids: list[int], *, max_tokens=None, temperature=None,
                       top_p=None, stop=None) -> Generation:
        """Sample a continuation of ``prompt_ids`` (the whole context so far, as the agent keeps it)."""
        session = self._rollout.sessions[item.id]
        return await self._rollout.on_loop(self._generate(session, list(prompt_ids), max_tokens=max_tokens,
                                                          temperature=temperature, top_p=top_p, stop=stop))

    async def _generate(self, session, prompt_ids, **options) -> Generation:  # on the rollout's loop
        async with session.lock:
            session.extend_tokens(prompt_ids)
            return await self._rollout.sample(session, **options)


# ---- one sample's token sequence -----------------------------------------------------------------------------------
def _normal(messages) -> list:
    """Messages reduced to what the template renders, for comparing histories (content None == "")."""
    out = []
    for m in messages:
        calls = []
        for c in m.get("tool_calls") or ():
            fn = c.get("function", c)
            args = fn.get("arguments")
            try:
                args = json.loads(args) if isinstance(args, str) else args
            except json.JSONDecodeError:
                pass
            calls.append((fn.get("name"), json.dumps(args, sort_keys=True)))
        out.append((m.get("role"), m.get("content") or "", tuple(calls), m.get("reasoning_content") or ""))
    return out


class Session:
    def __init__(self, item: AgentItem, tokenizer, *, eos_id: int, max_context_len: int, train_tool_results: bool,
                 max_token_bytes: int = 0):
        self.item, self.tok, self.eos_id = item, tokenizer, eos_id
        self.max_context_len, self.train_tool_results = max_context_len, train_tool_results
        self.max_token_bytes = max_token_bytes  # the longest vocabulary entry in UTF-8 bytes (0: no early check)
        self.lock = asyncio.Lock()
        self.rows: list[dict] = []  # closed trajectories (forks)
        self.forks = 0
        self.turns = 0
        self.prefilled: list[int] = []  # per turn: prompt tokens the engine computed (not from the prefix cache)
        self.samples: list[list[int]] = []  # per turn: the token ids the engine sampled
        self.key = 0  # which split-mode engine serves it
        self.overflowed = False  # a turn passed the context: the sample has ended
        self.ended: AgentError | None = None  # what every later call of an ended sample is answered with
        self._reset()

    def _reset(self):
        self.tokens: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float | None] = []
        self.versions: list[int | None] = []  # per token: the policy version that sampled it (None: not sampled)
        self.prompt_len = 0  # the first rendering: the row's prompt
        self.history: list | None = None  # the messages this sequence renders, the last assistant turn included
        self.tools = None
        self.finish_reason = None

    # rendering
    def _render(self, messages, tools, generation_prompt: bool) -> str:
        kw = {"tools": tools} if tools else {}
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **kw)

    def _encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def _close(self):
        if len(self.tokens) > self.prompt_len:
            self.rows.append({"tokens": self.tokens, "mask": self.mask, "logprobs": self.logprobs,
                              "versions": self.versions, "prompt_len": self.prompt_len, "messages": self.history,
                              "finish_reason": self.finish_reason})
        self._reset()

    def _start(self, messages, tools) -> None:
        ids = self._encode(self._render(messages, tools, True))
        self._append(ids, 0)
        self.prompt_len = len(self.tokens)
        self.history, self.tools = list(messages), tools

    def _append(self, ids, train: int, logprobs=None, version=None) -> None:
        self.tokens += ids
        self.mask += [train] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [None] * len(ids)
        self.versions += [version] * len(ids)

    def extend_messages(self, messages, tools) -> None:
        """Make the sequence end with ``messages`` rendered and the generation prompt: a delta, or a fork."""
        before = self._before_turn()
        messages = [dict(m) for m in messages]
        self._check_size(messages)
        if self.history is None:
            self._start(messages, tools)
        elif (len(messages) > len(self.history) and tools == self.tools
              and _normal(messages[: len(self.history)]) == _normal(self.history)):
            delta = self._delta(messages, tools)
            if delta is None:
                self._fork(messages, tools)
            else:
                new = messages[len(self.history):]
                train = int(self.train_tool_results and all(m.get("role") == "tool" for m in new))
                self._append(delta, train)
                self.history = list(messages)
        else:
            self._fork(messages, tools)
        self._check_room(before)

    def _delta(self, messages, tools) -> list[int] | None:
        """The tokens the template puts after the last sampled token: the text of the new messages' rendering past
        the end of the last assistant turn (its end-of-turn token included when the sample stopped on it)."""
        before = self._render(self.history, tools, False)
        after = self._render(messages, tools, True)
        eos_text = self.tok.decode([self.eos_id])
        cut = before.rfind(eos_text)
        if cut < 0 or not after.startswith(before[: cut + len(eos_text)]):
            return None
        delta = self._encode(after[cut + len(eos_text):])
        return delta if self.tokens[-1] == self.eos_id else [self.eos_id] + delta

    def _fork(self, messages, tools) -> None:
        self.forks += 1
        self._close()
        self._start(messages, tools)

    def extend_tokens(self, prompt_ids: list[int]) -> None:
        """Token-level agents: ``prompt_ids`` extends the sequence (the rest is context) or forks it."""
        before = self._before_turn()
        if self.tokens and prompt_ids[: len(self.tokens)] == self.tokens and len(prompt_ids) >= len(self.tokens):
            self._append(prompt_ids[len(self.tokens):], 0)
        else:
            if self.tokens:
                self.forks += 1
                self._close()
            self._append(list(prompt_ids), 0)
            self.prompt_len = len(self.tokens)
        self._check_room(before)

    def _before_turn(self) -> tuple:
        """What a refused turn goes back to; refuses any turn once the sample has ended."""
        if self.ended is not None:
            raise self.ended
        return self.tokens, len(self.tokens), self.history, self.tools

    def _check_size(self, messages) -> None:
        """Refuse, before rendering it, a conversation whose user, system and tool text alone needs more tokens than
        the context (each token holds at most ``max_token_bytes`` bytes): encoding a 10 MB tool result would stall
        the endpoint for a minute."""
        if not self.max_token_bytes:
            return
        size = sum(len(_text(m.get("content")).encode("utf-8", "replace")) for m in messages
                   if m.get("role") != "assistant")  # a template may drop parts of earlier answers (thinking)
        if size // self.max_token_bytes >= self.max_context_len:
            self._end(f"this conversation needs at least {size // self.max_token_bytes} tokens ({size} bytes of "
                      "text)")

    def _end(self, needs: str):
        self.finish_reason = "length"
        self.overflowed = True
        self.end(AgentError(f"this sample has ended: a turn passed --max-context-len {self.max_context_len} (it was "
                            "refused and nothing of it kept)", "context_length_exceeded", "messages"))
        raise AgentError(f"{needs} before the answer, but the context is limited to --max-context-len "
                         f"{self.max_context_len}; this sample has ended (its trajectory so far is kept, cut)",
                         "context_length_exceeded", "messages")

    def end(self, answer: AgentError) -> None:
        """No further turn: every later call is refused with ``answer``."""
        self.ended = answer

    def end_timed_out(self, timeout: float) -> None:
        """Its agent ran past ``--agent-timeout-s``: a call it still makes is refused."""
        self.end(AgentError(f"this sample has ended: its agent ran past --agent-timeout-s {timeout:g}",
                            "sample_ended"))

    def _check_room(self, before: tuple) -> None:
        """A sequence past the context: the turn is undone (the trajectory stays as it was, cut: ``length``), the
        sample ends and the agent gets a 400."""
        needed = len(self.tokens)
        if needed < self.max_context_len:
            return
        tokens, n, history, tools = before
        if self.tokens is tokens:  # a delta (or the first turn): cut it off again
            del self.tokens[n:], self.mask[n:], self.logprobs[n:], self.versions[n:]
            self.history, self.tools = history, tools
        else:  # a fork: the earlier trajectory is closed already, the new one goes
            self._reset()
        self._end(f"this conversation needs {needed} tokens")

    def add_sample(self, ids, logprobs, finish_reason, assistant: dict | None, version: int | None = None) -> None:
        """A turn the engine sampled (``version``: the policy version of the engine's weights, split mode)."""
        self._append(list(ids), 1, list(logprobs), version)
        self.samples.append(list(ids))
        self.finish_reason = finish_reason
        self.turns += 1
        if assistant is not None and self.history is not None:
            self.history = self.history + [assistant]

    def finish(self) -> list[dict]:
        self._close()
        return self.rows


def token_versions(versions: list) -> list[int] | None:
    """Every token's version from the sampled tokens' (``versions``: None where not sampled): a token the agent or
    the template added takes the version of the sampled token before it (the first sampled one's before any); None when
    no token carries one (a colocated rollout samples with the trainer's own weights)."""
    known = [v for v in versions if v is not None]
    if not known:
        return None
    out, last = [], known[0]
    for v in versions:
        last = last if v is None else v
        out.append(last)
    return out


def batch_over() -> AgentError:
    """The answer to a call that comes after its batch has ended (an abandoned agent that woke up)."""
    return AgentError("this sample has ended: its rollout batch is over (the agent ran past --agent-timeout-s?)",
                      "sample_ended")


def _text(content) -> str:
    """A message's text: its string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text") or "" for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def max_token_bytes(tokenizer) -> int:
    """The most UTF-8 bytes one vocabulary entry spells (each token of an encoding stands for at most that many
    bytes of the text: a byte-level entry's characters are one byte each, which UTF-8 spells in one or two)."""
    try:
        return max((len(t.encode("utf-8", "replace")) for t in tokenizer.get_vocab()), default=0)
    except Exception:  # noqa: BLE001 - a tokenizer without a readable vocabulary: no early check
        return 0


_ssl: list = []  # one SSL context for every pool: building one is most of a pool's cost


def _shared_pool(openai):
    if not _ssl:
        import ssl

        _ssl.append(ssl.create_default_context())

    class SharedPool(openai.DefaultAsyncHttpxClient):
        async def aclose(self) -> None:  # a sample's client closing (``async with``) leaves the pool to the rollout
            pass

        async def close_pool(self) -> None:
            await super().aclose()

    return SharedPool(verify=_ssl[0], trust_env=False)
