"""--eval-dataset-path during training: the sets are evaluated before the first step, every --eval-interval steps and
after the last, logged as eval/<name>/... to metrics.jsonl (and TensorBoard); and a run with evaluation trains exactly
as one without (every training metric, every step, and the final weights)."""

import json

import pytest
import torch

from areno.config import ConfigError, TrainConfig
from areno.quickstart.preset import MODEL, TASK, cached_model
from areno.quickstart.task import generate
from areno.rl.loop import TrainLoop

# measured times and what depends on them (how many groups were scored while others still decoded)
TIMED = ("time", "peak_mem_gib", "overlap_groups")
REWARD = "def reward_fn(record):\n    return 1.0 if len(set(record.completion)) % 2 == 0 else 0.0\n"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    from areno.quickstart.preset import cpu_threads

    cpu_threads()  # one intra-op thread: the tiny matrices only pay synchronisation for more
    root = tmp_path_factory.mktemp("evaltrain")
    (root / "reward.py").write_text(REWARD)  # half the random model's samples score: a real gradient
    model = cached_model(root / "model", MODEL)
    rows = [r for r in generate(n_eval=10) if r.get("split") == "eval"]
    (root / "add.jsonl").write_text("".join(json.dumps({"question": r["prompt"][0]["content"], "sum": r["answer"]})
                                            + "\n" for r in rows))
    return root, model


def train(inputs, out, **extra):
    root, model = inputs
    cfg = TrainConfig(ckpt=str(model), dataset_loader_fn=str(TASK), dataset_path="n_eval=4",
                      reward_fn_path=str(root / "reward.py"), algo="grpo", batch_size=4, n_samples=2, mini_bs=8,
                      max_new_tokens=4, lr=1e-2, dtype="float32", tensorboard=False, metrics_dir=str(root / out),
                      **{"max_steps": 3, **extra})
    loop = TrainLoop(cfg)
    try:
        loop.setup()
        loop.fit()
        weights = {k: v.detach().clone() for k, v in loop.model.state_dict().items()}
    finally:
        loop.close()
    records = [json.loads(line) for line in (root / out / "metrics.jsonl").read_text().splitlines()]
    return records, weights


def test_a_run_with_evaluation_trains_exactly_as_one_without(inputs):
    root, _ = inputs
    plain, w0 = train(inputs, "plain")
    evald, w1 = train(inputs, "evald", eval_dataset_path=[f"add={root / 'add.jsonl'}"], eval_interval=2,
                      eval_n_samples=3, eval_prompt_field="question", eval_answer_field="sum",
                      eval_prompt_format="chat")

    def training(records):
        return {r["step"]: {k: v for k, v in r.items() if not k.startswith("eval") and k not in TIMED
                            and not k.endswith(("_s", "tok_s"))}
                for r in records if "loss" in r}

    a, b = training(plain), training(evald)
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for step in a:
        differ = {k: (a[step].get(k), b[step].get(k)) for k in a[step].keys() | b[step].keys()
                  if a[step].get(k) != b[step].get(k)}
        assert not differ, f"step {step}: {differ}"
    assert any(r["grad_norm"] > 0 for r in a.values())  # the policy moved
    assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)
    evals = {r["step"]: r for r in evald if "eval/add/avg@3" in r}
    assert sorted(evals) == [0, 2, 3]  # before, --eval-interval 2, after the last step
    for r in evals.values():
        assert {"eval/add/pass@1", "eval/add/pass@2", "eval/add/pass@3", "eval/add/maj@3",
                "eval/add/avg@3_lo", "eval/add/avg@3_hi"} <= set(r)
        assert r["eval/add/pass@1"] == pytest.approx(r["eval/add/avg@3"])
        assert r["eval/add/avg@3_lo"] <= r["eval/add/avg@3"] <= r["eval/add/avg@3_hi"]
        assert r["eval/add/pass@1"] <= r["eval/add/pass@2"] <= r["eval/add/pass@3"]
    assert not any(k.startswith("eval/") for r in plain for k in r)
    pytest.importorskip("matplotlib")
    from areno.training.metrics import reward_curve_figure

    fig = reward_curve_figure(evald)  # the reward panel, then one panel per set: its metrics with interval bands
    assert len(fig.axes) == 2 and "add" in fig.axes[1].get_title()
    lines = {line.get_label(): list(line.get_ydata()) for line in fig.axes[1].get_lines()}
    assert sorted(lines) == ["avg@3", "maj@3", "pass@3"]
    assert lines["avg@3"] == [evals[s]["eval/add/avg@3"] for s in (0, 2, 3)]
    assert len(fig.axes[1].collections) == 3  # the bands
    assert (root / "evald" / "reward_curve.png").is_file()


@pytest.mark.parametrize("extra, flag", [
    (dict(eval_dataset_path=["add=/no/such.jsonl"]), "--eval-dataset-path"),
    (dict(eval_n_samples=0, eval_dataset_path=["x"]), "--eval-dataset-path"),
    (dict(eval_temperature=-1.0), "--eval-temperature"),
    (dict(eval_dataset_path=["{add}"], train_devices=[0], rollout_devices=[1], partial_rollout=True,
          max_staleness=1), "--eval-dataset-path"),
])
def test_bad_settings_name_the_flag(inputs, extra, flag):
    root, model = inputs
    extra = {k: [v[0].format(add=root / "add.jsonl")] if k == "eval_dataset_path" else v for k, v in extra.items()}
    with pytest.raises(ConfigError) as e:
        TrainConfig(ckpt=str(model), dataset_path="d.jsonl", reward_fn_path=str(TASK), **extra)
    assert e.value.flag == flag


def test_wandb_offline_run_holds_the_metrics_config_pictures_and_samples(inputs, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("matplotlib")
    from tests.helpers.wandb_offline import finished, history, run_info

    root, _ = inputs
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(root / "wandb-home"))
    records, _ = train(inputs, "wb", eval_dataset_path=[f"add={root / 'add.jsonl'}"], eval_n_samples=2,
                       eval_prompt_field="question", eval_answer_field="sum", max_steps=2,
                       wandb_project="areno-test", wandb_run_name="tiny", wandb_mode="offline")
    files = list((root / "wb" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1
    finished(files[0])
    rows = history(files[0])
    info = run_info(files[0])
    assert info["project"] == "areno-test" and info["name"] == "tiny"
    assert info["config"]["lr"] == 1e-2 and info["config"]["eval_n_samples"] == 2
    logged = {}  # every metric metrics.jsonl holds, at its step, is in the W&B history with the same value
    for r in rows:
        for k, v in r.items():
            if not k.startswith("_") and isinstance(v, (int, float)):
                logged[(r["train_step"], k)] = v
    for rec in records:
        for k, v in rec.items():
            if k not in ("step", "time") and isinstance(v, float):
                assert logged[(rec["step"], k)] == pytest.approx(v), k
    assert logged[(0, "eval/add/avg@2")] == next(r["eval/add/avg@2"] for r in records if r["step"] == 0)
    kinds = {k.rsplit("/", 1)[0]: r[k] for r in rows for k in r if k.endswith("/_type")}
    assert kinds["reward_curve"] == "image-file" and kinds["eval/add/samples"] == "table-file"
