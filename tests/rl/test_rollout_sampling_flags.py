"""`areno train` rollout sampling flags (--min-p, --repetition-penalty, --presence-penalty, --frequency-penalty)
reach the engine's options and change the run: the rollout log-probs are those of the penalised distribution."""

import json
import logging

import pytest

from areno.api import SamplingParams
from areno.cli import make_parser, parse_config
from areno.config import ConfigError, TrainConfig
from areno.engine.engine import Engine
from areno.rl.loop import TrainLoop
from areno.testing import make_tiny_checkpoint


def test_penalty_flags_reach_the_engine_and_the_logprobs(tmp_path, monkeypatch, caplog):
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", family="qwen3", seed=0)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{a}+{a}="}], "answer": str(2 * a)})
                            + "\n" for a in range(4)))
    reward = tmp_path / "reward.py"
    reward.write_text("def reward_fn(record):\n    return float(len(record.completion) % 2)\n")
    argv = ["--ckpt", str(ckpt), "--dataset-path", str(data), "--reward-fn-path", str(reward), "--batch-size", "2",
            "--n-samples", "2", "--mini-bs", "2", "--max-steps", "1", "--max-new-tokens", "5", "--dtype", "float32",
            "--no-tensorboard", "--save-path", str(tmp_path / "out"), "--metrics-dir", str(tmp_path / "m"),
            "--repetition-penalty", "1.5", "--presence-penalty", "1", "--frequency-penalty", "2", "--min-p", "0.05"]
    cfg = parse_config(make_parser("train", TrainConfig), TrainConfig, argv)
    seen = []
    add = Engine.add_request
    monkeypatch.setattr(Engine, "add_request", lambda self, p, o=None, **kw: seen.append(o) or add(self, p, o, **kw))
    caplog.set_level(logging.WARNING, logger="areno")
    loop = TrainLoop(cfg)
    loop.setup()
    m = loop.step(next(iter(loop.data)))
    loop.close()
    assert seen and all((o.repetition_penalty, o.presence_penalty, o.frequency_penalty, o.min_p)
                        == (1.5, 1.0, 2.0, 0.05) for o in seen)
    assert m["logprob_diff_max"] > 1e-3  # rollout: penalised distribution; trainer: the plain policy
    assert any("penalised distribution" in r.getMessage() for r in caplog.records)


def test_sdk_sampling_params_carry_the_options():
    o = SamplingParams(min_p=0.1, repetition_penalty=1.2, presence_penalty=-0.5, frequency_penalty=0.4,
                       logit_bias={7: -100.0}, min_new_tokens=2)
    assert (o.min_p, o.repetition_penalty, o.presence_penalty, o.frequency_penalty, o.logit_bias, o.min_new_tokens) \
        == (0.1, 1.2, -0.5, 0.4, {7: -100.0}, 2)
    cfg = TrainConfig(ckpt="m", dataset_path="d", min_p=0.2, repetition_penalty=1.1, frequency_penalty=1.0)
    p = SamplingParams.from_train_config(cfg)
    assert (p.min_p, p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (0.2, 1.1, 0.0, 1.0)
    for name, value in (("min_p", 1.5), ("repetition_penalty", 0.0), ("presence_penalty", 3.0),
                        ("frequency_penalty", -2.5), ("logit_bias", {1: 101.0}), ("logit_bias", {-1: 1.0})):
        with pytest.raises(ConfigError, match=name):
            SamplingParams(**{name: value})
    with pytest.raises(ConfigError, match="--min-p"):
        TrainConfig(ckpt="m", dataset_path="d", min_p=-0.1)
