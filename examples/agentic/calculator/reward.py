"""Reward for the calculator agent: 1.0 when the conversation's final reply answers correctly, else 0.0.

``areno train`` scores an agent that returns no reward with this file (``--reward-fn-path``): ``record["completion"]``
is the text of the last assistant reply and ``record["messages"]`` the whole conversation. A conversation whose last
reply still calls a tool (it ran out of turns or context) has no final answer and scores 0.0, as does a completion
holding a ``<tool_call>`` block. Otherwise the answer is judged by ``examples/math/math_verify_reward.py``: the last
``\\boxed{}`` (or a ``####`` line) against the reference, numerically for plain numbers, through ``math_verify``
otherwise, else the last number of the text.
"""

import importlib.util
from pathlib import Path


def _math_reward():
    """examples/math/math_verify_reward.py, imported by path (the examples are plain folders, not packages)."""
    path = Path(__file__).resolve().parents[2] / "math" / "math_verify_reward.py"
    spec = importlib.util.spec_from_file_location("areno_examples_math_verify_reward", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_math = _math_reward()


def reward_fn(record) -> float:
    messages = record.get("messages") or []
    last = next((m for m in reversed(messages) if m.get("role") == "assistant"), None)
    if last is not None and last.get("tool_calls"):
        return 0.0  # still calling the calculator: no final answer
    completion = record["completion"]
    if not isinstance(completion, str) or "<tool_call>" in completion:
        return 0.0
    return _math.reward_fn(record)
