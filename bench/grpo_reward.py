"""G1's trivial reward (``bench/grpo_step.py``): the parity of the completion's text length, as TRL's G1 baseline
scored it (``float(len(c) % 2)``), so both sides pay the same (negligible) reward cost and groups have variance."""


def reward_fn(record) -> float:
    return float(len(record.completion) % 2)
