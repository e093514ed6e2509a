"""Agentic rollout on a tiny checkpoint: token-in/token-out sessions through an unchanged openai client, loss masks,
forks, the delta-only prefill, failures that cost one sample (raising, hanging or blocking agents, non-number
rewards, turns past the context), and the trajectory dump."""

import json
import logging
import random
import threading
import time
from dataclasses import replace

import pytest
import torch

from areno.config import RunError, TrainConfig
from areno.rl.loop import TrainLoop
from areno.testing import make_tiny_checkpoint
from areno.training.plugins import stuck_calls

TOOLS = '''TOOLS = [{"type": "function", "function": {"name": "add", "description": "add two integers",
          "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
'''


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("agentic")
    ckpt = make_tiny_checkpoint(root / "ckpt", family="qwen3", seed=0)
    rng = random.Random(0)
    rows = [{"prompt": [{"role": "user", "content": f"{rng.randint(0, 9)}+{rng.randint(0, 9)}= use the tool"}],
             "answer": "7"} for _ in range(8)]
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ckpt, data, root


def agent_file(root, body: str, name: str):
    path = root / f"{name}.py"
    path.write_text("import asyncio, json, openai\n" + TOOLS + body)
    return path


THREE_TURNS = """
async def run_agent(ctx, batch):
    for item in batch.iter_samples():
        client = ctx.client(item)  # an unchanged openai.AsyncOpenAI
        messages = list(item.messages)
        for turn in range(3):
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                                         max_tokens=6)
            messages.append(reply.choices[0].message.model_dump(exclude_none=True))
            messages.append({"role": "tool", "tool_call_id": "call_1", "content": f"result {turn} 12"})
        return 1.0 if item.sample_index == 0 else 0.0
"""


def make_loop(files, agent, **kw):
    ckpt, data, root = files
    cfg = TrainConfig(ckpt=str(ckpt), dataset_path=str(data), agent_fn=str(agent), algo="grpo", batch_size=2,
                      n_samples=2, mini_bs=4, max_new_tokens=6, dtype="float32", lr=1e-3, tensorboard=False,
                      metrics_dir=str(root / "m"), seed=0, temperature=1.0)
    loop = TrainLoop(replace(cfg, **kw))
    loop.setup()
    return loop


def test_three_turns_train_on_the_sampled_tokens_plus_rendered_deltas(files):
    ckpt, data, root = files
    loop = make_loop(files, agent_file(root, THREE_TURNS, "three"))
    try:
        batch = next(iter(loop.data))
        rows, stats = loop.rollout(batch)
        sessions = list(loop.agent.sessions.values())
        tok = loop.tokenizer
        assert len(rows) == 4 and stats["agent_forks"] == 0 and stats["agent_turns_mean"] == 3
        lossy = 0
        for row, s in zip(rows, sessions):
            tokens = row.prompt_ids + row.response_ids
            mask = [0] * len(row.prompt_ids) + row.loss_mask
            # the trained positions are exactly the engine's samples, turn after turn
            runs, gaps, run, prev = [], [0], [], 0
            for t, m in zip(tokens, mask):
                if m and not prev:
                    run = []
                    runs.append(run)
                elif not m and prev:
                    gaps.append(0)
                if m:
                    run.append(t)
                else:
                    gaps[-1] += 1
                prev = m
            assert runs == s.samples and len(runs) == 3
            # a later turn prefills only its delta (plus at most one partly filled block of the turn before)
            block = loop.engine.engine.config.block_size
            assert all(s.prefilled[k] <= gaps[k] + block + 1 for k in (1, 2)), (s.prefilled, gaps)
            lossy += sum(tok.encode(tok.decode(ids), add_special_tokens=False) != ids for ids in s.samples)
            # the context between them is the template's rendering of the new messages, nothing re-tokenised
            first = tok.encode(tok.apply_chat_template(s.item.messages, tools=TOOL_SCHEMAS,
                                                       add_generation_prompt=True, tokenize=False),
                               add_special_tokens=False)
            assert row.prompt_ids == first
            assert len(row.rollout_logprobs) == len(row.response_ids)
        assert lossy > 0, "no sample with a lossy decode/encode round trip: the test proves less than it should"
        m = loop.step(batch)
        assert m["logprob_diff_max"] < 1e-4  # the trainer scores exactly the sampled tokens
    finally:
        loop.close()


