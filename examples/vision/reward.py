"""Reward for the counting task of ``shapes.py``: 1.0 when the completion's first number is the answer."""

import re


def reward_fn(record) -> float:
    found = re.search(r"\d+", record.completion)
    return float(found is not None and found.group() == str(record.answer))
