"""The agentic quickstart's task: sums of two 7-digit numbers, which the model can only get right through an ``add``
tool, demonstrated by a teacher who often skips the tool.

An episode is a conversation of two policy turns. The prompt is a short system line naming the tool and one user
message such as ``"3821733+1930566="`` (operands below 5,000,000, so every sum has 7 digits too). The policy calls
the tool, ``<tool_call>\\n{"name": "add", "arguments": {"a": 3821733, "b": 1930566}}\\n</tool_call>``, the agent
runs it and sends the result back as a ``tool`` message (``5752299``), and the policy answers with the number. The
reward is 1 when the final answer is exactly the sum. A tiny model cannot add 7-digit numbers itself, but it can
learn to copy them into the call and to copy the tool's result into its answer.

The demonstrations come one row per assistant turn, the conversation before the turn as the row's prompt and the
turn as its ``response`` (the SFT warm-up trains a row's response, nothing of its prompt, so the tool's result is
context, never a target):

- first turns, one per training problem: in a fixed fraction of them (``teacher_skips``, 0.7 by default) the
  teacher skips the tool and answers from a mental estimate, ``"about 5800000"`` (the sum rounded to its two leading
  digits, so almost never exact); otherwise it calls the tool correctly;
- answer turns, for a share of the problems (``answer_rows``, 0.5): the prompt runs up to the tool's result and the
  response is that result.

So the warm-up teaches the teacher's habit: the model starts about 70% of its first turns with ``about``, and
greedy decoding answers every held-out problem that way (held-out success near 0%), while sampling still calls the
tool in about 30% of the episodes. GRPO through the agent moves the model onto the tool. Every row is also an RL
prompt (an answer-turn row is an episode that starts at the tool's result); the held-out rows (``split: "test"``)
are first turns, which ``areno train`` evaluates through the agent, greedily.

The file is a plugin for ``--dataset-loader-fn`` (``load_training_dataset``; ``--dataset-path`` is an optional
comma-separated ``key=value`` spec of ``generate``'s arguments, e.g. ``"n_eval=100,teacher_skips=0.5"``) and
``--agent-fn`` (``run_agent``, which returns each episode's reward, so no ``--reward-fn-path`` is needed).
"""

from __future__ import annotations

import json
import random
import re

DEFAULTS = dict(seed=0, digits=7, n_train=8000, n_eval=200, teacher_skips=0.7, answer_rows=0.5)
SYSTEM = "Tool: add(a, b)."
MAX_TURNS = 3  # policy replies per episode: the tool call and the answer, and one to spare
NUMBER = re.compile(r"-?\d+")