TOOL_SCHEMAS = [{"type": "function", "function": {"name": "add", "description": "add two integers",
                 "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


def test_tool_results_are_trained_only_with_the_flag(files):
    ckpt, data, root = files
    loop = make_loop(files, agent_file(root, THREE_TURNS, "three_b"), train_tool_results=True)
    try:
        rows, _ = loop.rollout(next(iter(loop.data)))
        s = next(iter(loop.agent.sessions.values()))
        trained = sum(rows[0].loss_mask)
        assert trained > sum(len(x) for x in s.samples)  # tool-result deltas are trained too
    finally:
        loop.close()


DROPS_HISTORY = """
async def run_agent(ctx, batch):
    for item in batch.iter_samples():
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
        messages = list(item.messages)
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=5, user=item.id)
        answer = reply.choices[0].message.model_dump(exclude_none=True)
        answer["content"] = "(summarised)"  # rewrites history, as agents that drop a thinking block do
        messages += [answer, {"role": "user", "content": "go on"}]
        await client.chat.completions.create(model="policy", messages=messages, max_tokens=5, user=item.id)
"""


def test_a_rewritten_history_forks_without_duplicating_tokens(files):
    ckpt, data, root = files
    reward = root / "reward.py"
    reward.write_text("def reward_fn(record):\n    return float(len(record['messages']))\n")
    loop = make_loop(files, agent_file(root, DROPS_HISTORY, "drops"), reward_fn_path=str(reward))
    try:
        batch = next(iter(loop.data))
        rows, stats = loop.rollout(batch)
        assert stats["agent_forks"] == 4 and len(rows) == 8
        for s in loop.agent.sessions.values():
            ids = [r for r in rows if r.meta["item"] == s.item.id]
            assert len(ids) == 2
            sampled = [[t for t, m in zip(r.response_ids, r.loss_mask) if m] for r in ids]
            assert sampled == s.samples  # each turn's tokens once, in its own row
        assert all(r.reward == 4.0 for r in rows)  # the reward function saw the trajectory's messages
        m = loop.step(batch)
        assert m["groups"] == 2 and m["samples"] == 4
    finally:
        loop.close()


FAILING = """
async def run_agent(ctx, batch):
    for item in batch.iter_samples():
        client = ctx.client(item)
        if item.prompt_index == 0 and item.sample_index == 0:
            raise RuntimeError("tool backend down")
        if item.prompt_index == 0 and item.sample_index == 1:
            await asyncio.sleep(60)
        messages = list(item.messages) + [{"role": "user", "content": "x " * 400}]
        try:
            await client.chat.completions.create(model="policy", messages=messages, max_tokens=5)
        except openai.BadRequestError as e:
            assert e.code == "context_length_exceeded", e
            if item.sample_index == 0:
                raise
            return 0.5
        return 1.0
"""


def test_a_raising_hanging_or_overflowing_agent_costs_one_sample(files, caplog):
    ckpt, data, root = files
    loop = make_loop(files, agent_file(root, FAILING, "failing"), agent_timeout_s=2.0, max_context_len=200)
    try:
        with caplog.at_level(logging.WARNING, logger="areno.agent"):
            m = loop.step(next(iter(loop.data)))
        assert m["reward_failures"] == 3  # raised, timed out, overflow re-raised; the fourth handled its 400
        assert m["samples"] == 4 and "loss" in m or m.get("skipped")
        text = caplog.text
        assert "agent raised" in text and "tool backend down" in text and "--agent-timeout-s 2" in text
    finally:
        loop.close()


def test_the_dump_holds_every_rows_tokens_mask_and_messages(files, tmp_path):
    ckpt, data, root = files
    loop = make_loop(files, agent_file(root, THREE_TURNS, "three_c"), rollout_dump_dir=str(tmp_path / "dump"))
    try:
        loop.step(next(iter(loop.data)))
    finally:
        loop.close()
    lines = [json.loads(x) for x in (tmp_path / "dump" / "step-1.jsonl").read_text().splitlines()]
    assert len(lines) == 4
    for rec in lines:
        assert len(rec["loss_mask"]) == len(rec["response_ids"]) == len(rec["rollout_logprobs"])
        assert rec["policy_version"] == 0 and rec["finish_reason"] in ("length", "stop")
        assert [m["role"] for m in rec["messages"]][-1] == "assistant" and "reward" in rec


EVAL_AGENT = """
async def run_agent(ctx, batch):
    for item in batch.iter_samples():
        client = ctx.client(item)
        reply = await client.chat.completions.create(model="policy", messages=item.messages, max_tokens=6,
                                                     temperature=1.5)  # evaluation overrides it: greedy
        return 1.0 if item.prompt_index % 2 == 0 else 0.0
"""


def test_held_out_rows_are_evaluated_through_the_agent_greedily(files):
    ckpt, data, root = files
    loop = make_loop(files, agent_file(root, EVAL_AGENT, "evaluator"))
    try:
        rows = loop.rows[:4]
        assert loop.evaluate(rows) == 0.5
        first = [s.samples for s in loop.agent.sessions.values()]
        assert loop.evaluate(rows) == 0.5
        assert [s.samples for s in loop.agent.sessions.values()] == first  # greedy: the same answers again
    finally:
        loop.close()


# ---- issue 37: user code that takes the run down costs its sample ------------------------------------------------
ONE_TURN = """
async def run_agent(ctx, batch):
    for item in batch.iter_samples():
        await ctx.client(item).chat.completions.create(model="policy", messages=item.messages, max_tokens=4)
"""
BAD_REWARDS = """
BAD = {(0, 0): float("nan"), (0, 1): 1.0, (0, 2): float("inf"), (1, 0): "abc", (1, 1): 10**400, (1, 2): 0.5}
""" + ONE_TURN + """        return BAD[item.prompt_index, item.sample_index]
"""


def test_nan_inf_string_and_huge_agent_rewards_are_failures_and_the_rest_still_trains(files, caplog):
    ckpt, data, root = files
    loop = make_loop(files, agent_file(root, BAD_REWARDS, "bad_rewards"), n_samples=3, mini_bs=6)
    try:
        before = [p.detach().clone() for p in loop.model.parameters()]
        with caplog.at_level(logging.WARNING, logger="areno.agent"):
            m = loop.step(next(iter(loop.data)))
        assert m["samples"] == 6 and m["reward_failures"] == 4 and not m.get("skipped")
        assert m["reward_mean"] == pytest.approx(1.5 / 6)  # the failures score 0.0, the rest as returned
        assert any(not torch.equal(a, b) for a, b in zip(before, loop.model.parameters()))  # an update happened
        assert "not a finite number" in caplog.text
    finally:
        loop.close()


BLOCKING = """
import os, time
import httpx
""" + ONE_TURN + """        if item.prompt_index == 0 and item.sample_index == 0:
            while not os.path.exists(FLAG):  # a blocking call: time.sleep inside the coroutine
                time.sleep(0.05)
            # woken after its timeout (a synchronous call: its task's cancellation waits for the next await)
            reply = httpx.post(ctx.base_url + "/chat/completions", json={"messages": item.messages},
                               headers={"authorization": f"Bearer {ctx.api_key}", "X-Areno-Session": item.id})
            with open(FLAG + ".code", "w") as f:
                f.write(f"{reply.status_code} {reply.json()['error']['code']}")
        return 1.0
"""


def test_a_blocking_agent_times_out_and_its_thread_is_counted_until_it_ends(files, tmp_path):
    ckpt, data, root = files
    flag = tmp_path / "release"
    agent = agent_file(root, f"FLAG = {str(flag)!r}\n" + BLOCKING, "blocking")
    loop = make_loop(files, agent, agent_timeout_s=1.0)
    out = {}
    try:
        worker = threading.Thread(target=lambda: out.update(m=loop.step(next(iter(loop.data)))), daemon=True)
        t0 = time.monotonic()
        worker.start()
        worker.join(90)
        hung = worker.is_alive()
        stuck = stuck_calls.count()
        flag.touch()  # let the blocked call (and, before the fix, the whole rollout) go
        worker.join(30)
        assert not hung, "--agent-timeout-s never fired on a blocking agent"
        assert time.monotonic() - t0 < 90
        m = out["m"]
        assert m["samples"] == 4 and m["reward_failures"] == 1 and m["stuck_calls"] == 1 and stuck == 1
        deadline = time.monotonic() + 10
        while stuck_calls.count() and time.monotonic() < deadline:  # released: its thread ends and leaves the count
            time.sleep(0.05)
        assert stuck_calls.count() == 0
        assert (tmp_path / "release.code").read_text() == "400 sample_ended"  # its later call is refused
    finally:
        flag.touch()
        loop.close()


OVERLONG = """
async def run_agent(ctx, batch):
    for item in batch.iter_samples():
        client = ctx.client(item)
        reply = await client.chat.completions.create(model="policy", messages=item.messages, max_tokens=4)
        messages = list(item.messages) + [reply.choices[0].message.model_dump(exclude_none=True)]
        if item.prompt_index == 0:  # a 3,000-token turn
            messages.append({"role": "user", "content": "x " * 3000})
        else:  # a 10 MB tool result
            messages.append({"role": "tool", "tool_call_id": "call_1", "content": "ab1 " * (10 * 2**18)})
        for attempt in range(2):  # the turn is refused, and so is any later one: the sample has ended
            try:
                await client.chat.completions.create(model="policy", messages=messages[: len(messages) - attempt],
                                                     max_tokens=4)
                return -1.0
            except openai.BadRequestError as e:
                assert e.code == "context_length_exceeded", e
        return 1.0 if item.sample_index == 0 else 0.0
"""


def test_a_turn_past_the_context_ends_its_sample_and_the_run_goes_on(files):
    ckpt, data, root = files
    loop = make_loop(files, agent_file(root, OVERLONG, "overlong"))
    try:
        t0 = time.monotonic()
        rows, stats = loop.rollout(next(iter(loop.data)))
        assert time.monotonic() - t0 < 60  # the 10 MB result is refused without encoding it (a minute per sample)
        assert stats["agent_context_overflows"] == 4 and stats["reward_failures"] == 0
        assert len(rows) == 4 and all(r.meta["finish_reason"] == "length" for r in rows)
        limit = loop.agent.cfg_max_context()
        assert all(len(r.prompt_ids) + len(r.response_ids) < limit for r in rows)  # nothing of the refused turn
        m = loop.step(next(iter(loop.data)))  # before: IndexError (index 2048) in the update
        assert m["samples"] == 4 and m["agent_context_overflows"] == 4 and "loss" in m
    finally:
        loop.close()


NAN_ALWAYS = ONE_TURN + """        return float("nan")
"""


def test_an_agent_whose_rewards_are_always_nan_stops_the_run_with_a_line_naming_it_and_a_checkpoint(files, tmp_path):
    ckpt, data, root = files
    agent = agent_file(root, NAN_ALWAYS, "nan_always")
    loop = make_loop(files, agent, max_reward_failure_steps=1, max_steps=3, save_path=str(tmp_path / "out"))
    try:
        with pytest.raises(RunError) as stop:  # before: every update skipped, exit 0
            loop.run()
    finally:
        loop.close()
    assert f"--agent-fn {agent}" in str(stop.value) and "--reward-fn-path" not in str(stop.value)
    assert "every reward failed in the last 1 steps" in str(stop.value)
    assert (tmp_path / "out" / "step-1" / "COMPLETE").is_file()


def test_a_token_level_turn_past_the_context_is_undone_and_ends_the_session(files):
    from transformers import AutoTokenizer

    from areno.rl.agentic import AgentError, AgentItem, Session

    tok = AutoTokenizer.from_pretrained(files[0])
    s = Session(AgentItem({}, [], 0, 0), tok, eos_id=tok.eos_token_id, max_context_len=50, train_tool_results=False)
    s.extend_tokens([1, 2, 3])
    s.add_sample([4, 5], [-0.1, -0.2], "stop", None)
    with pytest.raises(AgentError) as refused:
        s.extend_tokens([1, 2, 3, 4, 5] + [6] * 100)  # ctx.generate with a context past the limit
    assert refused.value.code == "context_length_exceeded"
    assert s.tokens == [1, 2, 3, 4, 5] and s.mask == [0, 0, 0, 1, 1] and s.finish_reason == "length"
    with pytest.raises(AgentError, match="this sample has ended"):
        s.extend_tokens([1, 2, 3, 4, 5, 6])
    (row,) = s.finish()
    assert row["tokens"] == [1, 2, 3, 4, 5] and row["finish_reason"] == "length"
