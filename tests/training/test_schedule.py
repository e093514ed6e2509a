"""LRSchedule: exact values of warmup, constant, linear and cosine decay, min lr, and flag errors."""

import math

import pytest

from areno.training.schedule import LRSchedule


def test_constant_with_and_without_warmup():
    assert [LRSchedule(0.5).lr(i) for i in (0, 1, 1000)] == [0.5, 0.5, 0.5]
    s = LRSchedule(1.0, warmup_steps=4)
    assert [s.lr(i) for i in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_linear_warmup_then_decay_to_min_lr():
    s = LRSchedule(1.0, min_lr=0.2, warmup_steps=2, total_steps=6, style="linear")
    # warmup: (i + 1) / 2; decay over updates 2..6: t = (i - 2) / 4
    expect = [0.5, 1.0, 1.0, 0.8, 0.6, 0.4, 0.2, 0.2, 0.2]
    assert [s.lr(i) for i in range(9)] == pytest.approx(expect, abs=1e-15)


def test_cosine_values():
    s = LRSchedule(3e-4, min_lr=1e-5, warmup_steps=0, total_steps=10, style="cosine")
    for i in range(13):
        t = min(1.0, i / 10)
        assert s.lr(i) == pytest.approx(1e-5 + (3e-4 - 1e-5) * 0.5 * (1 + math.cos(math.pi * t)), rel=1e-14)
    assert s.lr(0) == 3e-4 and s.lr(5) == pytest.approx((3e-4 + 1e-5) / 2) and s.lr(10) == pytest.approx(1e-5)
    w = LRSchedule(1.0, warmup_steps=3, total_steps=7, style="cosine")
    assert [w.lr(i) for i in range(3)] == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert [w.lr(i) for i in range(3, 8)] == pytest.approx([1.0, (1 + math.cos(math.pi / 4)) / 2, 0.5,
                                                            (1 + math.cos(3 * math.pi / 4)) / 2, 0.0])


def test_decay_is_monotone_and_state_round_trips():
    for style in ("linear", "cosine"):
        s = LRSchedule(1e-3, min_lr=1e-4, warmup_steps=5, total_steps=50, style=style)
        values = [s.lr(i) for i in range(60)]
        assert all(a <= b for a, b in zip(values[:5], values[1:5]))
        assert all(a >= b for a, b in zip(values[4:], values[5:]))
        assert min(values) == pytest.approx(1e-4) and max(values) == 1e-3
        r = LRSchedule.from_state_dict(s.state_dict())
        assert [r.lr(i) for i in range(60)] == values
    assert LRSchedule(1.0, warmup_steps=10, total_steps=4, style="linear").lr(10) == 0.0  # decay done at once


@pytest.mark.parametrize("kwargs,match", [
    (dict(style="step"), "--lr-decay-style"),
    (dict(style="cosine"), "total number of updates"),
    (dict(style="linear", total_steps=10, min_lr=2.0), "--min-lr"),
    (dict(warmup_steps=-1), "--warmup-steps"),
])
def test_bad_settings_name_the_flag(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LRSchedule(1.0, **kwargs)