# ---- the tool and the episode's outcome --------------------------------------------------------------------------
def add(arguments) -> str:
    """The ``add`` tool: ``{"a": int, "b": int}`` (or its JSON text) -> their sum as text; anything else -> an
    ``error: ...`` text (a tool result, not an exception: a bad call costs the episode, never the run)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return "error: the arguments are not JSON"
    if not isinstance(arguments, dict) or set(arguments) != {"a", "b"}:
        return "error: add takes exactly the integers a and b"
    values = []
    for key in ("a", "b"):
        v = arguments[key]
        if isinstance(v, str) and re.fullmatch(r"-?\d{1,30}", v.strip()):
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int) or abs(v) >= 10**30:
            return f"error: {key} is not an integer"
        values.append(v)
    return str(values[0] + values[1])


def run_tool(name: str, arguments) -> str:
    return add(arguments) if name == "add" else f"error: unknown tool {name!r} (the only tool is add)"


def episode_reward(messages: list[dict], answer) -> float:
    """1.0 when the conversation's last message is an assistant reply without a tool call whose last number is
    exactly ``answer``, else 0.0."""
    last = messages[-1] if messages else {}
    if last.get("role") != "assistant" or last.get("tool_calls"):
        return 0.0
    numbers = NUMBER.findall(last.get("content") or "")
    return 1.0 if numbers and numbers[-1] == str(answer).strip() else 0.0


# ---- the agent ---------------------------------------------------------------------------------------------------
async def run_agent(ctx, batch):
    """One episode per sample: the policy's replies, each ``add`` call run and its result sent back, until a reply
    calls no tool (the answer) or ``MAX_TURNS`` replies."""
    import openai

    rewards = {}
    for item in batch.iter_samples():
        messages = list(item.messages)
        # plain HTTP on 127.0.0.1: an http client without certificate loading (30 ms per client on a CPU otherwise)
        async with ctx.client(item, http_client=openai.DefaultAsyncHttpxClient(verify=False)) as client:
            for _ in range(MAX_TURNS):
                try:
                    reply = await client.chat.completions.create(model="policy", messages=messages)
                except openai.BadRequestError as e:
                    if e.code == "context_length_exceeded":  # tool call after tool call: no answer, reward 0
                        break
                    raise
                message = reply.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                if not message.tool_calls:
                    break
                for call in message.tool_calls:
                    messages.append({"role": "tool", "tool_call_id": call.id,
                                     "content": run_tool(call.function.name, call.function.arguments)})
        rewards[item.id] = episode_reward(messages, item.record["answer"])
    return rewards


# ---- the data ----------------------------------------------------------------------------------------------------
def tool_call(a: int, b: int) -> dict:
    return {"id": "call_add", "type": "function",
            "function": {"name": "add", "arguments": json.dumps({"a": a, "b": b})}}


def tool_call_text(a: int, b: int) -> str:
    """The correct first turn, as the chat template renders ``tool_call(a, b)``."""
    return '<tool_call>\n{"name": "add", "arguments": ' + json.dumps({"a": a, "b": b}) + "}\n</tool_call>"


def estimate(a: int, b: int) -> str:
    """The teacher's first turn when it skips the tool: the sum rounded to its two leading digits (a hundred
    thousand for 7-digit sums)."""
    unit = 10 ** max(1, len(str(a + b)) - 2)
    return f"about {(a + b + unit // 2) // unit * unit}"


def prompt(a: int, b: int) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{a}+{b}="}]


def after_tool(a: int, b: int) -> list[dict]:
    """The conversation up to the tool's result: the answer turn's prompt."""
    return prompt(a, b) + [{"role": "assistant", "content": "", "tool_calls": [tool_call(a, b)]},
                           {"role": "tool", "tool_call_id": "call_add", "content": str(a + b)}]


def generate(seed: int = 0, digits: int = 7, n_train: int = 8000, n_eval: int = 200, teacher_skips: float = 0.7,
             answer_rows: float = 0.5) -> list[dict]:
    """First-turn rows for ``n_train`` problems, answer-turn rows for a share ``answer_rows`` of them, then ``n_eval``
    held-out first turns (``split: "test"``), over distinct pairs of ``digits``-digit operands; a first turn skips
    the tool with probability ``teacher_skips``. The same arguments give the same rows."""
    for name, value in (("teacher_skips", teacher_skips), ("answer_rows", answer_rows)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value}")
    if digits < 2 or n_train < 1 or n_eval < 0:
        raise ValueError(f"need digits >= 2, n_train >= 1 and n_eval >= 0 (got {digits}, {n_train}, {n_eval})")
    lo, hi = 10 ** (digits - 1), 5 * 10 ** (digits - 1) - 1  # the sum has `digits` digits too
    if n_train + n_eval > ((hi - lo + 1) ** 2) // 2:
        raise ValueError(f"{n_train} training and {n_eval} held-out problems asked of {digits}-digit operands")
    rng = random.Random(seed)
    pairs, seen = [], set()
    while len(pairs) < n_train + n_eval:
        pair = (rng.randint(lo, hi), rng.randint(lo, hi))
        if pair not in seen:
            seen.add(pair)
            pairs.append(pair)
    held_out, train = pairs[:n_eval], pairs[n_eval:]
    rows = []
    for a, b in train:
        skip = rng.random() < teacher_skips
        rows.append({"prompt": prompt(a, b), "response": estimate(a, b) if skip else tool_call_text(a, b),
                     "answer": str(a + b)})
        if rng.random() < answer_rows:
            rows.append({"prompt": after_tool(a, b), "response": str(a + b), "answer": str(a + b)})
    for a, b in held_out:
        rows.append({"prompt": prompt(a, b), "answer": str(a + b), "split": "test"})
    return rows


def parse_spec(spec) -> dict:
    """``"n_eval=64,teacher_skips=0.5"`` -> ``{"n_eval": 64, "teacher_skips": 0.5}`` (keys of ``generate``)."""
    from areno.quickstart.task import parse_spec as parse

    return parse(spec, DEFAULTS, "the agentic quickstart task")


def load_training_dataset(path=None, *, default_loader=None, **kwargs) -> list[dict]:
    return generate(**{**DEFAULTS, **parse_spec(path)})
