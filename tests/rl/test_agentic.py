"""Agentic rollout on a tiny checkpoint: token-in/token-out sessions through an unchanged openai client, loss masks,
forks, the delta-only prefill, failures that cost one sample, and the trajectory dump."""

import json
import logging
import random
from dataclasses import replace

import pytest

from areno.config import TrainConfig
from areno.rl.loop import TrainLoop
from areno.testing import make_tiny_checkpoint

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
