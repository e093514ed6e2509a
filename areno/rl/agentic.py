"""Agentic rollout: multi-turn agents with tools, trained on exactly the tokens the engine sampled.

``--agent-fn FILE`` defines ``async def run_agent(ctx, batch)``. Each (prompt, sample) runs as its own call with a
batch of one item (``batch.iter_samples()``), so an agent that raises, hangs past ``--agent-timeout-s`` or overflows
``--max-context-len`` costs that sample (reward 0, logged once, counted), not the run. The agent talks to the
rollout engine through ``ctx``:

- ``ctx.base_url`` / ``ctx.api_key`` / ``ctx.client(item)``: a local OpenAI-compatible ``/v1/chat/completions``
  endpoint (tools, ``tool_choice``, ``stop``, ``max_tokens``, sampling settings; ``n=1``; non-streaming) on the
  colocated engine; the session is named by the ``X-Areno-Session`` header (``ctx.client(item)`` sets it) or the
  request's ``user`` field;
- ``await ctx.generate(item, prompt_ids, ...)``: the token-level call.

A session is one growing token sequence (``Session``): the first call renders the prompt with the chat template;
each later call renders only the new messages, as the text the template puts after the last sampled token, appended
to the tokens so far; sampled tokens (and their log-probs) are kept as sampled, never decoded and re-encoded. A
history that does not extend the session's (an agent that rewrote or dropped part of it) closes the current
trajectory as a row and starts a new one from the full rendering (a fork, counted in ``agent_forks``). The prefix
cache serves the earlier turns, so a new turn prefills only its delta. Loss masks: sampled tokens 1, everything the
agent or the template adds 0 (tool results 1 with ``--train-tool-results``).
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import sys
import time
import traceback
import uuid
from dataclasses import dataclass, field

from areno.engine.token_service import RemoteTokens, sample_local
from areno.rl.agent_server import SESSION_HEADER, AgentError
from areno.training.batch import Row

log = logging.getLogger("areno.agent")


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
    def __init__(self, rollout: AgentRollout):
        self._rollout = rollout
        self.base_url = rollout.base_url
        self.api_key = rollout.api_key
        self._pool = None  # one HTTP connection pool per rollout, shared by the samples' clients

    def get_base_url(self) -> str:
        return self.base_url

    def client(self, item: AgentItem, **kwargs):
        """An ``openai.AsyncOpenAI`` client whose calls belong to ``item``'s session (``kwargs`` go to
        ``AsyncOpenAI``). Every sample's client shares one connection pool, which closing a client leaves open (the
        rollout closes it): a client with its own pool costs 30-100 ms to build, paid by every sample of a rollout."""
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
        async with session.lock:
            session.extend_tokens(list(prompt_ids))
            return await self._rollout.sample(session, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                              stop=stop)


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
    def __init__(self, item: AgentItem, tokenizer, *, eos_id: int, max_context_len: int, train_tool_results: bool):
        self.item, self.tok, self.eos_id = item, tokenizer, eos_id
        self.max_context_len, self.train_tool_results = max_context_len, train_tool_results
        self.lock = asyncio.Lock()
        self.rows: list[dict] = []  # closed trajectories (forks)
        self.forks = 0
        self.turns = 0
        self.prefilled: list[int] = []  # per turn: prompt tokens the engine computed (not from the prefix cache)
        self.samples: list[list[int]] = []  # per turn: the token ids the engine sampled
        self.key = 0  # which split-mode engine serves it
        self._reset()

    def _reset(self):
        self.tokens: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float | None] = []
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
                              "prompt_len": self.prompt_len, "messages": self.history,
                              "finish_reason": self.finish_reason})
        self._reset()

    def _start(self, messages, tools) -> None:
        ids = self._encode(self._render(messages, tools, True))
        self._append(ids, 0)
        self.prompt_len = len(self.tokens)
        self.history, self.tools = list(messages), tools

    def _append(self, ids, train: int, logprobs=None) -> None:
        self.tokens += ids
        self.mask += [train] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [None] * len(ids)

    def extend_messages(self, messages, tools) -> None:
        """Make the sequence end with ``messages`` rendered and the generation prompt: a delta, or a fork."""
        messages = [dict(m) for m in messages]
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
        self._check_room()

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
        if self.tokens and prompt_ids[: len(self.tokens)] == self.tokens and len(prompt_ids) >= len(self.tokens):
            self._append(prompt_ids[len(self.tokens):], 0)
        else:
            if self.tokens:
                self.forks += 1
                self._close()
            self._append(list(prompt_ids), 0)
            self.prompt_len = len(self.tokens)
        self._check_room()

    def _check_room(self) -> None:
        if len(self.tokens) >= self.max_context_len:
            raise AgentError(f"this conversation needs {len(self.tokens)} tokens before the answer, but the context "
                             f"is limited to --max-context-len {self.max_context_len}", "context_length_exceeded",
                             "messages")

    def add_sample(self, ids, logprobs, finish_reason, assistant: dict | None) -> None:
        self._append(list(ids), 1, list(logprobs))
        self.samples.append(list(ids))
        self.finish_reason = finish_reason
        self.turns += 1
        if assistant is not None and self.history is not None:
            self.history = self.history + [assistant]

    def finish(self) -> list[dict]:
        self._close()
        return self.rows


# ---- the rollout ---------------------------------------------------------------------------------------------------
class AgentRollout:
    """Runs the agent over a rollout batch on the colocated engine; returns one row per trajectory."""

    def __init__(self, loop, agent_fn):
        self.loop, self.agent_fn, self.cfg = loop, agent_fn, loop.cfg
        for name in ("httpx", "httpx2"):  # one INFO line per local request would drown the step lines
            logging.getLogger(name).setLevel(logging.WARNING)
        self.api_key = "areno-agent-" + uuid.uuid4().hex[:8]
        self.sessions: dict[str, Session] = {}
        self.async_engine = None
        self._remote = None
        self._greedy = False
        self._server = None
        self.base_url = self._start_server()

    # the local endpoint
    def _start_server(self) -> str:
        from areno.engine.token_service import serve_in_thread
        from areno.rl.agent_server import create_app

        self._server, self._thread, address = serve_in_thread(create_app(self), "127.0.0.1", "areno-agent-http")
        return address + "/v1"

    def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(10)
            self._server = None

    # sampling (called from the endpoint's loop or the agent's loop)
    async def sample(self, session: Session, *, max_tokens=None, temperature=None, top_p=None, stop=None,
                     assistant_message=False):
        from areno.config import SamplingParams

        cfg = self.cfg
        room = self.cfg_max_context() - len(session.tokens)
        asked = {"temperature": temperature} if temperature is not None and not self._greedy else {}
        options = SamplingParams.from_train_config(
            cfg, n=1, greedy=self._greedy, **asked, top_p=cfg.top_p if top_p is None else top_p,
            max_new_tokens=max(1, min(max_tokens or cfg.max_new_tokens, room)), min_new_tokens=0,
            stop=stop if isinstance(stop, str) else stop or cfg.stop)
        if self._remote is not None:  # split mode: the session's engine, always the same one (its prefix cache)
            out = await self._remote.sample(session.tokens, options, session.key)
        else:
            out = await sample_local(self.async_engine, session.tokens, options)
        ids, lps, finish, stop_text = out["ids"], out["logprobs"], out["finish_reason"], out["stop_text"]
        session.prefilled.append(len(session.tokens) - out["prefix_cached"])
        text = self.loop.tokenizer.decode(ids, skip_special_tokens=True)
        if stop_text:
            cut = text.find(stop_text)
            text = text[:cut] if cut >= 0 else text
        message = None
        if assistant_message:
            from areno.engine.tool_calls import parse_tool_calls

            content, calls = parse_tool_calls(text)
            message = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = [c.to_openai() for c in calls]
        session.add_sample(ids, lps, finish, message)
        return message if assistant_message else Generation(ids, lps, finish, text)

    def cfg_max_context(self) -> int:
        return self.cfg.max_context_len or (self.cfg.max_prompt_tokens + self.cfg.max_new_tokens)

    # one rollout batch
    def collect(self, batch: list[dict], n: int, reward_fn, *, greedy: bool = False):
        """``run``, then every sample the agent left unscored scored by ``reward_fn`` on its last trajectory (the
        record carries the messages); returns (rows, each row's sample, each sample's reward, failures, stats)."""
        from areno.rl.rewards import record_from, score

        rows, owner, rewards, stats = self.run(batch, n, greedy=greedy)
        t0 = time.perf_counter()
        last = dict(zip(owner, rows))  # sample -> its last trajectory
        failures = stats.pop("agent_failures") + sum(r is None and i not in last for i, r in enumerate(rewards))
        todo = [i for i, r in enumerate(rewards) if r is None and i in last]
        if todo and reward_fn is not None:
            records = []
            for i in todo:
                row = last[i]
                sampled = [t for t, m in zip(row.response_ids, row.loss_mask) if m]
                msgs = row.meta.get("messages") or []
                text = next((m.get("content") or "" for m in reversed(msgs) if m.get("role") == "assistant"),
                            self.loop.tokenizer.decode(sampled, skip_special_tokens=True))
                records.append(record_from({**batch[i // n], "messages": msgs}, text, sampled, len(records)))
            scored, bad = score(reward_fn, records, timeout_s=self.cfg.reward_timeout_s or None)
            for i, value in zip(todo, scored):
                rewards[i] = value
            failures += bad
        stats["reward_s"] = time.perf_counter() - t0
        return rows, owner, [0.0 if r is None else r for r in rewards], failures, stats

    def run(self, batch: list[dict], n: int, *, greedy: bool = False):
        """Rows (one per trajectory), each row's sample index, each sample's agent reward (None: score with
        --reward-fn-path) and stats, for this rank's ``batch`` with ``n`` samples per prompt (``greedy``: every
        answer at temperature 0, for evaluation)."""
        from areno.engine.async_engine import AsyncEngine

        split = getattr(self.loop.engine, "split", False)
        if split and not batch:  # a train rank other than 0: rank 0 runs the agents
            return [], [], [], {"agent_s": 0.0, "agent_failures": 0, "agent_forks": 0, "agent_turns_mean": 0.0,
                                "agent_prefill_tokens_mean": 0.0}
        items = [AgentItem({k: v for k, v in row.items() if not (isinstance(k, str) and k.startswith("_"))},
                           _messages(row["prompt"]), p, s) for p, row in enumerate(batch) for s in range(n)]
        eos = self.loop.tokenizer.eos_token_id
        self._greedy = greedy
        self.sessions = {it.id: Session(it, self.loop.tokenizer, eos_id=eos, max_context_len=self.cfg_max_context(),
                                        train_tool_results=self.cfg.train_tool_results) for it in items}
        for k, it in enumerate(items):
            self.sessions[it.id].key = k
        t0 = time.perf_counter()
        if split:
            addresses, token = self.loop.engine.agent_begin()
            try:
                rewards, failures = asyncio.run(self._run_all(items, (addresses, token)))
            finally:
                self.loop.engine.agent_end(addresses, token)
        else:
            self.loop.engine.refresh()  # stale prefixes from the previous policy go
            self.loop.model.eval()
            self.async_engine = AsyncEngine(self.loop.engine.engine, decode_steps=self.cfg.decode_steps)
            # the engine thread and the agents' event loop share the GIL: with the default 5 ms switch interval a
            # turn boundary's hundreds of resubmissions queue behind engine steps 5 ms at a time
            # and no cyclic-GC pass during the rollout: a full collection over its many small objects stalls both
            interval, collecting = sys.getswitchinterval(), gc.isenabled()
            sys.setswitchinterval(min(interval, 0.0005))
            gc.disable()
            try:
                rewards, failures = asyncio.run(self._run_all(items))
            finally:
                sys.setswitchinterval(interval)
                if collecting:
                    gc.enable()
                self.async_engine.shutdown(drain=False)
                self.async_engine = None
                self.loop.model.train()
        rows, owner, stats = [], [], {"agent_s": time.perf_counter() - t0, "agent_failures": failures}
        forks = turns = 0
        prefilled = []
        for i, it in enumerate(items):
            s = self.sessions[it.id]
            forks, turns = forks + s.forks, turns + s.turns
            prefilled += s.prefilled
            for traj in s.finish():
                P = traj["prompt_len"]
                row = Row(traj["tokens"][:P], traj["tokens"][P:], [x if x is not None else 0.0
                                                                     for x in traj["logprobs"][P:]])
                row.loss_mask = traj["mask"][P:]
                row.meta.update(messages=traj["messages"], finish_reason=traj["finish_reason"], item=it.id)
                rows.append(row)
                owner.append(i)
        stats.update(agent_forks=forks, agent_turns_mean=turns / max(1, len(items)),
                     agent_prefill_tokens_mean=sum(prefilled) / max(1, len(prefilled)))
        return rows, owner, rewards, stats

    async def _run_all(self, items, remote=None):
        ctx = AgentContext(self)
        self._remote = RemoteTokens(*remote) if remote is not None else None
        try:
            results = await asyncio.gather(*(self._run_one(ctx, it) for it in items))
        finally:
            await ctx.aclose()
            if self._remote is not None:
                await self._remote.aclose()
                self._remote = None
        return [r for r, _ in results], sum(not ok for _, ok in results)

    async def _run_one(self, ctx, item) -> tuple[float | None, bool]:
        timeout = self.cfg.agent_timeout_s or None
        try:
            out = await asyncio.wait_for(self.agent_fn(ctx, AgentBatch([item])), timeout)
        except asyncio.TimeoutError:
            _warn_once(("timeout",), f"agent timed out after --agent-timeout-s {timeout:g}s on prompt "
                       f"{item.prompt_index} sample {item.sample_index}: scored 0.0 (later timeouts counted, not "
                       "logged)")
            return 0.0, False
        except (Exception, SystemExit) as e:  # a broken agent costs the sample, not the run
            frame = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
            _warn_once((type(e).__name__, frame and frame.filename, frame and frame.lineno),
                       f"agent raised on prompt {item.prompt_index} sample {item.sample_index}: scored 0.0 "
                       f"(later ones counted, not logged)\n{''.join(traceback.format_exception(e)).rstrip()}")
            return 0.0, False
        return _reward_of(out, item), True


def _shared_pool(openai):
    class SharedPool(openai.DefaultAsyncHttpxClient):
        async def aclose(self) -> None:  # a sample's client closing (``async with``) leaves the pool to the rollout
            pass

        async def close_pool(self) -> None:
            await super().aclose()

    return SharedPool()


def _reward_of(out, item) -> float | None:
    if isinstance(out, dict):
        out = out.get(item.id, out.get((item.prompt_index, item.sample_index)))
    elif isinstance(out, (list, tuple)):
        out = out[0] if out else None
    return None if out is None else float(out)


def _messages(prompt) -> list:
    return list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]


_warned: set = set()


def _warn_once(key, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message)
