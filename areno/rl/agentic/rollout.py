"""The agentic rollout: every (prompt, sample) of a batch run by the user's agent on the rollout's token sampler, its
sessions turned into rows (one per trajectory) and scored (areno.rl.agentic describes the whole)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import traceback
import uuid

from areno.config import SamplingParams
from areno.rl.agentic import session as session_module
from areno.rl.agentic.session import AgentBatch, AgentContext, AgentItem, Generation, Session
from areno.rl.agentic.threads import AgentThread
from areno.rl.rewards import record_from, reward_value, score, shown, user_fields
from areno.training.batch import Row
from areno.training.plugins import stuck_calls

log = logging.getLogger("areno.agent")


# ---- the rollout ---------------------------------------------------------------------------------------------------
class AgentRollout:
    """Runs the agent over a rollout batch on ``rollout``'s token sampler (a ``Rollout``: colocated or remote);
    returns one row per trajectory. ``cfg``: the TrainConfig (sampling, limits, timeouts)."""

    def __init__(self, rollout, agent_fn, tokenizer, cfg, tool_format=None):
        from areno.engine.tool_calls import format_for, special_tokens

        self.rollout, self.agent_fn, self.tokenizer, self.cfg = rollout, agent_fn, tokenizer, cfg
        self.tool_format = tool_format or format_for(None)  # the policy's family's (areno serve reads the same)
        self.special_tokens = special_tokens(tokenizer)
        for name in ("httpx", "httpx2"):  # one INFO line per local request would drown the step lines
            logging.getLogger(name).setLevel(logging.WARNING)
        self.api_key = "areno-agent-" + uuid.uuid4().hex[:8]
        self.sessions: dict[str, Session] = {}
        self._tokens = None  # the token sampler's client, while a batch runs
        self._greedy = False
        self._server = None
        self._loop = None  # the event loop of the running batch (its token sampler's)
        self._token_bytes = None  # session.max_token_bytes, found on the first batch
        self._running = threading.Lock()  # one batch at a time (the sessions, the loop): batches sent ahead run on
        # a thread of their own (areno.rl.agentic.ahead) while evaluation may run one on the loop's thread
        self.base_url = self._start_server()

    # the local endpoint
    def _start_server(self) -> str:
        from areno.engine.token_service import serve_in_thread
        from areno.rl.agentic.endpoint import create_app

        self._server, self._thread, address = serve_in_thread(create_app(self), "127.0.0.1", "areno-agent-http")
        return address + "/v1"

    def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(10)
            self._server = None

    # sampling (called from the endpoint's loop or the agent's loop)
    async def sample(self, session: Session, *, max_tokens=None, temperature=None, top_p=None, stop=None,
                     assistant_message=False, tools=None, plan=None):
        cfg = self.cfg
        room = self.cfg_max_context() - len(session.tokens)
        asked = {"temperature": temperature} if temperature is not None and not self._greedy else {}
        if plan is not None and plan.grammar is not None:  # a forced or strict tool call, as areno serve runs it
            asked["grammar"] = plan.grammar
        options = SamplingParams.from_train_config(
            cfg, n=1, greedy=self._greedy, **asked, top_p=cfg.top_p if top_p is None else top_p,
            max_new_tokens=max(1, min(max_tokens or cfg.max_new_tokens, room)), min_new_tokens=0,
            stop=stop if isinstance(stop, str) else stop or cfg.stop)
        # split mode: the session's engine (by its key), always the same one (its prefix cache)
        if self._tokens is None:
            raise session_module.batch_over()
        out = await self._tokens.sample(session.tokens, options, session.key)
        ids, lps, finish, stop_text = out["ids"], out["logprobs"], out["finish_reason"], out["stop_text"]
        session.prefilled.append(len(session.tokens) - out["prefix_cached"])
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if stop_text:
            cut = text.find(stop_text)
            text = text[:cut] if cut >= 0 else text
        message = None
        if assistant_message:
            message = self.assistant_message(ids, stop_text, text, tools, plan)
        session.add_sample(ids, lps, finish, message, out.get("version"))
        return message if assistant_message else Generation(ids, lps, finish, text)

    def assistant_message(self, ids: list[int], stop_text: str | None, text: str, tools=None, plan=None) -> dict:
        """A sample as the assistant message the agent gets: its tool calls (and reasoning) read in the policy's
        tool-call format, as ``areno serve`` reads them (``tools``: the request's, which type XML arguments;
        ``plan``: its tool_choice's ``ToolPlan``, read with ``read_calls`` as the server reads it)."""
        from areno.engine.tool_calls import read_answer, read_calls

        fmt = self.tool_format
        if fmt.special_markup:  # its markers are special tokens: read the text with them
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
            cut = text.find(stop_text) if stop_text else -1
            text = text[:cut] if cut >= 0 else text
        if plan is not None:
            parsed = read_calls(fmt, text, plan, self.special_tokens)
        else:
            parsed = read_answer(fmt, text, tools, self.special_tokens)
        message = {"role": "assistant", "content": parsed.content}
        if parsed.reasoning is not None:
            message["reasoning_content"] = parsed.reasoning
        if parsed.calls:
            message["tool_calls"] = [c.to_openai() for c in parsed.calls]
        return message

    def cfg_max_context(self) -> int:
        return self.cfg.max_context_len or (self.cfg.max_prompt_tokens + self.cfg.max_new_tokens)

    # one rollout batch
    def collect(self, batch: list[dict], n: int, reward_fn, *, greedy: bool = False):
        """``run``, then every sample the agent left unscored scored by ``reward_fn`` on its last trajectory (the
        record carries the messages); returns (rows, each row's sample, each sample's reward, failures, stats)."""
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
                            self.tokenizer.decode(sampled, skip_special_tokens=True))
                records.append(record_from({**batch[i // n].row, "messages": msgs}, text, sampled, len(records)))
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
        if not batch:  # nothing to run here (split mode: train rank 0 runs every agent)
            return [], [], [], {"agent_s": 0.0, "agent_failures": 0, "agent_forks": 0, "agent_turns_mean": 0.0,
                                "agent_prefill_tokens_mean": 0.0, "agent_context_overflows": 0}
        with self._running:
            return self._run(batch, n, greedy)

    def _run(self, batch: list[dict], n: int, greedy: bool):
        items = [AgentItem(user_fields(p.row),
                           _messages(p.row["prompt"]), i, s) for i, p in enumerate(batch) for s in range(n)]
        eos = self.tokenizer.eos_token_id
        self._greedy = greedy
        if self._token_bytes is None:
            self._token_bytes = session_module.max_token_bytes(self.tokenizer)
        self.sessions = {it.id: Session(it, self.tokenizer, eos_id=eos, max_context_len=self.cfg_max_context(),
                                        train_tool_results=self.cfg.train_tool_results,
                                        max_token_bytes=self._token_bytes) for it in items}
        for k, it in enumerate(items):
            self.sessions[it.id].key = k
        t0 = time.perf_counter()
        with self.rollout.token_sampler() as tokens:
            rewards, failures = asyncio.run(self._run_all(items, tokens))
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
                row.versions = session_module.token_versions(traj["versions"][P:])
                row.meta.update(messages=traj["messages"], finish_reason=traj["finish_reason"], item=it.id,
                                **({"versions": row.versions} if row.versions else {}))  # dumps show them
                rows.append(row)
                owner.append(i)
        stats.update(agent_forks=forks, agent_turns_mean=turns / max(1, len(items)),
                     agent_context_overflows=sum(self.sessions[it.id].overflowed for it in items),
                     agent_prefill_tokens_mean=sum(prefilled) / max(1, len(prefilled)))
        return rows, owner, rewards, stats

    async def _run_all(self, items, tokens):
        self._loop = asyncio.get_running_loop()
        self._tokens = tokens()  # made inside this event loop (an HTTP client in split mode)
        try:
            if stuck_calls.full():
                _warn_once(("stuck",), f"{stuck_calls.count()} agent or reward calls are stuck past their timeout "
                           "(the limit): this batch's samples are scored 0.0 without running the agent and the run "
                           "stops after this step")
                results = [(0.0, False)] * len(items)
            else:
                results = await asyncio.gather(*(self._run_one(it) for it in items))
        finally:
            await self._tokens.aclose()
            self._tokens = self._loop = None
        return [r for r, _ in results], sum(not ok for _, ok in results)

    async def on_loop(self, coro):
        """Await ``coro`` on the rollout's own event loop (the token sampler's), from an agent's thread."""
        loop = self._loop
        if loop is None:
            coro.close()
            raise session_module.batch_over()
        if asyncio.get_running_loop() is loop:
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))

    async def _run_one(self, item) -> tuple[float | None, bool]:
        """One sample's agent call on its own thread (a blocking call in it stalls nothing else and the timeout
        still fires); its reward, or 0.0 and a failure."""
        timeout = self.cfg.agent_timeout_s or None
        call = AgentThread(self.agent_fn, AgentContext(self), AgentBatch([item]))
        try:
            kind, out = await asyncio.wait_for(call.outcome, timeout)
        except asyncio.TimeoutError:
            call.abandon()
            self.sessions[item.id].end_timed_out(timeout)
            _warn_once(("timeout",), f"agent timed out after --agent-timeout-s {timeout:g}s on prompt "
                       f"{item.prompt_index} sample {item.sample_index}: scored 0.0 (later timeouts counted, not "
                       "logged)")
            return 0.0, False
        if kind == "raised":  # a broken agent costs the sample, not the run
            frame = traceback.extract_tb(out.__traceback__, limit=10_000)[-1] if out.__traceback__ else None
            _warn_once((type(out).__name__, frame and frame.filename, frame and frame.lineno),
                       f"agent raised on prompt {item.prompt_index} sample {item.sample_index}: scored 0.0 "
                       f"(later ones counted, not logged)\n{''.join(traceback.format_exception(out)).rstrip()}")
            return 0.0, False
        return _reward_of(out, item)


def _reward_of(out, item) -> tuple[float | None, bool]:
    """The agent's reward for ``item`` from what ``run_agent`` returned (None: left to --reward-fn-path) and whether
    it is one: a string, NaN, inf or ``10**400`` is 0.0 and a failure."""
    if isinstance(out, dict):
        out = out.get(item.id, out.get((item.prompt_index, item.sample_index)))
    elif isinstance(out, (list, tuple)):
        out = out[0] if out else None
    if out is None:
        return None, True
    reward = reward_value(out)
    if reward is None:
        _warn_once(("reward", type(out).__name__), f"agent returned {shown(out)} ({type(out).__name__}) as the reward "
                   f"of prompt {item.prompt_index} sample {item.sample_index}: not a finite number, scored 0.0 and "
                   "counted as a failure (later ones counted, not logged)")
        return 0.0, False
    return reward, True


def _messages(prompt) -> list:
    return list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]


_warned: set = set()


def _warn_once(key, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message)
